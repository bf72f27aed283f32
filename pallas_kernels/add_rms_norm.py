"""Residual add + RMSNorm in one kernel launch, next to its reference.

    stream, normed = add_rms_norm(x, delta, weight, eps=..., mode=..., impl="xla" | "pallas" | "pallas_interpret")

x, delta [..., H] (the residual stream and what a mixer / MLP adds to it), weight [H]. Returns
stream = x + delta (x's dtype) and normed = RMSNorm(stream) in x's dtype, the norm as
models.layers.RMSNorm computes it in each `mode`: "zero_centered" (out = norm(s) * (1 + w),
Qwen3.5), "fp32_weight" (w * norm(s) in float32, then cast: NemotronH), "plain" (cast, then w *
norm(s): Qwen3 / Llama). `reference` is that module's arithmetic.

Why a kernel: between two GEMVs of a decode step XLA runs the residual add, the sum of squares
and the normalize as three launches for each row (docs/decisions/0013-add-rms-norm-kernel.md);
here one program per row loads both inputs once, writes the sum and the normed row.

delta may also be split-K partial sums: float32 [S, ..., H]. At 65 rows (a tree verify of the 27B
model) XLA runs the MLP down and the mixer output products as split-K GEMMs writing S = 8 / 4
float32 partials, then a reduce fusion of its own (2.3-3.9 us a launch, 128 a step) before this
kernel; taking the partials here removes that launch. The kernel adds the S partials in float32
in index order, rounds the sum to x's dtype (what the reduce fusion writes), then adds x as for a
plain delta. The row goes in power-of-two column blocks of at most PARTS_CHUNK (a static loop;
a block's S partial loads, its x and weight loads are independent), the blocks' stream values
stay in registers for the second loop that normalizes and stores (a form holding all partials as
one [8, 8192] float32 block spilled heavily); no spill at PARTS_WARPS / PARTS_CHUNK
(scripts/offline_triton_compile.py add_rms_norm; figures: docs/decisions/0014-split-k-partials-add-rms-norm.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import check_impl, compiler_params, load, next_pow2, store, summed_partials

MODES = ("zero_centered", "fp32_weight", "plain")
DEFAULT_WARPS = 4
# Split-K partials: one program a row, so 65 rows fill 65 of 132 SMs and a program's loads in
# flight set the speed; 1024 threads, blocks of 4096 + 1024 columns at 5120 (4 + 1 a thread).
# ncu at S = 8 after the product: 5.6 us; 16 warps 6.1 (4096) / 6.6 (2048); 8 warps 6.6 (1024).
PARTS_WARPS = 32
PARTS_CHUNK = 4096  # widest column block of the partials path (a power of two)


def _weighted(normed, w, mode: str, dtype):
    """The float32 normalized values times the weight w, in `mode`, cast to dtype."""
    if mode == "zero_centered":
        return (normed * (1.0 + w.astype(jnp.float32))).astype(dtype)
    if mode == "fp32_weight":
        return (w.astype(jnp.float32) * normed).astype(dtype)
    return w.astype(dtype) * normed.astype(dtype)


def _normed(s, w, eps: float, mode: str, dtype):
    """RMSNorm of the float32 row(s) s with weight w (models.layers.RMSNorm's arithmetic)."""
    s32 = s.astype(jnp.float32)
    normed = s32 * jax.lax.rsqrt(jnp.mean(s32 * s32, axis=-1, keepdims=True) + eps)
    return _weighted(normed, w, mode, dtype)


def _dense(x, delta):
    """delta as one [..., H] array: split-K partial sums [S, ..., H] added and rounded to x's dtype."""
    return summed_partials(delta, x.dtype) if delta.ndim == x.ndim + 1 else delta


def reference(x, delta, weight, *, eps: float, mode: str):
    stream = (x + _dense(x, delta)).astype(x.dtype)
    return stream, _normed(stream, weight, eps, mode, x.dtype)


def _kernel(x_ref, d_ref, w_ref, s_ref, n_ref, *, h, hp, eps, mode):
    f32 = jnp.float32
    idx = jax.lax.broadcasted_iota(jnp.int32, (hp,), 0)
    mask = None if hp == h else idx < h
    get = lambda ref: load(ref, (pl.ds(0, hp),)) if mask is None else load(ref, (pl.ds(0, hp),), mask=mask, other=0)
    put = lambda ref, v: store(ref, (pl.ds(0, hp),), v, mask=mask)
    stream = (get(x_ref).astype(f32) + get(d_ref).astype(f32)).astype(s_ref.dtype)
    put(s_ref, stream)
    s32 = stream.astype(f32)
    inv = jax.lax.rsqrt(jnp.sum(s32 * s32) / h + eps)  # padded lanes are zero: the sum is the row's
    normed = s32 * inv
    w = get(w_ref)
    w32 = w.astype(f32)
    if mode == "zero_centered":
        out = (normed * (1.0 + w32)).astype(n_ref.dtype)
    elif mode == "fp32_weight":
        out = (w32 * normed).astype(n_ref.dtype)
    else:
        out = w.astype(n_ref.dtype) * normed.astype(n_ref.dtype)
    put(n_ref, out)


def _chunks(h: int, chunk: int):
    """(start, width, lanes kept or None) of the column blocks covering a row of h, each a power of
    two: whole `chunk`-wide blocks, then the rest: one block when it is a power of two, else
    one of next_pow2(rest) that ends at column h (it overlaps the block before it; only its new
    columns are kept) or, for a row narrower than that, starts at 0 and is masked at h. Every
    start stays inside the row (interpret mode rejects a block that starts inside and runs out)."""
    blocks = [(c0, chunk, None) for c0 in range(0, h - chunk + 1, chunk)]
    done = len(blocks) * chunk
    rest = h - done
    if rest:
        width = next_pow2(rest)
        lanes = jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
        if width == rest:
            blocks.append((done, width, None))
        elif width <= h:
            blocks.append((h - width, width, lanes >= width - rest))
        else:
            blocks.append((0, width, lanes < h))
    return blocks


def _parts_kernel(x_ref, d_ref, w_ref, s_ref, n_ref, *, h, chunk, parts, eps, mode):
    """One row: delta = the sum of `parts` float32 partial rows d_ref [S, H], a block of columns at
    a time (a static loop), then the normalize over the blocks' stream values held in registers."""
    f32 = jnp.float32
    blocks = _chunks(h, chunk)

    def get(ref, c0, width, keep, *lead):
        idx = (*lead, pl.ds(c0, width))
        return load(ref, idx) if keep is None else load(ref, idx, mask=keep, other=0)

    streams, weights = [], []  # each block's stream in x's dtype and its weights, for the normalize loop
    squares = {}  # block width -> per-lane sums of squares over the blocks of that width
    for c0, width, keep in blocks:
        partials = [get(d_ref, c0, width, keep, jnp.int32(p)) for p in range(parts)]  # independent loads
        acc = partials[0]
        for part in partials[1:]:
            acc = acc + part  # index order, jnp.sum's over axis 0 where XLA keeps it
        stream = (get(x_ref, c0, width, keep).astype(f32) + acc.astype(s_ref.dtype).astype(f32)).astype(s_ref.dtype)
        streams.append(stream)
        weights.append(get(w_ref, c0, width, keep))  # loaded here: no load latency after the reduction
        s32 = stream.astype(f32)
        squares[width] = s32 * s32 + squares.get(width, 0.0)  # lanes not kept are zero
    inv = jax.lax.rsqrt(sum(jnp.sum(v) for v in squares.values()) / h + eps)
    for (c0, width, keep), stream, w in zip(blocks, streams, weights):
        store(s_ref, (pl.ds(c0, width),), stream, mask=keep)  # no store between the blocks' loads
        out = _weighted(stream.astype(f32) * inv, w, mode, n_ref.dtype)
        store(n_ref, (pl.ds(c0, width),), out, mask=keep)


def _pallas(x, delta, weight, eps: float, mode: str, *, interpret: bool, num_warps: int | None,
            parts_chunk: int | None):
    *lead, h = x.shape
    rows_x = x.reshape(-1, h)
    r = rows_x.shape[0]
    row = pl.BlockSpec((None, h), lambda i: (i, 0))
    if delta.ndim == x.ndim + 1:  # split-K partial sums [S, ..., H]
        parts = delta.shape[0]
        rows_d = delta.reshape(parts, r, h)
        delta_spec = pl.BlockSpec((parts, None, h), lambda i: (0, i, 0))
        chunk = min(parts_chunk or PARTS_CHUNK, next_pow2(h))
        kernel = functools.partial(_parts_kernel, h=h, chunk=chunk, parts=parts, eps=eps, mode=mode)
        warps = num_warps or PARTS_WARPS
    else:
        rows_d = delta.reshape(-1, h)
        delta_spec = row
        kernel = functools.partial(_kernel, h=h, hp=next_pow2(h), eps=eps, mode=mode)
        warps = num_warps or DEFAULT_WARPS
    stream, normed = pl.pallas_call(
        kernel,
        grid=(r,),
        in_specs=[row, delta_spec, pl.BlockSpec((h,), lambda i: (0,))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((r, h), x.dtype), jax.ShapeDtypeStruct((r, h), x.dtype)],
        compiler_params=None if interpret else compiler_params(warps, 1),
        interpret=interpret,
        name="add_rms_norm",
    )(rows_x, rows_d, weight)
    return stream.reshape(x.shape), normed.reshape(x.shape)


def add_rms_norm(x, delta, weight, *, eps: float, mode: str, impl: str = "xla", num_warps: int | None = None,
                 parts_chunk: int | None = None):
    """(x + delta, RMSNorm(x + delta)) over the last axis, both in x's dtype; delta [..., H] like
    x, or float32 split-K partial sums [S, ..., H] (added in float32, rounded to x's dtype, then
    added to x). num_warps: DEFAULT_WARPS (plain delta) / PARTS_WARPS (partials) when None;
    parts_chunk: the partials path's widest column block (a power of two; PARTS_CHUNK when None)."""
    check_impl(impl)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    parts = delta.ndim == x.ndim + 1
    if delta.shape[int(parts):] != x.shape or weight.shape != x.shape[-1:] or (parts and delta.shape[0] < 1):
        raise ValueError(f"add_rms_norm: x {x.shape}, delta {delta.shape} and weight {weight.shape} do not match "
                         "(delta is [..., H] like x, or split-K partial sums [S >= 1, ..., H])")
    if parts and delta.dtype != jnp.float32:
        raise ValueError(f"add_rms_norm: split-K partial sums delta {delta.shape} must be float32, got {delta.dtype}")
    if impl == "xla":
        return reference(x, delta, weight, eps=eps, mode=mode)
    if parts_chunk is not None and (parts_chunk < 16 or parts_chunk & (parts_chunk - 1)):
        raise ValueError(f"add_rms_norm: parts_chunk must be a power of two >= 16, got {parts_chunk}")
    return _pallas(x, delta, weight, eps, mode, interpret=impl == "pallas_interpret", num_warps=num_warps,
                   parts_chunk=parts_chunk)
