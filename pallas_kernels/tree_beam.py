"""DDTree's depth-by-depth beam in one kernel launch (small budgets), next to its reference.

    scores, parents, ranks = beam(top_val, budget, impl="xla" | "pallas" | "pallas_interpret")

top_val [B, D, k] float32: per draft depth, the k best log-probs in lax.top_k order. Depth d
extends each of the `budget` kept prefixes of depth d - 1 (one empty prefix at depth 0) by the k
candidates and keeps the best `budget` of the w x k extensions, stored in lexicographic order
(flat index = parent slot x k + candidate rank, ties to the lower flat index). Returns
[B, D, budget] each: the kept scores (-inf past the extensions that exist), parent slots and
candidate ranks (0 there). The reference is the XLA beam of ddtree_jax.spec.build
(`beam_xla`); both give the same arrays, ties and signed zeros included.

Why a kernel: on a GPU the reference costs ~4 launches per depth (pairwise ranks: compare,
rank, position and pick reductions), 56 of the ~92 kernels of the demo pair's DDTree-16 tree
build (scripts/profile_pair.py, docs/benchmarks.md section 3), and a step of a small model is
bound by launches. One program per sequence runs all depths (a loop; the beam stays in
registers). Per depth: the w x k extension values from one-hot reductions over the beam and the
candidates; their int32 order keys; the width-th largest key by a 32-step bitwise search (count
of keys >= a candidate threshold, one bit at a time); the chosen entries = keys above it, then
keys equal to it in index order (exclusive prefix counts, cumsum); their slots in index order
(another prefix count); each slot's entry by a masked reduction. ~25k element operations per
depth, for w x k <= BEAM_KERNEL_MAX_ENTRIES (budget 16 with k = 16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ddtree_jax.spec.build import beam_xla, order_key
from pallas_kernels._common import check_impl, compiler_params, load, next_pow2, store

BEAM_KERNEL_MAX_ENTRIES = 256  # w x k extensions per depth held in one program's registers
# Untimed guess: fewer warps make the ~40 reductions per depth cheaper (no cross-warp step), more
# warps spread the one-hot [256, 16] work; scripts/gpu_tree_beam.py --warps 1,2,4,8 decides.
DEFAULT_WARPS = 4


def _kernel(val_ref, scores_ref, parents_ref, ranks_ref, *, depth, k, budget, kp, bp, n_pad):
    f32, i32 = jnp.float32, jnp.int32
    neg = jnp.float32(-jnp.inf)
    lowest = jnp.int32(jnp.iinfo(jnp.int32).min)  # below every real key (the key of -inf included)
    idx = lax.broadcasted_iota(i32, (n_pad,), 0)
    par, rank = idx // k, idx % k
    one_hot_cand = rank[:, None] == lax.broadcasted_iota(i32, (n_pad, kp), 1)
    one_hot_par = par[:, None] == lax.broadcasted_iota(i32, (n_pad, bp), 1)
    slots = lax.broadcasted_iota(i32, (bp, n_pad), 0)
    lane = lax.broadcasted_iota(i32, (kp,), 0)
    out_lane = lax.broadcasted_iota(i32, (bp,), 0)

    def step(d, beam, first: bool):
        """Depth d (traced past depth 0): extend `beam` [bp], store the kept entries, return them."""
        cand = load(val_ref, (d, pl.ds(0, kp)), mask=lane < k, other=neg)  # [kp]
        n = k if first else budget * k
        width = min(budget, n)
        cv = jnp.max(jnp.where(one_hot_cand, cand[None, :], neg), axis=1)
        bv = jnp.zeros((n_pad,), f32) if first else jnp.max(jnp.where(one_hot_par, beam[None, :], neg), axis=1)
        real = idx < n
        val = jnp.where(real, bv + cv, neg)  # the reference's sum, same rounding
        key = jnp.where(real, order_key(val), lowest)
        # t = the width-th largest key: sign first, then bits 30..0 (two's complement: setting a
        # lower bit raises the value for either sign)
        t = jnp.where(jnp.sum((key >= 0).astype(i32)) >= width, jnp.int32(0), lowest)
        for bit in range(30, -1, -1):
            c = t | jnp.int32(1 << bit)
            t = jnp.where(jnp.sum((key >= c).astype(i32)) >= width, c, t)
        above = key > t
        tied = (key == t).astype(i32)
        tied_before = jnp.cumsum(tied) - tied
        chosen = above | ((tied == 1) & (tied_before < width - jnp.sum(above.astype(i32))))
        ci = chosen.astype(i32)
        slot = jnp.where(chosen, jnp.cumsum(ci) - ci, bp)  # position among the chosen, index order
        hit = slots == slot[None, :]  # [bp, n_pad]
        pick = jnp.sum(jnp.where(hit, idx[None, :], 0), axis=1)
        kept = jnp.max(jnp.where(hit, val[None, :], neg), axis=1)
        live = out_lane < width
        new_beam = jnp.where(live, kept, neg)
        store(scores_ref, (d, pl.ds(0, bp)), new_beam)
        store(parents_ref, (d, pl.ds(0, bp)), jnp.where(live, pick // k, 0))
        store(ranks_ref, (d, pl.ds(0, bp)), jnp.where(live, pick % k, 0))
        return new_beam

    beam = step(jnp.int32(0), None, True)
    lax.fori_loop(1, depth, lambda d, bm: step(d, bm, False), beam)


def _pallas(top_val, budget: int, *, interpret: bool, num_warps: int | None):
    b, depth, k = top_val.shape
    if budget * k > BEAM_KERNEL_MAX_ENTRIES:
        raise ValueError(
            f"the beam kernel holds at most {BEAM_KERNEL_MAX_ENTRIES} extensions per depth in one program; "
            f"budget {budget} x {k} candidates = {budget * k}: use impl='xla'")
    if k > budget:
        raise ValueError(f"more candidates per depth ({k}) than the budget ({budget})")
    kp, bp = max(16, next_pow2(k)), max(16, next_pow2(budget))
    n_pad = max(16, next_pow2(budget * k))
    kernel = functools.partial(_kernel, depth=depth, k=k, budget=budget, kp=kp, bp=bp, n_pad=n_pad)
    out_spec = pl.BlockSpec((None, depth, bp), lambda i: (i, 0, 0))
    scores, parents, ranks = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=[pl.BlockSpec((None, depth, k), lambda i: (i, 0, 0))],
        out_specs=[out_spec, out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((b, depth, bp), jnp.float32),
                   jax.ShapeDtypeStruct((b, depth, bp), jnp.int32),
                   jax.ShapeDtypeStruct((b, depth, bp), jnp.int32)],
        compiler_params=None if interpret else compiler_params(num_warps or DEFAULT_WARPS, 1),
        interpret=interpret,
        name="tree_beam",
    )(top_val.astype(jnp.float32))
    return scores[..., :budget], parents[..., :budget], ranks[..., :budget]


def beam(top_val: jax.Array, budget: int, *, impl: str = "xla", num_warps: int | None = None):
    """[B, D, k] per-depth top-k log-probs -> (scores, parent slots, candidate ranks) [B, D, budget]."""
    check_impl(impl)
    if top_val.ndim != 3:
        raise ValueError(f"top_val must be [B, D, k], got {top_val.shape}")
    if impl == "xla":
        return beam_xla(top_val, budget)
    return _pallas(top_val, budget, interpret=impl == "pallas_interpret", num_warps=num_warps)
