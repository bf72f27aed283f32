"""Ancestor bitsets of a draft tree, built on device, in the layout tree_attention reads.

    bits = ancestor_bits(parents, impl="xla" | "pallas" | "pallas_interpret")   # [B, N, W] uint32

parents [B, N] int32: parents[b, i] is the parent slot of node i, -1 for the root and for
padding. Bit j % 32 of word j // 32 of row i is set iff j is i or an ancestor of i (padding nodes:
only their own bit). Any acyclic forest works (topological order is not required); a parent
outside [0, N) counts as -1. Same bits as ddtree_jax.tree.ancestor_bits_from_parents.

Both implementations use pointer doubling: with J_k the 2^k-th ancestor and A_k the set of
ancestors at distance < 2^k (self included), A_{k+1} = A_k | A_k[J_k] and J_{k+1} = J_k[J_k], so
ceil(log2(max_depth + 1)) steps suffice (max_depth defaults to N - 1).

Pallas kernel (Triton lowering, grid (B,)): one program holds a tree in registers as bytes
[N_pad, C] (byte c of row i = bits 8c..8c+7 of row i's bitset, i.e. the little-endian bytes of
the uint32 words); the row gather A_k[J_k] is a one-hot [N_pad, N_pad] x [N_pad, C] bf16 matmul
(exact: one nonzero term per output, bytes <= 255), J_k[J_k] a masked row reduction. It writes
uint8 bytes [B, N, 4W], reinterpreted as uint32 words by a bitcast.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import WORD, cdiv, check_impl, compiler_params, dot, load, log2_ceil, next_pow2, store

MAX_KERNEL_NODES = 256  # N_pad = 512 asked the H200 for 576 KiB of shared memory (it has 227 KiB)


def bits_to_dense(bits: jax.Array, n: int) -> jax.Array:
    """[B, N, W] uint32 ancestor-or-self bitsets -> [B, N, N] bool visibility (j visible to i)."""
    j = jnp.arange(n)
    word = jnp.take(bits, j // WORD, axis=-1)
    return (jnp.right_shift(word, (j % WORD).astype(jnp.uint32)) & 1).astype(bool)


def all_visible_bits(batch: int, n: int) -> jax.Array:
    """[B, N, ceil(N/32)] uint32 bitsets where every one of n nodes sees every node (a DFlash
    block's non-causal attention; n = 1: a decode step's one query seeing itself)."""
    lanes = jnp.arange(-(-n // WORD) * WORD, dtype=jnp.uint32).reshape(-1, WORD)
    words = jnp.sum(jnp.where(lanes < n, jnp.left_shift(jnp.uint32(1), lanes % WORD), 0), axis=-1, dtype=jnp.uint32)
    return jnp.broadcast_to(words, (batch, n, words.shape[0]))


def _steps(n: int, max_depth: int | None) -> int:
    depth = n - 1 if max_depth is None else max(0, min(int(max_depth), n - 1))
    return log2_ceil(depth + 1)


def reference(parents: jax.Array, *, max_depth: int | None = None) -> jax.Array:
    b, n = parents.shape
    words = cdiv(n, WORD)
    idx = jnp.arange(n, dtype=jnp.int32)
    own = (idx[:, None] // WORD == jnp.arange(words, dtype=jnp.int32)[None, :]).astype(jnp.uint32)
    own = own << (idx % WORD).astype(jnp.uint32)[:, None]
    bits = jnp.broadcast_to(own, (b, n, words))
    jump = jnp.where((parents >= 0) & (parents < n), parents, -1).astype(jnp.int32)
    for _ in range(_steps(n, max_depth)):
        safe = jnp.maximum(jump, 0)
        has = (jump >= 0)[..., None]
        bits = bits | jnp.where(has, jnp.take_along_axis(bits, safe[..., None], axis=1), jnp.uint32(0))
        jump = jnp.where(jump >= 0, jnp.take_along_axis(jump, safe, axis=1), -1)
    return bits


def _kernel(par_ref, out_ref, *, n, n_pad, c_pad, c_out, steps):
    i = jnp.arange(n_pad, dtype=jnp.int32)
    par = load(par_ref, (pl.ds(0, n_pad),), mask=i < n, other=-1)
    jump = jnp.where((par >= 0) & (par < n), par, -1)
    col = jnp.arange(c_pad, dtype=jnp.int32)
    own = jnp.left_shift(jnp.ones((n_pad, 1), jnp.int32), (i % 8)[:, None])
    acc = jnp.where(col[None, :] == (i // 8)[:, None], own, 0)  # [n_pad, c_pad] bytes
    for _ in range(steps):
        onehot = jump[:, None] == i[None, :]  # row i selects row jump[i] (none for -1)
        gathered = dot(onehot.astype(jnp.bfloat16), acc.astype(jnp.bfloat16)).astype(jnp.int32)
        acc = acc | gathered
        nxt = jnp.sum(jnp.where(onehot, jump[None, :], 0), axis=1)
        jump = jnp.where(jump >= 0, nxt, -1)
    mask = (i[:, None] < n) & (col[None, :] < c_out)
    store(out_ref, (pl.ds(0, n_pad), pl.ds(0, c_pad)), acc.astype(jnp.uint8), mask=mask)


def ancestor_bits_pallas(parents: jax.Array, *, max_depth: int | None = None, interpret: bool = False,
                         num_warps: int | None = None) -> jax.Array:
    b, n = parents.shape
    if n > MAX_KERNEL_NODES:
        raise ValueError(
            f"the ancestor-bits kernel holds a tree in one program and handles at most {MAX_KERNEL_NODES} nodes "
            f"(its one-hot gather needs N_pad^2 in shared memory: 576 KiB at {n} nodes, the H200 has 227 KiB); "
            f"got {n}: use impl='xla' (the same doubling as separate XLA gathers)")
    words = cdiv(n, WORD)
    c_out = 4 * words
    n_pad = max(16, next_pow2(n))
    c_pad = max(16, next_pow2(c_out))
    kernel = functools.partial(_kernel, n=n, n_pad=n_pad, c_pad=c_pad, c_out=c_out, steps=_steps(n, max_depth))
    out = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=[pl.BlockSpec((None, n), lambda bb: (bb, 0))],
        out_specs=pl.BlockSpec((None, n, c_out), lambda bb: (bb, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, n, c_out), jnp.uint8),
        compiler_params=compiler_params(num_warps or (4 if n_pad <= 64 else 8), 1),
        interpret=interpret,
        name="tree_ancestor_bits",
    )(parents.astype(jnp.int32))
    return lax.bitcast_convert_type(out.reshape(b, n, words, 4), jnp.uint32)


def ancestor_bits(parents: jax.Array, *, impl: str = "xla", max_depth: int | None = None) -> jax.Array:
    """[B, N] int32 parent pointers (-1 = none) -> [B, N, ceil(N/32)] uint32 ancestor-or-self bitsets.

    max_depth: an upper bound on the tree depth (fewer doubling steps); None = N - 1.
    """
    check_impl(impl)
    if parents.ndim != 2:
        raise ValueError(f"parents must be [B, N], got {parents.shape}")
    if impl == "xla":
        return reference(parents, max_depth=max_depth)
    return ancestor_bits_pallas(parents, max_depth=max_depth, interpret=impl == "pallas_interpret")
