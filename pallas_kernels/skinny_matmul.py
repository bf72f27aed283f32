"""Matmuls with few rows (a DDTree verify's 65 nodes, a DFlash block's 16) that stream the weight
once, next to the reference.

    y = skinny_matmul(x, w, scale=None, impl="xla" | "pallas" | "pallas_interpret", config=None,
                      out_dtype=None)

x [..., K], w [K, N] -> y [..., N] in their (common) dtype with float32 accumulation: what
`jnp.matmul(x, w)` returns (`reference`). Weight-only int8 (the int8 drafter, models/int8.py):
w int8 with `scale` [N] float32, y = (x @ w) * scale accumulated and scaled in float32 and rounded
once to out_dtype (default x's dtype; the draft head asks for float32 logits).

Why a kernel: a verify pass multiplies 65 rows (budget 64 + the root) by every weight of the
target, so it is weight-bound like a decode step, but XLA hands it to cuBLAS, which tiles 65 rows
as 72 or 128 and reads the 27B shape's weights at 3.6-3.7 TB/s where the decode GEMVs reach
4.1-4.4 (the verify's GEMMs take ~2.8 ms more than the decode step's; 64 rows cost 1.15 ms less
than 65: docs/benchmarks.md section 1). XLA's own Triton GEMMs are slower still at 65 rows.

How: one program per block of `block_n` weight columns (times `split_k` slices of K) streams its
[K, block_n] slab of the weight once, `block_k` rows at a time (Triton pipelines those loads
`num_stages` deep), and multiplies each weight tile with ALL rows of x. The rows go as
power-of-two tiles of at most `max_row_tile` (Triton blocks are powers of two): 65 rows are a
64-row and a 16-row tile (80 rows of MMA work, not 128). Layout "cols" computes w_tile^T x_tile^T,
so the weight columns are the MMA's M side (Hopper's wgmma takes 64 rows per warpgroup) and the
few tokens its N side, and stores the transpose; layout "rows" is the plain x_tile @ w_tile.
With split_k > 1 each program covers one K slice and writes float32 partial sums that XLA adds
(and scales, for int8). Masks appear only where a shape needs them (a row tile past the last row, N or K not a multiple
of the blocks): an unmasked weight load keeps Triton's 16-byte vector loads.

Why int8 too: the drafter's products have 15-16 rows, so they are bound by their weight bytes, and
int8 halves those; but XLA's int8 GEMMs at 16 rows read only 1.9-3.2 TB/s of int8 (H200, session
13: the merged gate | up took 94.6 us in int8 against 83 in bf16). Two things cost there: where the
int8 tile is widened, and how. Layout "cols" makes the weight the MMA's A operand, which Hopper's
wgmma takes from registers, so the widened tile never goes back through shared memory. The widening
(`dequant`): "cvt" is Triton's own int8 -> bf16 conversion (Triton 3.6 widens through byte
permutes on sm_90, no I2F, whose 16 a cycle per SM would cap the read near 4.2 TB/s of int8);
"magic" builds the float32 2^23 + 128 + q by integer add into the bits of 2^23 (exact for
|q| <= 128) and subtracts 2^23 + 128, one integer and one float add at full rate, then rounds to
the activations' dtype (exact: |q| <= 127 has 7 significant bits). Measured on the H200 (session
14, scripts/gpu_int8_matmul.py): below XLA's int8 GEMM on the drafter's products, so the model's
route is off (models/int8.py KERNEL); docs/kernels_dense.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import cdiv, check_impl, compiler_params, dot_precision, is_pow2, load, store

SKINNY_MAX_ROWS = 256  # beyond this a GEMM is no longer weight-bound at the 27B shape: XLA's territory
LAYOUTS = ("cols", "rows")
DEQUANTS = ("cvt", "magic")
MAGIC_BITS = 0x4B000080  # float32 bits of 2^23 + 128: + q (int32) gives the bits of 2^23 + 128 + q
MAGIC = float(2**23 + 128)


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Tiling of one skinny matmul (block sizes are powers of two, >= 16)."""

    block_n: int = 128
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    layout: str = "cols"
    max_row_tile: int = 64
    dequant: str = "magic"  # int8 weights only: how a tile is widened (module docstring)

    def check(self) -> None:
        bad = [f"{name} = {getattr(self, name)}" for name in ("block_n", "block_k", "max_row_tile")
               if not (is_pow2(getattr(self, name)) and getattr(self, name) >= 16)]
        bad += [] if self.split_k >= 1 else [f"split_k = {self.split_k}"]
        bad += [] if self.layout in LAYOUTS else [f"layout = {self.layout!r} (one of {LAYOUTS})"]
        bad += [] if self.dequant in DEQUANTS else [f"dequant = {self.dequant!r} (one of {DEQUANTS})"]
        if bad:
            raise ValueError("invalid skinny matmul config (block sizes are powers of two >= 16): " + ", ".join(bad))


# H200, session 7 (scripts/gpu_skinny_matmul.py --trace, 65 rows): 64 columns, 64-deep K tiles 4
# stages deep, K split in 2 ranked first of 15 configs over the four largest 27B projections
# (geometric mean 1.03x XLA's kernel time; it wins the 5120 -> 6144 / 10240 and 6144 -> 5120
# products, loses the 17408-wide ones: models.layers routes accordingly).
DEFAULT_CONFIG = SkinnyConfig(block_n=64, block_k=64, num_stages=4, split_k=2)


# int8 weights: 128 columns a program where that gives two waves of the H200's 132 SMs (else 64),
# K split until it does (each slice at least 4 K tiles deep); not measured yet.
INT8_BLOCK_K = 128
INT8_TARGET_PROGRAMS = 264


def filling_split(k: int, n: int, block_n: int, block_k: int) -> int:
    """K slices that bring the grid to INT8_TARGET_PROGRAMS programs (each slice >= 4 K tiles)."""
    return max(1, min(cdiv(INT8_TARGET_PROGRAMS, cdiv(n, block_n)), k // (4 * block_k)))


def default_config(m: int, k: int, n: int, int8: bool = False) -> SkinnyConfig:
    """The tiling for an [m, k] x [k, n] product (16-bit: one measured default; int8: sized so
    the grid fills the GPU; 128 columns take 8 warps, where 4 spill: offline_triton_compile.py
    int8_matmul)."""
    del m
    if not int8:
        return DEFAULT_CONFIG
    bn = 128 if cdiv(n, 128) >= INT8_TARGET_PROGRAMS else 64
    return SkinnyConfig(block_n=bn, block_k=INT8_BLOCK_K, split_k=filling_split(k, n, bn, INT8_BLOCK_K),
                        num_warps=8 if bn == 128 else 4, num_stages=4)


def row_tiles(m: int, max_tile: int) -> tuple[tuple[int, int], ...]:
    """(first row, rows) of the power-of-two row tiles (>= 16, <= max_tile) that cover m rows,
    largest first: 65 -> (0, 64), (64, 16)."""
    left, start, tiles = cdiv(m, 16) * 16, 0, []
    while left > 0:
        size = min(max_tile, 1 << (left.bit_length() - 1))
        tiles.append((start, size))
        start, left = start + size, left - size
    return tuple(tiles)


def reference(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, out_dtype=None,
              w_layout: str = "in_out") -> jax.Array:
    """jnp.matmul(x, w) (w_layout "out_in": w is stored [N, K], x @ w.T); int8 w: (x @ w) * scale
    with float32 accumulation and scaling, rounded once to out_dtype (default x's dtype). XLA fuses
    the widening of w into its GEMM."""
    spec = "...i,io->...o" if w_layout == "in_out" else "...i,oi->...o"
    if scale is None:
        y = jnp.einsum(spec, x, w)
        return y if out_dtype is None else y.astype(out_dtype)
    y = jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale).astype(out_dtype or x.dtype)


def widen_int8(w: jax.Array, dtype, how: str) -> jax.Array:
    """int8 weights -> dtype, exactly (|w| <= 127); `how` as SkinnyConfig.dequant."""
    if how == "cvt":
        return w.astype(dtype)
    bits = w.astype(jnp.int32) + MAGIC_BITS
    return (lax.bitcast_convert_type(bits, jnp.float32) - MAGIC).astype(dtype)


def _kernel(x_ref, w_ref, *refs, m, k, n, cfg: SkinnyConfig, tiles, k_per_split, precision, int8, scaled, w_t):
    s_ref, o_ref = refs if int8 else (None, refs[0])
    i32, f32 = jnp.int32, jnp.float32
    bn, bk = cfg.block_n, cfg.block_k
    col0 = pl.program_id(0) * bn
    k_base = pl.program_id(1) * k_per_split
    mask_k = k_per_split * cfg.split_k != k
    mask_n = n % bn != 0
    cols = col0 + lax.broadcasted_iota(i32, (bn,), 0)
    kk = lax.broadcasted_iota(i32, (bk,), 0)

    def w_mask(k0):  # of a [bk, bn] tile ([bn, bk] for a weight stored [N, K])
        if not (mask_k or mask_n):
            return None
        mask = jnp.ones((bk, bn), jnp.bool_)
        if mask_k:
            mask = mask & jnp.broadcast_to(((k0 + kk) < k)[:, None], (bk, bn))
        if mask_n:
            mask = mask & jnp.broadcast_to((cols < n)[None, :], (bk, bn))
        return mask.T if w_t else mask

    def x_mask(r0, rt, k0):
        rows_out = r0 + rt > m
        if not (rows_out or mask_k):
            return None
        mask = jnp.ones((rt, bk), jnp.bool_)
        if rows_out:
            mask = mask & jnp.broadcast_to(((r0 + lax.broadcasted_iota(i32, (rt,), 0)) < m)[:, None], (rt, bk))
        if mask_k:
            mask = mask & jnp.broadcast_to(((k0 + kk) < k)[None, :], (rt, bk))
        return mask

    def masked(ref, idx, mask):
        return load(ref, idx) if mask is None else load(ref, idx, mask=mask, other=0)

    def step(t, accs):
        k0 = k_base + t * bk
        idx = (pl.ds(col0, bn), pl.ds(k0, bk)) if w_t else (pl.ds(k0, bk), pl.ds(col0, bn))
        w = masked(w_ref, idx, w_mask(k0))
        if int8:
            w = widen_int8(w, x_ref.dtype, cfg.dequant)
        wk = 1 if w_t else 0  # the weight tile's contraction axis
        out = []
        for (r0, rt), acc in zip(tiles, accs):
            xt = masked(x_ref, (pl.ds(r0, rt), pl.ds(k0, bk)), x_mask(r0, rt, k0))
            if cfg.layout == "rows":
                part = lax.dot_general(xt, w, (((1,), (wk,)), ((), ())), precision=precision,
                                       preferred_element_type=f32)
            else:  # [bn, rt]: the weight columns on the MMA's M side
                part = lax.dot_general(w, xt, (((wk,), (1,)), ((), ())), precision=precision,
                                       preferred_element_type=f32)
            out.append(acc + part)
        return tuple(out)

    shape = (lambda rt: (rt, bn)) if cfg.layout == "rows" else (lambda rt: (bn, rt))
    accs = lax.fori_loop(0, k_per_split // bk, step, tuple(jnp.zeros(shape(rt), f32) for _, rt in tiles))
    col_scale = None
    if scaled:  # the column scales of this program's columns (split-K partials are scaled by XLA)
        col_scale = masked(s_ref, (pl.ds(col0, bn),), (cols < n) if mask_n else None)
    for (r0, rt), acc in zip(tiles, accs):
        y = acc if cfg.layout == "rows" else acc.T
        if col_scale is not None:
            y = y * col_scale[None, :]
        mask = None
        if r0 + rt > m or mask_n:
            mask = jnp.ones((rt, bn), jnp.bool_)
            if r0 + rt > m:
                mask = mask & jnp.broadcast_to(((r0 + lax.broadcasted_iota(i32, (rt,), 0)) < m)[:, None], (rt, bn))
            if mask_n:
                mask = mask & jnp.broadcast_to((cols < n)[None, :], (rt, bn))
        store(o_ref, (pl.ds(r0, rt), pl.ds(col0, bn)), y.astype(o_ref.dtype), mask=mask)


W_LAYOUTS = ("in_out", "out_in")  # how a weight is stored: [K, N] (ours) or [N, K] (HF's, K-major)


def check_operands(x, w, scale, w_layout: str = "in_out") -> list[str]:
    """What is wrong with (x, w, scale) for skinny_matmul (empty: nothing)."""
    if w_layout not in W_LAYOUTS:
        return [f"w_layout must be one of {W_LAYOUTS}, got {w_layout!r}"]
    k = x.shape[-1]
    kd = 0 if w_layout == "in_out" else 1
    want = f"[{k}, N]" if kd == 0 else f"[N, {k}] (w_layout 'out_in')"
    bad = [] if w.ndim == 2 and w.shape[kd] == k else [f"x [..., {k}] needs a weight {want}, got {tuple(w.shape)}"]
    if w.dtype == jnp.int8:
        n = w.shape[1 - kd] if w.ndim == 2 else -1
        if scale is None:
            bad.append("an int8 weight needs its column scale (scale [N] float32)")
        elif scale.shape != (n,) or scale.dtype != jnp.float32:
            bad.append(f"scale must be float32 [{n}], got {scale.dtype} {tuple(scale.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            bad.append(f"x must be floating point, got {x.dtype}")
    else:
        if scale is not None:
            bad.append(f"scale is for int8 weights; the weight is {w.dtype}")
        if x.dtype != w.dtype:
            bad.append(f"x is {x.dtype} but the weight is {w.dtype}; the kernel takes one dtype (or an int8 weight)")
    return bad


def _pallas(x, w, scale, cfg: SkinnyConfig, out_dtype, w_layout: str, *, interpret: bool):
    *lead, k = x.shape
    bad = check_operands(x, w, scale, w_layout)
    if bad:
        raise ValueError("skinny_matmul: " + "; ".join(bad))
    cfg.check()
    int8 = w.dtype == jnp.int8
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    w_t = w_layout == "out_in"
    n = w.shape[0] if w_t else w.shape[1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if not 1 <= m <= SKINNY_MAX_ROWS:
        raise ValueError(f"skinny_matmul takes 1..{SKINNY_MAX_ROWS} rows, got {m}: use impl='xla'")
    tiles = row_tiles(m, cfg.max_row_tile)
    k_per_split = cdiv(cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = cdiv(k, k_per_split)  # a split past K would only add zeros
    cfg = dataclasses.replace(cfg, split_k=split)
    kernel = functools.partial(_kernel, m=m, k=k, n=n, cfg=cfg, tiles=tiles, k_per_split=k_per_split,
                               precision=dot_precision(x.dtype), int8=int8, scaled=int8 and split == 1, w_t=w_t)
    mp = sum(size for _, size in tiles)  # blocks as tall as the row tiles; rows >= m are masked
    out_spec = (pl.BlockSpec((mp, n), lambda j, s: (0, 0)) if split == 1
                else pl.BlockSpec((None, mp, n), lambda j, s: (s, 0, 0)))
    out_shape = (m, n) if split == 1 else (split, m, n)
    in_specs = [pl.BlockSpec((mp, k), lambda j, s: (0, 0)), pl.BlockSpec(w.shape, lambda j, s: (0, 0))]
    operands = (rows, w)
    if int8:
        in_specs.append(pl.BlockSpec((n,), lambda j, s: (0,)))
        operands += (scale,)
    y = pl.pallas_call(
        kernel,
        grid=(cdiv(n, cfg.block_n), split),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype if split == 1 else jnp.float32),
        compiler_params=None if interpret else compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="skinny_matmul",
    )(*operands)
    if split > 1:  # the partials added in float32 (and scaled) in one XLA fusion, rounded once
        y = jnp.sum(y, axis=0)
        y = (y * scale if int8 else y).astype(out_dtype)
    return y.reshape(*lead, n)


def skinny_matmul(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, *, impl: str = "xla",
                  config: SkinnyConfig | None = None, out_dtype=None, w_layout: str = "in_out") -> jax.Array:
    """[..., K] @ [K, N] -> [..., N] (int8 w: times its column scale; w_layout "out_in": w stored
    [N, K]); the kernel for at most SKINNY_MAX_ROWS rows."""
    check_impl(impl)
    if impl == "xla":
        bad = (check_operands(x, w, scale, w_layout)
               if w.dtype == jnp.int8 or scale is not None or w_layout != "in_out" else [])
        if bad:
            raise ValueError("skinny_matmul: " + "; ".join(bad))
        return reference(x, w, scale, out_dtype, w_layout)
    m = 1
    for d in x.shape[:-1]:
        m *= d
    n = w.shape[0] if w_layout == "out_in" and w.ndim == 2 else w.shape[-1]
    cfg = config or default_config(m, x.shape[-1], n, int8=w.dtype == jnp.int8)
    return _pallas(x, w, scale, cfg, out_dtype, w_layout, interpret=impl == "pallas_interpret")
