"""The grouped path of the routed-expert product (pallas_kernels/moe_experts.py: the API, the
rounding, the route): the (token, choice) pairs grouped by expert into row tiles (`group_pairs`),
their XLA form `grouped_xla` and the grouped Pallas kernel, which the kernel route takes above
the decode path's pair count (prefill, tree verify).

Grouping (`group_pairs`): pair p = t k + j goes to sorted row s_p = its rank by (expert, p) (a
stable sort by expert); the row tiles partition each expert's rows into tiles of `block_m`
(static count ceil(T k / block_m) + min(T k, E): every tile but one per expert is full); a
tile is (expert, first sorted row, rows), rows 0 for the unused ones. Ranks come from one
comparison count over the pairs (one XLA fusion; no sort kernel) up to RANK_BY_COUNT_MAX_PAIRS
pairs, from a stable argsort above.

`grouped_xla`: the row tiles of one expert each (padded groups), the tiles' rows and their
experts' weights gathered, two batched GEMMs. The XLA route from T k >= E.

The kernel (impl "pallas" / "pallas_interpret" with a `MoeConfig`): the grouping of grouped_xla;
two launches over (tile, output column block, K slice): (1) the tile's rows of x gathered by
token times the tile's expert's w_in columns, the activation applied, written to the sorted rows
of h [pairs, I]; (2) h's rows (contiguous) times w_out. Each program streams its expert's weight
block once (`block_k` rows a step, `num_stages` deep); an empty tile writes nothing. The weighted
sum over the k choices is one XLA gather + reduce. Why two launches, not one fused: a fused
program needs all of its tile's h, so it would read the whole of w_in per output block, or run
one program a tile: 8 programs on 132 SMs at decode (T = 1, k = 8).

A shared expert (`Shared`, both grouped forms) is one more choice of every token: expert E of the
grouping (`with_shared`), whose T rows fill ceil(T / block_m) tiles of their own; the kernel's
programs on those tiles read the shared expert's weights instead of a routed expert's, and the
combine sums it with the routed choices in float32 before the one rounding, as the decode path and
`reference` do. So a tree verify or prefill reads the shared expert's weights inside the two
grouped launches instead of in its own products, gate and sum.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import cdiv, compiler_params, dot_precision, load, next_pow2, store
from pallas_kernels._moe_common import (MIN_BLOCK, GemmConfig, MoeConfig, Shared, _act_rounded, _dims, _filling_split,
                                        _mm, _round, _valid, activate, combine_choices, kernel_problems, shared_weight)

RANK_BY_COUNT_MAX_PAIRS = 16384  # up to here a pair's sorted row is a comparison count (P^2 compares)


def default_config(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> MoeConfig:
    """The tiling for T tokens (not measured yet: the first guess that the GPU script sweeps).
    block_m: a power of two >= 1.5 x the mean rows of a touched expert (T k / min(T k, E)), in
    16..64, so most experts' rows fit one tile and their weights are read once. Columns in blocks
    of 64; K split (in powers of two) until each launch has ~2 programs per SM, counting
    min(T k, E) experts' tiles (decode: 8 experts x 8 column blocks of I = 512 -> K split 4)."""
    if hidden % MIN_BLOCK or inter % MIN_BLOCK:
        return MoeConfig()  # the kernel refuses the shape (kernel_problems)
    pairs = tokens * top_k
    groups = max(1, min(pairs, num_experts))
    block_m = min(64, max(MIN_BLOCK, next_pow2(cdiv(3 * pairs, 2 * groups))))
    tiles = groups * cdiv(cdiv(pairs, groups), block_m)
    up = GemmConfig(layout="cols" if block_m <= 32 else "rows").fit(inter, hidden)
    down = GemmConfig(layout=up.layout).fit(hidden, inter)
    up = dataclasses.replace(up, split_k=_filling_split(tiles * (inter // up.block_n), hidden, up.block_k))
    down = dataclasses.replace(down, split_k=_filling_split(tiles * (hidden // down.block_n), inter, down.block_k))
    return MoeConfig(block_m=block_m, up=up, down=down)


def max_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """Static tile count: every expert's rows in tiles of block_m, at most one partial tile per
    touched expert (and at most min(pairs, E) experts are touched)."""
    return cdiv(pairs, block_m) + min(pairs, num_experts)


# ----------------------------------------------------------------------------------------------
# the grouping and its XLA form


class PairGroups(NamedTuple):
    """The (token, choice) pairs grouped by expert and cut into row tiles (`group_pairs`)."""

    sorted_row: jax.Array  # [P] int32: pair p's row in expert order
    token: jax.Array  # [P + block_m] int32: the token of each sorted row (0 past the last pair)
    tile_expert: jax.Array  # [tiles] int32
    tile_row: jax.Array  # [tiles] int32: the tile's first sorted row
    tile_rows: jax.Array  # [tiles] int32: its rows (0: an unused tile)
    expert_tile: jax.Array  # [E] int32: each expert's first tile
    expert_row: jax.Array  # [E] int32: each expert's first sorted row
    valid: jax.Array  # [T, k] bool: ids in [0, E)


def group_pairs(expert_ids, num_experts: int, block_m: int, rank_by_count_max: int = RANK_BY_COUNT_MAX_PAIRS
                ) -> PairGroups:
    """Sort the pairs by expert (stable) and cut each expert's rows into tiles of block_m.
    Pairs with an id outside [0, E) sort last and belong to no tile."""
    t, k = expert_ids.shape
    p = t * k
    i32 = jnp.int32
    valid = _valid(expert_ids, num_experts)
    ids = jnp.where(valid, expert_ids, num_experts).reshape(p).astype(i32)
    pair = jnp.arange(p, dtype=i32)
    if p <= rank_by_count_max and (num_experts + 1) * p < 2**31:
        key = ids * p + pair  # distinct; ordered by (expert, pair)
        sorted_row = jnp.sum((key[None, :] < key[:, None]).astype(i32), axis=1)
    else:
        order = jnp.argsort(ids, stable=True).astype(i32)
        sorted_row = jnp.zeros((p,), i32).at[order].set(pair, unique_indices=True)
    token = jnp.zeros((p + block_m,), i32).at[sorted_row].set(pair // k, unique_indices=True)
    experts = jnp.arange(num_experts, dtype=i32)
    counts = jnp.sum((ids[None, :] == experts[:, None]).astype(i32), axis=1)  # [E]
    starts = jnp.cumsum(counts) - counts
    tiles_e = (counts + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles_e)  # tiles of experts <= e
    m = max_tiles(p, num_experts, block_m)
    tile = jnp.arange(m, dtype=i32)
    te = jnp.minimum(jnp.sum((tile_end[None, :] <= tile[:, None]).astype(i32), axis=1), num_experts - 1)
    local = tile - (tile_end[te] - tiles_e[te])
    rows = jnp.clip(counts[te] - local * block_m, 0, block_m)
    used = tile < tile_end[-1]
    return PairGroups(sorted_row, token, jnp.where(used, te, 0), jnp.where(used, starts[te] + local * block_m, 0),
                      jnp.where(used, rows, 0), tile_end - tiles_e, starts, valid)


def with_shared(x, expert_ids, weights, shared: Shared | None, num_experts: int):
    """(ids, weights, experts) of the grouping: with a shared expert, its pairs as each token's
    last choice, id E of E + 1 (routed ids outside [0, E) made -1 so that none joins it), weight
    `shared_weight` (float32); without, the inputs and E."""
    if shared is None:
        return expert_ids, weights, num_experts
    t = expert_ids.shape[0]
    routed = jnp.where(_valid(expert_ids, num_experts), expert_ids, -1)
    ids = jnp.concatenate([routed, jnp.full((t, 1), num_experts, routed.dtype)], axis=1)
    w = jnp.concatenate([weights.astype(jnp.float32), shared_weight(shared, x)[:, None]], axis=1)
    return ids, w, num_experts + 1


def _combine_sorted(out_sorted, groups: PairGroups, weights, dtype):
    """The rows of out_sorted [>= P, H] back in pair order, weighted and summed over k."""
    t, k = weights.shape
    o = jnp.take(out_sorted, groups.sorted_row, axis=0).reshape(t, k, -1)
    return combine_choices(o, weights, groups.valid, dtype)


def grouped_xla(x, expert_ids, weights, w_in, w_out, *, act: str, w_layout: str = "in_out",
                block_m: int | None = None, shared: Shared | None = None):
    """The grouped form in XLA: the row tiles of `group_pairs` (block_m rows each, default as the
    kernel's) as a batch: [tiles, block_m, H] rows gathered by token, [tiles, H, N1] / [tiles, I, H]
    weights gathered by the tiles' experts, two batched GEMMs (an unused tile reads expert 0). A
    `shared` expert is expert E of the grouping (`with_shared`): its tiles select its weights."""
    t, k = expert_ids.shape
    e, h, _, inter, _ = _dims(w_in, w_out, w_layout)
    bm = block_m or default_config(t, k, e, h, inter).block_m
    ids, weights, groups_of = with_shared(x, expert_ids, weights, shared, e)
    g = group_pairs(ids, groups_of, bm)
    r = jnp.arange(bm, dtype=jnp.int32)
    rows = g.tile_row[:, None] + r[None, :]  # [tiles, bm] sorted rows (< P + bm)
    xt = jnp.take(x, g.token[rows], axis=0)  # [tiles, bm, H]

    def tile_weights(w, w_shared):
        routed = w[jnp.minimum(g.tile_expert, e - 1)]
        if shared is None:
            return routed
        return jnp.where((g.tile_expert == e)[:, None, None], w_shared, routed)

    pre = _mm(xt, tile_weights(w_in, None if shared is None else shared.w_in), "mrh", "m", "mrn", w_layout)
    a = activate(pre, act, x.dtype)
    o = _mm(a, tile_weights(w_out, None if shared is None else shared.w_out), "mri", "m", "mrh", w_layout)
    # pair p (expert e, sorted row s) is row (s - e's first row) % bm of e's tile (s - first row) // bm
    flat = jnp.where(g.valid, ids, 0).reshape(-1)
    local = g.sorted_row - g.expert_row[flat]
    tile = jnp.clip(g.expert_tile[flat] + local // bm, 0, o.shape[0] - 1)  # (invalid pairs: any tile)
    o_pairs = o[tile, local % bm].reshape(t, ids.shape[1], -1)
    return combine_choices(o_pairs, weights, g.valid, x.dtype)


# ----------------------------------------------------------------------------------------------
# the grouped kernel


def _gemm_kernel(exp_ref, row_ref, cnt_ref, tok_ref, x_ref, w_ref, *refs, bm, cfg: GemmConfig, k_per_split,
                 col_offsets, gather, w_t, precision, epilogue, act, num_experts=None):
    """One (tile, column block, K slice) program. gather: x_ref is x [T, H] and the tile's rows are
    gathered by token; else x_ref holds the sorted rows (h). col_offsets: the weight column groups
    multiplied (gate, up) or (up,) / (all,). epilogue "act": write act(round(.)) into o_ref [P', I];
    "round": write round(.) into o_ref [P', N]; "partial": write the float32 sums (split K). With
    num_experts = E (a shared expert: refs its weights [1, ...], then o_ref) a tile of expert E
    reads the shared expert's weights."""
    o_ref = refs[-1]
    tile, col_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = cnt_ref[tile]
    e = exp_ref[tile]
    run = functools.partial(_tile_product, row_ref, tok_ref, x_ref, o_ref, tile=tile, col_block=col_block,
                            split=split, rows=rows, bm=bm, cfg=cfg,
                            k_per_split=k_per_split, col_offsets=col_offsets, gather=gather, w_t=w_t,
                            precision=precision, epilogue=epilogue, act=act)
    if num_experts is None:
        pl.when(rows > 0)(lambda: run(w_ref, e))
        return
    pl.when((rows > 0) & (e < num_experts))(lambda: run(w_ref, e))
    pl.when((rows > 0) & (e == num_experts))(lambda: run(refs[0], jnp.int32(0)))


def _tile_product(row_ref, tok_ref, x_ref, o_ref, w_ref, e, *, tile, col_block, split, rows, bm, cfg: GemmConfig,
                  k_per_split, col_offsets, gather, w_t, precision, epilogue, act):
    """The product of one program's tile (rows of expert e of w_ref) and column block, K slice."""
    f32, i32 = jnp.float32, jnp.int32
    bn, bk = cfg.block_n, cfg.block_k
    r0 = row_ref[tile]
    col0 = col_block * bn
    k_base = split * k_per_split
    kk = lax.broadcasted_iota(i32, (bk,), 0)
    tok = load(tok_ref, (pl.ds(r0, bm),)) if gather else None

    def step(t, accs):
        k0 = k_base + t * bk
        if gather:  # the tile's rows of x, by token (integer-array load: a gather)
            xt = load(x_ref, (tok[:, None], (k0 + kk)[None, :]))
        else:
            xt = load(x_ref, (pl.ds(r0, bm), pl.ds(k0, bk)))
        out = []
        for off, acc in zip(col_offsets, accs):
            if w_t:  # stored [E, N, K]: a [bn, bk] tile
                w = load(w_ref, (e, pl.ds(off + col0, bn), pl.ds(k0, bk)))
            else:
                w = load(w_ref, (e, pl.ds(k0, bk), pl.ds(off + col0, bn)))
            wk = 1 if w_t else 0  # the weight tile's contraction axis
            if cfg.layout == "rows":
                part = lax.dot_general(xt, w, (((1,), (wk,)), ((), ())), precision=precision,
                                       preferred_element_type=f32)
            else:  # [bn, bm]: the weight columns on the MMA's M side
                part = lax.dot_general(w, xt, (((wk,), (1,)), ((), ())), precision=precision,
                                       preferred_element_type=f32)
            out.append(acc + part)
        return tuple(out)

    shape = (bm, bn) if cfg.layout == "rows" else (bn, bm)
    accs = lax.fori_loop(0, k_per_split // bk, step, tuple(jnp.zeros(shape, f32) for _ in col_offsets))
    accs = [a if cfg.layout == "rows" else a.T for a in accs]  # [bm, bn]
    mask = lax.broadcasted_iota(i32, (bm, bn), 0) < rows
    if epilogue == "partial":
        for off, acc in zip(col_offsets, accs):
            store(o_ref, (pl.ds(r0, bm), pl.ds(off + col0, bn)), acc, mask=mask)
        return
    y = accs[0].astype(o_ref.dtype) if epilogue == "round" else _act_rounded(accs, act, o_ref.dtype)
    store(o_ref, (pl.ds(r0, bm), pl.ds(col0, bn)), y, mask=mask)


def _launch(groups: PairGroups, lhs, w, *, n_out: int, k: int, cfg: GemmConfig, bm: int, gather: bool, w_t: bool,
            col_offsets, epilogue: str, act: str, out_dtype, interpret: bool, name: str, w_shared=None):
    """One grouped GEMM launch over grid (tiles, n_out / block_n, split_k). With split_k > 1 the
    output is [split_k, P + bm, width] float32 partials (width: every column group's columns).
    w_shared [1, ...]: the weights of the tiles of expert E = w.shape[0] (a shared expert)."""
    rows_out = groups.token.shape[0]  # P + bm: every tile's row block lies inside
    tiles = groups.tile_expert.shape[0]
    split = cfg.split_k
    k_per_split = k // split
    kernel = functools.partial(_gemm_kernel, bm=bm, cfg=cfg, k_per_split=k_per_split, col_offsets=col_offsets,
                               gather=gather, w_t=w_t, precision=dot_precision(lhs.dtype),
                               epilogue="partial" if split > 1 else epilogue, act=act,
                               num_experts=None if w_shared is None else w.shape[0])
    full = lambda a: pl.BlockSpec(a.shape, lambda i, j, s: (0,) * a.ndim)
    if split > 1:
        width = n_out * len(col_offsets)
        out_shape = jax.ShapeDtypeStruct((split, rows_out, width), jnp.float32)
        out_spec = pl.BlockSpec((None, rows_out, width), lambda i, j, s: (s, 0, 0))
    else:
        out_shape = jax.ShapeDtypeStruct((rows_out, n_out), out_dtype)
        out_spec = pl.BlockSpec((rows_out, n_out), lambda i, j, s: (0, 0))
    operands = (groups.tile_expert, groups.tile_row, groups.tile_rows, groups.token, lhs, w)
    operands += () if w_shared is None else (w_shared,)
    return pl.pallas_call(
        kernel,
        grid=(tiles, n_out // cfg.block_n, split),
        in_specs=[full(a) for a in operands],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=None if interpret else compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=name,
    )(*operands)


def _pallas(x, expert_ids, weights, w_in, w_out, *, act: str, w_layout: str, config: MoeConfig | None,
            interpret: bool, shared: Shared | None = None, group=group_pairs):
    """The grouped kernel's two launches; `group(ids, num_experts, block_m)` groups the pairs
    (`group_pairs`, or the one-launch pallas_kernels/pair_groups.py: config.grouping)."""
    t, k = expert_ids.shape
    e, h, _, inter, _ = _dims(w_in, w_out, w_layout)
    cfg = config or default_config(t, k, e, h, inter)
    bad = kernel_problems(h, inter, e, k, x.dtype, cfg)
    if bad:
        raise ValueError("expert_mlp kernel: " + "; ".join(bad) + " (use impl='xla')")
    bm = cfg.block_m
    up, down = cfg.up.fit(inter, h), cfg.down.fit(h, inter)
    ids, weights, groups_of = with_shared(x, expert_ids, weights, shared, e)
    groups = group(ids, groups_of, bm)
    w_t = w_layout == "out_in"
    offsets = (0, inter) if act == "silu_glu" else (0,)
    common = dict(bm=bm, w_t=w_t, act=act, out_dtype=x.dtype, interpret=interpret)
    hid = _launch(groups, x, w_in, n_out=inter, k=h, cfg=up, gather=True, col_offsets=offsets, epilogue="act",
                  name="moe_experts_up", w_shared=None if shared is None else shared.w_in, **common)
    if up.split_k > 1:  # float32 partials of gate | up (or up): added, rounded and activated here
        hid = activate(_round(jnp.sum(hid, axis=0), x.dtype), act, x.dtype)
    out = _launch(groups, hid, w_out, n_out=h, k=inter, cfg=down, gather=False, col_offsets=(0,),
                  epilogue="round", name="moe_experts_down", w_shared=None if shared is None else shared.w_out,
                  **common)
    if down.split_k > 1:
        out = _round(jnp.sum(out, axis=0), x.dtype)
    return _combine_sorted(out, groups, weights, x.dtype)
