"""Top-k of short rows in one kernel launch (DDTree's per-depth vocabulary candidates), next to its
reference.

    values, indices = row_top_k(x, k, impl="xla" | "pallas" | "pallas_interpret")

x [..., n] float32 -> [..., k] each, exactly lax.top_k (the reference): values in descending
order, ties to the lower index, -0.0 below +0.0.

Why a kernel: on a GPU XLA runs a vocabulary top-16 as a sort (ddtree_jax.speculative.build.sort_top_k,
staged over chunks of 2048) plus a second sort over the chunk winners and the gathers around them:
15.3 + 2.6 us and ~5 launches of the demo pair's DDTree-16 build, the largest piece left after the
node selection kernel (scripts/profile_pair.py, docs/benchmarks.md section 3). Here one program
per row holds the row's int32 order keys in registers and takes the k largest one at a time: a max,
then the lowest index holding it, then that entry masked out (2k dependent block reductions).
For rows up to ROW_TOP_K_MAX_LEN entries and k up to ROW_TOP_K_MAX_K.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ddtree_jax.speculative.build import order_key
from pallas_kernels._common import check_impl, compiler_params, load, next_pow2, store

ROW_TOP_K_MAX_LEN = 8192  # the row's keys in registers: 64 per thread at 4 warps
ROW_TOP_K_MAX_K = 32
# H200, session 6 (scripts/gpu_row_top_k.py --warps 4,16): 4 warps fastest at every measured shape
# (8192 x 16: 12.9 us against 14.9 / 14.3 at 8 / 16 warps and 24.5 for the staged sorts).
DEFAULT_WARPS = 4


def _kernel(x_ref, val_ref, idx_ref, *, n, k, n_pad, kp):
    i32 = jnp.int32
    lowest = i32(jnp.iinfo(jnp.int32).min)  # below every real key (order_key never returns it)
    idx = lax.broadcasted_iota(i32, (n_pad,), 0)
    x = load(x_ref, (pl.ds(0, n_pad),), mask=idx < n, other=0.0)
    key = jnp.where(idx < n, order_key(x), lowest)
    lane = lax.broadcasted_iota(i32, (kp,), 0)

    def take(j, carry):
        key, keys, picks = carry
        top = jnp.max(key)
        at = jnp.min(jnp.where(key == top, idx, n_pad))  # ties: the lower index first
        keys = jnp.where(lane == j, top, keys)
        picks = jnp.where(lane == j, at, picks)
        return jnp.where(idx == at, lowest, key), keys, picks

    _, keys, picks = lax.fori_loop(0, k, take, (key, jnp.zeros((kp,), i32), jnp.zeros((kp,), i32)))
    bits = jnp.where(keys < 0, keys ^ i32(0x7FFFFFFF), keys)  # order_key is its own inverse
    store(val_ref, (pl.ds(0, kp),), lax.bitcast_convert_type(bits, jnp.float32))
    store(idx_ref, (pl.ds(0, kp),), picks)


def _pallas(x, k: int, *, interpret: bool, num_warps: int | None):
    *lead, n = x.shape
    if n > ROW_TOP_K_MAX_LEN or k > ROW_TOP_K_MAX_K:
        raise ValueError(f"the row top-k kernel takes rows up to {ROW_TOP_K_MAX_LEN} entries and k up to "
                         f"{ROW_TOP_K_MAX_K}, got n = {n}, k = {k}: use impl='xla'")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    rows = x.reshape(-1, n).astype(jnp.float32)
    r = rows.shape[0]
    n_pad, kp = max(16, next_pow2(n)), max(16, next_pow2(k))
    kernel = functools.partial(_kernel, n=n, k=k, n_pad=n_pad, kp=kp)
    out_spec = pl.BlockSpec((None, kp), lambda i: (i, 0))
    vals, idx = pl.pallas_call(
        kernel,
        grid=(r,),
        in_specs=[pl.BlockSpec((None, n), lambda i: (i, 0))],
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((r, kp), jnp.float32), jax.ShapeDtypeStruct((r, kp), jnp.int32)],
        compiler_params=None if interpret else compiler_params(num_warps or DEFAULT_WARPS, 1),
        interpret=interpret,
        name="row_top_k",
    )(rows)
    return vals[:, :k].reshape(*lead, k), idx[:, :k].reshape(*lead, k)


def row_top_k(x: jax.Array, k: int, *, impl: str = "xla", num_warps: int | None = None):
    """[..., n] -> (values, indices) [..., k], equal to lax.top_k."""
    check_impl(impl)
    if impl == "xla":
        return lax.top_k(x.astype(jnp.float32), k)
    return _pallas(x, k, interpret=impl == "pallas_interpret", num_warps=num_warps)
