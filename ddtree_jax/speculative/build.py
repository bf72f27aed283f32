"""DDTree construction on device: the `budget` most likely draft prefixes as a tree.

The score of a prefix is the sum of the drafter's per-depth log-probs along it. The reference
is a best-first heap; here the same set comes from a depth-by-depth beam of width `budget`
followed by one top-`budget` over all depths (a node in the global top set has its parent in
it, and in its own depth's top set). Everything has fixed shapes for a given budget.

Ties follow one total order, the heap's: higher score first, then smaller depth, then the
lexicographically smaller path of sibling ranks (rank = position in the per-depth top-k, ties
in log-prob broken by the smaller token id). Beams are kept in that lexicographic order so
that "lower flat index first" (lax.top_k's tie rule) implements it.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ddtree_jax.routes import REFERENCE, Routes
from ddtree_jax.tree import Tree, chain_tree, make_tree
from pallas_kernels import tree_select
from pallas_kernels._common import order_key
from pallas_kernels.row_top_k import (PREFILTER_BLOCK, PREFILTER_MIN_RATIO, ROW_TOP_K_MAX_K, ROW_TOP_K_MAX_LEN,
                                      prefiltered_top_k, row_top_k, top_k)

MAX_BUDGET = 1024


def validate_budget(budget: int, depth: int, vocab: int, max_candidates: int | None = None) -> int:
    """Check the static tree parameters; returns the per-depth candidate count."""
    problems = []
    if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= MAX_BUDGET:
        problems.append(f"budget must be an integer in [1, {MAX_BUDGET}], got {budget!r}")
    if depth < 1:
        problems.append(f"the drafter must propose at least one depth (block_size >= 2), got {depth}")
    k = min(budget, vocab) if not problems else 1
    if max_candidates is not None:
        if not isinstance(max_candidates, int) or max_candidates < 1:
            problems.append(f"candidates per depth must be a positive integer, got {max_candidates!r}")
        else:
            k = min(k, max_candidates)
    if problems:
        raise ValueError("invalid tree parameters: " + "; ".join(problems))
    return k


def _routed(on: bool, kernel_takes: bool, kernel, xla, why: str):
    """The Pallas kernel where it is on and takes the shape, else the XLA form; a kernel that is on
    but cannot take the shape is announced by a warning when the step is traced, never silent."""
    if not on:
        return xla()
    if kernel_takes:
        return kernel()
    warnings.warn(why, stacklevel=4)
    return xla()


def _select_nodes(top_val: jax.Array, budget: int, routes: Routes, with_scores: bool = False):
    """The node selection: one kernel launch where the kernel takes the budget, else the XLA form
    (pairwise-rank selection for short rows where routes.rank_select_max says)."""
    forms = dict(rank_select_max=routes.rank_select_max, staged=routes.staged_top_k, sort_max=routes.sort_top_k_max,
                 with_scores=with_scores)
    limit = tree_select.SELECT_KERNEL_MAX_BUDGET
    return _routed(routes.kernels and routes.tree_select_kernel, budget <= limit,
                   lambda: tree_select.select_nodes(top_val, budget, impl=routes.impl, with_scores=with_scores),
                   lambda: tree_select.reference(top_val, budget, **forms),
                   f"the DDTree node selection of budget {budget} uses the XLA form, not the Pallas kernel: the "
                   f"kernel takes budgets up to {limit} (pallas_kernels/tree_select.py)")


def _vocab_top_k(logq: jax.Array, k: int, routes: Routes):
    """The per-depth candidates: one launch of the row top-k kernel where it takes the rows (the
    demo's 8k vocabulary), else `top_k` in the routes' XLA form (staged sorts on GPUs), through the
    block-max prefilter for rows much longer than k blocks (the 27B's 248k vocabulary)."""
    n = logq.shape[-1]
    forms = dict(staged=routes.staged_top_k, sort_max=routes.sort_top_k_max)
    long_row = routes.prefilter_top_k and n >= PREFILTER_MIN_RATIO * k * PREFILTER_BLOCK
    return _routed(routes.kernels and routes.row_top_k_kernel, n <= ROW_TOP_K_MAX_LEN and k <= ROW_TOP_K_MAX_K,
                   lambda: row_top_k(logq, k, impl=routes.impl),
                   lambda: prefiltered_top_k(logq, k, **forms) if long_row else top_k(logq, k, **forms),
                   f"the DDTree vocabulary top-{k} over {n} entries uses the XLA form (sorts, behind a block-max "
                   f"prefilter for long rows), not the Pallas kernel: it takes rows up to {ROW_TOP_K_MAX_LEN} "
                   f"and k up to {ROW_TOP_K_MAX_K} (pallas_kernels/row_top_k.py)")


def build_tree(logq: jax.Array, root_tokens: jax.Array, start: jax.Array, budget: int, max_candidates=None,
               routes: Routes = REFERENCE, vocab_ids: jax.Array | None = None) -> Tree:
    """logq [B, D, V]: log-probs of the D draft depths; root_tokens, start [B]. Static budget;
    routes pick the Pallas kernels of the vocabulary top-k (rows <= 8192, k <= 32), the node
    selection (budgets <= 64) and the ancestor bitsets (ddtree_jax.tree.make_tree), and the XLA
    forms elsewhere. vocab_ids [V] (ascending): logq is over a draft vocabulary and index i stands
    for token vocab_ids[i].

    Returns a Tree of budget + 1 slots: root first, then the valid nodes by depth, each depth in
    lex order, then the invalid ones (fewer than `budget` prefixes with a finite score).
    """
    b, depth, vocab = logq.shape
    k = validate_budget(budget, depth, vocab, max_candidates)
    logq = logq.astype(jnp.float32)
    top_val, top_tok = _vocab_top_k(logq, k, routes)  # [B, D, k], ties -> smaller token id first
    node_depth, rank, parent, valid = _select_nodes(top_val, budget, routes)
    return _assemble(top_tok, node_depth, rank, parent, valid, root_tokens, start, routes, vocab_ids)


def _assemble(top_tok, node_depth, rank, parent, valid, root_tokens, start, routes: Routes, vocab_ids) -> Tree:
    """The Tree of selected nodes [B, n] (tree order) under the roots: tokens from the per-depth
    candidates top_tok [B, D, k], parents and bits."""
    b, depth, k = top_tok.shape
    tokens = jnp.take_along_axis(top_tok.reshape(b, depth * k), node_depth * k + rank, axis=-1)
    if vocab_ids is not None:
        tokens = jnp.take(vocab_ids, tokens)
    all_tokens = jnp.concatenate([root_tokens[:, None], tokens], axis=1)
    all_parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent], axis=1)
    all_valid = jnp.concatenate([jnp.ones((b, 1), bool), valid], axis=1)
    return make_tree(all_tokens, all_parents, all_valid, start, max_depth=depth, routes=routes)


def build_chain(logq: jax.Array, root_tokens: jax.Array, start: jax.Array, vocab_ids: jax.Array | None = None
                ) -> Tree:
    """Linear DFlash: the argmax of every depth, as a chain tree of D + 1 slots (vocab_ids: see
    build_tree)."""
    draft = jnp.argmax(logq, axis=-1).astype(jnp.int32)
    if vocab_ids is not None:
        draft = jnp.take(vocab_ids, draft)
    return chain_tree(jnp.concatenate([root_tokens[:, None].astype(jnp.int32), draft], axis=1), start)


# ---- one selection, the trees of every smaller budget (the adaptive budget) ---------------------
class TreeCandidates(NamedTuple):
    """The `budget` best draft prefixes of one step as the node selection returns them (tree order),
    with their scores and their places in the heap's order. The top-b set of any b <= budget is
    the set of nodes with pop < b (the heap pops the same prefixes in the same order whatever its
    budget), so one selection at the largest budget gives the tree of every smaller one
    (`tree_from_candidates`) and its expected acceptance (speculative/expected.py)."""

    top_tok: jax.Array  # [B, D, k] per-depth candidates (draft-vocabulary indices when the proposer has one)
    best: jax.Array  # [B, D] each depth's largest log-prob (the DFlash chain's argmax)
    depth: jax.Array  # [B, budget] node depth index (tree depth - 1)
    rank: jax.Array  # [B, budget] candidate rank at that depth
    parent: jax.Array  # [B, budget] parent's node index (0 = the root, nodes numbered from 1)
    valid: jax.Array  # [B, budget] bool
    score: jax.Array  # [B, budget] float32 sum of the path's log-probs; -inf where not valid
    pop: jax.Array  # [B, budget] int32 place in the heap's order (valid nodes 0 .. n-1; budget where not valid)


def heap_places(score: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, N] scores in tree order -> each valid node's place in the heap's order: higher score
    first, ties by tree order (= smaller depth, then the lexicographically smaller path: the
    selection's tie rule). Pairwise ranks, O(N^2) for N <= a few hundred nodes."""
    n = score.shape[-1]
    key = order_key(score)
    idx = jnp.arange(n, dtype=jnp.int32)
    ki, kj = key[:, :, None], key[:, None, :]
    before = valid[:, None, :] & ((kj > ki) | ((kj == ki) & (idx[None, None, :] < idx[None, :, None])))
    return jnp.where(valid, jnp.sum(before, axis=-1, dtype=jnp.int32), n)


def tree_candidates(logq: jax.Array, budget: int, max_candidates=None, routes: Routes = REFERENCE) -> TreeCandidates:
    """The selection build_tree makes at `budget` (same routes), kept with the node scores."""
    b, depth, vocab = logq.shape
    k = validate_budget(budget, depth, vocab, max_candidates)
    top_val, top_tok = _vocab_top_k(logq.astype(jnp.float32), k, routes)
    node_depth, rank, parent, valid, score = _select_nodes(top_val, budget, routes, with_scores=True)
    return TreeCandidates(top_tok, top_val[:, :, 0], node_depth, rank, parent, valid, score, heap_places(score, valid))


def tree_from_candidates(c: TreeCandidates, budget: int, root_tokens: jax.Array, start: jax.Array,
                         routes: Routes = REFERENCE, vocab_ids: jax.Array | None = None) -> Tree:
    """build_tree's tree at `budget` (<= the candidates' budget), array for array: the nodes with
    pop < budget, kept in their tree order (the smaller tree's order: by depth, then lex), parents
    renumbered, the rest of the `budget` slots invalid as (0, 0, 0, False)."""
    b, n = c.valid.shape
    if not 1 <= budget <= n:
        raise ValueError(f"a tree of budget {budget} from candidates of budget {n}")
    keep = c.valid & (c.pop < budget)
    dest = jnp.cumsum(keep, axis=1, dtype=jnp.int32) - 1  # new slot (0-based) of every kept node
    new_parent = jnp.where(c.parent > 0, jnp.take_along_axis(dest, jnp.maximum(c.parent - 1, 0), axis=1) + 1, 0)
    slot = jnp.where(keep, dest, budget)  # dropped nodes write past the end
    fields = jnp.stack([c.depth, c.rank, new_parent, keep.astype(jnp.int32)], axis=-1)  # [B, n, 4]: one scatter
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    out = jnp.zeros((b, budget, 4), jnp.int32).at[rows, slot].set(fields, mode="drop")
    return _assemble(c.top_tok, out[..., 0], out[..., 1], out[..., 2], out[..., 3] == 1, root_tokens, start, routes,
                     vocab_ids)
