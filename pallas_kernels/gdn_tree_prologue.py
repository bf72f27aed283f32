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

Kernel: one program per (batch row, key head): its q and k channel blocks and the `rep` value
heads that read that key head. Taps are gather loads (`ref[idx, :]`: a row of the window or of the
nodes, selected by index). Pallas Triton needs power-of-two shapes for every value, so the nodes
run as one block when N is a power of two and as node 0 alone + a block of N - 1 when N - 1 is
(DDTree's root + 2^j drafts); other N are refused (`kernel_problems`).

impl="xla" is the reference, "pallas" the Triton kernel, "pallas_interpret" the same kernel in the
Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ddtree_jax.models.conv import tree_conv
from ddtree_jax.models.gdn import l2_normalize
from pallas_kernels._common import check_impl, compiler_params, is_pow2


def reference(mixed, window, conv_w, conv_src, *, num_k_heads: int, head_k_dim: int, head_v_dim: int,
              out_dtype):
    """(q, k, v in out_dtype, k float32): q, k [B, Hk, N, dk], v [B, Hv, N, dv] (module doc).

    mixed [B, N, D] (D = 2 Hk dk + Hv dv: q | k | v channels), window [B, K - 1, D], conv_w [K, D],
    conv_src [B, N, K] int32 (indices into [window ; mixed])."""
    b, n, d = mixed.shape
    act = jax.nn.silu(tree_conv(mixed, window, conv_w, conv_src)).astype(out_dtype).astype(jnp.float32)
    kd = num_k_heads * head_k_dim
    heads = lambda a, dim: jnp.swapaxes(a.reshape(b, n, -1, dim), 1, 2)
    q, k, v = heads(act[..., :kd], head_k_dim), heads(act[..., kd : 2 * kd], head_k_dim), heads(act[..., 2 * kd :], head_v_dim)
    k32 = l2_normalize(k)
    return (l2_normalize(q) * head_k_dim**-0.5).astype(out_dtype), k32.astype(out_dtype), v.astype(out_dtype), k32


def kernel_problems(n: int, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int,
                    taps: int = 4) -> list[str]:
    """Why the kernel cannot take this shape (empty: it can)."""
    out = [] if taps >= 2 else [f"a {taps}-tap conv has no window to read"]
    if not (is_pow2(n) or (n > 1 and is_pow2(n - 1))):
        out.append(f"{n} nodes: the kernel takes N or N - 1 a power of two")
    for name, v in (("key head dim", head_k_dim), ("value head dim", head_v_dim)):
        if not is_pow2(v):
            out.append(f"{name} {v} is not a power of two")
    if num_v_heads % num_k_heads:
        out.append(f"{num_v_heads} value heads do not divide into {num_k_heads} key heads")
    elif is_pow2(head_v_dim) and (2 * num_k_heads * head_k_dim) % head_v_dim:
        out.append(f"the value channels start at {2 * num_k_heads * head_k_dim}, not a multiple of {head_v_dim}")
    return out


def _prologue_kernel(*refs, taps: int, rep: int, blocks, scale: float):
    """One (batch row, key head): q, k and `rep` value channel blocks over the node blocks."""
    src_ref, w_q, w_k = refs[0], refs[1], refs[2]
    w_v = refs[3 : 3 + rep]
    x_q, x_k = refs[3 + rep], refs[4 + rep]
    x_v = refs[5 + rep : 5 + 2 * rep]
    win_q, win_k = refs[5 + 2 * rep], refs[6 + 2 * rep]
    win_v = refs[7 + 2 * rep : 7 + 3 * rep]
    q_out, k_out, k32_out, v_out = refs[7 + 3 * rep :]
    f32 = jnp.float32
    back = taps - 1  # window rows before node 0 in [window ; mixed]

    def act(x_ref, win_ref, w_ref, idx_of):
        """silu(conv) [size, C] of the block's nodes, rounded to the output dtype, as float32."""
        acc = None
        for m in range(taps):
            idx = idx_of(m)  # [size] indices into [window ; mixed]
            from_x = x_ref[jnp.maximum(idx - back, 0), :].astype(f32)
            from_w = win_ref[jnp.clip(idx, 0, back - 1), :].astype(f32)
            tap = jnp.where((idx >= back)[:, None], from_x, from_w) * w_ref[taps - 1 - m, :].astype(f32)[None, :]
            acc = tap if acc is None else acc + tap
        return jax.nn.silu(acc).astype(q_out.dtype).astype(f32)

    for start, size in blocks:
        rows = pl.ds(start, size)
        idx_of = lambda m, rows=rows: src_ref[rows, m]
        q = act(x_q, win_q, w_q, idx_of)
        k = act(x_k, win_k, w_k, idx_of)
        q_out[rows, :] = (l2_normalize(q) * scale).astype(q_out.dtype)
        k_n = l2_normalize(k)
        k_out[rows, :] = k_n.astype(k_out.dtype)
        k32_out[rows, :] = k_n
        for r in range(rep):
            v_out[r, rows, :] = act(x_v[r], win_v[r], w_v[r], idx_of).astype(v_out.dtype)


def gdn_tree_prologue(mixed, window, conv_w, conv_src, *, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                      out_dtype=None, impl: str = "xla", num_warps: int | None = None):
    """(q, k, v, k32) of a GDN tree verify: q, k [B, Hk, N, dk] and v [B, Hv, N, dv] in out_dtype
    (default: mixed's dtype) for `gdn_tree_verify`, and k [B, Hk, N, dk] float32 for the commit.
    Inputs as `reference`. impl "xla" | "pallas" | "pallas_interpret". num_warps (Triton): by
    default 8 for node blocks of 32 or more (offline sm_90 compile at the 27B layer, 65 nodes: 194
    registers and no spills at 8 warps; 255 and a 1.4 KB spill stack at 4), else 4."""
    check_impl(impl)
    out_dtype = jnp.dtype(out_dtype or mixed.dtype)
    b, n, d = mixed.shape
    hk, dk, dv = num_k_heads, head_k_dim, head_v_dim
    hv = (d - 2 * hk * dk) // dv
    if impl == "xla":
        return reference(mixed, window, conv_w, conv_src, num_k_heads=hk, head_k_dim=dk, head_v_dim=dv,
                         out_dtype=out_dtype)
    problems = kernel_problems(n, hk, dk, hv, dv, conv_w.shape[0])
    if problems:
        raise ValueError("gdn_tree_prologue: " + "; ".join(problems))
    taps = conv_w.shape[0]
    if window.shape[1] != taps - 1 or conv_src.shape != (b, n, taps):
        raise ValueError(f"window {window.shape} / conv_src {conv_src.shape} do not fit a {taps}-tap conv over {n} nodes")
    rep = hv // hk
    v0 = 2 * hk * dk // dv  # first value channel block (in dv-wide blocks)
    blocks = ((0, n),) if (n & (n - 1)) == 0 else ((0, 1), (1, n - 1))
    rows_chan = lambda rows, width, block: pl.BlockSpec((None, rows, width), lambda i, j, block=block: (i, 0, block(j)))
    w_chan = lambda width, block: pl.BlockSpec((taps, width), lambda i, j, block=block: (0, block(j)))
    q_blk, k_blk = (lambda j: j), (lambda j: hk + j)
    v_blk = [lambda j, r=r: v0 + j * rep + r for r in range(rep)]
    in_specs = ([pl.BlockSpec((None, n, taps), lambda i, j: (i, 0, 0)), w_chan(dk, q_blk), w_chan(dk, k_blk)]
                + [w_chan(dv, f) for f in v_blk]
                + [rows_chan(n, dk, q_blk), rows_chan(n, dk, k_blk)] + [rows_chan(n, dv, f) for f in v_blk]
                + [rows_chan(taps - 1, dk, q_blk), rows_chan(taps - 1, dk, k_blk)]
                + [rows_chan(taps - 1, dv, f) for f in v_blk])
    args = ([conv_src.astype(jnp.int32), conv_w, conv_w] + [conv_w] * rep + [mixed, mixed] + [mixed] * rep
            + [window, window] + [window] * rep)
    head = lambda width: pl.BlockSpec((None, None, n, width), lambda i, j: (i, j, 0, 0))
    out_specs = [head(dk), head(dk), head(dk), pl.BlockSpec((None, rep, n, dv), lambda i, j: (i, j, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, hk, n, dk), out_dtype), jax.ShapeDtypeStruct((b, hk, n, dk), out_dtype),
                 jax.ShapeDtypeStruct((b, hk, n, dk), jnp.float32), jax.ShapeDtypeStruct((b, hv, n, dv), out_dtype)]
    interpret = impl == "pallas_interpret"
    warps = num_warps or (8 if max(size for _, size in blocks) >= 32 else 4)
    params = {} if interpret else {"compiler_params": compiler_params(warps, 1)}
    q, k, k32, v = pl.pallas_call(
        functools.partial(_prologue_kernel, taps=taps, rep=rep, blocks=blocks, scale=dk**-0.5),
        grid=(b, hk), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, interpret=interpret,
        name="gdn_tree_prologue", **params,
    )(*args)
    return q, k, v, k32
