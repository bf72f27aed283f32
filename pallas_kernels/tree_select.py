"""DDTree's node selection in one kernel launch: a best-first heap, next to its reference.

    depth, rank, parent, valid = select_nodes(top_val, budget, impl="xla" | "pallas" | "pallas_interpret")

top_val [B, D, k] float32: per draft depth the k best log-probs (<= 0) in lax.top_k order. The
tree's nodes are the `budget` best prefixes (score = the left-to-right float32 sum of their
log-probs) in the heap's total order: higher score first, then smaller depth, then the
lexicographically smaller path of candidate ranks. Returns [B, budget] each, in tree order
(valid nodes by depth, each depth in lexicographic order, then the invalid ones): the node's
depth index (tree depth - 1), its candidate rank at that depth, its parent's node index (0 = the
root, nodes numbered from 1) and whether it is a real node (score > -inf). Invalid nodes read
(0, 0, 0, False). The reference is the XLA form of ddtree_jax.speculative.build (`select_nodes_xla`:
a depth-by-depth beam of width `budget`, then one top-`budget` over all depths); both give the
same arrays, ties and signed zeros included.

Why a kernel: on a GPU the XLA form costs ~4 launches per depth plus ~10 for the final pick and
the index mapping (the demo pair's DDTree-32 build: 82 kernels, 0.15 ms of a 0.7 ms step), and a
small model's step is bound by launches. A first one-launch form ran the beam in a kernel with a
32-step bitwise search per depth: 480 dependent block reductions, 79 us on the H200 at budget 16,
no faster than the XLA beam. This kernel: 10.1 / 21.2 / 57.8 us at budgets 16 / 32 / 64 against
88.6 / 107.3 / 305.3 us for the XLA form (batch 1, 15 depths, in an on-device loop;
scripts/gpu_tree_select.py, docs/benchmarks.md section 3).

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

from ddtree_jax.speculative.build import order_key, plus_zero, select_nodes_xla
from pallas_kernels._common import check_impl, compiler_params, load, next_pow2, store

SELECT_KERNEL_MAX_BUDGET = 64  # frontier of 128 slots; 57.8 us at budget 64 vs 305 us for the XLA form (H200)


# One warp reduces without shared memory or barriers: fastest at every budget measured on the H200
# (budget 16 / 32 / 64: 10.1 / 21.2 / 57.8 us at 1 warp, 11.6 / 34.0 / 79.0 at 4, 12.4 / 39.3 / 90.8 at 8;
# scripts/gpu_tree_select.py, docs/benchmarks.md section 3), though budget 64 spills 264 bytes at
# one warp (scripts/offline_triton_compile.py select --nodes 64).
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


def _kernel(val_ref, depth_ref, rank_ref, parent_ref, valid_ref, *, depth, k, budget, kp, dp, fp, bp):
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
    recs = (zero_b, zero_b, tuple(zero_b for _ in range(nw)), zero_b, zero_b)  # depth, rank, words, parent pop, valid

    def winner(sc, fw, live):
        """The live entry no other beats: the highest score key, then the smallest (depth, path)
        words, one reduction per field on [F] vectors. (A form with one [F, F] comparison and one
        reduction per pop instead was 1.4x / 3.1x / 28x slower at budgets 16 / 32 / 64 on the
        H200: its tiles need 4-8 warps, whose reductions cross shared memory.)"""
        key = jnp.where(live == 1, order_key(sc), lowest)
        top = jnp.max(key)
        win = (live == 1) & (key == top)
        for w in fw:
            win = win & (w == jnp.min(jnp.where(win, w, highest)))
        return win, top > lowest

    def pop(t, carry):
        (ps, sc, fd, fj, fw, fpp, live), (rd, rj, rw, rpp, rv) = carry
        win, found = winner(sc, fw, live)
        ps_w, sc_w = pick(win, ps), pick(win, sc)
        d_w, j_w, pp_w, s_w = pick(win, fd), pick(win, fj), pick(win, fpp), pick(win, slot)
        w_w = [pick(win, w) for w in fw]
        here = pops == t
        node_ok = found & (sc_w > neg)
        rd, rj, rpp = jnp.where(here, d_w, rd), jnp.where(here, j_w, rj), jnp.where(here, pp_w, rpp)
        rw = tuple(jnp.where(here, w, r) for w, r in zip(w_w, rw))
        rv = jnp.where(here, node_ok.astype(i32), rv)
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
        return front, (rd, rj, rw, rpp, rv)

    _, (rd, rj, rw, rpp, rv) = lax.fori_loop(0, budget, pop, (front, recs))
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


def _pallas(top_val, budget: int, *, interpret: bool, num_warps: int | None):
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
    shape = jax.ShapeDtypeStruct((b, bp), jnp.int32)
    depth_i, rank, parent, valid = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=[pl.BlockSpec((None, depth, k), lambda i: (i, 0, 0))],
        out_specs=[out_spec] * 4,
        out_shape=[shape] * 4,
        compiler_params=None if interpret else compiler_params(num_warps or DEFAULT_WARPS, 1),
        interpret=interpret,
        name="tree_select",
    )(top_val.astype(jnp.float32))
    return depth_i[:, :budget], rank[:, :budget], parent[:, :budget], valid[:, :budget] == 1


def select_nodes(top_val: jax.Array, budget: int, *, impl: str = "xla", num_warps: int | None = None):
    """[B, D, k] per-depth top-k log-probs -> (depth index, rank, parent, valid) [B, budget]."""
    check_impl(impl)
    if top_val.ndim != 3:
        raise ValueError(f"top_val must be [B, D, k], got {top_val.shape}")
    if impl == "xla":
        return select_nodes_xla(top_val, budget)
    return _pallas(top_val, budget, interpret=impl == "pallas_interpret", num_warps=num_warps)
