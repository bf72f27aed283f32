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

The conv window commit stays in XLA (models/conv.next_window): a [B, K-1, conv_dim] gather of
a few columns, far below a kernel launch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ddtree_jax.models import delta_rule

try:
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None

from pallas_kernels._common import check_impl, expand_heads  # noqa: E402




def reference(k, v, g, beta, state, path, count):
    """Gather the path's inputs, mask steps >= count, and scan (delta_rule.path_state)."""
    b, h, n, _ = v.shape
    p = path.shape[1]
    path = jnp.clip(path.astype(jnp.int32), 0, n - 1)
    on = (jnp.arange(p)[None, :] < count[:, None])[:, None, :]
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    take = lambda a: jnp.take_along_axis(f32(a), path[:, None, :, None], axis=2)
    take1 = lambda a: jnp.where(on, jnp.take_along_axis(f32(a), path[:, None, :], axis=2), 0.0)
    k = expand_heads(k, h)
    return delta_rule.path_state(take(k), take(v), take1(g), take1(beta), f32(state))


def _commit_kernel(path_ref, count_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, *, n, p):
    b = pl.program_id(0)
    f32 = jnp.float32
    steps = jnp.clip(count_ref[b], 0, p)

    def step(t, s):
        node = jnp.clip(path_ref[b, t], 0, n - 1)
        k_t = k_ref[node, :].astype(f32)  # [dk]
        v_t = v_ref[node, :].astype(f32)  # [dv_tile]
        s = s * jnp.exp(g_ref[node])
        u = beta_ref[node] * (v_t - jnp.sum(s * k_t[:, None], axis=0))
        return s + k_t[:, None] * u[None, :]

    o_ref[...] = lax.fori_loop(0, steps, step, s_ref[...].astype(f32))


def _pallas(k, v, g, beta, state, path, count, *, interpret, block_dv, num_warps, num_stages):
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
    kernel = functools.partial(_commit_kernel, n=n, p=p)
    return pl.pallas_call(
        kernel,
        grid=(b, h, dv // bdv),
        in_specs=[
            pl.BlockSpec((b, p), lambda i, j, t: (0, 0)),
            pl.BlockSpec((b,), lambda i, j, t: (0,)),
            pl.BlockSpec((None, None, n, dk), lambda i, j, t: (i, j // rep, 0, 0)),
            pl.BlockSpec((None, None, n, bdv), lambda i, j, t: (i, j, 0, t)),
            pl.BlockSpec((None, None, n), lambda i, j, t: (i, j, 0)),
            pl.BlockSpec((None, None, n), lambda i, j, t: (i, j, 0)),
            pl.BlockSpec((None, None, dk, bdv), lambda i, j, t: (i, j, 0, t)),
        ],
        out_specs=pl.BlockSpec((None, None, dk, bdv), lambda i, j, t: (i, j, 0, t)),
        out_shape=jax.ShapeDtypeStruct(state.shape, jnp.float32),
        # in place: each program reads its state tile whole before it writes the same tile. Inside
        # the generation loop a fresh output cost a 3 MB copy into the carried buffer per layer
        # (48 of the 27B DDTree step's memcpy kernels, 2026-11-30 session 12)
        input_output_aliases={6: 0},
        interpret=interpret,
        name="gdn_path_commit",
        **params,
    )(path.astype(jnp.int32), count.astype(jnp.int32), k, v, g.astype(jnp.float32),
      beta.astype(jnp.float32), state.astype(jnp.float32))


def gdn_path_commit(
    k,
    v,
    g,
    beta,
    state,
    path,
    count,
    *,
    impl: str = "xla",
    block_dv: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 1,
):
    """New state [B, H, dk, dv] float32: `state` advanced along path[b, :count[b]].

    k [B, Hk, N, dk] (l2-normed; Hk divides H, value head j reads key head j // (H // Hk));
    v [B, H, N, dv]; g, beta [B, H, N] per node; state [B, H, dk, dv] float32; path [B, P]
    node indices (root first; entries at or beyond count are ignored); count [B] in 0..P.
    k, v bf16 or float32; the recurrence runs in float32 with the arithmetic of
    delta_rule.recurrent_step, so the result equals sequential decoding of the accepted tokens.
    Pallas options: block_dv (dv tile per program, power of two, default 16), num_warps
    (default 1), num_stages. dk and dv must be powers of two for the kernel.
    """
    if impl == "xla":
        return reference(k, v, g, beta, state, path, count)
    check_impl(impl)
    return _pallas(
        k, v, g, beta, state, path, count, interpret=impl == "pallas_interpret",
        block_dv=block_dv, num_warps=num_warps, num_stages=num_stages,
    )
