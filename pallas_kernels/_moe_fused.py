"""The decode path in one launch (pallas_kernels/moe_experts.py's decode path with combine "fused";
the two-launch form is pallas_kernels/_moe_decode.py, whose helpers this module shares).

Why it was built: at batch 1 the two-launch form's launches take 14.8 + 10.1 us a layer where their
56.6 MB of expert weights need 12.9 us at the H200's read rate (docs/benchmarks.md section 6).
Measured, it is slower: 42.5-51 us a layer over 19 tilings against 33.2-34.5 us for the two
launches (docs/decisions/0059-last-program-epilogues.md): a program's down-product loads wait
for its own gate / up phase, and about one program a SM leaves nothing to overlap them. An option
(`Routes.moe_decode_fused`, off) and the tested form of the "last program" epilogue.

Program (chunk c, row r), grid (I / bc, R): row r is a (token, choice) pair, or from P on one of
the shared expert's T rows. The program makes the row's gate and up columns [c bc, (c + 1) bc) of
its expert over the whole K = H, rounds and activates them (a [bc] vector that stays in
registers), then that chunk's share of the down product, a_c @ w_out[e][c rows, :], for every
output column, float32, into a partials buffer [C, R, H]. The down product needs every chunk's
share, so the program that finishes a row last sums them: each program, after a CTA barrier (its
threads' stores before the count), increments the row's counter (an atomic, acquire-release at
GPU scope); the one that reads C - 1 adds the row's C partials in chunk order, rounds the sum to
the model dtype (o = round(a @ w_out[e]), the contract's rounding), multiplies by the row's
combine weight and writes the row's weighted part into [k (+ 1), T, H] at (choice, token): the
two-launch form's `parts` output, summed by the add + RMSNorm kernel. Deterministic: the sum's
order is fixed, only which program makes it varies. The counters are a zeroed input aliased to an
output. A shared expert's gate (`Shared.gate_w`) is summed over the whole K by its row's chunk-0
program; the row's last program reads it for the weight. A pair with an expert id outside [0, E)
writes zeros (its products are skipped; it still counts).

Reads the T k (+ T) expert matrices once each (gate | up columns by chunk, down rows by chunk:
contiguous [bc, H] blocks of weights stored [E, I, H]); writes and reads back C R H float32
partials (1.2 MB at C = 16, R = 9, H = 2048: in L2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import count_finished, counted_call, dot_precision, load, store, summed_partials
from pallas_kernels._moe_common import DecodeConfig, Shared, _dims, gate_weight, kernel_problems
from pallas_kernels._moe_decode import (_act_rounded, _acc_shape, _columns, _operand, _pair_expert, _row_product,
                                        _the_row, _weight_tile)


def _fused_kernel(ids_ref, wts_ref, x_ref, w_in_ref, w_out_ref, *refs, top_k, pairs, num_experts, chunks, bc, bk,
                  bn, hidden, offsets, w_t, layout, precision, act, dtype, shared, gate, interpret):
    """refs (counted_call's order): with a shared expert its w_in [1, ...], w_out [1, ...] and weights
    [T] (or gate_w); the counters' input; the outputs: parts o_ref [k (+ 1), T, H], partials p_ref
    [C, R, H], with a gate its sums g_ref [T]; the counters c_ref [R]."""
    f32 = jnp.float32
    o_ref, p_ref, *g, c_ref = refs[-4:] if gate else refs[-3:]
    g_ref = g[0] if gate else None
    chunk, row = pl.program_id(0), pl.program_id(1)
    c0 = chunk * bc
    x_cols = _columns(layout, w_t)  # x (and the activation) as a column [., 1]
    tok, e, routed = _pair_expert(ids_ref, row, top_k=top_k, pairs=pairs, num_experts=num_experts)
    s_tok = row - pairs  # a shared row's token

    def x_block(t, k0, width):
        if x_cols:
            return load(x_ref, (t, pl.ds(k0, width), pl.ds(0, 1)))
        return load(x_ref, (pl.ds(t, 1), pl.ds(k0, width)))

    def products(w_in, w_out, e, t):
        def up_step(i, accs):
            rows = _operand(x_block(t, i * bk, bk), layout)
            return tuple(acc + _row_product(_weight_tile(w_in, e, i * bk, off + c0, bk, bc, w_t), rows, w_t, layout,
                                            precision) for off, acc in zip(offsets, accs))

        zero = jnp.zeros(_acc_shape(bk, bc, w_t, layout), f32)
        accs = lax.fori_loop(0, hidden // bk, up_step, tuple(zero for _ in offsets))
        a = _act_rounded([_the_row(acc, layout, w_t) for acc in accs], act, dtype)  # [bc], dtype
        a_op = _operand(a[:, None] if x_cols else a[None, :], layout)

        def down_step(j, carry):
            n0 = j * bn
            v = _the_row(_row_product(_weight_tile(w_out, e, c0, n0, bc, bn, w_t), a_op, w_t, layout, precision),
                         layout, w_t)
            store(p_ref, (chunk, row, pl.ds(n0, bn)), v)
            return carry

        lax.fori_loop(0, hidden // bn, down_step, 0)

    pl.when(routed)(lambda: products(w_in_ref, w_out_ref, e, tok))
    if shared:
        pl.when(row >= pairs)(lambda: products(refs[0], refs[1], jnp.int32(0), s_tok))
    if gate:
        def gate_sum():
            def step(i, acc):
                k0 = i * bk
                if x_cols:
                    gs = load(refs[2], (pl.ds(k0, bk), pl.ds(0, 1)))
                else:
                    gs = load(refs[2], (pl.ds(0, 1), pl.ds(k0, bk)))
                return acc + x_block(s_tok, k0, bk).astype(f32) * gs.astype(f32)

            acc = lax.fori_loop(0, hidden // bk, step, jnp.zeros((bk, 1) if x_cols else (1, bk), f32))
            store(g_ref, (pl.ds(s_tok, 1),), jnp.sum(acc).reshape(1))

        pl.when((row >= pairs) & (chunk == 0))(gate_sum)

    done = count_finished(c_ref, (row,), interpret)

    def part_of(choice, t, weight):
        def step(j, carry):
            n0 = j * bn
            # Other programs wrote them; the count's acquire orders these loads after those stores
            # (and no program read them before: no stale L1 line).
            blocks = [load(p_ref, (jnp.int32(s), row, pl.ds(n0, bn))) for s in range(chunks)]
            acc = blocks[0]
            for b in blocks[1:]:
                acc = acc + b  # chunk order
            store(o_ref, (choice, t, pl.ds(n0, bn)), acc.astype(dtype).astype(f32) * weight)
            return carry

        lax.fori_loop(0, hidden // bn, step, 0)

    def zeros(choice, t):
        def step(j, carry):
            store(o_ref, (choice, t, pl.ds(j * bn, bn)), jnp.zeros((bn,), f32))
            return carry

        lax.fori_loop(0, hidden // bn, step, 0)

    last = done == chunks - 1
    choice = jnp.minimum(row, pairs - 1) % top_k
    pl.when(last & routed)(lambda: part_of(choice, tok, wts_ref[tok, choice]))
    pl.when(last & (row < pairs) & ~routed)(lambda: zeros(choice, tok))
    if shared:
        def shared_weight():
            if gate:
                return gate_weight(load(g_ref, (pl.ds(s_tok, 1),))[0], dtype, cast=not interpret)
            return load(refs[2], (pl.ds(s_tok, 1),))[0]

        pl.when(last & (row >= pairs))(lambda: part_of(jnp.int32(top_k), s_tok, shared_weight()))


def fused(x, ids, wts, w_in, w_out, *, act: str, w_t: bool, inter: int, config: DecodeConfig, interpret: bool,
          shared: Shared | None, precision):
    """The weighted parts [k (+ 1), T, H] float32 (module docstring) of x [T, H] (ids [T, k] int32,
    wts [T, k] float32); config.up.block_n is the chunk bc of intermediate columns a program owns,
    config.up.block_k its K step over H, config.down.block_n the output columns of a down step and
    of the last program's sum (both fitted to the sizes; num_warps / num_stages from up)."""
    t, k = ids.shape
    h = x.shape[1]
    f32 = jnp.float32
    up = config.up.fit(inter, h)
    bn = config.down.fit(h, up.block_n).block_n
    chunks = inter // up.block_n
    p = t * k
    rows = p + (t if shared is not None else 0)
    offsets = (0, inter) if act == "silu_glu" else (0,)
    cols = _columns(up.layout, w_t)
    gate = shared is not None and shared.gate_w is not None
    operands = [ids, wts, x[..., None] if cols else x, w_in, w_out]
    if shared is not None:
        operands += [shared.w_in, shared.w_out]
        if gate:
            operands.append(shared.gate_w[:, None] if cols else shared.gate_w[None, :])
        else:
            operands.append(shared.weight.astype(f32))
    n = k + (shared is not None)
    out_shape = [jax.ShapeDtypeStruct((n, t, h), f32), jax.ShapeDtypeStruct((chunks, rows, h), f32)]
    if gate:
        out_shape.append(jax.ShapeDtypeStruct((t,), f32))
    kernel = functools.partial(_fused_kernel, top_k=k, pairs=p, num_experts=w_in.shape[0], chunks=chunks,
                               bc=up.block_n, bk=up.block_k, bn=bn, hidden=h, offsets=offsets, w_t=w_t,
                               layout=up.layout, precision=precision, act=act, dtype=x.dtype,
                               shared=shared is not None, gate=gate, interpret=interpret)
    outs = counted_call(kernel, grid=(chunks, rows), operands=operands, out_shape=out_shape, counters=rows,
                        num_warps=up.num_warps, num_stages=up.num_stages, interpret=interpret, name="moe_decode_fused")
    return outs[0]


def one_launch(x, expert_ids, weights, w_in, w_out, *, act: str, w_layout: str, config: DecodeConfig,
               interpret: bool, shared: Shared | None = None, parts: bool = False):
    """expert_mlp's decode path with combine "fused": y [T, H] (the parts summed in index order,
    rounded once), or with `parts` the weighted parts [k (+ 1), T, H] themselves."""
    t, k = expert_ids.shape
    e, h, _, inter, _ = _dims(w_in, w_out, w_layout)
    bad = kernel_problems(h, inter, e, k, x.dtype, config)
    if bad:
        raise ValueError("expert_mlp kernel: " + "; ".join(bad) + " (use impl='xla')")
    out = fused(x, expert_ids.astype(jnp.int32), weights.astype(jnp.float32), w_in, w_out, act=act,
                w_t=w_layout == "out_in", inter=inter, config=config, interpret=interpret, shared=shared,
                precision=dot_precision(x.dtype))
    return out if parts else summed_partials(out, x.dtype)
