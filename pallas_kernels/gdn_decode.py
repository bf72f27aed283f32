"""One decoding step of a Gated DeltaNet layer's core in one kernel launch, next to its reference.

    y, state, window = gdn_decode(mixed, z, x, w_a, w_b, a_log, dt_bias, window, conv_w, state, norm_w,
                                  n_valid, num_k_heads=..., eps=..., impl="xla" | "pallas" | "pallas_interpret")
    y, state, window = gdn_decode_packed(proj, a_log, dt_bias, window, conv_w, state, norm_w, n_valid,
                                         num_k_heads=..., head_v_dim=..., eps=..., impl=...)

Inputs of one token per sequence: mixed [B, conv_dim] (the conv inputs q | k | v) and z [B, Hv, dv]
(the output gate) from the layer's large projections; x [B, hidden] (the normed hidden state they
read) with w_a, w_b [hidden, Hv] (the small a / b projections), a_log, dt_bias [Hv]; the layer's
cache: window [B, K-1, conv_dim] (the conv's last inputs), state [B, Hv, dk, dv] float32; conv_w
[K, conv_dim], norm_w [dv]; n_valid [B] (0: the row is idle and keeps its cache). Returns the
gated-normed output y [B, Hv, dv] in mixed's dtype (what out_proj reads), the new state and the
new window: the a / b products and the gates (beta = sigmoid(b), g = -exp(a_log) softplus(a +
dt_bias)), the causal conv + SiLU, the q / k l2 norms, the delta rule's recurrent step
(delta_rule.recurrent_step) and the gated RMSNorm, as the model's XLA decode path computes them
(`reference`; models/gdn.py). A layer that stores its b / a columns in the big projection's weight
(the models' `in_proj_qkvzba`) calls `gdn_decode_packed` with that product, proj [B, conv_dim + Hv dv + 2 Hv]
(qkv | z | b | a): the kernel reads the conv inputs, z and each head's b / a products from it in
place (no slice copies, no a / b weight slices or transposes, no x).

Why a kernel: XLA runs this part of a 27B-shaped GDN layer's decode step as ~9 launches (the a / b
products as multiply + reduce fusions in two stages, the gates, conv + SiLU + norms, the key
broadcast, kv_mem, the state update with the output and the gated norm, the window slide),
reading the 64 KB float32 state of every head twice (docs/decisions/0017-gdn-decode-kernel.md).
Here one program per
(sequence, value head) loads its head's q / k / v columns and conv window, does everything in
registers and writes y, the state (in place) and its window columns: one launch, the state read
and written once. Its a / b products read its head's row of the transposed a / b weights
(contiguous; a loop-invariant transpose). Programs of the same key head share q / k; the
first of them writes those window columns (into a new window buffer: the others still read the
old ones). With `dv_split` S > 1 a head's state columns (independent in the delta rule) go to S
programs, which recompute the head's q / k and gates: a batch-1 step has more programs than value
heads (32 at the 35B-A3B layer, on 132 SMs); the gated norm, which needs every column, then runs
after the kernel from their float32 sums of squares (`_finish_norm`, one XLA fusion;
docs/decisions/0058-gdn-decode-split-and-attention-splits.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_impl, compiler_params, load, store
from pallas_kernels._common import fitting_split  # noqa: F401 (the models' dv_split: gdn_decode.fitting_split)
from pallas_kernels.ref import delta_rule
from pallas_kernels.ref.conv import causal_conv, next_window
from pallas_kernels.ref.delta_rule import gate_values, split_heads
from pallas_kernels.ref.norms import gated_rms_norm
from pallas_kernels.row_product import NormedRow

DEFAULT_WARPS = 4  # fastest measured (docs/decisions/0017-gdn-decode-kernel.md)
# The state's column block a program updates at a time; None: all its columns at once. Blocks of 32
# halve the registers (246 -> 128 at 4 warps) but ran slower on the H200 (15.5 against 13.1 us at
# the 35B-A3B layer: the blocks' loads serialise); the 6 % occupancy Nsight Compute read is the
# grid's 32 blocks, which dv_split addresses (docs/decisions/0058-gdn-decode-split-and-attention-splits.md)
DEFAULT_DV_BLOCK = None


def reference(mixed, z, x, w_a, w_b, a_log, dt_bias, window, conv_w, state, norm_w, n_valid, *,
              num_k_heads: int, eps: float, ba=None):
    """The model's XLA decode path for one token, through the model's own pieces (models/gdn.py
    gate_values / split_heads, conv.causal_conv / next_window, delta_rule.recurrent_step,
    layers.gated_rms_norm). ba [B, 2 Hv]: the b | a products already made (x, w_a, w_b unused;
    `gdn_decode_packed`)."""
    hv, dv = z.shape[1], z.shape[2]
    dk = state.shape[2]
    dtype = mixed.dtype
    if ba is None:
        beta, g = gate_values(jnp.einsum("bi,io->bo", x, w_a), jnp.einsum("bi,io->bo", x, w_b), a_log, dt_bias)
    else:
        beta, g = gate_values(ba[:, hv:], ba[:, :hv], a_log, dt_bias)
    act = jax.nn.silu(causal_conv(mixed[:, None], window, conv_w)[:, 0]).astype(dtype)
    q, k, v = split_heads(act, num_k_heads, dk, hv, dv)
    on = (n_valid > 0)[:, None]
    o, new_state = delta_rule.recurrent_step(q, k, v, jnp.where(on, g, 0.0), jnp.where(on, beta, 0.0), state)
    y = gated_rms_norm(o.astype(dtype), z, norm_w, eps)
    return y, new_state, next_window(mixed[:, None], window, n_valid)


def _kernel(*refs, kd, dk, dv, rep, hv, taps, eps, hidden, chunk, packed, dv_block, dv_split):
    """Program (row b, value head h, column split j): head h's columns j P .. (j + 1) P of the
    state (P = dv / dv_split), in blocks of dv_block. dv_split 1: y gated-normed here; else the
    rounded o of its columns into y_ref and their float32 sum of squares into ss_ref [B, Hv,
    dv_split] (the norm needs every column: `_finish_norm` applies it)."""
    if dv_split > 1:
        refs, ss_ref = refs[:-3] + refs[-2:], refs[-3]
    if packed:  # one [B, conv_dim + Hv dv + 2 Hv] product: qkv | z | b | a
        nv_ref, mixed_ref, alog_ref, dtb_ref, win_ref, w_ref, s_ref, nw_ref, y_ref, s_out, win_out = refs
        z_ref = None
    else:
        (nv_ref, mixed_ref, z_ref, x_ref, wa_ref, wb_ref, alog_ref, dtb_ref, win_ref, w_ref, s_ref, nw_ref,
         y_ref, s_out, win_out) = refs
    f32 = jnp.float32
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    width = dv // dv_split  # this program's columns of the head
    col0 = split * width
    kh = h // rep
    conv_dim = 2 * kd + hv * dv
    dtype, wdtype, cdtype = mixed_ref.dtype, w_ref.dtype, win_ref.dtype
    xdtype = dtype if packed else x_ref.dtype
    live = nv_ref[b] > 0

    if packed:  # the layer's product made them: this head's b and a columns
        b_x = mixed_ref[b, conv_dim + hv * dv + h].astype(f32)
        a_x = mixed_ref[b, conv_dim + hv * dv + hv + h].astype(f32)
    else:
        # the a / b products of this head: float32 sums over the hidden size, rounded as the XLA
        # einsum's output is
        acc_a = acc_b = f32(0.0)
        for c0 in range(0, hidden, chunk):
            xs = load(x_ref, (b, pl.ds(c0, chunk))).astype(f32)
            acc_a += jnp.sum(xs * load(wa_ref, (h, pl.ds(c0, chunk))).astype(f32))
            acc_b += jnp.sum(xs * load(wb_ref, (h, pl.ds(c0, chunk))).astype(f32))
        a_x = acc_a.astype(xdtype).astype(f32)
        b_x = acc_b.astype(xdtype).astype(f32)
    # the gates as GatedDeltaNet.project computes them
    beta_h = jax.nn.sigmoid(b_x).astype(xdtype).astype(f32)
    sp = a_x + dtb_ref[h].astype(f32)
    softplus = jnp.maximum(sp, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(sp)))
    g_h = -jnp.exp(alog_ref[h].astype(f32)) * softplus

    def conv(col, width):
        """SiLU(causal conv) of `width` channels from column `col`, rounded to the model dtype; the
        window rows and the new input, each as the window stores it."""
        rows = [load(win_ref, (b, jnp.int32(m), pl.ds(col, width))) for m in range(taps - 1)]
        new = load(mixed_ref, (b, pl.ds(col, width)))
        acc = jnp.zeros((width,), f32)
        for m, row in enumerate(rows + [new]):
            w = load(w_ref, (jnp.int32(m), pl.ds(col, width))).astype(f32)
            acc = acc + row.astype(wdtype).astype(f32) * w
        act = acc.astype(wdtype).astype(f32)
        return (act * jax.nn.sigmoid(act)).astype(wdtype).astype(dtype).astype(f32), rows, new

    def slide(col, width, rows, new, mask=None):
        """The window after this token: drop the oldest row, append the new input (live rows only)."""
        kept = rows[1:] + [new.astype(cdtype)]
        for m in range(taps - 1):
            row = jnp.where(live, kept[m].astype(cdtype), rows[m])
            store(win_out, (b, jnp.int32(m), pl.ds(col, width)), row, mask=mask)

    q, q_rows, q_new = conv(kh * dk, dk)
    k, k_rows, k_new = conv(kd + kh * dk, dk)
    q = q * lax.rsqrt(jnp.sum(q * q) + 1e-6) * dk**-0.5
    k = k * lax.rsqrt(jnp.sum(k * k) + 1e-6)
    g = jnp.where(live, g_h, 0.0)
    beta = jnp.where(live, beta_h, 0.0)
    decay = jnp.exp(g)
    # the state in column blocks of dv_block (every column's update is independent): a block's
    # [dk, dv_block] tile, not the whole [dk, dv] one, is live in registers at a time
    outs = []
    for c0 in range(0, width, dv_block):
        cols = pl.ds(c0, dv_block)  # within this program's tiles
        v, v_rows, v_new = conv(2 * kd + h * dv + col0 + c0, dv_block)
        st = load(s_ref, (pl.ds(0, dk), cols)) * decay  # [dk, dv_block]
        u = beta * (v - jnp.sum(st * k[:, None], axis=0))
        st = st + k[:, None] * u[None, :]
        store(s_out, (pl.ds(0, dk), cols), st)
        outs.append(jnp.sum(st * q[:, None], axis=0).astype(dtype).astype(f32))
        slide(2 * kd + h * dv + col0 + c0, dv_block, v_rows, v_new)
    squares = sum(jnp.sum(o * o) for o in outs)
    if dv_split > 1:  # the norm waits for every split's sum (_finish_norm)
        for c0, o in zip(range(0, width, dv_block), outs):
            store(y_ref, (pl.ds(c0, dv_block),), o.astype(y_ref.dtype))
        store(ss_ref, (b, h, pl.ds(split, 1)), squares.reshape(1))
    else:
        inv = lax.rsqrt(squares / dv + eps)
        for c0, o in zip(range(0, dv, dv_block), outs):
            normed = (o * inv).astype(dtype)
            cols = pl.ds(c0, dv_block)
            zf = load(mixed_ref, (b, pl.ds(conv_dim + h * dv + c0, dv_block))) if packed else load(z_ref, (cols,))
            wn = (load(nw_ref, (cols,)) * normed).astype(f32)  # the norm weight times the normed output, in its dtype
            zf = zf.astype(f32)
            store(y_ref, (cols,), (wn * (zf * jax.nn.sigmoid(zf))).astype(y_ref.dtype))
    # one program per key head writes its q / k window columns
    first = jnp.full((dk,), (h % rep == 0) & (split == 0))
    slide(kh * dk, dk, q_rows, q_new, first)
    slide(kd + kh * dk, dk, k_rows, k_new, first)


def hidden_chunk(hidden: int) -> int:
    """The largest power of two <= 1024 dividing the hidden size (the a / b products' load width)."""
    return min(1024, hidden & -hidden)


def kernel_problems(conv_dim: int, num_k_heads: int, num_v_heads: int, dk: int, dv: int, taps: int,
                    hidden: int) -> list[str]:
    """Why the kernel cannot take a layer of this shape (empty: it can)."""
    problems = []
    if hidden_chunk(hidden) < 16:
        problems.append(f"hidden size {hidden} is not a multiple of 16")
    for name, d in (("dk", dk), ("dv", dv)):
        if d & (d - 1) or d < 16:
            problems.append(f"{name}={d} must be a power of two >= 16")
    if num_v_heads % num_k_heads:
        problems.append(f"{num_v_heads} value heads do not divide into {num_k_heads} key heads")
    if conv_dim != 2 * num_k_heads * dk + num_v_heads * dv:
        problems.append(f"conv_dim {conv_dim} != 2 x {num_k_heads * dk} + {num_v_heads} x {dv}")
    if taps < 2:
        problems.append(f"the conv needs at least 2 taps, got {taps}")
    return problems


def _pallas(mixed, z, x, w_a, w_b, a_log, dt_bias, window, conv_w, state, norm_w, n_valid, *, num_k_heads, eps,
            interpret, num_warps, head_v_dim=None, dv_block=None, dv_split=1, defer_norm=False):
    """z None: `mixed` is the packed product qkv | z | b | a (gdn_decode_packed), else the x form.
    defer_norm (packed, dv_split > 1): y as a row_product.NormedRow [B, Hv dv] for its consumer."""
    packed = z is None
    b, width = mixed.shape
    c = conv_w.shape[1]
    hv = a_log.shape[0]
    dv = head_v_dim if packed else z.shape[2]
    dk = state.shape[2]
    taps = conv_w.shape[0]
    # packed, the kernel reads no hidden state: a hidden size that suits the check stands in
    hidden = 16 if packed else x.shape[1]
    kd = num_k_heads * dk
    problems = kernel_problems(c, num_k_heads, hv, dk, dv, taps, hidden)
    per_program = dv // max(dv_split, 1)  # a program's columns
    dv_block = min(dv_block or DEFAULT_DV_BLOCK or per_program, per_program)
    if dv_split < 1 or dv_split & (dv_split - 1) or dv % dv_split or per_program < 16:
        problems.append(f"dv_split={dv_split} must be a power of two dividing dv={dv} into blocks of >= 16")
    if dv_block & (dv_block - 1) or dv_block < 16:
        problems.append(f"dv_block={dv_block} must be a power of two >= 16")
    if packed and width != c + hv * dv + 2 * hv:
        problems.append(f"the packed product has {width} columns, not conv_dim {c} + {hv} x {dv} + 2 x {hv}")
    if problems:
        raise ValueError("gdn_decode kernel: " + "; ".join(problems))
    full = lambda shape: pl.BlockSpec(shape, lambda i, j, s: (0,) * len(shape))
    # a program's part of a head: its columns of the last axis
    head = lambda *lead: pl.BlockSpec((None, None) + lead[:-1] + (lead[-1] // dv_split,),
                                      lambda i, j, s: (i, j) + (0,) * (len(lead) - 1) + (s,))
    if packed:
        lead_args, lead_specs = (mixed,), [full((b, width))]
    else:
        # the a / b weights as [Hv, hidden]: each program reads its head's row contiguously (strided
        # column reads of the [hidden, Hv] kernels measured slower: docs/decisions/0017-gdn-decode-kernel.md). The
        # transpose is loop-invariant in a decode loop (XLA may hoist it).
        w_a, w_b = w_a.T, w_b.T
        lead_args = (mixed, z, x, w_a, w_b)
        lead_specs = [full((b, c)), head(dv), full(x.shape), full(w_a.shape), full(w_b.shape)]
    kernel = functools.partial(_kernel, kd=kd, dk=dk, dv=dv, rep=hv // num_k_heads, hv=hv, taps=taps, eps=eps,
                               hidden=hidden, chunk=hidden_chunk(hidden), packed=packed, dv_block=dv_block,
                               dv_split=dv_split)
    state_pos = 1 + len(lead_args) + 4  # n_valid, the lead inputs, a_log, dt_bias, window, conv_w
    split = dv_split > 1
    squares = [jax.ShapeDtypeStruct((b, hv, dv_split), jnp.float32)] if split else []
    outs = pl.pallas_call(
        kernel,
        grid=(b, hv, dv_split),
        in_specs=[full((b,))] + lead_specs
                 + [full((hv,)), full((hv,)), full(window.shape), full(conv_w.shape), head(dk, dv), full((dv,))],
        out_specs=[head(dv)] + [full(sq.shape) for sq in squares] + [head(dk, dv), full(window.shape)],
        out_shape=[jax.ShapeDtypeStruct((b, hv, dv), mixed.dtype)] + squares
                  + [jax.ShapeDtypeStruct(state.shape, jnp.float32), jax.ShapeDtypeStruct(window.shape, window.dtype)],
        # the state in place (each program reads and writes only its head's tile); the window to a new
        # buffer: programs of one key head read q / k columns that another one rewrites
        input_output_aliases={state_pos: 1 + len(squares)},
        compiler_params=None if interpret else compiler_params(num_warps or DEFAULT_WARPS, 1),
        interpret=interpret,
        name="gdn_decode",
    )(n_valid.astype(jnp.int32), *lead_args, a_log, dt_bias, window, conv_w, state.astype(jnp.float32), norm_w)
    if not split:
        return tuple(outs)
    o, ss, new_state, new_window = outs
    if defer_norm and packed:
        return NormedRow(o.reshape(b, hv * dv), ss, mixed, norm_w, dv, c, float(eps)), new_state, new_window
    gate = mixed[:, c : c + hv * dv].reshape(b, hv, dv) if packed else z
    return _finish_norm(o, ss, gate, norm_w, eps), new_state, new_window


def _finish_norm(o, squares, z, norm_w, eps: float):
    """The gated RMSNorm of a split kernel's rounded o [B, Hv, dv] from its splits' float32 sums of
    squares [B, Hv, S] (summed in split order), rounded at the steps the kernel's own norm rounds
    (one XLA fusion)."""
    b, hv, dv = o.shape
    row = NormedRow(o.reshape(b, hv * dv), squares, z.reshape(b, hv * dv), norm_w, dv, 0, float(eps))
    return row.value().reshape(o.shape)


def gdn_decode(mixed, z, x, w_a, w_b, a_log, dt_bias, window, conv_w, state, norm_w, n_valid, *, num_k_heads: int,
               eps: float, impl: str = "xla", num_warps: int | None = None, dv_block: int | None = None,
               dv_split: int = 1):
    """(y [B, Hv, dv], state [B, Hv, dk, dv] float32, window [B, K-1, conv_dim]) after one token.
    Kernels: dv_block, the state's column block a program updates at a time (default
    DEFAULT_DV_BLOCK, or all its columns); dv_split, programs a head's columns are split over
    (B Hv dv_split programs; above 1 the gated norm runs after the kernel, `_finish_norm`)."""
    check_impl(impl)
    args = (mixed, z, x, w_a, w_b, a_log, dt_bias, window, conv_w, state, norm_w, n_valid)
    if impl == "xla":
        return reference(*args, num_k_heads=num_k_heads, eps=eps)
    return _pallas(*args, num_k_heads=num_k_heads, eps=eps, interpret=impl == "pallas_interpret",
                   num_warps=num_warps, dv_block=dv_block, dv_split=dv_split)


def gdn_decode_packed(proj, a_log, dt_bias, window, conv_w, state, norm_w, n_valid, *, num_k_heads: int,
                      head_v_dim: int, eps: float, impl: str = "xla", num_warps: int | None = None,
                      dv_block: int | None = None, dv_split: int = 1, defer_norm: bool = False):
    """`gdn_decode` of a layer whose one product proj [B, conv_dim + Hv dv + 2 Hv] holds the conv
    inputs, z and the b | a products (the models' in_proj_qkvzba); the kernel reads them all in place.
    defer_norm: with a split (kernels, dv_split > 1) y is returned as a row_product.NormedRow
    [B, Hv dv] (the rounded o, the splits' sums of squares, z read from proj in place), whose
    consumer norms it (the row-product kernel as it loads the row; else NormedRow.value, the same
    fusion `_finish_norm` is); otherwise y as without it."""
    check_impl(impl)
    b, width = proj.shape
    c, hv, dv = conv_w.shape[1], a_log.shape[0], head_v_dim
    if width != c + hv * dv + 2 * hv:
        raise ValueError(f"gdn_decode_packed: the product has {width} columns, not conv_dim {c} + {hv} x {dv} "
                         f"+ 2 x {hv} (qkv | z | b | a)")
    if impl == "xla":
        mixed, z, ba = proj[:, :c], proj[:, c : c + hv * dv].reshape(b, hv, dv), proj[:, c + hv * dv :]
        return reference(mixed, z, None, None, None, a_log, dt_bias, window, conv_w, state, norm_w, n_valid,
                         num_k_heads=num_k_heads, eps=eps, ba=ba)
    return _pallas(proj, None, None, None, None, a_log, dt_bias, window, conv_w, state, norm_w, n_valid,
                   num_k_heads=num_k_heads, eps=eps, interpret=impl == "pallas_interpret", num_warps=num_warps,
                   head_v_dim=dv, dv_block=dv_block, dv_split=dv_split, defer_norm=defer_norm)
