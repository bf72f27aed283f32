"""Commit of the Gated DeltaNet state after acceptance: the committed state advanced along the
accepted path (Pallas / Triton kernel + its pure-jnp reference).

The state after feeding the accepted nodes path[b, :count[b]] one by one (per value head):
    S <- exp(g) S ;  u = beta (v - S^T k) ;  S <- S + k u^T
Kernel: one program per (batch, value head, dv tile) for all heads in one launch; the state
tile stays on chip for the whole path (read once, written once, float32); each step gathers
its node's k row (from key head h // (H // Hk)), v tile, g and beta straight from the tree's
pending inputs (no gather pass in XLA); a dynamic-length loop runs exactly count[b] steps.
The recurrence is element-wise (no matmul), so it has no 16-wide minimum: dv tiles of 8 keep
many programs in flight, which is what a bandwidth-bound 16-step scan needs.

With `window` and `conv_in` the same launch also slides the conv window: the last K - 1 rows of
[window ; conv_in[path[:count]]] (models/conv.next_window), in place. Inside the generation loop
XLA's form of that slide was a fusion plus a copy into the loop-carried window per GDN layer.
The window's channels go in blocks of `wb` (a power of two dividing conv_dim, <= 128) to programs
of their own after the state programs (the grid is (batch, state programs + window blocks)): a
window block costs two dependent loads (path, then a node's row), which lengthened the state
programs (docs/decisions/0022-gdn-path-commit-in-place.md). Each window
program reads the K - 1 rows it needs (a window row or a path node's conv input, chosen per row)
before it writes any.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.ref import delta_rule
from pallas_kernels.ref.conv import next_window

try:
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None

from pallas_kernels._common import check_impl, expand_heads  # noqa: E402




def reference(k, v, g, beta, state, path, count, *, window=None, conv_in=None):
    """gdn_path_commit's XLA form: gather the path's inputs, mask steps >= count, and scan
    (delta_rule.path_state); with window / conv_in also the slid conv window."""
    if window is not None:
        return reference(k, v, g, beta, state, path, count), _window_reference(window, conv_in, path, count)
    b, h, n, _ = v.shape
    p = path.shape[1]
    path = jnp.clip(path.astype(jnp.int32), 0, n - 1)
    on = (jnp.arange(p)[None, :] < count[:, None])[:, None, :]
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    take = lambda a: jnp.take_along_axis(f32(a), path[:, None, :, None], axis=2)
    take1 = lambda a: jnp.where(on, jnp.take_along_axis(f32(a), path[:, None, :], axis=2), 0.0)
    k = expand_heads(k, h)
    return delta_rule.path_state(take(k), take(v), take1(g), take1(beta), f32(state))


def _window_reference(window, conv_in, path, count):
    """Conv window [B, K - 1, C] after the accepted path's conv inputs conv_in [B, N, >= C]."""

    n = conv_in.shape[1]
    rows = jnp.take_along_axis(conv_in, jnp.clip(path, 0, n - 1)[:, :, None], axis=1)[..., : window.shape[-1]]
    return next_window(rows, window, count)


def _window_block(c: int) -> int:
    wb = 1
    while wb < 128 and c % (2 * wb) == 0:
        wb *= 2
    return wb


def _commit_kernel(path_ref, count_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, *refs, n, p, programs, window):
    b = pl.program_id(0)
    j = pl.program_id(1)
    f32 = jnp.float32
    steps = jnp.clip(count_ref[b], 0, p)
    o_ref = refs[-2] if window else refs[-1]

    def step(t, s):
        node = jnp.clip(path_ref[b, t], 0, n - 1)
        k_t = k_ref[node, :].astype(f32)  # [dk]
        v_t = v_ref[node, :].astype(f32)  # [dv_tile]
        s = s * jnp.exp(g_ref[node])
        u = beta_ref[node] * (v_t - jnp.sum(s * k_t[:, None], axis=0))
        return s + k_t[:, None] * u[None, :]

    @pl.when(j < programs)
    def _():
        o_ref[...] = lax.fori_loop(0, steps, step, s_ref[...].astype(f32))

    if window:  # programs >= `programs` slide one channel block of the conv window each
        x_ref, w_ref, _, wo_ref = refs
        keep = window

        @pl.when(j >= programs)
        def _():
            rows = []
            for r in range(keep):  # row r of the new window: position steps + r of [window ; path]
                pos = steps + r
                node = jnp.clip(path_ref[b, jnp.clip(pos - keep, 0, p - 1)], 0, n - 1)
                old = w_ref[jnp.clip(pos, 0, keep - 1), :]
                rows.append(jnp.where(pos < keep, old, x_ref[node, :].astype(old.dtype)))
            for r in range(keep):  # every read above happens before the first write (in place)
                wo_ref[r, :] = rows[r]


def _pallas(k, v, g, beta, state, path, count, window, conv_in, *, interpret, block_dv, num_warps, num_stages):
    b, h, n, dv = v.shape
    hk, dk = k.shape[1], k.shape[3]
    if h % hk:
        raise ValueError(f"{h} value heads do not divide into {hk} key heads")
    rep = h // hk
    p = path.shape[1]
    for name, d in (("dk", dk), ("dv", dv)):
        if d & (d - 1):
            raise ValueError(f"{name}={d} must be a power of two for the Pallas commit")
    bdv = min(dv, block_dv or 16)
    if bdv & (bdv - 1) or dv % bdv:
        raise ValueError(f"block_dv={bdv} must be a power of two dividing dv={dv}")
    params = {}
    if pltriton is not None and not interpret:
        params["compiler_params"] = pltriton.CompilerParams(num_warps=num_warps or 1, num_stages=num_stages)
    tiles = dv // bdv
    programs = h * tiles  # state programs: (value head, dv tile), flattened; window programs follow
    head = lambda j: jnp.minimum(j, programs - 1) // tiles
    tile = lambda j: jnp.minimum(j, programs - 1) % tiles
    in_specs = [
        pl.BlockSpec((b, p), lambda i, j: (0, 0)),
        pl.BlockSpec((b,), lambda i, j: (0,)),
        pl.BlockSpec((None, None, n, dk), lambda i, j: (i, head(j) // rep, 0, 0)),
        pl.BlockSpec((None, None, n, bdv), lambda i, j: (i, head(j), 0, tile(j))),
        pl.BlockSpec((None, None, n), lambda i, j: (i, head(j), 0)),
        pl.BlockSpec((None, None, n), lambda i, j: (i, head(j), 0)),
        pl.BlockSpec((None, None, dk, bdv), lambda i, j: (i, head(j), 0, tile(j))),
    ]
    state_spec = pl.BlockSpec((None, None, dk, bdv), lambda i, j: (i, head(j), 0, tile(j)))
    args = [path.astype(jnp.int32), count.astype(jnp.int32), k, v, g.astype(jnp.float32), beta.astype(jnp.float32),
            state.astype(jnp.float32)]
    # in place: each program reads its state tile whole before it writes the same tile. Inside the
    # generation loop a fresh output cost a 3 MB copy into the carried buffer per layer
    aliases = {6: 0}
    out_specs = state_spec
    out_shape = jax.ShapeDtypeStruct(state.shape, jnp.float32)
    blocks = 0
    if window is not None:
        keep, c = window.shape[1], window.shape[2]
        wb = _window_block(c)
        blocks = c // wb
        blk = lambda i, j: (i, 0, jnp.clip(j - programs, 0, blocks - 1))
        in_specs += [pl.BlockSpec((None, n, wb), blk), pl.BlockSpec((None, keep, wb), blk)]
        args += [conv_in, window]
        aliases[8] = 1
        out_specs = [state_spec, pl.BlockSpec((None, keep, wb), blk)]
        out_shape = [out_shape, jax.ShapeDtypeStruct(window.shape, window.dtype)]
    kernel = functools.partial(_commit_kernel, n=n, p=p, programs=programs,
                               window=window.shape[1] if window is not None else 0)
    return pl.pallas_call(
        kernel,
        grid=(b, programs + blocks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        name="gdn_path_commit",
        **params,
    )(*args)


def gdn_path_commit(
    k,
    v,
    g,
    beta,
    state,
    path,
    count,
    *,
    window=None,
    conv_in=None,
    impl: str = "xla",
    block_dv: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 1,
):
    """New state [B, H, dk, dv] float32: `state` advanced along path[b, :count[b]]; with the conv
    window [B, K - 1, C] and the nodes' conv inputs conv_in [B, N, >= C] (first C columns read),
    (new state, new window), in the same launch (`reference`: the XLA form).

    k [B, Hk, N, dk] (l2-normed; Hk divides H, value head j reads key head j // (H // Hk));
    v [B, H, N, dv]; g, beta [B, H, N] per node; state [B, H, dk, dv] float32; path [B, P]
    node indices (root first; entries at or beyond count are ignored); count [B] in 0..P.
    k, v bf16 or float32; the recurrence runs in float32 with the arithmetic of
    delta_rule.recurrent_step, so the result equals sequential decoding of the accepted tokens.
    Pallas options: block_dv (dv tile per program, power of two, default 16), num_warps
    (default 1), num_stages. dk and dv must be powers of two for the kernel.
    """
    if (window is None) != (conv_in is None):
        raise ValueError("gdn_path_commit: pass both window and conv_in, or neither")
    if window is not None and (window.shape[0] != v.shape[0] or conv_in.shape[:2] != v.shape[:1] + v.shape[2:3]
                               or conv_in.shape[2] < window.shape[2]):
        raise ValueError(f"gdn_path_commit: window {window.shape} and conv_in {conv_in.shape} do not fit "
                         f"{v.shape[0]} sequences of {v.shape[2]} nodes")
    if impl == "xla":
        return reference(k, v, g, beta, state, path, count, window=window, conv_in=conv_in)
    check_impl(impl)
    out = _pallas(
        k, v, g, beta, state, path, count, window, conv_in, interpret=impl == "pallas_interpret",
        block_dv=block_dv, num_warps=num_warps, num_stages=num_stages,
    )
    return tuple(out) if window is not None else out
