"""Mamba2 token mixer (Mamba2ForCausalLM, Bamba and NemotronH "linear_attention" layers).

Same interface as the Gated DeltaNet mixer (ddtree_jax/models/gdn.py):
    append(x, cache, step)                 append tokens: chunked SSD prefill or one-token steps
    tree(x, cache, geo, start)             outputs of every draft node from its own path; writes nothing
    commit(pending, path, count, cache)    scan along the accepted path from the old state
`pending` holds per-node INPUTS (conv inputs, x, B, dt), never per-node states.

One token (x already through the block norm):
    z, xBC, dt = split(in_proj(x), [I, I + 2 G N, H])
    xBC = silu(conv_K(xBC) + conv_bias);  xs, B, C = split(xBC, [I, G N, G N])
    dt = clip(softplus(dt + dt_bias), lo, hi);  A = -exp(A_log)
    h = h exp(dt A) + dt xs B^T;  y = h C + D xs            (pallas_kernels/ref/ssd.py)
    y = grouped_rmsnorm(y * silu(z)) * w;  out_proj(y)     (gate before the norm, G groups)

The dt clamp rule (one function on every path). HF clamps dt to `time_step_limit` in its
chunked prefill (`mamba2_chunk_scan`) but not in its one-token decode
(`mamba2_selective_state_update`). For Mamba2 and Bamba the default limit (0, inf) is a no-op, so
the two agree; NemotronH forces (time_step_min, inf), so HF's own cached decode drifts from its
full forward whenever softplus(dt + dt_bias) < time_step_min. A speculative engine must compute
the SAME function in prefill, decode and tree verify, so here dt is ALWAYS clipped to
`cfg.mamba_dt_limit` (HF's chunked/full-forward rule, the one the models were trained with by
mamba_ssm's chunked kernels) in `project`, which every entry point shares; pending holds the
clipped dt, so commits replay exactly the same values.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import RecurrentCache
from ddtree_jax.config import TargetConfig
from ddtree_jax.models.layers import Linear
from ddtree_jax.models.mixer import Step
from ddtree_jax.routes import REFERENCE, Routes
from ddtree_jax.tree import TreeGeometry
from pallas_kernels.mamba2_decode import fitting_split, mamba2_decode
from pallas_kernels.ref import ssd
from pallas_kernels.ref.conv import causal_conv, next_window, tree_conv
from pallas_kernels.ref.norms import rms_normalize
from pallas_kernels.ssd_tree import (commit_kernel_problems, ssd_path_commit, ssd_tree_verify,
                                     verify_kernel_problems)


class Mamba2Pending(NamedTuple):
    """Per-node inputs a Mamba2 commit needs to replay an accepted path (never per-node states)."""

    conv_in: jax.Array  # [B, N, conv_dim] conv inputs (pre-conv xBC) of every node
    x: jax.Array  # [B, N, H, P] float32 SSM inputs
    b: jax.Array  # [B, N, G, Ns] float32
    dt: jax.Array  # [B, N, H] float32, already softplus'ed and clipped


class GroupedGatedRMSNorm(nnx.Module):
    """HF MambaRMSNormGated: y * silu(z) in float32, RMS-normalised per group of I / G channels, * w."""

    def __init__(self, dim: int, groups: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.groups = groups
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:
        """y, z [..., I] -> float32 [..., I]."""
        h = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        shape = h.shape
        h = rms_normalize(h.reshape(*shape[:-1], self.groups, shape[-1] // self.groups), self.eps).reshape(shape)
        return self.weight[...].astype(jnp.float32) * h


class Mamba2Mixer(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        hid, nh, inter, cdim = cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_intermediate, cfg.mamba_conv_dim
        bias = cfg.mamba_proj_bias
        self.in_proj = Linear(hid, inter + cdim + nh, bias=bias, dtype=dtype, rngs=rngs)
        k = cfg.conv_kernel
        self.conv_weight = nnx.Param((jax.random.normal(rngs.params(), (k, cdim)) * k**-0.5).astype(dtype))
        self.conv_bias = nnx.Param(jnp.zeros((cdim,), dtype)) if cfg.mamba_conv_bias else None
        self.dt_bias = nnx.Param(jnp.ones((nh,), dtype))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, nh + 1, dtype=jnp.float32)).astype(dtype))
        self.D = nnx.Param(jnp.ones((nh,), dtype))
        self.norm = GroupedGatedRMSNorm(inter, cfg.mamba_n_groups, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.out_proj = Linear(inter, hid, bias=bias, dtype=dtype, rngs=rngs)

    # ---- pieces shared by every entry point ------------------------------------------
    def project(self, x: jax.Array, routes: Routes = REFERENCE):
        """Gate z [B,T,I], conv inputs xBC [B,T,conv_dim], dt [B,T,H] (float32, softplus'ed, clipped)."""
        cfg = self.cfg
        inter = cfg.mamba_intermediate
        zxbcdt = self.in_proj(x, routes)
        z, xbc, dt = zxbcdt[..., :inter], zxbcdt[..., inter:-cfg.mamba_num_heads], zxbcdt[..., -cfg.mamba_num_heads:]
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        lo, hi = cfg.mamba_dt_limit
        if lo > 0.0 or hi != float("inf"):
            dt = jnp.clip(dt, lo, hi)
        return z, xbc, dt

    def ssm_inputs(self, conv: jax.Array, dtype):
        """Activated conv outputs -> float32 x [B,T,H,P], B, C [B,T,G,N]."""
        cfg = self.cfg
        b, t, _ = conv.shape
        inter, gn = cfg.mamba_intermediate, cfg.mamba_n_groups * cfg.mamba_state_size
        act = jax.nn.silu(conv).astype(dtype).astype(jnp.float32)
        xs = act[..., :inter].reshape(b, t, cfg.mamba_num_heads, cfg.mamba_head_dim)
        bm = act[..., inter : inter + gn].reshape(b, t, cfg.mamba_n_groups, cfg.mamba_state_size)
        cm = act[..., inter + gn :].reshape(b, t, cfg.mamba_n_groups, cfg.mamba_state_size)
        return xs, bm, cm

    def constants(self):
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        return a, self.D[...].astype(jnp.float32)

    def output(self, y: jax.Array, z: jax.Array, dtype, routes: Routes = REFERENCE) -> jax.Array:
        """y [B,T,H,P] float32 -> projected output [B,T,hidden]."""
        y = self.norm(y.reshape(*y.shape[:2], -1), z)
        return self.out_proj(y.astype(dtype), routes)

    def _conv_bias(self):
        return None if self.conv_bias is None else self.conv_bias[...]

    # ---- append tokens to the committed state -----------------------------------------
    def append(self, x: jax.Array, cache: RecurrentCache, step: Step, routes: Routes = REFERENCE
               ) -> tuple[jax.Array, RecurrentCache]:
        """Consume the first step.n_valid[b] of T tokens; later (padding) tokens leave the state alone.

        With kernels on, a single-token step (decoding) runs its dt, conv, state update, gate and
        window slide as one kernel between the projections, the group norm as one fusion after it
        (routes.mamba2_decode_kernel; pallas_kernels/mamba2_decode.py)."""
        t, n_valid, chunked = x.shape[1], step.n_valid, step.chunked
        if routes.kernels and routes.mamba2_decode_kernel and t == 1 and not chunked:
            return self._decode_kernel(x, cache, n_valid, routes)
        z, xbc, dt = self.project(x, routes)
        conv = causal_conv(xbc, cache.conv, self.conv_weight[...], self._conv_bias())
        xs, bm, cm = self.ssm_inputs(conv, x.dtype)
        valid = jnp.arange(t)[None, :] < n_valid[:, None]
        dt = jnp.where(valid[..., None], dt, 0.0)
        a, d = self.constants()
        if chunked:
            y, state = ssd.chunked(xs, dt, a, bm, cm, d, cache.state, self.cfg.mamba_chunk_size)
        else:
            y, state = ssd.recurrent(xs, dt, a, bm, cm, d, cache.state)
        new_cache = RecurrentCache(conv=next_window(xbc, cache.conv, n_valid), state=state)
        return self.output(y, z, x.dtype, routes), new_cache

    def _decode_kernel(self, x: jax.Array, cache: RecurrentCache, n_valid, routes: Routes):
        """One token through the layer with the core as one kernel, which reads z, the conv inputs
        and dt from the input product in place."""
        cfg = self.cfg
        y, state, window = mamba2_decode(
            self.in_proj(x, routes)[:, 0], cache.conv, self.conv_weight[...], self._conv_bias(), self.dt_bias[...],
            self.A_log[...], self.D[...], cache.state, self.norm.weight[...], n_valid, num_heads=cfg.mamba_num_heads,
            groups=cfg.mamba_n_groups, eps=self.norm.eps, dt_limit=cfg.mamba_dt_limit, impl=routes.impl,
            p_split=fitting_split(x.shape[0], cfg.mamba_num_heads, cfg.mamba_head_dim, routes.mamba2_decode_p_split,
                                  per_sm=routes.mamba2_decode_programs_per_sm),
            norm_in_kernel=routes.mamba2_decode_norm_in_kernel)
        return self.out_proj(y[:, None], routes), RecurrentCache(conv=window, state=state)

    # ---- speculative entry points -------------------------------------------------------
    def tree(self, x, cache: RecurrentCache, geo: TreeGeometry, start=None, routes: Routes = REFERENCE
             ) -> tuple[jax.Array, Mamba2Pending]:
        """Outputs of N nodes x [B, N, H], each from its own root-to-node path. Writes nothing.

        geo.visible [B, N, N]: ancestor-or-self. geo.conv_src [B, N, K] (tree.geometry) gathers each
        node's conv window from its ancestors and the committed window; None means a chain
        (node i's parent is i - 1: linear DFlash), its conv computed with the plain causal form.
        With kernels on, trees and chains of up to routes.ssd_kernel_max_nodes nodes go through the
        SSD tree kernel (pallas_kernels/ssd_tree.py), which reads the compact ancestor `bits`
        [B, N, W] instead of `visible`; larger ones take the XLA form, which measured faster there
        (docs/decisions/0027-ssd-kernel-max-nodes.md), announced by a warning when traced.
        """
        visible, conv_src, bits = geo.visible, geo.conv_src, geo.bits
        z, xbc, dt = self.project(x, routes)
        w = self.conv_weight[...]
        if conv_src is None:
            conv = causal_conv(xbc, cache.conv, w, self._conv_bias())
        else:
            conv = tree_conv(xbc, cache.conv, w, conv_src, self._conv_bias())
        xs, bm, cm = self.ssm_inputs(conv, x.dtype)
        a, d = self.constants()
        cfg = self.cfg
        problems = verify_kernel_problems(cfg.mamba_head_dim, cfg.mamba_state_size,
                                          interpret=routes.impl == "pallas_interpret") if routes.kernels else []
        if x.shape[1] > routes.ssd_kernel_max_nodes:
            problems.append(f"{x.shape[1]} nodes, and routes.ssd_kernel_max_nodes is {routes.ssd_kernel_max_nodes}")
        use_kernel = routes.kernels and not problems
        if routes.kernels and problems:
            warnings.warn("Mamba2 tree verify uses the XLA form, not the Pallas SSD kernel: " + "; ".join(problems)
                          + " (the path-commit kernel is still used where it applies)", stacklevel=2)
        if use_kernel:  # trees and chains (linear DFlash)
            y = ssd_tree_verify(xs, dt, a, bm, cm, d, cache.state, bits, impl=routes.impl,
                                masked_rows=None if routes.ssd_tree_masked_rows else False)
        else:
            acs = ssd.path_sums(dt, a, None if conv_src is None else visible)
            y = ssd.block(xs, dt, a, bm, cm, d, cache.state, visible, acs)
        return self.output(y, z, x.dtype, routes), Mamba2Pending(xbc, xs, bm, dt)

    def commit(self, pending: Mamba2Pending, path, count, cache: RecurrentCache, start=None,
               routes: Routes = REFERENCE) -> RecurrentCache:
        """State after the accepted path (path [B, P], first count[b] real): a scan from the
        committed state over the path's nodes, and the conv window slid over their inputs.
        With kernels on, the fused path-commit kernel (state read and written once)."""
        take = lambda arr: jnp.take_along_axis(arr, path.reshape(*path.shape, *([1] * (arr.ndim - 2))), axis=1)
        window = next_window(take(pending.conv_in), cache.conv, count)
        a, _ = self.constants()
        problems = commit_kernel_problems(self.cfg.mamba_head_dim, self.cfg.mamba_state_size) if routes.kernels else []
        if problems:
            warnings.warn("Mamba2 path commit uses the XLA scan, not the Pallas kernel: " + "; ".join(problems),
                          stacklevel=2)
        if routes.kernels and not problems:
            state = ssd_path_commit(pending.x, pending.dt, a, pending.b, cache.state, path, count, impl=routes.impl)
            return RecurrentCache(conv=window, state=state)
        on = jnp.arange(path.shape[1])[None, :] < count[:, None]
        dt = jnp.where(on[..., None], take(pending.dt), 0.0)
        state = ssd.path_state(take(pending.x), dt, a, take(pending.b), cache.state)
        return RecurrentCache(conv=window, state=state)
