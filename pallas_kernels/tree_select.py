"""DDTree's node selection in one kernel launch: a best-first heap, next to its reference.

    depth, rank, parent, valid = select_nodes(top_val, budget, impl="xla" | "pallas" | "pallas_interpret")
    depth, rank, parent, valid, score = select_nodes(top_val, budget, impl=..., with_scores=True)

top_val [B, D, k] float32: per draft depth the k best log-probs (<= 0) in lax.top_k order. The
tree's nodes are the `budget` best prefixes (score = the left-to-right float32 sum of their
log-probs) in the heap's total order: higher score first, then smaller depth, then the
lexicographically smaller path of candidate ranks. Returns [B, budget] each, in tree order
(valid nodes by depth, each depth in lexicographic order, then the invalid ones): the node's
depth index (tree depth - 1), its candidate rank at that depth, its parent's node index (0 = the
root, nodes numbered from 1) and whether it is a real node (score > -inf). Invalid nodes read
(0, 0, 0, False). with_scores: also each node's score (tree order; -inf for invalid nodes), the
bits an adaptive budget needs: the top-b set of any b <= budget is the first b of these nodes in
the heap's order, so the expected acceptance of every smaller tree follows from them
(ddtree_jax/speculative/expected.py). The reference (`reference`, the XLA form: a depth-by-depth
beam of width `budget`, then one top-`budget` over all depths) gives the same arrays, ties and
signed zeros included.

Why a kernel: on a GPU the XLA form costs ~4 launches per depth plus ~10 for the final pick and
the index mapping, and a small model's step is bound by launches; this kernel is one launch and
several times faster up to budget 64 (docs/decisions/0030-tree-select-kernel.md).

The algorithm has few dependent steps. Every prefix has one predecessor in the left-child /
right-sibling view of the candidate tree (its previous sibling, or its parent for a first child)
and comes after it in the total order (log-probs <= 0 and candidates sorted), so `budget` pops of
a frontier, each pushing the popped node's first child and next sibling, visit exactly the best
`budget` prefixes. One program (one warp) per sequence keeps the frontier (at most budget + 1
entries) in registers. Per pop: the winner by one reduction per key field (score key, then the
(depth, path) words: depth and candidate ranks packed most significant first into int32 words),
its fields by independent masked reductions, the two new scores by lookups in the [D, k] candidate
table. After the pops: each node's place in tree order by pairwise comparison and the parents'
places by a one-hot lookup.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_impl, compiler_params, load, next_pow2, order_key, plus_zero, store
from pallas_kernels.row_top_k import top_k

SELECT_KERNEL_MAX_BUDGET = 64  # a frontier of 128 slots in registers


# One warp reduces without shared memory or barriers: fastest at every budget measured
# (docs/decisions/0030-tree-select-kernel.md).
DEFAULT_WARPS = 1


def frontier_slots(budget: int) -> int:
    return max(16, next_pow2(budget + 1))


DEPTH_BITS = 5  # depth in the top bits of the first path word: draft depths up to 31


def path_words(depth: int, k: int):
    """(bits per rank, ranks in word 0, ranks per later word, words). Word 0 holds the depth in
    its top DEPTH_BITS and the first ranks below; ranks packed most significant first, 30 bits a
    word so every word stays non-negative: (depth, path) order = the words' order."""
    bits = max(1, (k - 1).bit_length())
    first, per = (30 - DEPTH_BITS) // bits, 30 // bits
    return bits, first, per, 1 + max(0, -(-(depth - first) // per))


def rank_place(p: int, bits: int, first: int, per: int):
    """(word, bit offset) of the rank at depth position p (0-based)."""
    if p < first:
        return 0, bits * (first - 1 - p)
    q = p - first
    return 1 + q // per, bits * (per - 1 - q % per)


def _words_less(a_words, b_words):
    """Elementwise: a before b in (depth, path) order (the nodes' final placement)."""
    less = jnp.zeros(a_words[0].shape, bool)
    for a, b in reversed(list(zip(a_words, b_words))):
        less = (a < b) | ((a == b) & less)
    return less


def _kernel(val_ref, depth_ref, rank_ref, parent_ref, valid_ref, *score_ref, depth, k, budget, kp, dp, fp, bp):
    f32, i32 = jnp.float32, jnp.int32
    neg = f32(-jnp.inf)
    lowest, highest = i32(jnp.iinfo(jnp.int32).min), i32(jnp.iinfo(jnp.int32).max)
    bits, first_ranks, per, nw = path_words(depth, k)
    depth_one = i32(1 << (30 - DEPTH_BITS))
    rows = lax.broadcasted_iota(i32, (dp, kp), 0)
    cols = lax.broadcasted_iota(i32, (dp, kp), 1)
    table = load(val_ref, (pl.ds(0, dp), pl.ds(0, kp)), mask=(rows < depth) & (cols < k), other=neg)
    slot = lax.broadcasted_iota(i32, (fp,), 0)
    pops = lax.broadcasted_iota(i32, (bp,), 0)

    def lookup(r, c):
        """table[r, c] (-inf outside it); a max keeps -0.0."""
        return jnp.max(jnp.where((rows == r) & (cols == c), table, neg))

    def pick(win, x):
        if x.dtype == f32:
            return jnp.max(jnp.where(win, x, neg))
        return jnp.sum(jnp.where(win, x, 0))

    zero_f = jnp.zeros((fp,), i32)
    first = slot == 0
    # frontier: parent score, score, depth (1-based), rank, (depth, path) words, parent's pop, live
    front = (jnp.zeros((fp,), f32), jnp.where(first, plus_zero(lookup(0, 0)), neg), jnp.where(first, 1, 0),
             zero_f, (jnp.where(first, depth_one, 0),) + tuple(zero_f for _ in range(nw - 1)),
             jnp.where(first, -1, 0), first.astype(i32))
    zero_b = jnp.zeros((bp,), i32)
    # depth, rank, words, parent pop, valid, score of every pop
    recs = (zero_b, zero_b, tuple(zero_b for _ in range(nw)), zero_b, zero_b, jnp.full((bp,), neg, f32))

    def winner(sc, fw, live):
        """The live entry no other beats: the highest score key, then the smallest (depth, path)
        words, one reduction per field on [F] vectors. (A form with one [F, F] comparison and one
        reduction per pop instead measured slower: its tiles need 4-8 warps, whose reductions
        cross shared memory.)"""
        key = jnp.where(live == 1, order_key(sc), lowest)
        top = jnp.max(key)
        win = (live == 1) & (key == top)
        for w in fw:
            win = win & (w == jnp.min(jnp.where(win, w, highest)))
        return win, top > lowest

    def pop(t, carry):
        (ps, sc, fd, fj, fw, fpp, live), (rd, rj, rw, rpp, rv, rs) = carry
        win, found = winner(sc, fw, live)
        ps_w, sc_w = pick(win, ps), pick(win, sc)
        d_w, j_w, pp_w, s_w = pick(win, fd), pick(win, fj), pick(win, fpp), pick(win, slot)
        w_w = [pick(win, w) for w in fw]
        here = pops == t
        node_ok = found & (sc_w > neg)
        rd, rj, rpp = jnp.where(here, d_w, rd), jnp.where(here, j_w, rj), jnp.where(here, pp_w, rpp)
        rw = tuple(jnp.where(here, w, r) for w, r in zip(w_w, rw))
        rv = jnp.where(here, node_ok.astype(i32), rv)
        rs = jnp.where(here, sc_w, rs)
        # first child -> the winner's slot; next sibling -> slot t + 1 (empty until now)
        child_ok = found & (d_w < depth)
        child_sc = plus_zero(sc_w + lookup(d_w, 0))
        sib_ok = found & (j_w + 1 < k)
        sib_sc = plus_zero(ps_w + lookup(d_w - 1, j_w + 1))
        inc = [i32(0)] * nw
        for p in range(depth):
            w, off = rank_place(p, bits, first_ranks, per)
            inc[w] = inc[w] + jnp.where(d_w - 1 == p, i32(1 << off), i32(0))
        child_w = [w_w[0] + depth_one] + w_w[1:]
        at_c, at_s = slot == s_w, slot == t + 1

        def put(x, c_val, s_val):
            return jnp.where(at_c, c_val, jnp.where(at_s, s_val, x))

        front = (put(ps, sc_w, ps_w), put(sc, child_sc, sib_sc), put(fd, d_w + 1, d_w), put(fj, 0, j_w + 1),
                 tuple(put(w, cw, ww + iw) for w, cw, ww, iw in zip(fw, child_w, w_w, inc)), put(fpp, t, pp_w),
                 put(live, child_ok.astype(i32), sib_ok.astype(i32)))
        return front, (rd, rj, rw, rpp, rv, rs)

    _, (rd, rj, rw, rpp, rv, rs) = lax.fori_loop(0, budget, pop, (front, recs))
    # tree order: valid nodes by (depth, path) words, then the invalid ones by pop index
    ua, ub = pops[:, None], pops[None, :]  # [t, u]
    va, vb = rv[:, None], rv[None, :]
    path_before = _words_less([w[None, :] for w in rw], [w[:, None] for w in rw])
    before = (vb > va) | ((vb == va) & jnp.where(va == 1, path_before, ub < ua))
    place = jnp.sum(before.astype(i32), axis=1)  # [t]
    parent_place = jnp.sum(jnp.where(rpp[:, None] == ub, place[None, :], 0), axis=1)
    parent = jnp.where(rpp < 0, 0, parent_place + 1)
    hit = (place[None, :] == ua) & (vb == 1)  # [slot, t]
    store(depth_ref, (pl.ds(0, bp),), jnp.sum(jnp.where(hit, rd[None, :] - 1, 0), axis=1))
    store(rank_ref, (pl.ds(0, bp),), jnp.sum(jnp.where(hit, rj[None, :], 0), axis=1))
    store(parent_ref, (pl.ds(0, bp),), jnp.sum(jnp.where(hit, parent[None, :], 0), axis=1))
    store(valid_ref, (pl.ds(0, bp),), jnp.sum(hit.astype(i32), axis=1))
    if score_ref:  # a max keeps each score's bits; slots of no valid node read -inf
        store(score_ref[0], (pl.ds(0, bp),), jnp.max(jnp.where(hit, rs[None, :], neg), axis=1))


def _pallas(top_val, budget: int, *, interpret: bool, num_warps: int | None, with_scores: bool = False):
    b, depth, k = top_val.shape
    if depth >= 1 << DEPTH_BITS:
        raise ValueError(f"the selection kernel packs depths in {DEPTH_BITS} bits: at most "
                         f"{(1 << DEPTH_BITS) - 1} draft depths, got {depth}: use impl='xla'")
    if budget > SELECT_KERNEL_MAX_BUDGET:
        raise ValueError(f"the selection kernel takes budgets up to {SELECT_KERNEL_MAX_BUDGET}, got {budget}: "
                         "use impl='xla'")
    if k > budget:
        raise ValueError(f"more candidates per depth ({k}) than the budget ({budget})")
    kp, dp, bp = max(16, next_pow2(k)), max(16, next_pow2(depth)), max(16, next_pow2(budget))
    kernel = functools.partial(_kernel, depth=depth, k=k, budget=budget, kp=kp, dp=dp,
                               fp=frontier_slots(budget), bp=bp)
    out_spec = pl.BlockSpec((None, bp), lambda i: (i, 0))
    shapes = [jax.ShapeDtypeStruct((b, bp), jnp.int32)] * 4
    if with_scores:
        shapes.append(jax.ShapeDtypeStruct((b, bp), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=[pl.BlockSpec((None, depth, k), lambda i: (i, 0, 0))],
        out_specs=[out_spec] * len(shapes),
        out_shape=shapes,
        compiler_params=None if interpret else compiler_params(num_warps or DEFAULT_WARPS, 1),
        interpret=interpret,
        name="tree_select",
    )(top_val.astype(jnp.float32))
    depth_i, rank, parent, valid = (x[:, :budget] for x in out[:4])
    return (depth_i, rank, parent, valid == 1) + tuple(x[:, :budget] for x in out[4:])


def select_nodes(top_val: jax.Array, budget: int, *, impl: str = "xla", num_warps: int | None = None,
                 with_scores: bool = False):
    """[B, D, k] per-depth top-k log-probs -> (depth index, rank, parent, valid) [B, budget], and
    with_scores each node's score [B, budget] float32 (-inf where not valid)."""
    check_impl(impl)
    if top_val.ndim != 3:
        raise ValueError(f"top_val must be [B, D, k], got {top_val.shape}")
    if impl == "xla":
        return reference(top_val, budget, with_scores=with_scores)
    return _pallas(top_val, budget, interpret=impl == "pallas_interpret", num_warps=num_warps,
                   with_scores=with_scores)


# ---- the XLA form (the reference) -------------------------------------------------------------
NEG = -jnp.inf


def beam_chunk(k: int) -> int:
    """Chunk of the staged top-k over a beam's W x k extensions: rows of 512 (4k for wide beams)."""
    return max(512, 4 * k)


def select_in_index_order(x: jax.Array, width: int, inf_last: bool = False) -> jax.Array:
    """The indices of top_k(x, width) (lax.top_k's tie rule) in increasing index order, [B, n] ->
    [B, width], by pairwise comparison: three reductions (rank of every entry, selected entries
    before each, the index holding each output slot) instead of a top-k sort, a sort of the picks
    and the copies XLA's in-place sorts make (~6 kernels). O(n^2) work, for short rows on a GPU,
    where a small model's tree build is one kernel launch per op (docs/decisions/0031-pairwise-rank-beam.md
    ). inf_last: picked -inf entries after all others (each group in index order)."""
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


def _beam_step(beam_scores, cand_scores, budget: int, k: int, rank_select_max: int, staged: bool, sort_max: int):
    """Extend each kept node [B, W] by k candidates [B, k]; keep the best `budget` in lex order.

    Returns (scores [B, budget], parent slot [B, budget], rank [B, budget])."""
    b, w = beam_scores.shape
    flat = plus_zero(beam_scores[:, :, None] + cand_scores[:, None, :]).reshape(b, w * k)
    width = min(budget, w * k)
    if w * k <= rank_select_max:
        pick = select_in_index_order(flat, width)
    else:
        _, pick = top_k(flat, width, chunk=beam_chunk(width), staged=staged, sort_max=sort_max)
        pick = jnp.sort(pick, axis=-1)  # store the beam in lexicographic order (ties: lower flat index)
    scores = jnp.take_along_axis(flat, pick, axis=-1)
    parent, rank = pick // k, pick % k
    if width < budget:
        pad = budget - width
        scores = jnp.pad(scores, ((0, 0), (0, pad)), constant_values=NEG)
        parent = jnp.pad(parent, ((0, 0), (0, pad)))
        rank = jnp.pad(rank, ((0, 0), (0, pad)))
    return scores, parent, rank


def beam(top_val: jax.Array, budget: int, *, rank_select_max: int = 0, staged: bool = False, sort_max: int = 0):
    """Depth by depth: beams in lexicographic order, padded to width `budget` with -inf.
    top_val [B, D, k] -> (scores, parent slots, candidate ranks) [B, D, budget] each."""
    b, depth, k = top_val.shape
    scores, parents, ranks = [], [], []
    state = jnp.zeros((b, 1), jnp.float32)
    for d in range(depth):
        state, parent, rank = _beam_step(state, top_val[:, d], budget, k, rank_select_max, staged, sort_max)
        scores.append(state)
        parents.append(parent)
        ranks.append(rank)
    return jnp.stack(scores, axis=1), jnp.stack(parents, axis=1), jnp.stack(ranks, axis=1)


def reference(top_val: jax.Array, budget: int, *, rank_select_max: int = 0, staged: bool = False,
              sort_max: int = 0, with_scores: bool = False):
    """The tree's nodes from the per-depth top-k log-probs [B, D, k] in XLA ops: the kernel's arrays
    (same signature; the keywords pick equivalent XLA forms: pairwise-rank selection for rows up to
    rank_select_max, staged / sort top-k as row_top_k.top_k takes them).

    Returns (depth index, candidate rank, parent node index (0 = root), valid) [B, budget] each,
    in tree order: valid nodes by depth, each depth in lexicographic order, then the invalid ones
    (score -inf), which read (0, 0, 0, False); with_scores: and each node's score (-inf if not valid)."""
    b, depth, k = top_val.shape
    scores, parents, ranks = beam(top_val, budget, rank_select_max=rank_select_max, staged=staged,
                                  sort_max=sort_max)  # [B, D, budget] each
    all_scores = scores.reshape(b, depth * budget)  # flat order = (depth, lex)
    if all_scores.shape[-1] <= rank_select_max:
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
    out = (jnp.where(valid, node_depth, 0), jnp.where(valid, rank, 0), jnp.where(valid, parent_index, 0), valid)
    if with_scores:
        out += (jnp.where(valid, jnp.take_along_axis(all_scores, chosen, axis=-1), NEG),)
    return out
