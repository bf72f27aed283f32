"""The decode path of the routed-expert product (pallas_kernels/moe_experts.py: the API, the
rounding, the route; impl "pallas" / "pallas_interpret" with a `DecodeConfig`, the kernel route's
default while T k <= KernelForm.max_pairs): no grouping at all. Each (token, choice) pair is its own
row (its expert read from expert_ids in the kernel: no sort, no scatter, no XLA prep). Launch (1)
over (column block, K slice, pair): the pair's token row of x times its expert's w_in columns, the
activation applied (or float32 partials with a K split); launch (2) over (column block, K slice,
pair) writing the pair's output row, or with combine "kernel" over (column block, token): the
program runs the token's k experts one after another in one pipelined loop and writes y itself
(weighted, summed in float32 in choice order, rounded once), so the layer is two launches and
nothing else. A K split of launch (1) is added, rounded and activated in launch (2)'s loads. The
row is padded to MIN_BLOCK with zero rows (tl.dot's smallest side): the MMA does wasted work, the
memory system none; layout "fma" has no MMA and no pad (the weight tile times the row broadcast
over it, summed over K once a program's loop ends). Reads T k expert matrices (one per pair,
repeats included): what a decode step reads when its tokens' choices rarely coincide. A shared
expert (`Shared`, combine "xla") is T more pairs of both launches, rows P .. P + T - 1, whose
programs read its weights instead of a routed expert's; XLA's combine adds them to the routed sums
before the one rounding. Given by its gate's weight (`Shared.gate_w`), the shared pairs' first
column block of launch (1) also sums x . gate_w over its K slice, and its combine weight is made
from those sums where it is used. With `parts` launch (2) writes each pair's weighted round(o) as
float32 partials [k (+ 1), T, H] that the caller sums (the add + RMSNorm kernel), so the layer is
the two launches and nothing else. With a `Choice` (a softmax router's logits) launch (1) also
chooses the experts: each routed program runs softmax_top_k's arithmetic on its token's logits and
takes its pair's expert (the same code on the same data in every program, so all agree), and one
program a token writes the ids and weights launch (2) reads: no launch of the choice's own.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import softmax_top_k as stk
from pallas_kernels._common import compiler_params, dot_precision, load, next_pow2, store
from pallas_kernels._moe_common import (MIN_BLOCK, TARGET_PROGRAMS, Choice, DecodeConfig, GemmConfig, Shared,
                                        _act_rounded, _dims, _filling_split, _round, _valid, combine_choices,
                                        gate_weight, kernel_problems)


def default_decode_config(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> DecodeConfig:
    """The decode path's tiling for T tokens (a first guess until the H200 sweep of
    scripts.bench.moe_experts sets it). Column blocks of 64 (128-byte rows of [E, in, out]
    weights); launch (1) split in K until it has ~TARGET_PROGRAMS programs (T = 1, top-8, I = 512:
    8 pairs x 8 blocks x split 4). Launch (2) combines in the kernel once T x H / 64 programs reach
    half of that (T >= 4 at H = 2048), else one program per pair and XLA's combine. Launch (1)
    loads x's row as the MMA's masked operand (`GemmConfig.masked_row`, decision 0064); both
    launches take the "rows" MMA layout (decision 0065)."""
    del num_experts
    if hidden % MIN_BLOCK or inter % MIN_BLOCK:
        return DecodeConfig()  # the kernel refuses the shape (kernel_problems)
    pairs = tokens * top_k
    up = GemmConfig(block_n=64, block_k=64, layout="rows", masked_row=True).fit(inter, hidden)  # 0065, 0064
    up = dataclasses.replace(up, split_k=_filling_split(pairs * (inter // up.block_n), hidden, up.block_k))
    down = GemmConfig(block_n=64, block_k=64, layout="rows").fit(hidden, inter)
    if tokens * (hidden // down.block_n) >= TARGET_PROGRAMS // 2:
        return DecodeConfig(up=up, down=down, combine="kernel")
    down = dataclasses.replace(down, split_k=_filling_split(pairs * (hidden // down.block_n), inter, down.block_k))
    return DecodeConfig(up=up, down=down, combine="xla")


def default_fused_config(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> DecodeConfig:
    """The one-launch decode path's tiling (pallas_kernels/_moe_fused.py): chunks of 32 intermediate
    columns (T = 1, top-8 + the shared expert, I = 512: 16 chunks x 9 rows = 144 programs), K steps
    of 128, down steps of 256 output columns, no MMA (a GEMV). The H200 sweep (`moe_experts --sweep
    fused`, decision 0059) found no tiling of this form faster than the two launches; the MMA
    "rows" form with down steps of 512 was within 1-4 % of its best."""
    del tokens, top_k, num_experts, hidden, inter
    return DecodeConfig(up=GemmConfig(block_n=32, block_k=128, layout="fma"),
                        down=GemmConfig(block_n=256, block_k=32, layout="fma"), combine="fused")


# ----------------------------------------------------------------------------------------------
# the kernels


def _padded_row(row):
    """A [1, K] row -> [MIN_BLOCK, K]: the row, then zero rows (tl.dot's smallest side). The
    product's other rows are then exact zeros, so a sum over them gives the row's product."""
    rows = jnp.broadcast_to(row, (MIN_BLOCK, row.shape[1]))
    first = lax.broadcasted_iota(jnp.int32, rows.shape, 0) == 0
    return jnp.where(first, rows, jnp.zeros_like(rows))


def _masked_rows(x_ref, tok, k0, bk: int):
    """What _padded_row makes of x's row `tok` at K offset k0, as one masked load: every row's
    pointers at that row, only row 0 read, zeros below. Triton pipelines this load with the
    weights' tiles (cp.async, offline sm_90 compile); the loaded row padded by a select is read by
    register loads that each K step waits for (decision 0063's profile)."""
    shape = (MIN_BLOCK, bk)
    rows = jnp.full(shape, tok, jnp.int32)
    cols = k0 + lax.broadcasted_iota(jnp.int32, shape, 1)
    first = lax.broadcasted_iota(jnp.int32, shape, 0) == 0
    return load(x_ref, (rows, cols), mask=first, other=jnp.zeros(shape, x_ref.dtype))


def _operand(row, layout: str):
    """A loaded row as the product's operand: [1, bk] padded to MIN_BLOCK rows for the MMA forms;
    for "fma" float32, [1, bk] (weights stored [E, out, in]) or a column [bk, 1] (loaded as one:
    `_columns`), each broadcast over the weight tile in the tile's own register layout."""
    return row.astype(jnp.float32) if layout == "fma" else _padded_row(row)


def _columns(layout: str, w_t: bool) -> bool:
    """Whether a launch reads its rows as columns [bk, 1]: "fma" on weights stored [E, in, out],
    whose [bk, bn] tiles take the row along their first axis (a [bk] vector there would be moved
    to the tile's layout through shared memory on every K step). Its operand is passed with a
    trailing unit axis."""
    return layout == "fma" and not w_t


def _acc_shape(bk: int, bn: int, w_t: bool, layout: str):
    """The float32 accumulator of a program: the MMA's [bn, MIN_BLOCK] / [MIN_BLOCK, bn], or for
    "fma" the weight tile's own shape ([bk, bn]; [bn, bk] for weights stored [E, out, in])."""
    if layout == "fma":
        return (bn, bk) if w_t else (bk, bn)
    return (bn, MIN_BLOCK) if layout == "cols" else (MIN_BLOCK, bn)


def _row_product(w, rows, w_t: bool, layout: str, precision):
    """w's tile ([bk, bn], or [bn, bk] for weights stored [E, out, in]) against the row operand
    (_operand), float32, in the accumulator's shape (_acc_shape): the MMA of the padded rows
    [MIN_BLOCK, bk] ("cols": the weight columns on the MMA's M side; "rows"), or for "fma" the
    tile times the row broadcast along its columns, not yet summed over K."""
    wk = 1 if w_t else 0  # the tile's contraction axis
    if layout == "fma":
        return w.astype(jnp.float32) * rows  # [1, bk] or [bk, 1] (_operand)
    if layout == "rows":
        return lax.dot_general(rows, w, (((1,), (wk,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)
    return lax.dot_general(w, rows, (((wk,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _the_row(acc, layout: str, w_t: bool):
    """The accumulator as the row's [bn] product: the padded MMA's one real row (the other rows
    are zeros), or for "fma" the sum over the tile's K axis."""
    if layout == "fma":
        return jnp.sum(acc, axis=1 if w_t else 0)
    return jnp.sum(acc, axis=1 if layout == "cols" else 0)


def _weight_tile(w_ref, e, k0, col, bk: int, bn: int, w_t: bool):
    if w_t:  # stored [E, N, K]
        return load(w_ref, (e, pl.ds(col, bn), pl.ds(k0, bk)))
    return load(w_ref, (e, pl.ds(k0, bk), pl.ds(col, bn)))


def _pair_expert(ids_ref, pair, *, top_k, pairs, num_experts):
    """(token, expert, whether a routed pair with a valid id) of pair < pairs; pairs from `pairs` on
    are the shared expert's, one per token (their id read is clamped into the table)."""
    p = jnp.minimum(pair, pairs - 1)
    tok, choice = p // top_k, p % top_k
    e = ids_ref[tok, choice]
    return tok, e, (pair < pairs) & (e >= 0) & (e < num_experts)


def _token_choice(logits_ref, tok, choice: Choice, interpret: bool):
    """Inside launch (1): token tok's (ids [kp], weights [kp]) chosen from the router's logits ref
    ([S, T, E] partial sums, or [1, T, E] logits), by softmax_top_k's arithmetic (`stk.choose`)."""
    n, k = logits_ref.shape[-1], choice.top_k
    n_pad, kp = max(16, next_pow2(n)), max(16, next_pow2(k))
    real = lax.broadcasted_iota(jnp.int32, (n_pad,), 0) < n
    zeros = jnp.zeros((n_pad,), logits_ref.dtype)
    rows = [load(logits_ref, (jnp.int32(p), tok, pl.ds(0, n_pad)), mask=real, other=zeros)
            for p in range(logits_ref.shape[0])]
    x = rows[0]
    for r in rows[1:]:
        x = x + r  # index order, as softmax_top_k adds them
    return stk.choose(x.astype(jnp.float32), real, k=k, kp=kp, norm=choice.norm, dtype=jnp.dtype(choice.weights_dtype),
                      interpret=interpret, round_to=choice.logits_dtype and jnp.dtype(choice.logits_dtype))


def _decode_up_kernel(ids_ref, x_ref, w_ref, *refs, top_k, pairs, num_experts, cfg: GemmConfig, k_per_split,
                      col_offsets, w_t, precision, act, shared=False, gate=False, choice: Choice | None = None,
                      interpret=False):
    """Program (column block, K slice, pair): the pair's token row of x times its expert's w_in
    columns (gate and up, or up). Without a K split: act(round(.)) into o_ref [P, I]; with one:
    the float32 sums into o_ref [S, P, N1]. A pair with an id outside [0, E) writes nothing. With a
    shared expert (refs: its w_in [1, ...] first) rows P .. P + T - 1 are its pairs, one per
    token; with its gate (refs: then gate_w shaped like a row of x, the outputs o_ref, g_ref
    [S, T]) each shared pair's first column block also writes the float32 sum of x . gate_w over
    its K slice. With a `choice` ids_ref holds the router's logits: each routed program chooses
    its token's experts itself (`_token_choice`) and takes its pair's; the token's first pair's
    first program writes the token's ids and weights into the last two outputs [T, k]."""
    if choice is not None:
        *refs, cids_ref, cwts_ref = refs
    o_ref = refs[-2] if gate else refs[-1]
    col_block, split, pair = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if choice is None:
        tok, e, routed = _pair_expert(ids_ref, pair, top_k=top_k, pairs=pairs, num_experts=num_experts)
    else:
        p = jnp.minimum(pair, pairs - 1)
        tok, j = p // top_k, p % top_k
        routed = pair < pairs
        e = None  # chosen inside the routed branch below
    run = functools.partial(_up_pair, x_ref, col_block=col_block, split=split, o_ref=o_ref, pair=pair, cfg=cfg,
                            k_per_split=k_per_split, col_offsets=col_offsets, w_t=w_t, precision=precision, act=act)
    if shared:
        pl.when(pair >= pairs)(lambda: run(w_ref=refs[0], tok=pair - pairs, e=jnp.int32(0)))
    if gate:
        g_ref, cols = refs[-1], _columns(cfg.layout, w_t)

        def gate_sum():
            s_tok, bk = pair - pairs, cfg.block_k

            def step(i, acc):
                k0 = split * k_per_split + i * bk
                if cols:
                    xs = load(x_ref, (s_tok, pl.ds(k0, bk), pl.ds(0, 1)))
                    gs = load(refs[1], (pl.ds(k0, bk), pl.ds(0, 1)))
                else:
                    xs = load(x_ref, (pl.ds(s_tok, 1), pl.ds(k0, bk)))
                    gs = load(refs[1], (pl.ds(0, 1), pl.ds(k0, bk)))
                return acc + xs.astype(jnp.float32) * gs.astype(jnp.float32)

            acc = lax.fori_loop(0, k_per_split // bk, step, jnp.zeros((bk, 1) if cols else (1, bk), jnp.float32))
            store(g_ref, (split, pl.ds(s_tok, 1)), jnp.sum(acc).reshape(1))

        pl.when((pair >= pairs) & (col_block == 0))(gate_sum)
    if choice is None:
        pl.when(routed)(lambda: run(w_ref=w_ref, tok=tok, e=e))
        return

    @pl.when(routed)
    def _():
        ids, wts = _token_choice(ids_ref, tok, choice, interpret)
        lane = lax.broadcasted_iota(jnp.int32, ids.shape, 0)
        run(w_ref=w_ref, tok=tok, e=jnp.sum(jnp.where(lane == j, ids, 0)))

        @pl.when((col_block == 0) & (split == 0) & (j == 0))
        def _():
            keep = lane < top_k
            store(cids_ref, (tok, pl.ds(0, ids.shape[0])), ids, mask=keep)
            store(cwts_ref, (tok, pl.ds(0, ids.shape[0])), wts, mask=keep)


def _up_pair(x_ref, *, w_ref, o_ref, pair, tok, e, col_block, split, cfg: GemmConfig, k_per_split, col_offsets, w_t,
             precision, act):
    """One program of launch (1) for a pair of token `tok` and expert `e` of w_ref."""
    bn, bk = cfg.block_n, cfg.block_k
    col0 = col_block * bn
    k_base = split * k_per_split

    def step(i, accs):
        k0 = k_base + i * bk
        if cfg.masked_row:
            rows = _masked_rows(x_ref, tok, k0, bk)
        elif _columns(cfg.layout, w_t):
            rows = _operand(load(x_ref, (tok, pl.ds(k0, bk), pl.ds(0, 1))), cfg.layout)
        else:
            rows = _operand(load(x_ref, (pl.ds(tok, 1), pl.ds(k0, bk))), cfg.layout)
        return tuple(acc + _row_product(_weight_tile(w_ref, e, k0, off + col0, bk, bn, w_t), rows, w_t,
                                        cfg.layout, precision)
                     for off, acc in zip(col_offsets, accs))

    shape = _acc_shape(bk, bn, w_t, cfg.layout)
    accs = lax.fori_loop(0, k_per_split // bk, step, tuple(jnp.zeros(shape, jnp.float32) for _ in col_offsets))
    sums = [_the_row(a, cfg.layout, w_t) for a in accs]
    if cfg.split_k > 1:
        for off, v in zip(col_offsets, sums):
            store(o_ref, (split, pair, pl.ds(off + col0, bn)), v)
        return
    store(o_ref, (pair, pl.ds(col0, bn)), _act_rounded(sums, act, o_ref.dtype))


def _decode_down_kernel(ids_ref, wts_ref, h_ref, w_ref, *refs, top_k, pairs, kp, num_experts, cfg: GemmConfig,
                        k_per_split, per_token, h_split, inter, w_t, precision, act, parts=False, dtype=None,
                        g_split=0, interpret=False):
    """Launch (2). per_token: program (column block, 0, token) runs the token's k choices in one
    loop of k x (I / bk) steps (the expert changes every I / bk steps, so the weight loads stay
    pipelined across experts) and writes round(sum_j w_j round(o_j)) into o_ref [T, H]. Else
    program (column block, K slice, pair) writes the pair's round(o) into o_ref [P, H] (float32
    partials [S, P, H] with a K split). h_ref: the activation [P, I] (dtype), or launch (1)'s
    float32 partials [h_split, P, N1], added, rounded and activated here as they are loaded. With a
    shared expert (refs: its w_out [1, ...], then o_ref; per pair only) rows P .. P + T - 1 are its
    pairs. parts (per pair, no K split): the pair's round(o) (to dtype) times its combine weight,
    float32, into o_ref [k (+ 1), T, H] at (choice, token) (the shared expert's at choice k, its
    weights [T] in refs before o_ref, or with g_split its gate's float32 sums [g_split, T], added
    in index order: `gate_weight`); a pair with an invalid id writes zeros."""
    o_ref = refs[-1]
    f32, i32 = jnp.float32, jnp.int32
    bn, bk = cfg.block_n, cfg.block_k
    col_block, split, row = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    col0 = col_block * bn
    k_base = split * k_per_split
    nk = k_per_split // bk

    cols = _columns(cfg.layout, w_t)

    def activation(pair, k0):
        """The pair's activation at K step k0: [1, bk], or [bk, 1] with cols (h_ref then has a
        trailing unit axis)."""
        if h_split == 0:
            if cols:
                return load(h_ref, (pair, pl.ds(k0, bk), pl.ds(0, 1)))
            return load(h_ref, (pl.ds(pair, 1), pl.ds(k0, bk)))
        at = lambda off: (pl.ds(0, h_split), pair, pl.ds(off + k0, bk), *((pl.ds(0, 1),) if cols else ()))
        parts = [jnp.sum(load(h_ref, at(off)), axis=0) for off in ((0, inter) if act == "silu_glu" else (0,))]
        a = _act_rounded(parts, act, w_ref.dtype)
        return a if cols else a[None, :]

    shape = _acc_shape(bk, bn, w_t, cfg.layout)
    if per_token:
        jj = lax.broadcasted_iota(i32, (kp,), 0)
        at = (jnp.zeros((kp,), i32) + row, jnp.minimum(jj, top_k - 1))  # the token's k choices (padded to kp)
        ids = load(ids_ref, at)
        valid = (jj < top_k) & (ids >= 0) & (ids < num_experts)
        wts = jnp.where(valid, load(wts_ref, at).astype(f32), 0.0)

        def step(i, carry):
            acc, y = carry
            j = i // nk
            k0 = k_base + (i - j * nk) * bk
            pick = jj == j
            e = jnp.clip(jnp.sum(jnp.where(pick, ids, 0)), 0, num_experts - 1)
            rows = _operand(activation(row * top_k + j, k0), cfg.layout)
            acc = acc + _row_product(_weight_tile(w_ref, e, k0, col0, bk, bn, w_t), rows, w_t, cfg.layout, precision)
            last = i - j * nk == nk - 1
            add = last & (jnp.sum(jnp.where(pick, valid.astype(i32), 0)) > 0)
            o = _the_row(acc, cfg.layout, w_t).astype(o_ref.dtype).astype(f32)
            y = jnp.where(add, y + jnp.sum(jnp.where(pick, wts, 0.0)) * o, y)
            return jnp.where(last, jnp.zeros_like(acc), acc), y

        _, y = lax.fori_loop(0, top_k * nk, step, (jnp.zeros(shape, f32), jnp.zeros((bn,), f32)))
        store(o_ref, (row, pl.ds(col0, bn)), y.astype(o_ref.dtype))
        return

    def one(w, e, at=None, weight=None):
        def step(i, acc):
            k0 = k_base + i * bk
            rows = _operand(activation(row, k0), cfg.layout)
            return acc + _row_product(_weight_tile(w, e, k0, col0, bk, bn, w_t), rows, w_t, cfg.layout, precision)

        v = _the_row(lax.fori_loop(0, nk, step, jnp.zeros(shape, f32)), cfg.layout, w_t)
        if parts:
            store(o_ref, (*at, pl.ds(col0, bn)), v.astype(dtype).astype(f32) * weight)
        elif cfg.split_k > 1:
            store(o_ref, (split, row, pl.ds(col0, bn)), v)
        else:
            store(o_ref, (row, pl.ds(col0, bn)), v.astype(o_ref.dtype))

    tok, e, routed = _pair_expert(ids_ref, row, top_k=top_k, pairs=pairs, num_experts=num_experts)
    if parts:
        choice = jnp.minimum(row, pairs - 1) % top_k
        if len(refs) == 3:  # the shared expert's w_out and weights [T] (or its gate's sums [S, T])
            s_tok = row - pairs

            def shared_weight():
                if g_split:
                    g = jnp.sum(load(refs[1], (pl.ds(0, g_split), pl.ds(s_tok, 1))))
                    return gate_weight(g, dtype, cast=not interpret)
                return load(refs[1], (pl.ds(s_tok, 1),))[0]

            pl.when(row >= pairs)(lambda: one(refs[0], jnp.int32(0), (jnp.int32(top_k), s_tok), shared_weight()))
        pl.when(routed)(lambda: one(w_ref, e, (choice, tok), wts_ref[tok, choice]))
        pl.when((row < pairs) & ~routed)(lambda: store(o_ref, (choice, tok, pl.ds(col0, bn)), jnp.zeros((bn,), f32)))
        return
    if len(refs) == 2:
        pl.when(row >= pairs)(lambda: one(refs[0], jnp.int32(0)))
    pl.when(routed)(lambda: one(w_ref, e))


def _call(kernel, grid, operands, out_shape, cfg: GemmConfig, interpret: bool, name: str):
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * len(a.shape))
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[full(a) for a in operands],
        out_specs=[full(o) for o in out_shape] if isinstance(out_shape, (list, tuple)) else full(out_shape),
        out_shape=out_shape,
        compiler_params=None if interpret else compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=name,
    )(*operands)


def _decode(x, expert_ids, weights, w_in, w_out, *, act: str, w_layout: str, config: DecodeConfig, interpret: bool,
            shared: Shared | None = None, parts: bool = False, choice: Choice | None = None):
    """The decode path (this module's docstring): two launches, plus XLA's combine with combine "xla".
    A shared expert runs as T more pairs of both launches (combine "xla" only). parts: float32
    partials [n, T, H] whose sum in index order, rounded to x's dtype, is y: with combine "xla"
    and no K split in launch (2) that launch writes each choice's weighted round(o) (n = k, + 1
    for the shared expert) and no combine runs; otherwise y itself (n = 1). With a `choice`
    (expert_ids and weights None) launch (1) chooses the experts from the router's logits and
    writes the ids and weights that launch (2) reads: returns (y, ids, weights)."""
    if choice is not None:
        t, k = choice.logits.shape[-2], choice.top_k
    else:
        t, k = expert_ids.shape
    e, h, _, inter, _ = _dims(w_in, w_out, w_layout)
    bad = kernel_problems(h, inter, e, k, x.dtype, config)
    if choice is not None:
        bad += choice.problems()
    if shared is not None and config.combine != "xla":
        bad.append("a shared expert needs combine 'xla' (the per-token combine sums the routed choices only)")
    if bad:
        raise ValueError("expert_mlp kernel: " + "; ".join(bad) + " (use impl='xla')")
    up, down = config.up.fit(inter, h), config.down.fit(h, inter)
    per_token = config.combine == "kernel"
    if per_token:
        down = dataclasses.replace(down, split_k=1)
    if choice is None:
        ids, wts = expert_ids.astype(jnp.int32), weights.astype(jnp.float32)
        route_in = ids
    else:  # launch (1) reads the logits ([1, T, E] when not partial sums) and writes ids / weights
        route_in = choice.logits if choice.logits_dtype is not None else choice.logits[None]
    w_t = w_layout == "out_in"
    p = t * k
    rows = p + (t if shared is not None else 0)  # the routed pairs, then the shared expert's
    offsets = (0, inter) if act == "silu_glu" else (0,)
    precision = dot_precision(x.dtype)
    f32 = jnp.float32
    if up.split_k > 1:
        hid_shape = jax.ShapeDtypeStruct((up.split_k, rows, len(offsets) * inter), f32)
    else:
        hid_shape = jax.ShapeDtypeStruct((rows, inter), x.dtype)
    gate = shared is not None and shared.gate_w is not None  # the gate's product in launch (1)
    up_kernel = functools.partial(_decode_up_kernel, top_k=k, pairs=p, num_experts=e, cfg=up,
                                  k_per_split=h // up.split_k, col_offsets=offsets, w_t=w_t, precision=precision,
                                  act=act, shared=shared is not None, gate=gate, interpret=interpret,
                                  choice=None if choice is None else choice._replace(logits=None))  # its statics
    cols = _columns(up.layout, w_t)
    extra_in = () if shared is None else (shared.w_in,)
    if gate:
        extra_in += (shared.gate_w[:, None] if cols else shared.gate_w[None, :],)
    x_op = x[..., None] if cols else x
    up_out = [hid_shape] + ([jax.ShapeDtypeStruct((up.split_k, t), f32)] if gate else [])
    if choice is not None:
        up_out += [jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((t, k), f32)]
    hid = _call(up_kernel, (inter // up.block_n, up.split_k, rows), (route_in, x_op, w_in, *extra_in),
                up_out if len(up_out) > 1 else hid_shape, up, interpret, "moe_decode_up")
    if choice is not None:
        *hid, ids, wts = hid
        hid = hid if gate else hid[0]
    if gate:
        hid, gate_sums = hid
        weight = gate_weight(jnp.sum(gate_sums, axis=0), x.dtype)  # XLA's form, for the combines below
    weighted = parts and not per_token and down.split_k == 1  # launch (2) writes the weighted parts
    done = (lambda y: (y, ids, wts)) if choice is not None else (lambda y: y)
    down_kernel = functools.partial(_decode_down_kernel, top_k=k, pairs=p, kp=next_pow2(k), num_experts=e, cfg=down,
                                    k_per_split=inter // down.split_k, per_token=per_token,
                                    h_split=up.split_k if up.split_k > 1 else 0, inter=inter, w_t=w_t,
                                    precision=precision, act=act, parts=weighted, dtype=x.dtype,
                                    g_split=up.split_k if gate else 0, interpret=interpret)
    if _columns(down.layout, w_t):
        hid = hid[..., None]
    if per_token:
        y = _call(down_kernel, (h // down.block_n, 1, t), (ids, wts, hid, w_out),
                  jax.ShapeDtypeStruct((t, h), x.dtype), down, interpret, "moe_decode_down")
        return done(y.astype(f32)[None] if parts else y)
    if weighted:
        extra = () if shared is None else (shared.w_out, gate_sums if gate else shared.weight.astype(f32))
        n = k + (shared is not None)
        return done(_call(down_kernel, (h // down.block_n, 1, rows), (ids, wts, hid, w_out, *extra),
                          jax.ShapeDtypeStruct((n, t, h), f32), down, interpret, "moe_decode_down"))
    if down.split_k > 1:
        out_shape = jax.ShapeDtypeStruct((down.split_k, rows, h), f32)
    else:
        out_shape = jax.ShapeDtypeStruct((rows, h), x.dtype)
    extra_out = () if shared is None else (shared.w_out,)
    out = _call(down_kernel, (h // down.block_n, down.split_k, rows), (ids, wts, hid, w_out, *extra_out), out_shape,
                down, interpret, "moe_decode_down")
    if down.split_k > 1:
        out = _round(jnp.sum(out, axis=0), x.dtype)
    if shared is None:
        y = combine_choices(out.reshape(t, k, h), wts, _valid(ids, e), x.dtype)
    else:
        # the shared expert as each token's last choice, added to the routed sum in float32 (no
        # concatenation: XLA makes the whole combine one fusion)
        prod = out[:p].reshape(t, k, h).astype(f32) * wts[..., None]
        routed = jnp.sum(jnp.where(_valid(ids, e)[..., None], prod, 0.0), axis=1)
        w_shared = weight if gate else shared.weight.astype(f32)
        y = _round(routed + w_shared[:, None] * out[p:].astype(f32), x.dtype)
    return done(y.astype(f32)[None] if parts else y)
