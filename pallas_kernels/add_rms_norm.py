"""Residual add + RMSNorm in one kernel launch, next to its reference.

    stream, normed = add_rms_norm(x, delta, weight, eps=..., mode=..., impl="xla" | "pallas" | "pallas_interpret")

x, delta [..., H] (the residual stream and what a mixer / MLP adds to it), weight [H]. Returns
stream = x + delta (x's dtype) and normed = RMSNorm(stream) in x's dtype, the norm as
models.layers.RMSNorm computes it in each `mode`: "zero_centered" (out = norm(s) * (1 + w),
Qwen3.5), "fp32_weight" (w * norm(s) in float32, then cast: NemotronH), "plain" (cast, then w *
norm(s): Qwen3 / Llama). `reference` is that module's arithmetic.

Why a kernel: between two GEMVs of a decode step XLA runs the residual add, the sum of squares
and the normalize as three launches of ~1.4-1.6 us each for a 5120-wide row (the 127-128-launch
add / reduce / convert fusions of the 27B decode profile, ~0.56 ms a step: docs/benchmarks.md
section 1); here one program per row loads both inputs once, writes the sum and the normed row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import check_impl, compiler_params, load, next_pow2, store

MODES = ("zero_centered", "fp32_weight", "plain")
DEFAULT_WARPS = 4


def _normed(s, w, eps: float, mode: str, dtype):
    """RMSNorm of the float32 row(s) s with weight w (models.layers.RMSNorm's arithmetic)."""
    s32 = s.astype(jnp.float32)
    normed = s32 * jax.lax.rsqrt(jnp.mean(s32 * s32, axis=-1, keepdims=True) + eps)
    w32 = w.astype(jnp.float32)
    if mode == "zero_centered":
        return (normed * (1.0 + w32)).astype(dtype)
    if mode == "fp32_weight":
        return (w32 * normed).astype(dtype)
    return w.astype(dtype) * normed.astype(dtype)


def reference(x, delta, weight, *, eps: float, mode: str):
    stream = (x + delta).astype(x.dtype)
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


def _pallas(x, delta, weight, eps: float, mode: str, *, interpret: bool, num_warps: int | None):
    *lead, h = x.shape
    rows_x = x.reshape(-1, h)
    rows_d = delta.reshape(-1, h)
    r = rows_x.shape[0]
    hp = next_pow2(h)
    kernel = functools.partial(_kernel, h=h, hp=hp, eps=eps, mode=mode)
    row = pl.BlockSpec((None, h), lambda i: (i, 0))
    stream, normed = pl.pallas_call(
        kernel,
        grid=(r,),
        in_specs=[row, row, pl.BlockSpec((h,), lambda i: (0,))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((r, h), x.dtype), jax.ShapeDtypeStruct((r, h), x.dtype)],
        compiler_params=None if interpret else compiler_params(num_warps or DEFAULT_WARPS, 1),
        interpret=interpret,
        name="add_rms_norm",
    )(rows_x, rows_d, weight)
    return stream.reshape(x.shape), normed.reshape(x.shape)


def add_rms_norm(x, delta, weight, *, eps: float, mode: str, impl: str = "xla", num_warps: int | None = None):
    """(x + delta, RMSNorm(x + delta)) over the last axis, both in x's dtype."""
    check_impl(impl)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if x.shape != delta.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: x {x.shape}, delta {delta.shape} and weight {weight.shape} do not match")
    if impl == "xla":
        return reference(x, delta, weight, eps=eps, mode=mode)
    return _pallas(x, delta, weight, eps, mode, interpret=impl == "pallas_interpret", num_warps=num_warps)
