"""The inputs of a Gated DeltaNet tree verify from the layer's projections, in one kernel (Pallas /
Triton kernel + its pure-jnp reference).

Between the qkv projection and `gdn_tree_verify` a tree pass runs, per node: the causal conv over
the node's own path (its K - 1 nearest ancestors, reaching into the committed conv window),
SiLU, the split into heads, the q / k L2 norms (q scaled by dk^-1/2), the heads-first transposes
and the casts the tree kernel and the commit want. XLA runs that as ~5 fusions a layer plus a
concatenation of window and nodes (docs/kernels_gdn.md, "Next"); here it is one launch.

    seq   = [window (K - 1 rows) ; mixed (N rows)]                  per channel
    conv  = sum_m seq[conv_src[n, m]] * w[K - 1 - m]                conv_src: tree.geometry
    act   = silu(conv), rounded to the output dtype (as the model's XLA form does)
    q     = l2norm(act_q) * dk^-1/2,  k = l2norm(act_k)  (float32, then the output dtype),
    v     = act_v

Kernel: one program per (batch row, key head, channel group): group 0 is the key head's q
channels, group 1 its k channels, group 2 + r its r-th value head (value head j * rep + r reads
key head j). 2 + rep groups per key head keep 80 programs in flight for the 27B layer at batch 1
(one program per key head was too few: docs/decisions/0018-gdn-tree-prologue-kernel.md). Every group is one dk-wide
block of channels (dk == dv), so one BlockSpec serves all groups; a program stores only its own
outputs. Taps are gather loads (`ref[idx, :]`: a row of the window or of the nodes, selected by
index). Pallas Triton needs power-of-two shapes for every value, so the nodes run as one block
when N is a power of two and as node 0 alone + a block of N - 1 when N - 1 is (DDTree's root +
2^j drafts); other N are refused (`kernel_problems`).

`mixed` may carry more columns than the conv reads (the layer's merged qkv | z | b | a product):
the kernel reads the conv's channel blocks only, so the product need not be sliced (a copy) first.

Gates (optional, `gates=(a_log, dt_bias), ba_col=c`): where `mixed` is the whole qkv | z | b | a
product, each value-head program also computes its head's gates from the
b and a columns at `c + head` and `c + Hv + head`, as the decode kernel does (gdn_decode: beta =
sigmoid(b) rounded to the model dtype, g = -exp(A_log) softplus(a + dt_bias) in float32), and
stores g and beta [B, Hv, N] heads-first: two XLA fusions fewer per GDN layer.

impl="xla" is the reference, "pallas" the Triton kernel, "pallas_interpret" the same kernel in the
Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import check_impl, compiler_params, is_pow2
from pallas_kernels.ref.conv import tree_conv
from pallas_kernels.ref.delta_rule import gate_values
from pallas_kernels.ref.norms import l2_normalize


def reference(mixed, window, conv_w, conv_src, *, num_k_heads: int, head_k_dim: int, head_v_dim: int,
              out_dtype, gates=None, ba_col: int | None = None):
    """(q, k, v in out_dtype, k float32): q, k [B, Hk, N, dk], v [B, Hv, N, dv] (module doc); with
    `gates` also (g, beta) [B, Hv, N] float32.

    mixed [B, N, >= D] (its first D = 2 Hk dk + Hv dv columns: q | k | v channels); window
    [B, K - 1, D], conv_w [K, D], conv_src [B, N, K] int32 (indices into [window ; mixed]);
    gates = (a_log, dt_bias) [Hv] with the b columns of mixed at [ba_col, ba_col + Hv) and the a
    columns after them."""
    b, n, _ = mixed.shape
    d = conv_w.shape[1]
    act = jax.nn.silu(tree_conv(mixed[..., :d], window, conv_w, conv_src)).astype(out_dtype).astype(jnp.float32)
    kd = num_k_heads * head_k_dim
    heads = lambda a, dim: jnp.swapaxes(a.reshape(b, n, -1, dim), 1, 2)
    q, k, v = (heads(act[..., :kd], head_k_dim), heads(act[..., kd : 2 * kd], head_k_dim),
               heads(act[..., 2 * kd :], head_v_dim))
    k32 = l2_normalize(k)
    out = (l2_normalize(q) * head_k_dim**-0.5).astype(out_dtype), k32.astype(out_dtype), v.astype(out_dtype), k32
    if gates is None:
        return out
    hv = v.shape[1]
    ba = mixed[..., ba_col : ba_col + 2 * hv]
    beta, g = gate_values(ba[..., hv:], ba[..., :hv], *gates)
    return (*out, jnp.swapaxes(g, 1, 2), jnp.swapaxes(beta, 1, 2))


def kernel_problems(n: int, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int,
                    taps: int = 4) -> list[str]:
    """Why the kernel cannot take this shape (empty: it can)."""
    out = [] if taps >= 2 else [f"a {taps}-tap conv has no window to read"]
    if not (is_pow2(n) or (n > 1 and is_pow2(n - 1))):
        out.append(f"{n} nodes: the kernel takes N or N - 1 a power of two")
    for name, v in (("key head dim", head_k_dim), ("value head dim", head_v_dim)):
        if not is_pow2(v):
            out.append(f"{name} {v} is not a power of two")
    if head_k_dim != head_v_dim:
        out.append(f"key head dim {head_k_dim} != value head dim {head_v_dim} (one channel block per group)")
    if num_v_heads % num_k_heads:
        out.append(f"{num_v_heads} value heads do not divide into {num_k_heads} key heads")
    return out


def _prologue_kernel(src_ref, w_ref, x_ref, win_ref, *refs, taps: int, blocks, scale: float, rep: int,
                     num_v_heads: int, ba_col: int | None):
    """One (batch row, key head, channel group): silu(conv) of the group's channels over the node
    blocks, then q (normed, scaled), k (normed; also float32) or v, by group; value-head groups
    also the head's gates when `ba_col` is set (refs then hold the whole-row product, A_log and
    dt_bias before the outputs, and g / beta after them)."""
    if ba_col is None:
        q_out, k_out, k32_out, v_out = refs
    else:
        whole_ref, alog_ref, dtb_ref, q_out, k_out, k32_out, v_out, g_out, beta_out = refs
    group = pl.program_id(2)
    head = pl.program_id(1) * rep + jnp.maximum(group - 2, 0)  # the value head of a value group
    f32 = jnp.float32
    back = taps - 1  # window rows before node 0 in [window ; mixed]

    def act(rows):
        """silu(conv) [size, C] of the block's nodes with the decode kernel's arithmetic
        (gdn_decode: inputs in the weight dtype, float32 sum from the oldest tap on, rounded to
        the weight dtype, SiLU in float32, rounded to the weight and output dtypes), as float32:
        a committed token's activations come out the same whether it was decoded or verified."""
        wdt = w_ref.dtype
        acc = None
        for m in reversed(range(taps)):  # oldest tap first, as gdn_decode sums
            idx = src_ref[rows, m]  # [size] indices into [window ; mixed]
            from_x = x_ref[jnp.maximum(idx - back, 0), :].astype(wdt).astype(f32)
            from_w = win_ref[jnp.clip(idx, 0, back - 1), :].astype(wdt).astype(f32)
            tap = jnp.where((idx >= back)[:, None], from_x, from_w) * w_ref[taps - 1 - m, :].astype(f32)[None, :]
            acc = tap if acc is None else acc + tap
        a = acc.astype(wdt).astype(f32)
        return (a * jax.nn.sigmoid(a)).astype(wdt).astype(q_out.dtype).astype(f32)

    for start, size in blocks:
        rows = pl.ds(start, size)
        a = act(rows)

        @pl.when(group == 0)
        def _():
            q_out[rows, :] = (l2_normalize(a) * scale).astype(q_out.dtype)

        @pl.when(group == 1)
        def _():
            k_n = l2_normalize(a)
            k_out[rows, :] = k_n.astype(k_out.dtype)
            k32_out[rows, :] = k_n

        @pl.when(group >= 2)
        def _():
            v_out[rows, :] = a.astype(v_out.dtype)
            if ba_col is not None:  # this value head's gates, as gdn_decode computes them
                xdt = whole_ref.dtype
                b_x = whole_ref[rows, ba_col + head].astype(f32)
                a_x = whole_ref[rows, ba_col + num_v_heads + head].astype(f32)
                beta_out[rows] = jax.nn.sigmoid(b_x).astype(xdt).astype(f32)
                sp = a_x + dtb_ref[head].astype(f32)
                softplus = jnp.maximum(sp, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(sp)))
                g_out[rows] = -jnp.exp(alog_ref[head].astype(f32)) * softplus


def gdn_tree_prologue(mixed, window, conv_w, conv_src, *, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                      out_dtype=None, impl: str = "xla", num_warps: int | None = None, gates=None,
                      ba_col: int | None = None):
    """(q, k, v, k32) of a GDN tree verify: q, k [B, Hk, N, dk] and v [B, Hv, N, dv] in out_dtype
    (default: mixed's dtype) for `gdn_tree_verify`, and k [B, Hk, N, dk] float32 for the commit
    (`gdn_path_commit` maps value head j to key head j // rep itself); with gates = (A_log,
    dt_bias) also (g, beta) [B, Hv, N] float32 from the b | a columns at ba_col (module doc).
    Inputs as `reference`.
    impl "xla" | "pallas" | "pallas_interpret". num_warps (Triton): by default 8 for node blocks
    of 32 or more (offline sm_90 compile at the 27B layer, 65 nodes: 91 registers at 8 warps, 248
    at 4, both without spills), else 4."""
    check_impl(impl)
    out_dtype = jnp.dtype(out_dtype or mixed.dtype)
    b, n, width = mixed.shape
    taps, d = conv_w.shape
    hk, dk, dv = num_k_heads, head_k_dim, head_v_dim
    hv = (d - 2 * hk * dk) // dv
    bad = [f"mixed has {width} columns, fewer than the conv's {d}"] if width < d else []
    if window.shape != (b, taps - 1, d) or conv_src.shape != (b, n, taps):
        bad.append(f"window {window.shape} / conv_src {conv_src.shape} do not fit a {taps}-tap conv of {d} "
                   f"channels over {n} nodes")
    if gates is not None:
        if ba_col is None or ba_col < d or ba_col + 2 * hv > width:
            bad.append(f"gates need the b | a columns ({2 * hv}) inside mixed's {width} after the conv's {d}, "
                       f"got ba_col={ba_col}")
        if any(a.shape != (hv,) for a in gates):
            bad.append(f"A_log / dt_bias {[a.shape for a in gates]} are not [{hv}]")
    if bad:
        raise ValueError("gdn_tree_prologue: " + "; ".join(bad))
    if impl == "xla":
        return reference(mixed, window, conv_w, conv_src, num_k_heads=hk, head_k_dim=dk, head_v_dim=dv,
                         out_dtype=out_dtype, gates=gates, ba_col=ba_col)
    problems = kernel_problems(n, hk, dk, hv, dv, taps)
    if problems:
        raise ValueError("gdn_tree_prologue: " + "; ".join(problems))
    rep = hv // hk
    v0 = 2 * hk  # first value channel block (dk-wide blocks; dk == dv)

    def chan(j, g):  # the channel block of (key head j, group g)
        return jnp.where(g == 0, j, jnp.where(g == 1, hk + j, v0 + j * rep + g - 2))

    blocks = ((0, n),) if (n & (n - 1)) == 0 else ((0, 1), (1, n - 1))
    x_spec = pl.BlockSpec((None, n, dk), lambda i, j, g: (i, 0, chan(j, g)))
    in_specs = [pl.BlockSpec((None, n, taps), lambda i, j, g: (i, 0, 0)),
                pl.BlockSpec((taps, dk), lambda i, j, g: (0, chan(j, g))),
                x_spec,
                pl.BlockSpec((None, taps - 1, dk), lambda i, j, g: (i, 0, chan(j, g)))]
    head = pl.BlockSpec((None, None, n, dk), lambda i, j, g: (i, j, 0, 0))
    v_head = pl.BlockSpec((None, None, n, dv), lambda i, j, g: (i, j * rep + jnp.maximum(g - 2, 0), 0, 0))
    out_shape = [jax.ShapeDtypeStruct((b, hk, n, dk), out_dtype), jax.ShapeDtypeStruct((b, hk, n, dk), out_dtype),
                 jax.ShapeDtypeStruct((b, hk, n, dk), jnp.float32), jax.ShapeDtypeStruct((b, hv, n, dv), out_dtype)]
    out_specs = [head, head, head, v_head]
    args = [conv_src.astype(jnp.int32), conv_w, mixed, window]
    if gates is not None:  # the whole row of the product (gate columns by index), A_log, dt_bias
        in_specs += [pl.BlockSpec((None, n, width), lambda i, j, g: (i, 0, 0)),
                     pl.BlockSpec((hv,), lambda i, j, g: (0,)), pl.BlockSpec((hv,), lambda i, j, g: (0,))]
        args += [mixed, *gates]
        gate_spec = pl.BlockSpec((None, None, n), lambda i, j, g: (i, j * rep + jnp.maximum(g - 2, 0), 0))
        out_specs += [gate_spec, gate_spec]
        out_shape += [jax.ShapeDtypeStruct((b, hv, n), jnp.float32)] * 2
    interpret = impl == "pallas_interpret"
    warps = num_warps or (8 if max(size for _, size in blocks) >= 32 else 4)
    params = {} if interpret else {"compiler_params": compiler_params(warps, 1)}
    out = pl.pallas_call(
        functools.partial(_prologue_kernel, taps=taps, blocks=blocks, scale=dk**-0.5, rep=rep, num_v_heads=hv,
                          ba_col=None if gates is None else ba_col),
        grid=(b, hk, 2 + rep), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, name="gdn_tree_prologue", **params,
    )(*args)
    q, k, k32, v = out[:4]
    return (q, k, v, k32, *out[4:])
