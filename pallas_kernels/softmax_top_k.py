"""Softmax, top-k and renormalisation of short rows in one kernel launch (a softmax router's choice
of experts per token), next to its reference.

    ids, weights = softmax_top_k(logits, k, norm=True, weights_dtype=jnp.bfloat16,
                                 impl="xla" | "pallas" | "pallas_interpret")

logits [T, n] -> ids [T, k] int32: the k largest of p = softmax(float32(logits)) in descending
order, ranked by exp(x - max x) (p's order before the division by the sum rounds: two entries of
equal exps go to the lower index, lax.top_k's rule); weights [T, k] float32: those
probabilities, divided by their sum if `norm`, rounded to `weights_dtype` (float32 holding values
of that dtype: what a router that rounds its weights to the params dtype hands the experts).
With `logits_dtype` the logits come as float32 split-K partial sums [S, T, n] (a router's one-row
product from pallas_kernels/row_product.py): the kernel adds them in index order and rounds the
sum to logits_dtype (what XLA's sum of them writes) before the softmax, saving that launch.

Why a kernel: on a GPU XLA makes a softmax router's choice of one decode token in ~4 launches (the
softmax, a sort for the top-k, the renormalisation, the rounding): 6.6 us a layer of the
Qwen3.6-35B-A3B-shape decode step on the H200, a fifth of the step's small launches
(docs/results/2026-12-02_profile_35b_a3b_decode_row_pad.json: sort 3.9 us, the two softmax-like
fusions 1.6 + 1.1 us). Here one program per row holds the row in registers: max, exp, sum, then
the k largest exps one at a time (a max, the lowest index holding it, that entry masked out; the
probabilities' order, but not moved by the sum's rounding), the renormalisation and the
rounding. Rows up to SOFTMAX_TOP_K_MAX_LEN entries, k up to SOFTMAX_TOP_K_MAX_K.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (check_impl, compiler_params, load, next_pow2, rounded, store, summed_partials,
                                    take_top_k)

SOFTMAX_TOP_K_MAX_LEN = 4096  # the row in registers (512 experts is the largest router in use)
SOFTMAX_TOP_K_MAX_K = 32
DEFAULT_WARPS = 1  # fastest at every measured shape: docs/decisions/0052-moe-router-kernel.md


def _rounded(x, dtype, interpret: bool):
    """x (float32) rounded to dtype, kept in float32. Interpret mode runs the kernel through XLA, so
    it rounds as the XLA forms do (`_common.rounded`); the Triton lowering keeps casts."""
    if jnp.dtype(dtype) == jnp.float32:
        return x
    if interpret:
        return rounded(x, dtype).astype(jnp.float32)
    return x.astype(dtype).astype(jnp.float32)


def _kernel(x_ref, ids_ref, w_ref, *, n, k, n_pad, kp, norm, dtype, parts, logits_dtype, interpret):
    f32, i32 = jnp.float32, jnp.int32
    idx = lax.broadcasted_iota(i32, (n_pad,), 0)
    real = idx < n
    if parts:  # x_ref [S, n]: the partial sums, added in index order, rounded to the logits' dtype
        rows = [load(x_ref, (jnp.int32(p), pl.ds(0, n_pad)), mask=real, other=0.0) for p in range(parts)]
        x = rows[0]
        for r in rows[1:]:
            x = x + r
        store_choice(ids_ref, w_ref, x, real, k=k, kp=kp, norm=norm, dtype=dtype, interpret=interpret,
                     round_to=logits_dtype)
    else:
        x = load(x_ref, (pl.ds(0, n_pad),), mask=real, other=0.0).astype(f32)
        store_choice(ids_ref, w_ref, x, real, k=k, kp=kp, norm=norm, dtype=dtype, interpret=interpret)


def choose(x, real, *, k, kp, norm, dtype, interpret, round_to=None):
    """Inside a kernel: the softmax top-k of one row of float32 logits x [n_pad] (lanes where `real`
    is false ignored; first rounded to `round_to` when given: a sum of partial products): (ids
    [kp] int32, weights [kp] float32 rounded to dtype), lanes past k zero. The module's arithmetic,
    which every kernel that routes a token runs (pallas_kernels/router_choice.py's last program,
    the experts' first decode launch: pallas_kernels/_moe_decode.py), so all route it alike."""
    if round_to is not None:
        x = _rounded(x, round_to, interpret)
    x = jnp.where(real, x, -jnp.inf)
    e = jnp.exp(x - jnp.max(x))
    key = jnp.where(real, e, -1.0)  # below every exp
    vals, picks = take_top_k(key, k, kp, removed=-2.0)
    # the chosen probabilities, p = e / sum(e) (jax.nn.softmax's formula); chosen by e, whose order p
    # keeps, so the choice does not depend on the sum's reduction order, which follows a kernel's
    # layout: every kernel that runs this routes a token alike (decision 0071)
    vals = vals / jnp.sum(e)  # lanes past k hold zeros
    if norm:
        vals = vals / jnp.sum(vals)
    return picks, _rounded(vals, dtype, interpret)


def store_choice(ids_ref, w_ref, x, real, *, k, kp, norm, dtype, interpret, round_to=None, at=()):
    """Inside a kernel: `choose`'s ids and weights of the row x stored into ids_ref / w_ref at index
    prefix `at`, k lanes."""
    picks, weights = choose(x, real, k=k, kp=kp, norm=norm, dtype=dtype, interpret=interpret, round_to=round_to)
    keep = lax.broadcasted_iota(jnp.int32, (kp,), 0) < k
    store(ids_ref, (*at, pl.ds(0, kp)), picks, mask=keep)
    store(w_ref, (*at, pl.ds(0, kp)), weights, mask=keep)


def _pallas(logits, k: int, *, norm: bool, weights_dtype, interpret: bool, num_warps: int | None,
            logits_dtype=None):
    """logits [T, n], or float32 partial sums [S, T, n] with logits_dtype."""
    t, n = logits.shape[-2:]
    problems = []
    if n > SOFTMAX_TOP_K_MAX_LEN:
        problems.append(f"rows up to {SOFTMAX_TOP_K_MAX_LEN} entries, got {n}")
    if not 1 <= k <= min(n, SOFTMAX_TOP_K_MAX_K):
        problems.append(f"k in [1, min(n, {SOFTMAX_TOP_K_MAX_K})], got k = {k} for n = {n}")
    if problems:
        raise ValueError("the softmax top-k kernel takes " + "; ".join(problems) + ": use impl='xla'")
    n_pad, kp = max(16, next_pow2(n)), max(16, next_pow2(k))
    parts = logits.shape[0] if logits_dtype is not None else 0
    kernel = functools.partial(_kernel, n=n, k=k, n_pad=n_pad, kp=kp, norm=norm, dtype=jnp.dtype(weights_dtype),
                               parts=parts, logits_dtype=logits_dtype and jnp.dtype(logits_dtype), interpret=interpret)
    in_spec = (pl.BlockSpec((parts, None, n), lambda i: (0, i, 0)) if parts else
               pl.BlockSpec((None, n), lambda i: (i, 0)))
    out_spec = pl.BlockSpec((None, k), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        grid=(t,),
        in_specs=[in_spec],
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((t, k), jnp.float32)],
        compiler_params=None if interpret else compiler_params(num_warps or DEFAULT_WARPS, 1),
        interpret=interpret,
        name="softmax_top_k",
    )(logits)


def softmax_top_k(logits: jax.Array, k: int, *, norm: bool, weights_dtype=jnp.float32, impl: str = "xla",
                  num_warps: int | None = None, logits_dtype=None) -> tuple[jax.Array, jax.Array]:
    """[..., n] -> (ids int32, weights float32) [..., k] (module docstring); with logits_dtype,
    logits are float32 split-K partial sums [S, ..., n] whose rounded sum is the logits."""
    check_impl(impl)
    if logits_dtype is not None and (logits.dtype != jnp.float32 or logits.ndim < 2):
        raise ValueError(f"softmax_top_k: partial sums must be float32 [S, ..., n], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if impl == "xla":
        if logits_dtype is not None:
            logits = summed_partials(logits, logits_dtype)
        return reference(logits, k, norm=norm, weights_dtype=weights_dtype)
    lead, n = logits.shape[1 if logits_dtype is not None else 0:-1], logits.shape[-1]
    flat = logits.reshape(logits.shape[0], -1, n) if logits_dtype is not None else logits.reshape(-1, n)
    ids, weights = _pallas(flat, k, norm=norm, weights_dtype=weights_dtype, interpret=impl == "pallas_interpret",
                           num_warps=num_warps, logits_dtype=logits_dtype)
    return ids.reshape(*lead, k), weights.reshape(*lead, k)


def reference(logits: jax.Array, k: int, *, norm: bool, weights_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """The kernel's reference: the softmax in float32 (jax.nn.softmax's formula), lax.top_k of its
    exps (the probabilities' order, free of the sum's rounding), the chosen probabilities, the
    renormalisation, the rounding."""
    x = logits.astype(jnp.float32)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    top, ids = lax.top_k(e, k)
    top = top / jnp.sum(e, axis=-1, keepdims=True)
    if norm:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), _rounded(top, weights_dtype, interpret=True)
