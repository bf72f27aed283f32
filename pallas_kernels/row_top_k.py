"""Top-k of short rows in one kernel launch (DDTree's per-depth vocabulary candidates), next to its
reference.

    values, indices = row_top_k(x, k, impl="xla" | "pallas" | "pallas_interpret")

x [..., n] float32 -> [..., k] each, exactly lax.top_k (the reference): values in descending
order, ties to the lower index, -0.0 below +0.0.

Why a kernel: on a GPU XLA runs a vocabulary top-16 as a sort (`sort_top_k` below, staged over
chunks of 2048) plus a second sort over the chunk winners and the gathers around them:
15.3 + 2.6 us and ~5 launches of the demo pair's DDTree-16 build, the largest piece left after the
node selection kernel (docs/decisions/0032-row-top-k-kernel.md). Here one program
per row holds the row's int32 order keys in registers and takes the k largest one at a time: a max,
then the lowest index holding it, then that entry masked out (2k dependent block reductions).
For rows up to ROW_TOP_K_MAX_LEN entries and k up to ROW_TOP_K_MAX_K.

Below the kernel: the XLA forms of the same top-k for rows the kernel does not take (the 27B's
248k-entry vocabulary rows, a beam's W x k extensions): one stable sort, staged chunks, and the
block-max prefilter, each equal to lax.top_k (values, indices and tie rule). Which one runs is
the caller's explicit choice (ddtree_jax.routes: sort_top_k_max, staged_top_k, prefilter_top_k).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_impl, compiler_params, load, next_pow2, order_key, store, take_top_k

ROW_TOP_K_MAX_LEN = 8192  # the row's keys in registers: 64 per thread at 4 warps
ROW_TOP_K_MAX_K = 32
DEFAULT_WARPS = 4  # fastest at every measured shape (docs/decisions/0032-row-top-k-kernel.md)


def _kernel(x_ref, val_ref, idx_ref, *, n, k, n_pad, kp):
    i32 = jnp.int32
    lowest = i32(jnp.iinfo(jnp.int32).min)  # below every real key (order_key never returns it)
    idx = lax.broadcasted_iota(i32, (n_pad,), 0)
    x = load(x_ref, (pl.ds(0, n_pad),), mask=idx < n, other=0.0)
    key = jnp.where(idx < n, order_key(x), lowest)
    keys, picks = take_top_k(key, k, kp, removed=lowest)
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
        return reference(x, k)
    return _pallas(x, k, interpret=impl == "pallas_interpret", num_warps=num_warps)


def reference(x: jax.Array, k: int):
    """lax.top_k of x in float32: the kernel's reference."""
    return lax.top_k(x.astype(jnp.float32), k)


# ---- XLA forms of the same top-k ------------------------------------------------------------
TOPK_CHUNK = 2048  # chunk of the staged top-k
PREFILTER_BLOCK = 128  # vocabulary block of the block-max prefilter
PREFILTER_MIN_RATIO = 8  # rows at least this many times k * PREFILTER_BLOCK long are worth prefiltering


def sort_top_k(x: jax.Array, k: int):
    """lax.top_k over the last axis as one stable sort of descending keys (ties: lower index first).

    For k <= 16 XLA runs lax.top_k on GPUs as its TopK custom kernel, which such a sort beats on
    short rows (docs/decisions/0034-vocabulary-top-k-xla-forms.md). Integer keys with a less-than order keep XLA from
    matching the sort back into a TopK."""
    idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    _, idx = jax.lax.sort((~order_key(x), idx), dimension=x.ndim - 1, num_keys=1, is_stable=True)
    idx = idx[..., :k]
    return jnp.take_along_axis(x, idx, axis=-1), idx


def _one_pass_top_k(x: jax.Array, k: int, sort_max: int):
    return sort_top_k(x, k) if k <= sort_max else jax.lax.top_k(x, k)


def top_k(x: jax.Array, k: int, *, chunk: int = TOPK_CHUNK, staged: bool = False, sort_max: int = 0):
    """lax.top_k over the last axis (same values, indices and tie rule: equal values, lower index
    first). staged: for long rows, the top k of each contiguous chunk, then (again staged if still
    long) the top k of those candidates, kept in chunk order so the tie rule carries over: on a GPU
    lax.top_k of one long row runs as one thread block or a sort of the whole row, while rows of a
    few thousand sort in one short pass; XLA:CPU's partial-sort top-k is faster unstaged. sort_max:
    k up to this takes `sort_top_k` (GPU) in each pass."""
    n = x.shape[-1]
    if not staged or n <= 2 * chunk or k > chunk // 4:
        # The barrier keeps XLA from fusing the consumers' slices into the top-k: on XLA:CPU the
        # fused form re-ran it per consumer.
        return jax.lax.optimization_barrier(_one_pass_top_k(x, k, sort_max))
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf) if pad else x
    xp = xp.reshape(*x.shape[:-1], n_chunks, chunk)
    val, idx = _one_pass_top_k(xp, k, sort_max)  # [..., n_chunks, k]
    idx = idx + (jnp.arange(n_chunks, dtype=idx.dtype) * chunk)[:, None]
    val, idx = val.reshape(*x.shape[:-1], n_chunks * k), idx.reshape(*x.shape[:-1], n_chunks * k)
    best, pos = top_k(val, k, chunk=chunk, staged=staged, sort_max=sort_max)  # candidates in (chunk, rank) order
    return jax.lax.optimization_barrier((best, jnp.take_along_axis(idx, pos, axis=-1)))


def prefiltered_top_k(x: jax.Array, k: int, *, block: int = PREFILTER_BLOCK, staged: bool = False,
                      sort_max: int = 0):
    """lax.top_k over the last axis (same values, indices, tie rule) of a long row through a
    block-max prefilter: the k best entries lie in the k best blocks by block maximum.

    Why it is exact: rank entries by (value desc, index asc) and blocks (contiguous, `block` wide)
    by (max desc, block index asc), both on `order_key` (lax.top_k's order, -0.0 below +0.0).
    An entry e of a block c outside the k best blocks is beaten by each of their k maxima: a
    block ranked ahead of c has a larger maximum (> max(c) >= e), or an equal one at a lower block
    index, i.e. an equal entry at a lower index. So e is not among the k best, and the top k of
    the k best blocks' entries, gathered in block order so "lower position" stays "lower index",
    is the row's top k. Cost: one max-reduce pass over the row and a top-k of k * block
    candidates, where the staged top-k's first stage sorts every chunk of the row."""
    n = x.shape[-1]
    n_blocks = -(-n // block)
    if n_blocks < k:
        return top_k(x, k, staged=staged, sort_max=sort_max)
    pad = n_blocks * block - n
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf) if pad else x
    xp = xp.reshape(*x.shape[:-1], n_blocks, block)
    block_max = jnp.max(order_key(xp), axis=-1)  # [..., n_blocks] int32, lax.top_k's order
    _, best = top_k(block_max, k, staged=staged, sort_max=sort_max)
    best = jnp.sort(best, axis=-1)  # block order: candidate position order = index order
    cand = jnp.take_along_axis(xp, best[..., None], axis=-2).reshape(*x.shape[:-1], k * block)
    val, pos = top_k(cand, k, staged=staged, sort_max=sort_max)
    idx = jnp.take_along_axis(best, pos // block, axis=-1) * block + pos % block
    return jax.lax.optimization_barrier((val, idx))
