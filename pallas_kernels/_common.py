"""Small helpers shared by the Triton-lowered Pallas kernels.

Version notes (checked against the jax sources):
- jax 0.10.2 moved masked `load` / `store` and `dot` into `jax.experimental.pallas.triton`
  (`pl.dot` is a deprecated alias there; `pl.load` / `pl.store` are gone). The Triton module
  has `load(ref, *, mask, other)` / `store(ref, val, *, mask)` taking a ref view
  (`ref.at[idx]`). Older releases only have `pl.load(ref, idx, ...)`. `load` / `store` below
  pick whichever exists, so the kernels run on 0.10.2 (CPU interpret) and 0.11.2 (GPU).
- Matmuls go through `lax.dot_general` with an explicit precision: the Triton lowering maps
  DEFAULT / HIGH to TF32 for float32 operands and HIGHEST to IEEE.
- Interpret mode applies a load's mask only when `other` is given, so every masked load
  here passes `other`; loads must use either only slices / scalars or only integer arrays
  (interpret mode rejects a mix).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # jax >= 0.10: masked load/store live in the Triton module
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - very old jax
    pltriton = None

IMPLS = ("xla", "pallas", "pallas_interpret")
WORD = 32  # bits per word of the tree kernels' ancestor bitsets (uint32)
LOG2E = 1.4426950408889634
NEG = -1e30  # finite "minus infinity": exp2(NEG - m) == 0 and NEG - NEG never makes NaN
H200_SMS = 132  # streaming multiprocessors of the H200 (the kernels' grid-size heuristics)


def load(ref, idx, *, mask=None, other=None):
    """Masked load of ref[idx] (idx: a tuple of slices / pl.ds / scalars, or integer arrays)."""
    if pltriton is not None and hasattr(pltriton, "load"):
        return pltriton.load(ref.at[idx], mask=mask, other=other)
    return pl.load(ref, idx, mask=mask, other=other)  # pragma: no cover


def store(ref, idx, val, *, mask=None):
    if pltriton is not None and hasattr(pltriton, "store"):
        return pltriton.store(ref.at[idx], val, mask=mask)
    return pl.store(ref, idx, val, mask=mask)  # pragma: no cover


def load_rows(ref, start, rows: int, n_valid: int | None = None, cols=None):
    """Inside a kernel: rows start .. start + rows - 1 of a row ref, [rows] of a 1-D ref or
    [rows, width] of a 2-D one at the columns `cols` (a pl.ds; None: all). With n_valid (the
    rows the ref holds, fewer than a block covers) one masked load: rows at or past n_valid read
    as zeros. Their indices are left out of bounds, not clamped: masked off, Triton reads
    nothing there, and a clamped index would make `store_rows`' interpreter scatter write the
    last real row twice (the tree kernels' masked rows, docs/decisions/0068-gdn-tree-masked-rows.md)."""
    two_d = len(ref.shape) == 2
    if n_valid is None:
        return ref[pl.ds(start, rows), slice(None) if cols is None else cols] if two_d else ref[pl.ds(start, rows)]
    if not two_d:
        node = start + lax.broadcasted_iota(jnp.int32, (rows,), 0)
        return load(ref, (node,), mask=node < n_valid, other=jnp.zeros((rows,), ref.dtype))
    col0, width = (0, ref.shape[1]) if cols is None else (cols.start, cols.size)
    node = start + lax.broadcasted_iota(jnp.int32, (rows, width), 0)
    col = col0 + lax.broadcasted_iota(jnp.int32, (rows, width), 1)
    return load(ref, (node, col), mask=node < n_valid, other=jnp.zeros((rows, width), ref.dtype))


def store_rows(ref, start, val, n_valid: int | None = None):
    """Inside a kernel: val [rows, width] into rows start .. of a 2-D row ref (all its columns);
    with n_valid only the rows before it are written (`load_rows`)."""
    if n_valid is None:
        ref[pl.ds(start, val.shape[0]), :] = val
        return
    node = start + lax.broadcasted_iota(jnp.int32, val.shape, 0)
    store(ref, (node, lax.broadcasted_iota(jnp.int32, val.shape, 1)), val, mask=node < n_valid)


def compiler_params(num_warps: int, num_stages: int):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def count_finished(counter_ref, idx, interpret: bool):
    """Inside a kernel of `counted_call` (a "last program" epilogue,
    docs/decisions/0059-last-program-epilogues.md): add one to counter_ref[idx] once this program's
    stores are done and return the count before it. Of n programs counting at idx, the one that
    reads n - 1 runs after every other's stores and sees them. A CTA barrier first (every thread's
    stores before Triton's single-thread atomic: its release is cumulative), then the
    acquire-release atomic at GPU scope. Interpret mode runs the programs one after another: no
    barrier."""
    if not interpret:
        pltriton.debug_barrier()
    return pltriton.atomic_add(counter_ref, idx, jnp.ones((), jnp.int32))


def counted_call(kernel, *, grid, operands, out_shape, counters: int, num_warps: int, num_stages: int,
                 interpret: bool, name: str):
    """pl.pallas_call of kernel over whole-array blocks, with `counters` zeroed int32 counters
    (count_finished's) appended to the operands and aliased to one more output after out_shape:
    kernel(*operand_refs, counters_in_ref, *out_refs, counters_ref). Returns out_shape's outputs."""
    operands = (*operands, jnp.zeros((counters,), jnp.int32))
    out_shape = (*out_shape, jax.ShapeDtypeStruct((counters,), jnp.int32))
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * len(a.shape))
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[full(a) for a in operands],
        out_specs=[full(o) for o in out_shape],
        out_shape=out_shape,
        input_output_aliases={len(operands) - 1: len(out_shape) - 1},
        compiler_params=None if interpret else compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*operands)
    return outs[:-1]


def dot(a, b, *, trans_b: bool = False, precision=None):
    """2-D a @ b (or a @ b.T) with float32 accumulation."""
    contract_b = 1 if trans_b else 0
    return lax.dot_general(
        a,
        b,
        (((1,), (contract_b,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def dot_precision(dtype):
    """IEEE float32 matmuls for float32 inputs (no TF32); the native path for 16-bit inputs."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def rounded(v, dtype):
    """A float value -> dtype by round to nearest even, through reduce_precision: under jit XLA may
    drop a bare f32 -> 16-bit -> f32 round trip (its default excess precision; seen on CPU), which
    would skip the rounding. XLA forms and interpret mode only: the Triton lowering has no
    reduce_precision (kernels round with a cast, which it keeps)."""
    dtype = jnp.dtype(dtype)
    v = v.astype(jnp.float32)
    if dtype == jnp.float32:
        return v
    info = jnp.finfo(dtype)
    return lax.reduce_precision(v, info.nexp, info.nmant).astype(dtype)


def summed_partials(parts, dtype):
    """Split-K partial products [S, ...] added in float32 (index order) and rounded to dtype once:
    what XLA's reduce after its own split-K GEMM writes (`rounded`)."""
    return rounded(jnp.sum(parts.astype(jnp.float32), axis=0), dtype)


def order_key(x: jax.Array) -> jax.Array:
    """int32 keys ordered as lax.top_k orders float32 values (-0.0 below +0.0): the top-k and
    selection kernels' keys."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def take_top_k(key, k: int, kp: int, removed):
    """Inside a kernel: the k largest entries of a row held in registers, one at a time (a max, the
    lowest index holding it, that entry set to `removed`, a value below every real key). key [n_pad];
    returns (values [kp], indices [kp] int32), lanes past k zero. Ties go to the lower index:
    lax.top_k's rule."""
    i32 = jnp.int32
    n_pad = key.shape[0]
    idx = lax.broadcasted_iota(i32, (n_pad,), 0)
    lane = lax.broadcasted_iota(i32, (kp,), 0)

    def take(j, carry):
        key, vals, picks = carry
        top = jnp.max(key)
        at = jnp.min(jnp.where(key == top, idx, n_pad))
        vals = jnp.where(lane == j, top, vals)
        picks = jnp.where(lane == j, at, picks)
        return jnp.where(idx == at, removed, key), vals, picks

    _, vals, picks = lax.fori_loop(0, k, take, (key, jnp.zeros((kp,), key.dtype), jnp.zeros((kp,), i32)))
    return vals, picks


def plus_zero(score: jax.Array) -> jax.Array:
    """A prefix score as the sum from +0.0 makes it: never -0.0 (log-probs are <= 0, and -0.0 only
    comes from -0.0 + -0.0). Written out because compilers may fold 0.0 + x to x, which keeps a
    -0.0 log-prob's sign and would order it below +0.0."""
    return jnp.where(score == 0, jnp.float32(0.0), score)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def pow2_at_least(x: int, lo: int = 16) -> int:
    """Smallest power of two >= x and >= lo (padded block sizes: tl.dot needs >= 16)."""
    return max(lo, next_pow2(max(int(x), 1)))


def shift_bits(ancestor_bits):
    """[B, N, W] uint32 ancestor words of nodes 1.. relative to nodes 1.. (bit j -> bit j - 1):
    the rows and columns of a tree with node 0 peeled off (the tree kernels' root peel).
    Returns (words [B, N-1, W], bit0 [B, N-1] float32: 1 where the node descends from node 0)."""
    words = ancestor_bits.astype(jnp.uint32)
    nxt = jnp.concatenate([words[..., 1:], jnp.zeros_like(words[..., :1])], axis=-1)
    shifted = jnp.right_shift(words, jnp.uint32(1)) | jnp.left_shift(nxt, jnp.uint32(WORD - 1))
    return shifted[:, 1:], (words[:, 1:, 0] & 1).astype(jnp.float32)


SCALAR_LANES = 16  # per-(batch, head) scalars travel as one 16-wide vector (a Triton block needs >= 16)


def pack_scalars(*xs):
    """[B, H] float32 scalars -> [B, H, 16] (lanes 0, 1, ...; the rest zero) for one BlockSpec."""
    packed = jnp.stack([jnp.asarray(x, jnp.float32) for x in xs], axis=-1)
    return jnp.pad(packed, ((0, 0), (0, 0), (0, SCALAR_LANES - len(xs))))


def unpack_scalars(ref, count: int):
    """Inside a kernel: the first `count` scalars of a pack_scalars block."""
    lanes = lax.broadcasted_iota(jnp.int32, (SCALAR_LANES,), 0)
    v = ref[...]
    return [jnp.sum(jnp.where(lanes == i, v, 0.0)) for i in range(count)]


def join_root(rest, root, n: int, axis: int):
    """A root-peeled kernel's outputs -> all nodes: root [..] goes in front of the first n rows of
    `rest` along the node axis."""
    return jnp.concatenate([jnp.expand_dims(root, axis), lax.slice_in_dim(rest, 0, n, axis=axis)], axis=axis)


def expand_heads(x, h: int):
    """[B, Hk, ...] -> [B, H, ...]: value head j reads key head j // (H // Hk)."""
    hk = x.shape[1]
    if hk == h:
        return x
    if h % hk:
        raise ValueError(f"{h} value heads do not divide into {hk} key heads")
    return jnp.repeat(x, h // hk, axis=1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def log2_ceil(x: int) -> int:
    return 0 if x <= 1 else math.ceil(math.log2(x))


def as_int32_bits(bits: jax.Array) -> jax.Array:
    """uint32 bitsets viewed as int32 (same bits): signed types are the safest in kernels."""
    if bits.dtype == jnp.int32:
        return bits
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.int32)


def fitting_split(batch: int, num_v_heads: int, dv: int, most: int, num_sms: int = H200_SMS, per_sm: int = 2) -> int:
    """The split of a decode kernel's heads a call takes (gdn_decode's dv_split, mamba2_decode's
    p_split): the largest power of two <= most that leaves >= 16 columns (rows) of a head's dv
    a program and keeps the grid of batch x heads x split within `per_sm` programs per SM (a
    decode step at batch 1 has fewer programs than SMs: 32 at the 35B-A3B GDN layer; at batch 8,
    256, it takes none with two an SM)."""
    split = 1
    while (split * 2 <= most and dv // (split * 2) >= 16 and dv % (split * 2) == 0
           and batch * num_v_heads * split * 2 <= per_sm * num_sms):
        split *= 2
    return split
