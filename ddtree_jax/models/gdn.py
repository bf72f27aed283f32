"""Gated DeltaNet token mixer (Qwen3.5 / Qwen3.6 / Qwen3-Next linear-attention layers).

The input projections are held as one [hidden, conv_dim + value_dim + 2 Hv] weight
(`in_proj_qkvzba`, columns qkv | z | b | a; the converters join HF's separate or Qwen3-Next's
grouped projections into it: docs/decisions/0005-merged-projection-layouts.md). Prefill uses the
chunked form, single-token steps the recurrence; both are pure functions of (params, inputs,
RecurrentCache). The math: pallas_kernels/ref/delta_rule.py; the tree-state contract:
docs/tree_state.md.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import RecurrentCache
from ddtree_jax.config import TargetConfig
from ddtree_jax.models.layers import GatedRMSNorm, Linear
from ddtree_jax.models.mixer import Step
from ddtree_jax.routes import REFERENCE, Routes
from ddtree_jax.tree import TreeGeometry
from pallas_kernels import gdn_decode, gdn_tree_prologue
from pallas_kernels.gdn_commit import gdn_path_commit
from pallas_kernels.gdn_tree import gdn_tree_verify
from pallas_kernels.ref import delta_rule
from pallas_kernels.ref.conv import causal_conv, next_window, tree_conv
from pallas_kernels.ref.delta_rule import gate_values, split_heads
from pallas_kernels.row_product import NormedRow


class RecurrentPending(NamedTuple):
    """Per-node inputs a GDN commit needs to replay an accepted path (never per-node states)."""

    conv_in: jax.Array  # [B, N, >= conv_dim] conv inputs of every node (first conv_dim columns)
    k: jax.Array  # [B, H or Hk, N, dk] float32 (per key head: value head j reads j // (H // Hk))
    v: jax.Array  # [B, H, N, dv] float32, or the model dtype where v was rounded to it
    g: jax.Array  # [B, H, N]
    beta: jax.Array  # [B, H, N]


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        h, hv = cfg.hidden_size, cfg.gdn_num_v_heads
        self.in_proj_qkvzba = Linear(h, cfg.gdn_conv_dim + cfg.gdn_value_dim + 2 * hv, dtype=dtype, rngs=rngs)
        k = cfg.conv_kernel
        self.conv_weight = nnx.Param(
            (jax.random.normal(rngs.params(), (k, cfg.gdn_conv_dim)) * k**-0.5).astype(dtype)
        )
        self.dt_bias = nnx.Param(jnp.ones((hv,), dtype))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), minval=1.0, maxval=16.0)).astype(dtype))
        self.norm = GatedRMSNorm(cfg.gdn_v_head_dim, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.out_proj = Linear(cfg.gdn_value_dim, h, dtype=dtype, rngs=rngs)

    # ---- pieces shared by every entry point ------------------------------------------
    def split_product(self, whole: jax.Array, wide_conv_in: bool = False):
        """(conv inputs, flat z, b | a) of the qkv | z | b | a product. wide_conv_in: the conv
        inputs keep the columns after the first conv_dim (the whole product, for a consumer that
        reads only its channel blocks: no slice copy)."""
        c, vd = self.cfg.gdn_conv_dim, self.cfg.gdn_value_dim
        return (whole if wide_conv_in else whole[..., :c]), whole[..., c : c + vd], whole[..., c + vd :]

    def project(self, x: jax.Array, routes: Routes = REFERENCE, wide_conv_in: bool = False):
        """Conv inputs [B,T,conv_dim] (wide_conv_in: see split_product), gate z [B,T,Hv,dv], beta and
        g [B,T,Hv] (float32)."""
        cfg = self.cfg
        b, t, _ = x.shape
        mixed, z, ba = self.split_product(self.in_proj_qkvzba(x, routes), wide_conv_in)
        hv = cfg.gdn_num_v_heads
        beta, g = gate_values(ba[..., hv:], ba[..., :hv], self.A_log[...], self.dt_bias[...])
        return mixed, z.reshape(b, t, hv, cfg.gdn_v_head_dim), beta, g

    def heads(self, conv_out: jax.Array):
        """Split activated conv outputs into float32 q (normed, scaled), k (normed), v, heads-first."""
        cfg = self.cfg
        q, k, v = split_heads(conv_out, cfg.gdn_num_k_heads, cfg.gdn_k_head_dim, cfg.gdn_num_v_heads,
                              cfg.gdn_v_head_dim)
        to_heads = lambda a: jnp.swapaxes(a, 1, 2)
        return to_heads(q), to_heads(k), to_heads(v)

    def output(self, o: jax.Array, z: jax.Array, dtype, routes: Routes = REFERENCE) -> jax.Array:
        """o [B,H,T,dv] float32 -> projected output [B,T,hidden]."""
        o = jnp.swapaxes(o, 1, 2).astype(dtype)
        y = self.norm(o, z)
        return self.out_proj(y.reshape(*y.shape[:2], -1), routes)

    # ---- append tokens to the committed state -----------------------------------------
    def append(self, x: jax.Array, cache: RecurrentCache, step: Step, routes: Routes = REFERENCE
               ) -> tuple[jax.Array, RecurrentCache]:
        """Consume the first step.n_valid[b] of T tokens; later (padding) tokens leave the state alone.

        With kernels on, a single-token step (decoding) runs its conv, norms, recurrent step, gated
        norm and window slide as one kernel between the projections (routes.gdn_decode_kernel;
        pallas_kernels/gdn_decode.py); a layer shape the kernel cannot take is announced by a
        warning when traced and runs the XLA form."""
        t, n_valid, chunked = x.shape[1], step.n_valid, step.chunked
        if routes.kernels and routes.gdn_decode_kernel and t == 1 and not chunked and self._decode_kernel_takes(x):
            return self._decode_kernel(x, cache, n_valid, routes)
        mixed, z, beta, g = self.project(x, routes)
        conv_out = jax.nn.silu(causal_conv(mixed, cache.conv, self.conv_weight[...]))
        q, k, v = self.heads(conv_out.astype(x.dtype))
        valid = (jnp.arange(t)[None, :] < n_valid[:, None])[:, None, :]
        beta = jnp.where(valid, jnp.swapaxes(beta, 1, 2), 0.0)
        g = jnp.where(valid, jnp.swapaxes(g, 1, 2), 0.0)
        if chunked:
            o, state = delta_rule.chunked(q, k, v, g, beta, cache.state)
        else:
            o, state = delta_rule.recurrent(q, k, v, g, beta, cache.state)
        new_cache = RecurrentCache(conv=next_window(mixed, cache.conv, n_valid), state=state)
        return self.output(o, z, x.dtype, routes), new_cache

    def _decode_kernel_takes(self, x: jax.Array) -> bool:
        """Whether the decode kernel takes this layer's shape; if not, say why (a warning when traced)."""
        cfg = self.cfg
        problems = gdn_decode.kernel_problems(cfg.gdn_conv_dim, cfg.gdn_num_k_heads, cfg.gdn_num_v_heads,
                                              cfg.gdn_k_head_dim, cfg.gdn_v_head_dim, self.conv_weight.shape[0],
                                              x.shape[-1])
        if problems:
            warnings.warn("the GDN decode step uses the XLA form, not the Pallas kernel: " + "; ".join(problems),
                          stacklevel=4)
        return not problems

    def _decode_kernel(self, x: jax.Array, cache: RecurrentCache, n_valid, routes: Routes):
        """One token through the layer with the core as one kernel, which reads the conv inputs, z
        and the b / a products from the one qkv | z | b | a product in place."""
        cfg = self.cfg
        y, state, window = gdn_decode.gdn_decode_packed(
            self.in_proj_qkvzba(x, routes)[:, 0], self.A_log[...], self.dt_bias[...], cache.conv,
            self.conv_weight[...], cache.state, self.norm.weight[...], n_valid, num_k_heads=cfg.gdn_num_k_heads,
            head_v_dim=cfg.gdn_v_head_dim, eps=self.norm.eps, impl=routes.impl,
            dv_split=gdn_decode.fitting_split(x.shape[0], cfg.gdn_num_v_heads, cfg.gdn_v_head_dim,
                                              routes.gdn_decode_dv_split, per_sm=routes.gdn_decode_programs_per_sm),
            defer_norm=routes.gdn_norm_into_out_proj)
        b = x.shape[0]
        if isinstance(y, NormedRow):  # the out projection norms it (models.layers.Linear)
            y = y._replace(x=y.x.reshape(b, 1, -1), squares=y.squares.reshape(b, 1, *y.squares.shape[1:]),
                           gate=y.gate.reshape(b, 1, -1))
        else:
            y = y.reshape(b, 1, -1)
        return self.out_proj(y, routes), RecurrentCache(conv=window, state=state)

    # ---- speculative entry points -------------------------------------------------------
    def tree(self, x, cache: RecurrentCache, geo: TreeGeometry, start=None, routes: Routes = REFERENCE
             ) -> tuple[jax.Array, RecurrentPending]:
        """Outputs of N nodes x [B, N, H], each from its own root-to-node path. Writes nothing.

        geo.visible [B, N, N]: ancestor-or-self. geo.conv_src [B, N, K] (tree.geometry) gathers each
        node's conv window from its ancestors and the committed window; None means a chain
        (node i's parent is i - 1: linear DFlash), its conv computed with the plain causal form.
        With kernels on, the conv .. casts and the gates of a tree or a chain run as one kernel
        (routes.gdn_tree_prologue_kernel), and the nodes through the fused tree delta-rule kernel
        (path sums from the ancestor bits, no per-node state anywhere).
        """
        visible, conv_src, bits = geo.visible, geo.conv_src, geo.bits
        if routes.kernels and routes.gdn_tree_prologue_kernel and self._prologue_takes(x):
            return self._tree_prologue_kernel(x, cache, conv_src, bits, routes)
        mixed, z, beta, g = self.project(x, routes)
        beta, g = jnp.swapaxes(beta, 1, 2), jnp.swapaxes(g, 1, 2)
        w = self.conv_weight[...]
        conv = causal_conv(mixed, cache.conv, w) if conv_src is None else tree_conv(mixed, cache.conv, w, conv_src)
        q, k, v = self.heads(jax.nn.silu(conv).astype(x.dtype))
        pending = RecurrentPending(mixed, k, v, g, beta)
        if routes.kernels:  # trees and chains (linear DFlash): a chain is a tree of depth N - 1
            # 16-bit models hand the kernel q / k / v in the model dtype (its loads halve and its
            # float32 products run as one-pass TF32, below the bf16 rounding of o:
            # docs/decisions/0020-gdn-tree-root-peel-bf16-inputs.md); the state stays exact: the
            # commit replays the float32 k / v.
            lo = (lambda a: a.astype(x.dtype)) if x.dtype in (jnp.bfloat16, jnp.float16) else (lambda a: a)
            o = gdn_tree_verify(lo(q), lo(k), lo(v), g, beta, cache.state, bits, impl=routes.impl,
                                masked_rows=None if routes.gdn_tree_masked_rows else False)
            return self.output(o, z, x.dtype, routes), pending
        if conv_src is None:
            path_g = jnp.cumsum(g, axis=-1)
        else:
            path_g = jnp.einsum("bij,bhj->bhi", visible.astype(jnp.float32), g, precision=delta_rule.HIGHEST)
        o, _ = delta_rule.block(q, k, v, path_g, beta, cache.state, visible)
        return self.output(o, z, x.dtype, routes), pending

    def _tree_prologue_kernel(self, x, cache: RecurrentCache, conv_src, bits, routes: Routes):
        """The tree pass with the prologue kernel: it reads the conv channels and the b | a columns
        of the whole qkv | z | b | a product in place and writes q / k / v for the tree kernel, the
        float32 k per key head and the gates for the commit (v in the model dtype: exact, v is
        rounded to it before the float32 cast)."""
        cfg = self.cfg
        w = self.conv_weight[...]
        mixed, z, _ = self.split_product(self.in_proj_qkvzba(x, routes), wide_conv_in=True)
        z = z.reshape(*x.shape[:2], cfg.gdn_num_v_heads, cfg.gdn_v_head_dim)
        if conv_src is None:  # a chain: node i's m-th tap is node i - m, or the window before node 0
            taps, n = w.shape[0], x.shape[1]
            chain = (taps - 1) + jnp.arange(n, dtype=jnp.int32)[:, None] - jnp.arange(taps, dtype=jnp.int32)[None]
            conv_src = jnp.broadcast_to(chain, (x.shape[0], n, taps))
        q, k, v, k32, g, beta = gdn_tree_prologue.gdn_tree_prologue(
            mixed, cache.conv, w, conv_src, num_k_heads=cfg.gdn_num_k_heads, head_k_dim=cfg.gdn_k_head_dim,
            head_v_dim=cfg.gdn_v_head_dim, out_dtype=x.dtype, impl=routes.impl,
            gates=(self.A_log[...], self.dt_bias[...]), ba_col=cfg.gdn_conv_dim + cfg.gdn_value_dim)
        o = gdn_tree_verify(q, k, v, g, beta, cache.state, bits, impl=routes.impl,
                            masked_rows=None if routes.gdn_tree_masked_rows else False)
        return self.output(o, z, x.dtype, routes), RecurrentPending(mixed, k32, v, g, beta)

    def _prologue_takes(self, x: jax.Array) -> bool:
        """Whether the prologue kernel takes this tree's shape; if not, say why (a warning when traced)."""
        cfg = self.cfg
        problems = gdn_tree_prologue.kernel_problems(x.shape[1], cfg.gdn_num_k_heads, cfg.gdn_k_head_dim,
                                                     cfg.gdn_num_v_heads, cfg.gdn_v_head_dim,
                                                     self.conv_weight.shape[0])
        if problems:
            warnings.warn("the GDN tree prologue uses the XLA form, not the Pallas kernel: " + "; ".join(problems),
                          stacklevel=4)
        return not problems

    @staticmethod
    def commit(pending: RecurrentPending, path, count, cache: RecurrentCache, start=None, routes: Routes = REFERENCE
               ) -> RecurrentCache:
        """State after the accepted path (path [B, P], first count[b] real): a scan from the
        committed state over the path's nodes, and the conv window slid over their inputs.
        With kernels on, the fused path-commit kernel (one launch, all heads, the conv window slid
        in the same launch; state and window in place)."""
        if routes.kernels:
            state, window = gdn_path_commit(pending.k, pending.v, pending.g, pending.beta, cache.state, path, count,
                                            window=cache.conv, conv_in=pending.conv_in, impl=routes.impl)
            return RecurrentCache(conv=window, state=state)
        conv_in = jnp.take_along_axis(pending.conv_in, path[:, :, None], axis=1)[..., : cache.conv.shape[-1]]
        window = next_window(conv_in, cache.conv, count)
        p, h = path.shape[1], pending.v.shape[1]
        on = (jnp.arange(p)[None, :] < count[:, None])[:, None, :]
        take = lambda a: jnp.take_along_axis(jnp.repeat(a, h // a.shape[1], axis=1), path[:, None, :, None], axis=2)
        take1 = lambda a: jnp.where(on, jnp.take_along_axis(a, path[:, None, :], axis=2), 0.0)
        state = delta_rule.path_state(take(pending.k), take(pending.v), take1(pending.g), take1(pending.beta),
                                      cache.state)
        return RecurrentCache(conv=window, state=state)
