"""A one-row product x @ w (a decode step at batch 1) as one kernel launch, next to its reference.

    y = row_product(x, w, config=None, partials=False, impl="xla" | "pallas" | "pallas_interpret")

x [..., K] holding one row (every leading dim 1), w [K, N] (the project's Linear layout [in, out]).
Returns y [..., N] in x's dtype: the float32 sum over K rounded once (what XLA's GEMM writes); or
with `partials` the float32 partial products [S, ..., N] over config.split_k slices of K, for
pallas_kernels/add_rms_norm.py, which adds them in its own launch. Without `partials` a config
with split_k > 1 has XLA add its partials (one more launch).

Why a kernel: in a batch-1 decode step XLA makes each one-row product of a 2048-wide model three
launches: the row padded to two rows (else XLA GPU strength-reduces the vector product to a slow
multiply + reduce: docs/decisions/0049-single-row-products.md), its split-K GEMM, and a reduce /
slice of row 0; ~3.5 us of launches around each product. Here program (column block, K slice)
reads x's row in place and its [K / S, block_n] slab of w, and writes its columns: one launch.

Forms (config.form): "fma" multiplies each [block_k, block_n] weight tile by the row broadcast
along its columns in float32 and sums over K once at the end (a GEMV on the CUDA cores: no MMA,
no padding); "dot" pads the row to 16 rows (tl.dot's smallest side) and accumulates MMAs.

x may be a `NormedRow`: a row still to be gated-RMS-normed per group of columns from float32 sums
of squares its producer wrote (the GDN decode kernel split over a head's columns). The kernel
normalises each K step of the row as it loads it (its group's sums are tiny; the gate is read
in place from the row that holds it), so the norm is no launch of its own.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from typing import NamedTuple

from pallas_kernels._common import check_impl, compiler_params, dot_precision, is_pow2, load, store, summed_partials
from pallas_kernels.ref.norms import gate_normed

FORMS = ("fma", "dot")
MIN_BLOCK = 16  # tl.dot's smallest side; also the narrowest column block taken
DTYPES = ("bfloat16", "float16", "float32")
TARGET_PROGRAMS = 512  # ~four programs per SM of the H200's 132: the loads in flight fill HBM
NARROW = 1024  # outputs narrower than this (routers: 256 / 512 experts) take the narrow tiling


class NormedRow(NamedTuple):
    """A row x [..., K] (rounded to its dtype) whose product input is its gated RMSNorm per group of
    `group` columns: normed = round(x * rsqrt(sum(squares[g]) / group + eps)) for group g (the float32
    sums of squares [..., K / group, S] added in index order), then round(weight * normed *
    silu(z)) with weight [group] and z = gate[..., gate_offset : gate_offset + K] (`value`: XLA's
    form). group and gate_offset are static (Python ints), eps a Python float."""

    x: jax.Array
    squares: jax.Array
    gate: jax.Array
    weight: jax.Array
    group: int
    gate_offset: int
    eps: float

    def value(self) -> jax.Array:
        """The normed row [..., K] in x's dtype (one XLA fusion)."""
        k = self.x.shape[-1]
        lead = self.x.shape[:-1]
        xs = self.x.astype(jnp.float32).reshape(*lead, k // self.group, self.group)
        inv = lax.rsqrt(jnp.sum(self.squares, axis=-1, keepdims=True) / self.group + self.eps)
        z = self.gate[..., self.gate_offset : self.gate_offset + k].reshape(xs.shape)
        return gate_normed((xs * inv).astype(self.x.dtype), z, self.weight).reshape(self.x.shape)

    def problems(self) -> list[str]:
        k, g = self.x.shape[-1], self.group
        bad = [] if is_pow2(g) and g >= MIN_BLOCK and k % g == 0 else [
            f"norm group {g} must be a power of two >= {MIN_BLOCK} dividing K = {k}"]
        if self.squares.shape[-2:-1] != (k // max(g, 1),) or not is_pow2(self.squares.shape[-1]):
            bad.append(f"squares {tuple(self.squares.shape)} must be [..., K / group = {k // max(g, 1)}, S] with S a "
                       "power of two")
        if self.weight.shape != (g,):
            bad.append(f"norm weight {tuple(self.weight.shape)} must be [{g}]")
        if not 0 <= self.gate_offset <= self.gate.shape[-1] - k:
            bad.append(f"gate columns {self.gate_offset} .. {self.gate_offset + k} outside its {self.gate.shape[-1]}")
        return bad


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """Tiling of the launch: column blocks of block_n, K steps of block_k (both upper bounds: the
    largest power of two <= them dividing N / the K slice, `fit`), split_k slices of K (a power of
    two), the product's form (FORMS) and the Triton launch parameters. `unroll`: the K steps as a
    static loop whose loads all come first, so a program has its whole slab in flight at once;
    Triton 3.6 does not software-pipeline the "fma" form's loads (no cp.async in its sm_90 SASS:
    `python -m scripts.offline_triton_compile row_product`), so the rolled loop waits on each
    step's loads in turn. Unrolling holds K slice / block_k tiles in registers."""

    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    form: str = "fma"
    num_warps: int = 4
    num_stages: int = 3
    unroll: bool = False

    def problems(self) -> list[str]:
        bad = [f"{f} = {getattr(self, f)} (a power of two >= {MIN_BLOCK})" for f in ("block_n", "block_k")
               if not (is_pow2(getattr(self, f)) and getattr(self, f) >= MIN_BLOCK)]
        bad += [] if is_pow2(self.split_k) else [f"split_k = {self.split_k} (a power of two)"]
        bad += [] if self.form in FORMS else [f"form = {self.form!r} (one of {FORMS})"]
        bad += [] if self.num_warps in (1, 2, 4, 8, 16) else [f"num_warps = {self.num_warps}"]
        bad += [] if self.num_stages >= 1 else [f"num_stages = {self.num_stages}"]
        return bad

    def fit(self, k: int, n: int) -> RowConfig:
        """The blocks and split this launch uses for [1, k] x [k, n] (k, n multiples of MIN_BLOCK)."""
        bn = min(self.block_n, n & -n)
        split = self.split_k
        while split > 1 and (k % split or (k // split) % MIN_BLOCK):
            split //= 2
        bk = min(self.block_k, (k // split) & -(k // split))
        return dataclasses.replace(self, block_n=bn, block_k=bk, split_k=split)


def default_config(k: int, n: int, *, partials: bool = False) -> RowConfig:
    """The launch's tiling for a [k, n] weight, from the H200 sweep of
    `python -m scripts.bench.kernels row_product` (docs/decisions/0054-row-product-kernel.md), all
    "fma". A narrow output (n < NARROW: a router) takes column blocks of 32 and K slices down to 128
    until 128 programs (2048 -> 256: 3.3 us with XLA's sum of the partials, against 5.3 for XLA's
    padded GEMM). Wider ones with `partials` (the add + RMSNorm kernel sums them): blocks of 64, K
    split until ~TARGET_PROGRAMS programs with slices at least 256 deep, 8 warps (4096 -> 2048: 9.2
    us with the norm against 10.2); without, no split (there XLA's GEMM measured faster, and the
    route leaves such products to XLA)."""
    if n < NARROW:
        cfg = RowConfig(block_n=32).fit(k, n)
        blocks, split = n // cfg.block_n, 1
        while blocks * split < TARGET_PROGRAMS // 4 and k % (2 * split) == 0 and k // (2 * split) >= 128:
            split *= 2
        return dataclasses.replace(cfg, split_k=split).fit(k, n)
    cfg = RowConfig().fit(k, n)
    if not partials:
        return cfg
    blocks, split = n // cfg.block_n, 1
    while blocks * split < TARGET_PROGRAMS and k % (2 * split) == 0 and k // (2 * split) >= 256:
        split *= 2
    return dataclasses.replace(cfg, split_k=split, num_warps=8).fit(k, n)


def problems(k: int, n: int, dtype, config: RowConfig | None = None) -> list[str]:
    """Why the kernel cannot take a [k, n] weight of this dtype (empty: it can)."""
    bad = [f"{name} = {d} is not a multiple of {MIN_BLOCK}" for name, d in (("K", k), ("N", n)) if d % MIN_BLOCK]
    if jnp.dtype(dtype).name not in DTYPES:
        bad.append(f"dtype {jnp.dtype(dtype).name} (the kernel takes {', '.join(DTYPES)})")
    if config is not None:
        bad += config.problems()
    return bad


def reference(x, w, *, split_k: int = 1, partials: bool = False):
    """XLA's forms: x @ w in x's dtype (a 16-bit product accumulates in float32, rounded once), or
    the float32 partial products [S, ..., N] over split_k slices of K (x read in place)."""
    if not partials:
        return jnp.einsum("...i,io->...o", x, w, precision=dot_precision(x.dtype))
    k, n = w.shape
    lead = x.ndim - 1
    return lax.dot_general(x.reshape(*x.shape[:-1], split_k, k // split_k), w.reshape(split_k, k // split_k, n),
                           (((lead + 1,), (1,)), ((lead,), (0,))), precision=dot_precision(x.dtype),
                           preferred_element_type=jnp.float32)


def _kernel(x_ref, w_ref, *refs, cfg: RowConfig, k_per_split: int, partials: bool, precision, norm=None):
    """Program (column block, K slice): the row's product with w's [k_per_split, block_n] slab.
    norm (group, gate_offset, eps, S): refs start with the sums of squares [K / group, S], the
    gate's row as a column [W, 1] and the norm weight as a column [group, 1] (`_normed_chunk`)."""
    o_ref = refs[-1]
    col, split = pl.program_id(0), pl.program_id(1)
    row = None if norm is None else functools.partial(_normed_chunk, x_ref, *refs[:3], norm=norm)
    y = slab_product(x_ref, w_ref, cfg=cfg, k_per_split=k_per_split, precision=precision, row=row)
    if partials:
        store(o_ref, (split, pl.ds(col * cfg.block_n, cfg.block_n)), y)
    else:
        store(o_ref, (pl.ds(col * cfg.block_n, cfg.block_n),), y.astype(o_ref.dtype))


def _normed_chunk(x_ref, sq_ref, gate_ref, nw_ref, k0, bk: int, *, norm):
    """The row's K step [k0, k0 + bk) as a column [bk, 1], gated-RMS-normed as NormedRow.value
    computes it (bk divides the group, so the step lies in one group)."""
    group, gate_offset, eps, n_sums = norm
    f32 = jnp.float32
    xk = load(x_ref, (pl.ds(k0, bk), pl.ds(0, 1)))
    g = k0 // group
    total = sq_ref[g, 0]
    for j in range(1, n_sums):  # in index order
        total = total + sq_ref[g, j]
    inv = lax.rsqrt(total / group + eps)
    normed = (xk.astype(f32) * inv).astype(xk.dtype)
    wn = load(nw_ref, (pl.ds(k0 % group, bk), pl.ds(0, 1))) * normed  # in the weight's dtype, as gate_normed
    z = load(gate_ref, (pl.ds(gate_offset + k0, bk), pl.ds(0, 1))).astype(f32)
    return (wn * (z * jax.nn.sigmoid(z))).astype(xk.dtype)


def slab_product(x_ref, w_ref, *, cfg: RowConfig, k_per_split: int, precision, row=None):
    """Inside program (column block, K slice) of a grid like `_pallas`'s: the float32 product [block_n]
    of the row x_ref [K, 1] (a column) with w_ref's [k_per_split, block_n] slab. row(k0, bk), if
    given, makes the row's K step [bk, 1] instead of loading it from x_ref."""
    f32 = jnp.float32
    bn, bk = cfg.block_n, cfg.block_k
    col, split = pl.program_id(0), pl.program_id(1)
    col0, k_base = col * bn, split * k_per_split
    chunk = row or (lambda k0, n: load(x_ref, (pl.ds(k0, n), pl.ds(0, 1))))  # x passed as a column (_pallas)

    def step(i, acc):
        k0 = k_base + i * bk
        w = load(w_ref, (pl.ds(k0, bk), pl.ds(col0, bn)))
        xk = chunk(k0, bk)  # [bk, 1]
        if cfg.form == "fma":
            return acc + w.astype(f32) * xk.astype(f32)
        rows = jnp.where(lax.broadcasted_iota(jnp.int32, (MIN_BLOCK, bk), 0) == 0,
                         jnp.broadcast_to(xk.T, (MIN_BLOCK, bk)), jnp.zeros((MIN_BLOCK, bk), xk.dtype))
        return acc + lax.dot_general(rows, w, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=f32)

    shape = (bk, bn) if cfg.form == "fma" else (MIN_BLOCK, bn)
    steps = k_per_split // bk
    if cfg.unroll and cfg.form == "fma":  # every load of the slab first, then the products
        k0s = [k_base + i * bk for i in range(steps)]
        ws = [load(w_ref, (pl.ds(k0, bk), pl.ds(col0, bn))) for k0 in k0s]
        xs = [chunk(k0, bk) for k0 in k0s]
        acc = jnp.zeros(shape, f32)
        for w, xk in zip(ws, xs):
            acc = acc + w.astype(f32) * xk.astype(f32)
    elif cfg.unroll:
        acc = jnp.zeros(shape, f32)
        for i in range(steps):
            acc = step(i, acc)
    else:
        acc = lax.fori_loop(0, steps, step, jnp.zeros(shape, f32))
    return jnp.sum(acc, axis=0)  # the dot form's pad rows are zeros


def _pallas(x_col, w, cfg: RowConfig, partials: bool, interpret: bool, norm: NormedRow | None = None):
    """x_col [K, 1]: the row as a column, so that a [block_k, 1] load broadcasts over the weight
    tile's columns in the tile's own register layout (a 1-D [block_k] row would be converted to
    that layout through shared memory, a barrier on every K step). norm: the row's NormedRow (its
    squares, gate and weight passed in place, as columns)."""
    k, n = w.shape
    if partials or cfg.split_k > 1:
        out_shape = jax.ShapeDtypeStruct((cfg.split_k, n), jnp.float32)
    else:
        out_shape = jax.ShapeDtypeStruct((n,), x_col.dtype)
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    extra, norm_args = (), None
    if norm is not None:
        squares = norm.squares.reshape(k // norm.group, norm.squares.shape[-1]).astype(jnp.float32)
        extra = (squares, norm.gate.reshape(-1, 1), norm.weight.reshape(-1, 1))
        norm_args = (norm.group, norm.gate_offset, float(norm.eps), squares.shape[-1])
    kernel = functools.partial(_kernel, cfg=cfg, k_per_split=k // cfg.split_k,
                               partials=len(out_shape.shape) == 2, precision=dot_precision(x_col.dtype),
                               norm=norm_args)
    out = pl.pallas_call(
        kernel,
        grid=(n // cfg.block_n, cfg.split_k),
        in_specs=[full(a.shape) for a in (x_col, w, *extra)],
        out_specs=full(out_shape.shape),
        out_shape=out_shape,
        compiler_params=None if interpret else compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="row_product",
    )(x_col, w, *extra)
    if partials or cfg.split_k == 1:
        return out
    return summed_partials(out, x_col.dtype)


def row_product(x, w, *, config: RowConfig | None = None, partials: bool = False, impl: str = "xla"):
    """x [..., K] of one row @ w [K, N] -> [..., N] in x's dtype, or with `partials` float32
    [S, ..., N] (S = the config's split_k after `fit`; module docstring). impl "xla": `reference`.
    x may be a NormedRow: the product of its normed row (the kernel norms each K step as it loads
    it; K steps no wider than the norm's group; "xla": `NormedRow.value` first)."""
    check_impl(impl)
    norm = x if isinstance(x, NormedRow) else None
    if norm is not None:
        bad = norm.problems()
        if bad:
            raise ValueError("row_product: " + "; ".join(bad))
        x = norm.x
        if impl == "xla":
            return row_product(norm.value(), w, config=config, partials=partials, impl=impl)
    k, n = w.shape
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    if x.shape[-1] != k or w.ndim != 2 or rows != 1:
        raise ValueError(f"row_product: x {tuple(x.shape)} must hold one row of K = {k} for w {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"row_product: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    bad = problems(k, n, x.dtype, config)
    cfg = config or (RowConfig() if bad else default_config(k, n, partials=partials))
    if impl == "xla":
        if bad and config is not None:
            raise ValueError("row_product: " + "; ".join(bad))
        split = cfg.fit(k, n).split_k if not bad else 1
        return reference(x, w, split_k=split, partials=partials)
    if bad:
        raise ValueError("row_product kernel: " + "; ".join(bad) + " (use impl='xla')")
    cfg = cfg.fit(k, n)
    if norm is not None:  # K steps within one group, their loads (and the norm's) all issued first
        cfg = dataclasses.replace(cfg, block_k=min(cfg.block_k, norm.group), unroll=True).fit(k, n)
    out = _pallas(x.reshape(k, 1), w, cfg, partials, impl == "pallas_interpret", norm)
    return out.reshape(cfg.split_k, *x.shape[:-1], n) if partials else out.reshape(*x.shape[:-1], n)
