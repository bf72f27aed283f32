"""Matmuls with few rows (a DDTree verify's 65 nodes, a DFlash block's 16) that stream the weight
once, next to the reference.

    y = skinny_matmul(x, w, impl="xla" | "pallas" | "pallas_interpret", config=None)

x [..., K], w [K, N] -> y [..., N] in their (common) dtype with float32 accumulation: what
`jnp.matmul(x, w)` returns (`reference`).

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
With split_k > 1 each program covers one K slice and writes float32 partial sums that XLA adds.
Masks appear only where a shape needs them (a row tile past the last row, N or K not a multiple
of the blocks): an unmasked weight load keeps Triton's 16-byte vector loads.
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

    def check(self) -> None:
        bad = [f"{name} = {getattr(self, name)}" for name in ("block_n", "block_k", "max_row_tile")
               if not (is_pow2(getattr(self, name)) and getattr(self, name) >= 16)]
        bad += [] if self.split_k >= 1 else [f"split_k = {self.split_k}"]
        bad += [] if self.layout in LAYOUTS else [f"layout = {self.layout!r} (one of {LAYOUTS})"]
        if bad:
            raise ValueError("invalid skinny matmul config (block sizes are powers of two >= 16): " + ", ".join(bad))


# H200, session 7 (scripts/gpu_skinny_matmul.py --trace, 65 rows): 64 columns, 64-deep K tiles 4
# stages deep, K split in 2 ranked first of 15 configs over the four largest 27B projections
# (geometric mean 1.03x XLA's kernel time; it wins the 5120 -> 6144 / 10240 and 6144 -> 5120
# products, loses the 17408-wide ones: models.layers routes accordingly).
DEFAULT_CONFIG = SkinnyConfig(block_n=64, block_k=64, num_stages=4, split_k=2)


def default_config(m: int, k: int, n: int) -> SkinnyConfig:
    """The tiling for an [m, k] x [k, n] product (one measured default for now)."""
    del m, k, n
    return DEFAULT_CONFIG


def row_tiles(m: int, max_tile: int) -> tuple[tuple[int, int], ...]:
    """(first row, rows) of the power-of-two row tiles (>= 16, <= max_tile) that cover m rows,
    largest first: 65 -> (0, 64), (64, 16)."""
    left, start, tiles = cdiv(m, 16) * 16, 0, []
    while left > 0:
        size = min(max_tile, 1 << (left.bit_length() - 1))
        tiles.append((start, size))
        start, left = start + size, left - size
    return tuple(tiles)


def reference(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.matmul(x, w)


def _kernel(x_ref, w_ref, o_ref, *, m, k, n, cfg: SkinnyConfig, tiles, k_per_split, precision):
    i32, f32 = jnp.int32, jnp.float32
    bn, bk = cfg.block_n, cfg.block_k
    col0 = pl.program_id(0) * bn
    k_base = pl.program_id(1) * k_per_split
    mask_k = k_per_split * cfg.split_k != k
    mask_n = n % bn != 0
    cols = col0 + lax.broadcasted_iota(i32, (bn,), 0)
    kk = lax.broadcasted_iota(i32, (bk,), 0)

    def w_mask(k0):
        if not (mask_k or mask_n):
            return None
        mask = jnp.ones((bk, bn), jnp.bool_)
        if mask_k:
            mask = mask & jnp.broadcast_to(((k0 + kk) < k)[:, None], (bk, bn))
        if mask_n:
            mask = mask & jnp.broadcast_to((cols < n)[None, :], (bk, bn))
        return mask

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
        w = masked(w_ref, (pl.ds(k0, bk), pl.ds(col0, bn)), w_mask(k0))
        out = []
        for (r0, rt), acc in zip(tiles, accs):
            xt = masked(x_ref, (pl.ds(r0, rt), pl.ds(k0, bk)), x_mask(r0, rt, k0))
            if cfg.layout == "rows":
                part = lax.dot_general(xt, w, (((1,), (0,)), ((), ())), precision=precision,
                                       preferred_element_type=f32)
            else:  # [bn, rt]: the weight columns on the MMA's M side
                part = lax.dot_general(w, xt, (((0,), (1,)), ((), ())), precision=precision,
                                       preferred_element_type=f32)
            out.append(acc + part)
        return tuple(out)

    shape = (lambda rt: (rt, bn)) if cfg.layout == "rows" else (lambda rt: (bn, rt))
    accs = lax.fori_loop(0, k_per_split // bk, step, tuple(jnp.zeros(shape(rt), f32) for _, rt in tiles))
    for (r0, rt), acc in zip(tiles, accs):
        y = acc if cfg.layout == "rows" else acc.T
        mask = None
        if r0 + rt > m or mask_n:
            mask = jnp.ones((rt, bn), jnp.bool_)
            if r0 + rt > m:
                mask = mask & jnp.broadcast_to(((r0 + lax.broadcasted_iota(i32, (rt,), 0)) < m)[:, None], (rt, bn))
            if mask_n:
                mask = mask & jnp.broadcast_to((cols < n)[None, :], (rt, bn))
        store(o_ref, (pl.ds(r0, rt), pl.ds(col0, bn)), y.astype(o_ref.dtype), mask=mask)


def _pallas(x, w, cfg: SkinnyConfig, *, interpret: bool):
    *lead, k = x.shape
    if w.ndim != 2 or w.shape[0] != k:
        raise ValueError(f"skinny_matmul: x [..., {k}] needs a weight [{k}, N], got {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"skinny_matmul: x is {x.dtype} but the weight is {w.dtype}; the kernel takes one dtype")
    cfg.check()
    n = w.shape[1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if not 1 <= m <= SKINNY_MAX_ROWS:
        raise ValueError(f"skinny_matmul takes 1..{SKINNY_MAX_ROWS} rows, got {m}: use impl='xla'")
    tiles = row_tiles(m, cfg.max_row_tile)
    k_per_split = cdiv(cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = cdiv(k, k_per_split)  # a split past K would only add zeros
    cfg = dataclasses.replace(cfg, split_k=split)
    kernel = functools.partial(_kernel, m=m, k=k, n=n, cfg=cfg, tiles=tiles, k_per_split=k_per_split,
                               precision=dot_precision(x.dtype))
    out_dtype = x.dtype if split == 1 else jnp.float32
    mp = sum(size for _, size in tiles)  # blocks as tall as the row tiles; rows >= m are masked
    out_spec = (pl.BlockSpec((mp, n), lambda j, s: (0, 0)) if split == 1
                else pl.BlockSpec((None, mp, n), lambda j, s: (s, 0, 0)))
    out_shape = (m, n) if split == 1 else (split, m, n)
    y = pl.pallas_call(
        kernel,
        grid=(cdiv(n, cfg.block_n), split),
        in_specs=[pl.BlockSpec((mp, k), lambda j, s: (0, 0)), pl.BlockSpec((k, n), lambda j, s: (0, 0))],
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        compiler_params=None if interpret else compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="skinny_matmul",
    )(rows, w)
    if split > 1:
        y = jnp.sum(y, axis=0).astype(x.dtype)
    return y.reshape(*lead, n)


def skinny_matmul(x: jax.Array, w: jax.Array, *, impl: str = "xla", config: SkinnyConfig | None = None) -> jax.Array:
    """[..., K] @ [K, N] -> [..., N]; the kernel for at most SKINNY_MAX_ROWS rows."""
    check_impl(impl)
    if impl == "xla":
        return reference(x, w)
    m = 1
    for d in x.shape[:-1]:
        m *= d
    cfg = config or default_config(m, x.shape[-1], w.shape[-1])
    return _pallas(x, w, cfg, interpret=impl == "pallas_interpret")
