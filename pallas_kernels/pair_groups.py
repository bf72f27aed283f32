"""The grouped expert kernel's grouping of (token, choice) pairs by expert in one kernel launch,
next to its reference.

    groups = pair_groups(expert_ids, num_experts, block_m, impl="xla" | "pallas" | "pallas_interpret")

expert_ids [T, k] int32 -> `PairGroups` (pallas_kernels/_moe_grouped.py), field for field what the
reference `group_pairs` (XLA) returns: each pair's sorted row (its rank by (expert, pair index); an
id outside [0, E) sorts after every valid one), each sorted row's token, the row tiles of block_m
rows (expert, first row, rows; 0 for the unused tiles of the static count `max_tiles`) and each
expert's first tile and first row.

Why a kernel: XLA makes `group_pairs` eight small fusions in a verify (ten launches alone: the
rank count, the token scatter, the expert counts, their cumulative sum, the tiles' experts, the
selects and slices): ~0.4 ms of the Qwen3.6-35B-A3B-shape DDTree-8 verify on the H200, 40 layers at
~10 us (docs/results/2026-12-03_profile_35b_a3b_verify_b8.json). Here comparison counts compute them all
in one launch of G = cdiv(max(P, tiles), CHUNK) programs. Every program counts each expert's pairs
(a loop over chunks of COUNT_CHUNK pairs) and takes their cumulative sums (a scan); program g then
ranks pairs g CHUNK .. (g + 1) CHUNK - 1 (a pair's rank is the number of smaller (expert, pair)
keys) and scatters their tokens to the sorted rows, and fills tiles g CHUNK .. (g + 1) CHUNK - 1
(a tile's expert is the number of experts whose tiles end at or before it; the gathers by expert
are one-hot sums over the expert axis). The first version, one program looping over every chunk,
was slower than XLA's fusions in the step (decision 0067): its chunks' dependent reductions ran in
series. Up to PAIR_GROUPS_MAX_PAIRS pairs (the count loop grows with P).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_impl, compiler_params, is_pow2, load, next_pow2, store
from pallas_kernels._moe_grouped import PairGroups, _valid, group_pairs, max_tiles

PAIR_GROUPS_MAX_PAIRS = 1024  # a tree verify of budget 64 at batch 2 (130 tokens x top-8 = 1040: above)
CHUNK = 16  # pairs ranked (and tiles filled) by one program
COUNT_CHUNK = 32  # pairs counted against every expert in one step of the count loop
DEFAULT_WARPS = 4


def problems(tokens: int, top_k: int, num_experts: int, block_m: int) -> list[str]:
    """Why the kernel cannot take this grouping (empty: it can)."""
    p = tokens * top_k
    bad = [] if 0 < p <= PAIR_GROUPS_MAX_PAIRS else [f"{p} pairs (the kernel takes 1 .. {PAIR_GROUPS_MAX_PAIRS})"]
    bad += [] if num_experts >= 1 else [f"{num_experts} experts"]
    bad += [] if is_pow2(block_m) and block_m >= CHUNK else [f"block_m = {block_m} (a power of two >= {CHUNK})"]
    if (num_experts + 2) * next_pow2(max(p, CHUNK)) >= 2**31:
        bad.append(f"{num_experts} experts x {p} pairs overflow the int32 sort keys")
    return bad


def _kernel(ids_ref, sorted_ref, token_ref, tile_e_ref, tile_row_ref, tile_rows_ref, e_tile_ref, e_row_ref, *,
            p, k, e, bm, m, p_pad, e_pad):
    i32 = jnp.int32
    g = pl.program_id(0)
    ex = lax.broadcasted_iota(i32, (e_pad,), 0)

    def ids_of(start, size):  # pair ids start .. start + size - 1: invalid -> e, past the pairs -> e + 1
        q = start + lax.broadcasted_iota(i32, (size,), 0)
        raw = load(ids_ref, (pl.ds(start, size),), mask=q < p, other=0)
        ids = jnp.where(_valid(raw, e), raw, e)
        return q, jnp.where(q < p, ids, e + 1)

    # every program: each expert's count, then the cumulative sums
    def count(c, counts):
        _, ids_c = ids_of(c * COUNT_CHUNK, COUNT_CHUNK)
        return counts + jnp.sum((ids_c[:, None] == ex[None, :]).astype(i32), axis=0)

    counts = lax.fori_loop(0, pl.cdiv(p, COUNT_CHUNK), count, jnp.zeros((e_pad,), i32))
    counts = jnp.where(ex < e, counts, 0)
    starts = jnp.cumsum(counts) - counts
    tiles_e = lax.div(counts + (bm - 1), i32(bm))
    tile_end = jnp.cumsum(tiles_e)
    total = jnp.sum(tiles_e)

    # this program's pairs: their ranks (keys distinct, ordered by (expert, pair)) and tokens
    q, ids_q = ids_of(g * CHUNK, CHUNK)
    _, ids_all = ids_of(0, p_pad)
    key_all = ids_all * p_pad + lax.broadcasted_iota(i32, (p_pad,), 0)
    rank = jnp.sum((key_all[None, :] < (ids_q * p_pad + q)[:, None]).astype(i32), axis=1)
    real = q < p
    store(sorted_ref, (pl.ds(g * CHUNK, CHUNK),), rank, mask=real)
    store(token_ref, (rank,), lax.div(q, i32(k)), mask=real)  # a permutation of 0 .. P - 1: no two alike

    # this program's tiles
    tile = g * CHUNK + lax.broadcasted_iota(i32, (CHUNK,), 0)
    te = jnp.minimum(jnp.sum((tile_end[None, :] <= tile[:, None]).astype(i32), axis=1), e - 1)
    hot = ex[None, :] == te[:, None]  # [CHUNK, e_pad]: the gathers by expert as one-hot sums
    at = lambda v: jnp.sum(jnp.where(hot, v[None, :], 0), axis=1)
    tiles_te = at(tiles_e)
    local = tile - (at(tile_end) - tiles_te)
    rows = jnp.clip(at(counts) - local * bm, 0, bm)
    used = tile < total
    mask = tile < m
    store(tile_e_ref, (pl.ds(g * CHUNK, CHUNK),), jnp.where(used, te, 0), mask=mask)
    store(tile_row_ref, (pl.ds(g * CHUNK, CHUNK),), jnp.where(used, at(starts) + local * bm, 0), mask=mask)
    store(tile_rows_ref, (pl.ds(g * CHUNK, CHUNK),), jnp.where(used, rows, 0), mask=mask)

    @pl.when(g == 0)
    def _():
        store(token_ref, (pl.ds(p, bm),), jnp.zeros((bm,), i32))
        store(e_tile_ref, (pl.ds(0, e_pad),), tile_end - tiles_e, mask=ex < e)
        store(e_row_ref, (pl.ds(0, e_pad),), starts, mask=ex < e)


def _pallas(expert_ids, num_experts: int, block_m: int, *, interpret: bool, num_warps: int) -> PairGroups:
    t, k = expert_ids.shape
    p = t * k
    m = max_tiles(p, num_experts, block_m)
    p_pad, e_pad = (next_pow2(max(n, CHUNK)) for n in (p, num_experts))
    i32 = jnp.int32
    shapes = [(p,), (p + block_m,), (m,), (m,), (m,), (num_experts,), (num_experts,)]
    kernel = functools.partial(_kernel, p=p, k=k, e=num_experts, bm=block_m, m=m, p_pad=p_pad, e_pad=e_pad)
    outs = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(max(p, m), CHUNK),),
        out_shape=[jax.ShapeDtypeStruct(s, i32) for s in shapes],
        compiler_params=None if interpret else compiler_params(num_warps, 1),
        interpret=interpret,
        name="pair_groups",
    )(expert_ids.reshape(p).astype(i32))
    return PairGroups(*outs, _valid(expert_ids, num_experts))


def pair_groups(expert_ids, num_experts: int, block_m: int, *, impl: str = "xla",
                num_warps: int = DEFAULT_WARPS) -> PairGroups:
    """The pairs of expert_ids [T, k] grouped by expert into tiles of block_m rows (module doc).
    impl "xla": `group_pairs`; "pallas" / "pallas_interpret": one launch (`problems` must be empty)."""
    check_impl(impl)
    if impl == "xla":
        return group_pairs(expert_ids, num_experts, block_m)
    bad = problems(*expert_ids.shape, num_experts, block_m)
    if bad:
        raise ValueError("pair_groups kernel: " + "; ".join(bad) + " (use impl='xla')")
    return _pallas(expert_ids, num_experts, block_m, interpret=impl == "pallas_interpret", num_warps=num_warps)


reference = group_pairs  # the XLA form, same signature but impl
