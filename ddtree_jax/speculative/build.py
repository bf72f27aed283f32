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

import jax
import jax.numpy as jnp

from ddtree_jax.tree import Tree, chain_tree, make_tree

NEG = -jnp.inf
MAX_BUDGET = 1024
TOPK_CHUNK = 2048  # vocab chunk of the two-stage top-k


SORT_TOP_K_MAX = 16  # k up to this: XLA's GPU TopK custom kernel, which a sort beats


def order_key(x: jax.Array) -> jax.Array:
    """int32 keys ordered as lax.top_k orders float32 values (-0.0 below +0.0); also the selection
    kernel's keys (pallas_kernels/tree_select.py)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def plus_zero(score: jax.Array) -> jax.Array:
    """A prefix score as the sum from +0.0 makes it: never -0.0 (log-probs are <= 0, and -0.0 only
    comes from -0.0 + -0.0). Written out because compilers may fold 0.0 + x to x, which keeps a
    -0.0 log-prob's sign and would order it below +0.0."""
    return jnp.where(score == 0, jnp.float32(0.0), score)


def sort_top_k(x: jax.Array, k: int):
    """lax.top_k over the last axis as one stable sort of descending keys (ties: lower index first).

    For k <= 16 XLA runs lax.top_k on GPUs as its TopK custom kernel: the demo's vocabulary top-16
    took 45 us there (one call per DDTree-16 step), where the sort XLA emits for k = 32 on the same
    rows took 16 us (H200, docs/benchmarks.md section 3). Integer keys with a less-than order keep
    XLA from matching the sort back into a TopK."""
    idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    _, idx = jax.lax.sort((~order_key(x), idx), dimension=x.ndim - 1, num_keys=1, is_stable=True)
    idx = idx[..., :k]
    return jnp.take_along_axis(x, idx, axis=-1), idx


def _one_pass_top_k(x: jax.Array, k: int):
    if k <= SORT_TOP_K_MAX and jax.default_backend() != "cpu":
        return sort_top_k(x, k)
    return jax.lax.top_k(x, k)


def top_k(x: jax.Array, k: int, chunk: int = TOPK_CHUNK, staged: bool | None = None):
    """lax.top_k over the last axis (same values, indices and tie rule: equal values, lower index
    first), in stages when the axis is long: the top k of each contiguous chunk, then (again in
    stages if still long) the top k of those candidates, kept in chunk order so the tie rule
    carries over. On the GPU lax.top_k of one long row runs as one thread block (k <= 16) or a
    sort of the whole row: a 248k-entry vocabulary row took several sort passes, an 8k row 93 us,
    a 4096-entry beam row 30 us (H200, scripts/profile_pair.py, docs/benchmarks.md section 3);
    rows of a few thousand sort in one short pass. XLA:CPU's top-k is a partial sort that staging
    only slows down (about 3x for the demo's 8k vocabulary on this project's CPU), so
    `staged=None` stages on every backend but the CPU.
    """
    n = x.shape[-1]
    if staged is None:
        staged = jax.default_backend() != "cpu"
    if not staged or n <= 2 * chunk or k > chunk // 4:
        # The barrier keeps XLA from fusing the consumers' slices into the top-k: on XLA:CPU the
        # fused form re-ran it per consumer (the demo's tree build: 30-40 ms -> 0.3 ms).
        return jax.lax.optimization_barrier(_one_pass_top_k(x, k))
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf) if pad else x
    xp = xp.reshape(*x.shape[:-1], n_chunks, chunk)
    val, idx = _one_pass_top_k(xp, k)  # [..., n_chunks, k]
    idx = idx + (jnp.arange(n_chunks, dtype=idx.dtype) * chunk)[:, None]
    val, idx = val.reshape(*x.shape[:-1], n_chunks * k), idx.reshape(*x.shape[:-1], n_chunks * k)
    best, pos = top_k(val, k, chunk, staged)  # candidates are in (chunk, rank) order: ties keep lower index
    return jax.lax.optimization_barrier((best, jnp.take_along_axis(idx, pos, axis=-1)))


PREFILTER_BLOCK = 128  # vocabulary block of the block-max prefilter (`prefiltered_top_k`)
PREFILTER_MIN_RATIO = 8  # rows at least this many times k * PREFILTER_BLOCK long take it


def prefiltered_top_k(x: jax.Array, k: int, block: int = PREFILTER_BLOCK, staged: bool | None = None):
    """lax.top_k over the last axis (same values, indices, tie rule) of a long row through a
    block-max prefilter: the k best entries lie in the k best blocks by block maximum.

    Why it is exact: rank entries by (value desc, index asc) and blocks (contiguous, `block` wide)
    by (max desc, block index asc), both on `order_key` (lax.top_k's order, -0.0 below +0.0).
    An entry e of a block c outside the k best blocks is beaten by each of their k maxima: a
    block ranked ahead of c has a larger maximum (> max(c) >= e), or an equal one at a lower block
    index, i.e. an equal entry at a lower index. So e is not among the k best, and the top k of
    the k best blocks' entries, gathered in block order so "lower position" stays "lower index",
    is the row's top k. Cost on the GPU: one max-reduce pass over the row and a top-k of k *
    block candidates, where `top_k`'s first stage sorts every 2048-entry chunk of the row: the
    27B's 248320-entry rows at k = 64 took 0.19 ms of sorts a DDTree step (H200, 2026-11-30:
    docs/kernels_tree_build.md)."""
    n = x.shape[-1]
    n_blocks = -(-n // block)
    if n_blocks < k:
        return top_k(x, k, staged=staged)
    pad = n_blocks * block - n
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf) if pad else x
    xp = xp.reshape(*x.shape[:-1], n_blocks, block)
    block_max = jnp.max(order_key(xp), axis=-1)  # [..., n_blocks] int32, lax.top_k's order
    _, best = top_k(block_max, k, staged=staged)
    best = jnp.sort(best, axis=-1)  # block order: candidate position order = index order
    cand = jnp.take_along_axis(xp, best[..., None], axis=-2).reshape(*x.shape[:-1], k * block)
    val, pos = top_k(cand, k, staged=staged)
    idx = jnp.take_along_axis(best, pos // block, axis=-1) * block + pos % block
    return jax.lax.optimization_barrier((val, idx))


def beam_chunk(k: int) -> int:
    """Chunk of the staged top-k over a beam's W x k extensions: rows of 512 (4k for wide beams)."""
    return max(512, 4 * k)


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


RANK_SELECT_MAX = 1024  # beam rows up to this long select by pairwise ranks off the CPU


def select_in_index_order(x: jax.Array, width: int, inf_last: bool = False) -> jax.Array:
    """The indices of top_k(x, width) (lax.top_k's tie rule) in increasing index order, [B, n] ->
    [B, width], by pairwise comparison: three reductions (rank of every entry, selected entries
    before each, the index holding each output slot) instead of a top-k sort, a sort of the picks
    and the copies XLA's in-place sorts make (~6 kernels). O(n^2) work, for short rows on a GPU,
    where a small model's tree build is one kernel launch per op (docs/benchmarks.md section 3).
    inf_last: picked -inf entries after all others (each group in index order)."""
    n = x.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    earlier = idx[None, :] < idx[:, None]  # [i, j]: j before i
    key = order_key(x)
    xi, xj = key[:, :, None], key[:, None, :]
    rank = jnp.sum((xj > xi) | ((xj == xi) & earlier[None]), axis=-1, dtype=jnp.int32)
    chosen = rank < width
    if inf_last:
        late = x == NEG
        li, lj = late[:, :, None], late[:, None, :]
        placed_before = (lj < li) | ((lj == li) & earlier[None])  # [B, i, j]
    else:
        placed_before = earlier[None]
    before = jnp.sum(chosen[:, None, :] & placed_before, axis=-1, dtype=jnp.int32)
    slot = jnp.where(chosen, before, width)  # output position of each chosen entry
    hit = slot[:, None, :] == jnp.arange(width, dtype=jnp.int32)[None, :, None]  # [B, width, n]
    return jnp.sum(jnp.where(hit, idx[None, None, :], 0), axis=-1, dtype=jnp.int32)


def _beam_step(beam_scores, cand_scores, budget: int, k: int):
    """Extend each kept node [B, W] by k candidates [B, k]; keep the best `budget` in lex order.

    Returns (scores [B, budget], parent slot [B, budget], rank [B, budget]).
    """
    b, w = beam_scores.shape
    flat = plus_zero(beam_scores[:, :, None] + cand_scores[:, None, :]).reshape(b, w * k)
    width = min(budget, w * k)
    if w * k <= RANK_SELECT_MAX and jax.default_backend() != "cpu":  # XLA:CPU sorts these faster
        pick = select_in_index_order(flat, width)
    else:
        _, pick = top_k(flat, width, beam_chunk(width))  # ties: lower flat index = lex-smaller path
        pick = jnp.sort(pick, axis=-1)  # store the beam in lexicographic order
    scores = jnp.take_along_axis(flat, pick, axis=-1)
    parent, rank = pick // k, pick % k
    if width < budget:
        pad = budget - width
        scores = jnp.pad(scores, ((0, 0), (0, pad)), constant_values=NEG)
        parent = jnp.pad(parent, ((0, 0), (0, pad)))
        rank = jnp.pad(rank, ((0, 0), (0, pad)))
    return scores, parent, rank


def beam_xla(top_val: jax.Array, budget: int):
    """Depth by depth: beams in lexicographic order, padded to width `budget` with -inf.
    top_val [B, D, k] -> (scores, parent slots, candidate ranks) [B, D, budget] each."""
    b, depth, k = top_val.shape
    scores, parents, ranks = [], [], []
    beam = jnp.zeros((b, 1), jnp.float32)
    for d in range(depth):
        beam, parent, rank = _beam_step(beam, top_val[:, d], budget, k)
        scores.append(beam)
        parents.append(parent)
        ranks.append(rank)
    return jnp.stack(scores, axis=1), jnp.stack(parents, axis=1), jnp.stack(ranks, axis=1)


def select_nodes_xla(top_val: jax.Array, budget: int):
    """The tree's nodes from the per-depth top-k log-probs [B, D, k], in XLA ops: the reference of
    the one-launch kernel (pallas_kernels/tree_select.py, same signature and arrays).

    Returns (depth index, candidate rank, parent node index (0 = root), valid) [B, budget] each,
    in tree order: valid nodes by depth, each depth in lexicographic order, then the invalid ones
    (score -inf), which read (0, 0, 0, False).
    """
    b, depth, k = top_val.shape
    scores, parents, ranks = beam_xla(top_val, budget)  # [B, D, budget] each
    all_scores = scores.reshape(b, depth * budget)  # flat order = (depth, lex)
    if all_scores.shape[-1] <= RANK_SELECT_MAX and jax.default_backend() != "cpu":
        chosen = select_in_index_order(all_scores, budget, inf_last=True)
    else:
        _, chosen = jax.lax.top_k(all_scores, budget)
        late = jnp.take_along_axis(all_scores, chosen, axis=-1) == NEG
        n = depth * budget
        chosen = jnp.sort(chosen + jnp.where(late, n, 0), axis=-1) % n  # by depth, then lex; -inf last
    valid = jnp.take_along_axis(all_scores, chosen, axis=-1) > NEG
    node_depth = chosen // budget  # 0-based depth index (tree depth - 1)
    # Final index of every (depth, slot) beam entry that was chosen (0 = root for "depth -1").
    final_index = jnp.zeros((b, depth * budget), jnp.int32)
    final_index = jax.vmap(lambda f, c: f.at[c].set(jnp.arange(1, budget + 1, dtype=jnp.int32)))(final_index, chosen)
    parent_slot = jnp.take_along_axis(parents.reshape(b, depth * budget), chosen, axis=-1)
    rank = jnp.take_along_axis(ranks.reshape(b, depth * budget), chosen, axis=-1)
    parent_flat = (node_depth - 1) * budget + parent_slot
    parent_index = jnp.where(node_depth == 0, 0, jnp.take_along_axis(final_index, jnp.maximum(parent_flat, 0), axis=-1))
    return (jnp.where(valid, node_depth, 0), jnp.where(valid, rank, 0), jnp.where(valid, parent_index, 0), valid)


def _routed(impl: str, kernel_takes: bool, kernel, xla, why: str):
    """The Pallas kernel where it takes the shape, else the XLA form - announced by a warning when
    the step is traced, never silent. impl "xla" runs the XLA form."""
    if impl == "xla":
        return xla()
    if kernel_takes:
        return kernel()
    warnings.warn(why, stacklevel=4)
    return xla()


def _select_nodes(top_val: jax.Array, budget: int, impl: str):
    """The node selection in one kernel launch where the kernel takes the budget."""
    from pallas_kernels.tree_select import SELECT_KERNEL_MAX_BUDGET, select_nodes

    return _routed(impl, budget <= SELECT_KERNEL_MAX_BUDGET, lambda: select_nodes(top_val, budget, impl=impl),
                   lambda: select_nodes_xla(top_val, budget),
                   f"the DDTree node selection of budget {budget} uses the XLA form, not the Pallas kernel: the "
                   f"kernel takes budgets up to {SELECT_KERNEL_MAX_BUDGET} (pallas_kernels/tree_select.py)")


def _vocab_top_k(logq: jax.Array, k: int, impl: str):
    """The per-depth candidates: one launch of the row top-k kernel where it takes the rows (the
    demo's 8k vocabulary), else `top_k` (staged sorts on GPUs), through the block-max prefilter
    for rows much longer than k blocks (the 27B's 248k vocabulary; `prefiltered_top_k`). XLA:CPU's
    partial-sort top-k needs neither."""
    from pallas_kernels.row_top_k import ROW_TOP_K_MAX_K, ROW_TOP_K_MAX_LEN, row_top_k

    n = logq.shape[-1]
    long_row = jax.default_backend() != "cpu" and n >= PREFILTER_MIN_RATIO * k * PREFILTER_BLOCK
    return _routed(impl, n <= ROW_TOP_K_MAX_LEN and k <= ROW_TOP_K_MAX_K, lambda: row_top_k(logq, k, impl=impl),
                   lambda: prefiltered_top_k(logq, k) if long_row else top_k(logq, k),
                   f"the DDTree vocabulary top-{k} over {n} entries uses the XLA form (sorts, behind a block-max "
                   f"prefilter for long rows), not the Pallas kernel: it takes rows up to {ROW_TOP_K_MAX_LEN} "
                   f"and k up to {ROW_TOP_K_MAX_K} (pallas_kernels/row_top_k.py)")


def build_tree(logq: jax.Array, root_tokens: jax.Array, start: jax.Array, budget: int, max_candidates=None,
               impl: str = "xla", vocab_ids: jax.Array | None = None) -> Tree:
    """logq [B, D, V]: log-probs of the D draft depths; root_tokens, start [B]. Static budget;
    impl picks the Pallas kernels of the vocabulary top-k (rows <= 8192, k <= 32), the node
    selection (budgets <= 64) and the ancestor bitsets (ddtree_jax.tree.make_tree). vocab_ids
    [V] (ascending): logq is over a draft vocabulary and index i stands for token vocab_ids[i].

    Returns a Tree of budget + 1 slots: root first, then the valid nodes by depth, each depth in
    lex order, then the invalid ones (fewer than `budget` prefixes with a finite score).
    """
    b, depth, vocab = logq.shape
    k = validate_budget(budget, depth, vocab, max_candidates)
    logq = logq.astype(jnp.float32)
    top_val, top_tok = _vocab_top_k(logq, k, impl)  # [B, D, k], ties -> smaller token id first
    node_depth, rank, parent, valid = _select_nodes(top_val, budget, impl)
    tokens = jnp.take_along_axis(top_tok.reshape(b, depth * k), node_depth * k + rank, axis=-1)
    if vocab_ids is not None:
        tokens = jnp.take(vocab_ids, tokens)
    all_tokens = jnp.concatenate([root_tokens[:, None], tokens], axis=1)
    all_parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent], axis=1)
    all_valid = jnp.concatenate([jnp.ones((b, 1), bool), valid], axis=1)
    return make_tree(all_tokens, all_parents, all_valid, start, max_depth=depth, impl=impl)


def build_chain(logq: jax.Array, root_tokens: jax.Array, start: jax.Array, vocab_ids: jax.Array | None = None
                ) -> Tree:
    """Linear DFlash: the argmax of every depth, as a chain tree of D + 1 slots (vocab_ids: see
    build_tree)."""
    draft = jnp.argmax(logq, axis=-1).astype(jnp.int32)
    if vocab_ids is not None:
        draft = jnp.take(vocab_ids, draft)
    return chain_tree(jnp.concatenate([root_tokens[:, None].astype(jnp.int32), draft], axis=1), start)
