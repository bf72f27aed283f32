"""One decoding step of a Mamba2 mixer's core in one kernel launch, next to its reference.

    y, state, window = mamba2_decode(proj, window, conv_w, conv_b, dt_bias, a_log, d, state, norm_w, n_valid,
                                     num_heads=..., groups=..., eps=..., dt_limit=..., impl="xla" | "pallas" | ...)

Inputs of one token per sequence: proj [B, I + conv_dim + H], the mixer's input product z | xBC | dt
(I = H P channels of the gate z, conv_dim = I + 2 G N conv inputs x | B | C, H raw dt); the layer's
cache: window [B, K-1, conv_dim] (the conv's last inputs, oldest first), state [B, H, P, N] float32;
conv_w [K, conv_dim], conv_b [conv_dim] or None, dt_bias / a_log / d [H], norm_w [I] (the grouped
gated RMSNorm's weight); n_valid [B] (0: the row is idle and keeps its cache). Returns y [B, I] in
proj's dtype (what out_proj reads), the new state and the new window, as the model's XLA decode
path computes them (`reference`, through pallas_kernels/ref: conv, ssd, norms): dt = clip(softplus(
dt + dt_bias), dt_limit), the causal conv + bias + SiLU, h = h exp(dt A) + dt x B^T, y = h C + D x
(A = -exp(a_log)), then y silu(z) RMS-normed over each of the G groups of I / G channels, times w.

Why a kernel: XLA runs this part of a Mamba2 decode step as ~10 launches (the dt softplus, the conv
and its SiLU, the state update, the C product as a reduce, the gate, the group norm's two reduces,
the window slide), ~0.3 ms of a Nemotron-H-8B decode step's 24 Mamba2 layers
(docs/benchmarks.md section 9). Here program (row b, head h) loads its head's x columns, its
group's B / C columns and conv window, updates its [P, N] state tile in registers (in place: it
reads and writes only its own tile) and writes its gated output y silu(z) in float32 with that
row's sum of squares; the group norm, which needs the G groups' every head, is one XLA fusion after
the kernel (`_finish_norm`). With `p_split` S > 1 a head's P rows (independent in the state update
and in y) go to S programs, each with its share of the sums of squares: more programs and fewer
registers a program than one per head (`fitting_split` picks S). Programs of one group share B / C;
the first of them writes those window columns, into a new window buffer (the others still read
the old ones). P and N need not be powers of two: the kernel pads its tiles to
the next power of two >= 16 and masks every load and store.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_impl, compiler_params, count_finished, load, pow2_at_least, store
from pallas_kernels._common import fitting_split  # noqa: F401 (the models' p_split: mamba2_decode.fitting_split)
from pallas_kernels.ref import ssd
from pallas_kernels.ref.conv import causal_conv, next_window
from pallas_kernels.ref.norms import rms_normalize

DEFAULT_WARPS = 2  # the H200's fastest at batches 1 and 8: 9.78 / 22.2 us a layer against 10.5 / 24.6 at 4 (0073)
TILE_PER_WARP = 4096  # state elements a warp holds (64 x 128 at 2 warps): larger tiles take more warps


def default_warps(pp: int, nn: int) -> int:
    """Warps for a padded [pp, nn] state tile: DEFAULT_WARPS up to 2 x TILE_PER_WARP elements (the
    measured Nemotron-H-8B tile), more for larger ones (a state of 256: 4) so that the tile's
    registers a thread stay where they were measured; at most 8."""
    return min(8, max(DEFAULT_WARPS, pp * nn // TILE_PER_WARP))


def _softplus(x):
    """softplus in float32 without overflow: max(x, 0) + log(1 + exp(-|x|))."""
    return jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))


def _dims(proj, window, conv_w, a_log, state):
    b, width = proj.shape
    taps, c = conv_w.shape
    h = a_log.shape[0]
    p, n = state.shape[2], state.shape[3]
    return b, width, taps, c, h, p, n


def kernel_problems(proj_shape, window_shape, conv_w_shape, state_shape, num_heads: int, groups: int,
                    norm_w_shape) -> list[str]:
    """Why the shapes do not make one Mamba2 layer's decode step (empty: they do)."""
    b, width = proj_shape
    taps, c = conv_w_shape
    bad = []
    if len(state_shape) != 4 or state_shape[:2] != (b, num_heads):
        return [f"state {tuple(state_shape)} must be [B = {b}, H = {num_heads}, P, N]"]
    p, n = state_shape[2:]
    inter = num_heads * p
    if groups < 1 or num_heads % groups:
        bad.append(f"{num_heads} heads do not divide into {groups} groups")
    if c != inter + 2 * groups * n:
        bad.append(f"conv_dim {c} != I {inter} + 2 x {groups} groups x N {n}")
    if width != inter + c + num_heads:
        bad.append(f"proj has {width} columns, not z {inter} + conv_dim {c} + dt {num_heads}")
    if taps < 2:
        bad.append(f"the conv needs at least 2 taps, got {taps}")
    if tuple(window_shape) != (b, taps - 1, c):
        bad.append(f"window {tuple(window_shape)} must be [{b}, {taps - 1}, {c}]")
    if tuple(norm_w_shape) != (inter,):
        bad.append(f"norm weight {tuple(norm_w_shape)} must be [{inter}]")
    return bad


def reference(proj, window, conv_w, conv_b, dt_bias, a_log, d, state, norm_w, n_valid, *, num_heads: int,
              groups: int, eps: float, dt_limit=(0.0, float("inf"))):
    """The model's XLA decode path for one token (models/mamba2.py: project, ssm_inputs, ssd.step,
    GroupedGatedRMSNorm, output's cast, next_window), through pallas_kernels/ref's pieces."""
    b, width, taps, c, h, p, n = _dims(proj, window, conv_w, a_log, state)
    inter, gn, dtype = h * p, groups * n, proj.dtype
    f32 = jnp.float32
    z, xbc, raw = proj[:, :inter], proj[:, inter : inter + c], proj[:, inter + c :]
    dt = jax.nn.softplus(raw.astype(f32) + dt_bias.astype(f32))
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = jnp.clip(dt, lo, hi)
    dt = jnp.where((n_valid > 0)[:, None], dt, 0.0)
    conv = causal_conv(xbc[:, None], window, conv_w, conv_b)[:, 0]
    act = jax.nn.silu(conv).astype(dtype).astype(f32)
    xs = act[:, :inter].reshape(b, h, p)
    bm = act[:, inter : inter + gn].reshape(b, groups, n)
    cm = act[:, inter + gn :].reshape(b, groups, n)
    y, new_state = ssd.step(xs, dt, -jnp.exp(a_log.astype(f32)), bm, cm, d.astype(f32), state)
    gated = y.reshape(b, inter) * jax.nn.silu(z.astype(f32))
    normed = rms_normalize(gated.reshape(b, groups, inter // groups), eps).reshape(b, inter)
    out = (norm_w.astype(f32) * normed).astype(dtype)
    return out, new_state, next_window(xbc[:, None], window, n_valid)


def _kernel(nv_ref, proj_ref, win_ref, w_ref, *refs, heads, p, n, pr, pp, nn, rep, taps, c, width, dt_limit, bias,
            splits, norm=None, interpret=False):
    """Program (row b, head h, split s): rows s pr .. (s + 1) pr of head h's [P, N] state (a [pr, N]
    tile padded to [pp, nn]; the rows are independent in the state update and in y = h C + D x),
    their gated output y silu(z) in float32 into g_ref and its sum of squares into ss_ref [B H S];
    their x window columns, and for the group's first program the group's B / C window columns,
    into win_out. norm (groups, eps): the group norm here too (`_group_norm_epilogue`); refs then
    hold the norm weight and the counters after the state, y and the counters after win_out."""
    if bias:
        b_ref, *refs = refs
    if norm is None:
        dtb_ref, alog_ref, d_ref, s_ref, g_ref, ss_ref, s_out, win_out = refs
    else:
        dtb_ref, alog_ref, d_ref, s_ref, nw_ref, _, g_ref, ss_ref, s_out, win_out, y_ref, cnt_ref = refs
    f32, i32 = jnp.float32, jnp.int32
    bi, hi, si = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    inter = heads * p
    gn = (c - inter) // 2
    grp = hi // rep
    dtype, wdtype, cdtype = proj_ref.dtype, w_ref.dtype, win_ref.dtype
    live = nv_ref[bi] > 0
    row0 = bi * width  # proj flattened [B * width]
    col0 = hi * p + si * pr  # this program's first channel of the head's P
    # the state tile and the gate first: their loads depend on nothing else, so they are in flight
    # while the conv's loads and arithmetic run (one round trip to memory, not a chain of them)
    prow = lax.broadcasted_iota(i32, (pp, nn), 0)
    ncol = lax.broadcasted_iota(i32, (pp, nn), 1)
    tile_ok = (prow < pr) & (ncol < n)
    at = (bi * heads * p + col0 + prow, ncol)  # state flattened [B H P, N]
    st = load(s_ref, at, mask=tile_ok, other=jnp.zeros((pp, nn), f32))
    lanes = lax.broadcasted_iota(i32, (pp,), 0)
    z = load(proj_ref, (row0 + col0 + lanes,), mask=lanes < pr, other=jnp.zeros((pp,), proj_ref.dtype))

    sp = proj_ref[row0 + inter + c + hi].astype(f32) + dtb_ref[hi].astype(f32)
    dt = _softplus(sp)
    lo, hi_lim = dt_limit
    if lo > 0.0:
        dt = jnp.maximum(dt, lo)
    if hi_lim != float("inf"):
        dt = jnp.minimum(dt, hi_lim)
    dt = jnp.where(live, dt, 0.0)
    a = -jnp.exp(alog_ref[hi].astype(f32))
    dcoef = d_ref[hi].astype(f32)

    def window_at(m, ch):
        return (bi * (taps - 1) + m) * c + ch

    def conv(start, size, padded):
        """SiLU(causal conv + bias) of channels start .. start + size of xBC ([padded], zeros past
        size), rounded as the model rounds it; the window rows and the new input as stored."""
        lanes = lax.broadcasted_iota(i32, (padded,), 0)
        ok = lanes < size
        ch = start + lanes
        zero = lambda ref: jnp.zeros((padded,), ref.dtype)
        rows = [load(win_ref, (window_at(m, ch),), mask=ok, other=zero(win_ref)) for m in range(taps - 1)]
        new = load(proj_ref, (row0 + inter + ch,), mask=ok, other=zero(proj_ref))
        acc = jnp.zeros((padded,), f32)
        for m, r in enumerate(rows + [new]):
            wm = load(w_ref, (m * c + ch,), mask=ok, other=zero(w_ref)).astype(f32)
            acc = acc + r.astype(wdtype).astype(f32) * wm
        if bias:
            acc = acc + load(b_ref, (ch,), mask=ok, other=zero(b_ref)).astype(f32)
        pre = acc.astype(wdtype).astype(f32)
        return (pre * jax.nn.sigmoid(pre)).astype(wdtype).astype(dtype).astype(f32), rows, new, ch, ok

    def slide(rows, new, ch, ok):
        """The window after this token: drop the oldest row, append the new input (live rows only)."""
        kept = rows[1:] + [new.astype(cdtype)]
        for m in range(taps - 1):
            store(win_out, (window_at(m, ch),), jnp.where(live, kept[m].astype(cdtype), rows[m]), mask=ok)

    x, x_rows, x_new, x_ch, x_ok = conv(col0, pr, pp)
    bv, b_rows, b_new, b_ch, b_ok = conv(inter + grp * n, n, nn)
    cv, c_rows, c_new, c_ch, c_ok = conv(inter + gn + grp * n, n, nn)

    st = st * jnp.exp(dt * a) + (dt * x)[:, None] * bv[None, :]
    store(s_out, at, st, mask=tile_ok)
    y = jnp.sum(st * cv[None, :], axis=1) + dcoef * x  # [pp], zeros past pr

    zf = z.astype(f32)
    gated = y * (zf * jax.nn.sigmoid(zf))
    store(g_ref, (bi * inter + col0 + lanes,), gated, mask=x_ok)
    store(ss_ref, (pl.ds((bi * heads + hi) * splits + si, 1),), jnp.sum(gated * gated).reshape(1))

    slide(x_rows, x_new, x_ch, x_ok)
    first = ((hi % rep) == 0) & (si == 0)  # one program a group writes its B / C columns
    slide(b_rows, b_new, b_ch, b_ok & first)
    slide(c_rows, c_new, c_ch, c_ok & first)
    if norm is not None:
        groups, eps = norm
        done = count_finished(cnt_ref, (bi * groups + grp,), interpret)
        pl.when(done == rep * splits - 1)(functools.partial(
            _group_norm_epilogue, g_ref, ss_ref, nw_ref, y_ref, bi=bi, grp=grp, per=inter // groups,
            inter=inter, progs=rep * splits, eps=eps))


def _group_norm_epilogue(g_ref, ss_ref, nw_ref, y_ref, *, bi, grp, per, inter, progs, eps):
    """Run by the last program of group grp of row bi to finish (count_finished: every other
    program's gated output and sum of squares are stored and visible): the group's RMSNorm from
    its programs' sums of squares, times the weight, cast into y_ref ([B I], proj's dtype), as
    `_finish_norm` computes it."""
    f32, i32 = jnp.float32, jnp.int32
    lanes = lax.broadcasted_iota(i32, (pow2_at_least(progs),), 0)
    sums = load(ss_ref, (bi * (inter // per) * progs + grp * progs + lanes,), mask=lanes < progs,
                other=jnp.zeros(lanes.shape, f32))
    inv = lax.rsqrt(jnp.sum(sums) / per + eps)
    chunk = min(1024, pow2_at_least(per))
    for c0 in range(0, per, chunk):
        cols = c0 + lax.broadcasted_iota(i32, (chunk,), 0)
        ok = cols < per
        g = load(g_ref, (bi * inter + grp * per + cols,), mask=ok, other=jnp.zeros((chunk,), f32))
        w = load(nw_ref, (grp * per + cols,), mask=ok, other=jnp.zeros((chunk,), nw_ref.dtype))
        store(y_ref, (bi * inter + grp * per + cols,), (w.astype(f32) * (g * inv)).astype(y_ref.dtype), mask=ok)


def _finish_norm(gated, squares, norm_w, groups: int, eps: float, dtype):
    """The grouped RMSNorm of the kernel's gated output [B, I] (float32) from its programs' sums of
    squares [B, H S] (added in head, then split order within a group), times the weight, cast (one
    XLA fusion)."""
    b, inter = gated.shape
    per = inter // groups
    total = jnp.sum(squares.reshape(b, groups, -1), axis=-1, keepdims=True)  # [B, G, 1]
    normed = gated.reshape(b, groups, per) * lax.rsqrt(total / per + eps)
    return (norm_w.astype(jnp.float32) * normed.reshape(b, inter)).astype(dtype)


def _pallas(proj, window, conv_w, conv_b, dt_bias, a_log, d, state, norm_w, n_valid, *, num_heads, groups, eps,
            dt_limit, interpret, num_warps, p_split, norm_in_kernel):
    b, width, taps, c, h, p, n = _dims(proj, window, conv_w, a_log, state)
    inter = h * p
    bias = conv_b is not None
    pr = p // p_split
    kernel = functools.partial(_kernel, heads=h, p=p, n=n, pr=pr, pp=pow2_at_least(pr), nn=pow2_at_least(n),
                               rep=h // groups, taps=taps, c=c, width=width,
                               dt_limit=(float(dt_limit[0]), float(dt_limit[1])), bias=bias, splits=p_split,
                               norm=(groups, float(eps)) if norm_in_kernel else None, interpret=interpret)
    # every operand whole and flat (the kernel indexes and masks its padded tiles itself)
    flat_state = state.astype(jnp.float32).reshape(b * h * p, n)
    operands = (n_valid.astype(jnp.int32), proj.reshape(-1), window.reshape(-1), conv_w.reshape(-1),
                *((conv_b,) if bias else ()), dt_bias, a_log, d, flat_state)
    state_pos = len(operands) - 1
    if norm_in_kernel:  # the norm weight, then the epilogue's zeroed counters (one a row's group)
        operands += (norm_w, jnp.zeros((b * groups,), jnp.int32))
    full = lambda shape: pl.BlockSpec(shape, lambda i, j, s: (0,) * len(shape))
    out_shape = [jax.ShapeDtypeStruct((b * inter,), jnp.float32), jax.ShapeDtypeStruct((b * h * p_split,), jnp.float32),
                 jax.ShapeDtypeStruct(flat_state.shape, jnp.float32),
                 jax.ShapeDtypeStruct((window.size,), window.dtype)]
    aliases = {state_pos: 2}
    if norm_in_kernel:
        out_shape += [jax.ShapeDtypeStruct((b * inter,), proj.dtype), jax.ShapeDtypeStruct((b * groups,), jnp.int32)]
        aliases[len(operands) - 1] = len(out_shape) - 1
    outs = pl.pallas_call(
        kernel,
        grid=(b, h, p_split),
        in_specs=[full(o.shape) for o in operands],
        out_specs=[full(o.shape) for o in out_shape],
        out_shape=out_shape,
        # the state in place (each program reads and writes only its head's tile); the window to a new
        # buffer: programs of one group read B / C columns that its first program rewrites
        input_output_aliases=aliases,
        compiler_params=None if interpret else compiler_params(num_warps or default_warps(pow2_at_least(pr),
                                                                                          pow2_at_least(n)), 1),
        interpret=interpret,
        name="mamba2_decode",
    )(*operands)
    gated, squares, new_state, new_window = outs[:4]
    if norm_in_kernel:
        y = outs[4].reshape(b, inter)
    else:
        y = _finish_norm(gated.reshape(b, inter), squares.reshape(b, h * p_split), norm_w, groups, eps, proj.dtype)
    return y, new_state.reshape(state.shape), new_window.reshape(window.shape)


def mamba2_decode(proj, window, conv_w, conv_b, dt_bias, a_log, d, state, norm_w, n_valid, *, num_heads: int,
                  groups: int, eps: float, dt_limit=(0.0, float("inf")), impl: str = "xla",
                  num_warps: int | None = None, p_split: int = 1, norm_in_kernel: bool = False):
    """(y [B, I] in proj's dtype, state [B, H, P, N] float32, window [B, K-1, conv_dim]) after one
    token (module docstring). Kernels: p_split, programs a head's P rows are split over (B H p_split
    programs; a divisor of P); norm_in_kernel, the group norm run by each group's last program
    (a "last program" epilogue, docs/decisions/0059-last-program-epilogues.md) instead of an XLA
    fusion after the kernel. A shape that is not one Mamba2 layer's is refused, every problem named."""
    check_impl(impl)
    bad = kernel_problems(proj.shape, window.shape, conv_w.shape, state.shape, num_heads, groups, norm_w.shape)
    if conv_b is not None and conv_b.shape != (conv_w.shape[1],):
        bad.append(f"conv bias {tuple(conv_b.shape)} must be [{conv_w.shape[1]}]")
    if state.dtype != jnp.float32:
        bad.append(f"state dtype {state.dtype} (the recurrent state is float32)")
    if p_split < 1 or (len(state.shape) == 4 and state.shape[2] % p_split):
        bad.append(f"p_split={p_split} must be a positive divisor of the head dim P = {state.shape[-2]}")
    if bad:
        raise ValueError("mamba2_decode: " + "; ".join(bad))
    args = (proj, window, conv_w, conv_b, dt_bias, a_log, d, state, norm_w, n_valid)
    if impl == "xla":
        return reference(*args, num_heads=num_heads, groups=groups, eps=eps, dt_limit=dt_limit)
    return _pallas(*args, num_heads=num_heads, groups=groups, eps=eps, dt_limit=dt_limit,
                   interpret=impl == "pallas_interpret", num_warps=num_warps, p_split=p_split,
                   norm_in_kernel=norm_in_kernel)
