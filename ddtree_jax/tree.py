"""The draft tree every layer's tree entry point reads, and its derived geometry.

A tree has N = budget + 1 slots per sequence in topological order: slot 0 is the root (the
bonus token, already chosen by the target), every other valid slot has its parent at a lower
index. Padding slots (valid = False) are children of nothing: they see only themselves and are
never anyone's ancestor, so they cannot disturb real nodes.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ddtree_jax.routes import REFERENCE, Routes
from pallas_kernels.tree_mask import WORD, all_visible_bits, ancestor_bits, bits_to_dense  # noqa: F401 (re-exported)


class Tree(NamedTuple):
    tokens: jax.Array  # [B, N] int32; slot 0 = root
    parents: jax.Array  # [B, N] int32; -1 for the root and for padding
    depths: jax.Array  # [B, N] int32; root 0, padding 0
    positions: jax.Array  # [B, N] int32; committed length + depth
    valid: jax.Array  # [B, N] bool
    ancestor_bits: jax.Array  # [B, N, ceil(N/32)] uint32: bit j of node i set iff j is i or an ancestor

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def root_path(parents, i: int) -> list[int]:
    """Host-side walk: the nodes from the root to node i (parents: a sequence, -1 = none). The
    sequential oracle the device forms (bits, tree verify, commit) are checked against."""
    path = []
    while i >= 0:
        path.append(int(i))
        i = parents[i]
    return path[::-1]


def ancestor_bits_from_parents(parents: jax.Array, max_depth: int, routes: Routes = REFERENCE) -> jax.Array:
    """Bitsets of ancestors-or-self from parent pointers, on device ([B, N] -> [B, N, W]):
    pallas_kernels.tree_mask (pointer doubling, ceil(log2(max_depth + 1)) dependent steps).

    With kernels on, one kernel launch for trees of up to routes.bits_kernel_max_nodes nodes,
    where one launch beats XLA's ~2 per step; larger trees take the same doubling as XLA gathers
    (exact, the same bits), which measured faster there (docs/decisions/0029-ancestor-bits-kernel.md).
    The XLA form above the threshold is announced by a warning when the step is traced."""
    impl = routes.impl
    if routes.kernels and parents.shape[-1] > routes.bits_kernel_max_nodes:
        warnings.warn(
            f"ancestor bits of a {parents.shape[-1]}-node tree use the XLA doubling, not the Pallas kernel: "
            f"routes.bits_kernel_max_nodes is {routes.bits_kernel_max_nodes}", stacklevel=2)
        impl = "xla"
    return ancestor_bits(parents, impl=impl, max_depth=max_depth)


def depths_from_bits(bits: jax.Array) -> jax.Array:
    """[B, N, W] ancestor-or-self bitsets -> [B, N] depths (ancestors counted, self excluded)."""
    return jnp.sum(jax.lax.population_count(bits).astype(jnp.int32), axis=-1) - 1


def make_tree(tokens, parents, valid, start, max_depth: int, routes: Routes = REFERENCE) -> Tree:
    """Assemble a Tree from tokens / parents / valid [B, N] and committed lengths start [B].

    Bits and depths come from ceil(log2(max_depth + 1)) pointer-doubling steps (with kernels on:
    one kernel), not a walk of 2 x max_depth dependent gathers: on a GPU a small model's step
    costs about one launch per kernel (the demo's DDTree step: ~370 kernels, ~2 us each)."""
    parents = jnp.where(valid, parents, -1).astype(jnp.int32)
    bits = ancestor_bits_from_parents(parents, max_depth, routes)
    depths = depths_from_bits(bits)
    return Tree(
        tokens=tokens.astype(jnp.int32),
        parents=parents,
        depths=depths,
        positions=start[:, None].astype(jnp.int32) + depths,
        valid=valid,
        ancestor_bits=bits,
    )


def chain_tree(tokens: jax.Array, start: jax.Array) -> Tree:
    """A chain: root = tokens[:, 0], node i's parent is i - 1 (linear DFlash as a tree)."""
    b, n = tokens.shape
    parents = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (b, n))
    return make_tree(tokens, parents, jnp.ones((b, n), bool), start, max_depth=n - 1)


class TreeGeometry(NamedTuple):
    """What the XLA (reference) tree layers read; derived from a Tree inside jit."""

    positions: jax.Array  # [B, N]
    visible: jax.Array  # [B, N, N] bool, ancestor-or-self
    conv_src: jax.Array | None  # [B, N, K]: m-th ancestor of each node as an index into concat(window, nodes);
    #                             None for a chain (the plain causal conv applies)
    bits: jax.Array  # [B, N, W] uint32 ancestor bitsets (what the Pallas kernels read)


def geometry(tree: Tree, conv_kernel: int) -> TreeGeometry:
    """Dense visibility and the conv gather indices.

    conv_src[b, i, m] indexes concat(conv window [K-1], tree inputs [N]) along time: the m-th
    ancestor of node i (m = 0 is i itself) if it is in the tree, else the window column that
    precedes the root by the overshoot (newest column first).
    """
    n = tree.size
    visible = bits_to_dense(tree.ancestor_bits, n)
    k1 = conv_kernel - 1
    cols = []
    cur = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), tree.parents.shape)
    for m in range(conv_kernel):
        in_tree = m <= tree.depths
        cols.append(jnp.where(in_tree, k1 + cur, k1 - (m - tree.depths)))
        cur = jnp.maximum(jnp.take_along_axis(tree.parents, cur, axis=1), 0)
    return TreeGeometry(tree.positions, visible, jnp.stack(cols, axis=-1), tree.ancestor_bits)


def chain_geometry(start: jax.Array, n: int) -> TreeGeometry:
    """Geometry of a chain of n tokens after `start` (linear DFlash): causal visibility."""
    b = start.shape[0]
    parents = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (b, n))
    positions = start[:, None].astype(jnp.int32) + jnp.arange(n, dtype=jnp.int32)[None]
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
    return TreeGeometry(positions, visible, None, ancestor_bits_from_parents(parents, n - 1))
