"""Gated DeltaNet token mixer (Qwen3.5 / Qwen3.6 / Qwen3-Next linear-attention layers).

Parameters follow the Qwen3.5 split layout (the converter reorders Qwen3-Next's fused
projections into it). Prefill uses the chunked form, single-token steps the recurrence;
both are pure functions of (params, inputs, RecurrentCache).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import RecurrentCache
from ddtree_jax.config import TargetConfig
from ddtree_jax.models import delta_rule
from ddtree_jax.models.conv import causal_conv, next_window, tree_conv
from ddtree_jax.models.layers import GatedRMSNorm, Linear, SplitKParts, unmerged_inputs


class RecurrentPending(NamedTuple):
    """Per-node inputs a GDN commit needs to replay an accepted path (never per-node states)."""

    conv_in: jax.Array  # [B, N, >= conv_dim] conv inputs of every node (first conv_dim columns)
    k: jax.Array  # [B, H or Hk, N, dk] float32 (per key head: value head j reads j // (H // Hk))
    v: jax.Array  # [B, H, N, dv] float32, or the model dtype where v was rounded to it
    g: jax.Array  # [B, H, N]
    beta: jax.Array  # [B, H, N]


# Single-token steps (decoding) with kernels on run the layer's core as one kernel
# (pallas_kernels/gdn_decode.py; 17.1 vs 21.4 us a 27B layer on the H200). False routes them to
# the XLA form: an A/B switch for measurements (`scripts/bench_e2e.py --override`).
DECODE_KERNEL = True
# Layout switches (on: measured together with models.layers.MERGED_GATE_UP, see there).
# MERGED_BA: GatedDeltaNet modules built while it is True hold the b and a projections as one
# [hidden, 2 Hv] weight (`in_proj_ba`, b columns first). XLA's dot merger joins the two separate
# ones in a verify by concatenating the weights every pass (48 launches of ~6.5 us a 27B step,
# docs/benchmarks.md section 1); stored merged there is nothing to concatenate.
MERGED_BA = True
# MERGED_QKV_Z: the qkv and z projections as one [hidden, conv_dim + value_dim] weight
# (`in_proj_qkv_z`, qkv columns first). A DDTree verify keeps separate weights apart
# (`unmerged_inputs`); stored merged they are one product: 44.6 us a 27B layer at 65 rows on the
# H200 against 32.4 + 19.8 for the two (session 8 profile). Decoding reads the same bytes either
# way (XLA merges the two GEMVs). Checkpoints in either layout load (converters/layout.py).
MERGED_QKV_Z = True
# MERGED_QKVZ_BA (the default since session 10): one [hidden, conv_dim + value_dim + 2 Hv] weight
# (`in_proj_qkvzba`, columns qkv | z | b | a) instead of the two above. The 27B verify spent 3.9 us
# a GDN layer on a separate b | a product and 1.9 us on its split-K reduce (session 9 profile) for
# 1 MB of weights. The decode kernel reads the conv inputs, z and the b / a products from the one
# product in place (`gdn_decode_packed`: no slice copies, no a / b weight slices or transposes).
# H200, 27B, batch 1, same session (docs/benchmarks.md section 1, session 10): decode 13.71 ->
# 13.22 ms, DDTree-64 19.35 -> 19.03 ms. Overrides the two switches above.
MERGED_QKVZ_BA = True


# With kernels on, a tree verify runs the conv over each node's path, SiLU, the head split, the
# q / k norms and the casts as one kernel (pallas_kernels/gdn_tree_prologue.py), reading the conv
# channels of the merged qkv | z product in place, instead of ~5 XLA fusions, a slice copy and a
# window concatenation a layer. H200, 27B layer, 65 nodes (session 9): 6.2 us a layer in the
# verify; isolated 9.2 us against 13.4 for the XLA form (batch 1), 26.7 vs 51.9 (batch 8).
# False keeps the XLA form (announced by a warning when traced).
TREE_PROLOGUE_KERNEL = True

# Opt-in (measured, lost): with the prologue kernel and the merged qkv | z | b | a product, a
# verify's product returns IN_PROJ_PARTS_SLICES float32 split-K partials (models.layers.SplitKParts)
# that the prologue kernel adds on load, so XLA's reduce after its own split-K GEMM goes away (4.5 us
# a 27B layer at 65 nodes, 0.22 ms a step); z's partials are added by XLA inside the gated norm's
# fusion. H200, session 14 (profile_step --phases loop, int8 drafter, one GPU): XLA kept the same
# GEMM for the explicit 2-slice product (2.21 ms), the reduces fell 0.35 -> 0.15 ms, but the
# prologue, reading two float32 partials where it read one bf16 product, went 0.31 -> 0.71 ms: the
# step's kernels 18.13 -> 18.35 ms; end to end 18.24 against 17.94 ms (docs/benchmarks.md).
# True: `--override ddtree_jax.models.gdn.IN_PROJ_PARTS=True`.
IN_PROJ_PARTS = False
IN_PROJ_PARTS_SLICES = 2


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gate_values(a: jax.Array, b: jax.Array, a_log: jax.Array, dt_bias: jax.Array):
    """(beta, g) float32 from the a / b projections (in the model dtype): beta = sigmoid(b),
    g = -exp(A_log) * softplus(a + dt_bias)."""
    beta = jax.nn.sigmoid(b).astype(jnp.float32)
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return beta, g


def split_heads(conv_out: jax.Array, num_k_heads: int, dk: int, num_v_heads: int, dv: int):
    """Activated conv outputs [..., conv_dim] -> float32 q (normed, scaled), k (normed) [..., Hv, dk]
    (v-head j reads k-head j // (Hv / Hk)) and v [..., Hv, dv]."""
    kd = num_k_heads * dk
    lead = conv_out.shape[:-1]
    q = conv_out[..., :kd].reshape(*lead, num_k_heads, dk)
    k = conv_out[..., kd : 2 * kd].reshape(*lead, num_k_heads, dk)
    v = conv_out[..., 2 * kd :].reshape(*lead, num_v_heads, dv)
    rep = num_v_heads // num_k_heads
    if rep > 1:
        q, k = jnp.repeat(q, rep, axis=-2), jnp.repeat(k, rep, axis=-2)
    q = l2_normalize(q.astype(jnp.float32)) * dk**-0.5
    k = l2_normalize(k.astype(jnp.float32))
    return q, k, v.astype(jnp.float32)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        h, hv = cfg.hidden_size, cfg.gdn_num_v_heads
        if MERGED_QKVZ_BA:
            self.in_proj_qkvzba = Linear(h, cfg.gdn_conv_dim + cfg.gdn_value_dim + 2 * hv, dtype=dtype, rngs=rngs)
        elif MERGED_QKV_Z:
            self.in_proj_qkv_z = Linear(h, cfg.gdn_conv_dim + cfg.gdn_value_dim, dtype=dtype, rngs=rngs)
        else:
            self.in_proj_qkv = Linear(h, cfg.gdn_conv_dim, dtype=dtype, rngs=rngs)
            self.in_proj_z = Linear(h, cfg.gdn_value_dim, dtype=dtype, rngs=rngs)
        if MERGED_BA and not MERGED_QKVZ_BA:
            self.in_proj_ba = Linear(h, 2 * hv, dtype=dtype, rngs=rngs)
        elif not MERGED_QKVZ_BA:
            self.in_proj_b = Linear(h, hv, dtype=dtype, rngs=rngs)
            self.in_proj_a = Linear(h, hv, dtype=dtype, rngs=rngs)
        k = cfg.conv_kernel
        self.conv_weight = nnx.Param(
            (jax.random.normal(rngs.params(), (k, cfg.gdn_conv_dim)) * k**-0.5).astype(dtype)
        )
        self.dt_bias = nnx.Param(jnp.ones((hv,), dtype))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), minval=1.0, maxval=16.0)).astype(dtype))
        self.norm = GatedRMSNorm(cfg.gdn_v_head_dim, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.out_proj = Linear(cfg.gdn_value_dim, h, dtype=dtype, rngs=rngs)

    # ---- pieces shared by every entry point ------------------------------------------
    def project(self, x: jax.Array, impl: str = "xla", wide_conv_in: bool = False):
        """Conv inputs [B,T,conv_dim], gate z [B,T,Hv,dv], beta and g [B,T,Hv] (float32).
        wide_conv_in: the conv inputs may carry more columns after the first conv_dim (the whole
        merged qkv | z product, for a consumer that reads only its channel blocks: no slice copy)."""
        cfg = self.cfg
        b, t, _ = x.shape
        whole = getattr(self, "in_proj_qkvzba", None)
        if whole is not None:  # one product: qkv | z | b | a
            mixed, z, ba = self._split_qkvzba(whole(x, impl), wide_conv_in)
            hv = cfg.gdn_num_v_heads
            beta, g = gate_values(ba[..., hv:], ba[..., :hv], self.A_log[...], self.dt_bias[...])
            return mixed, z.reshape(b, t, hv, cfg.gdn_v_head_dim), beta, g
        ba = getattr(self, "in_proj_ba", None)
        ab_group = (ba,) if ba is not None else (self.in_proj_b, self.in_proj_a)
        qkv_z = getattr(self, "in_proj_qkv_z", None)
        if qkv_z is not None:
            x_qkv_z, x_ab = unmerged_inputs(x, (qkv_z,), ab_group)
            mixed, z = self.qkv_z_outputs(x_qkv_z, impl, wide_conv_in)
        else:
            x_qkv, x_z, x_ab = unmerged_inputs(x, (self.in_proj_qkv,), (self.in_proj_z,), ab_group)
            mixed, z = self.in_proj_qkv(x_qkv, impl), self.in_proj_z(x_z, impl)
        z = z.reshape(b, t, cfg.gdn_num_v_heads, cfg.gdn_v_head_dim)
        if ba is not None:
            b_lin, a_lin = jnp.split(ba(x_ab, impl), 2, axis=-1)
        else:
            b_lin, a_lin = self.in_proj_b(x_ab, impl), self.in_proj_a(x_ab, impl)
        beta, g = gate_values(a_lin, b_lin, self.A_log[...], self.dt_bias[...])
        return mixed, z, beta, g

    def _split_qkvzba(self, whole: jax.Array, wide_conv_in: bool = False):
        """(conv inputs, flat z, b | a) of the qkv | z | b | a product (wide_conv_in: see `project`)."""
        c, vd = self.cfg.gdn_conv_dim, self.cfg.gdn_value_dim
        return (whole if wide_conv_in else whole[..., :c]), whole[..., c : c + vd], whole[..., c + vd :]

    def qkv_z_outputs(self, x: jax.Array, impl: str = "xla", wide_conv_in: bool = False
                      ) -> tuple[jax.Array, jax.Array]:
        """Conv inputs [..., conv_dim] and the flat gate z [..., value_dim] in either layout
        (wide_conv_in: see `project`)."""
        whole = getattr(self, "in_proj_qkvzba", None)
        if whole is not None:
            return self._split_qkvzba(whole(x, impl), wide_conv_in)[:2]
        qkv_z = getattr(self, "in_proj_qkv_z", None)
        if qkv_z is None:
            return self.in_proj_qkv(x, impl), self.in_proj_z(x, impl)
        both = qkv_z(x, impl)
        return (both if wide_conv_in else both[..., : self.cfg.gdn_conv_dim]), both[..., self.cfg.gdn_conv_dim :]

    def ab_kernels(self) -> tuple[jax.Array, jax.Array]:
        """The a and b projection weights [hidden, Hv] in any layout (slices of a merged weight)."""
        hv = self.cfg.gdn_num_v_heads
        whole = getattr(self, "in_proj_qkvzba", None)
        if whole is not None:
            w = whole.kernel[...][:, -2 * hv :]
            return w[:, hv:], w[:, :hv]
        ba = getattr(self, "in_proj_ba", None)
        if ba is None:
            return self.in_proj_a.kernel[...], self.in_proj_b.kernel[...]
        w = ba.kernel[...]
        return w[:, hv:], w[:, :hv]

    def heads(self, conv_out: jax.Array):
        """Split activated conv outputs into float32 q (normed, scaled), k (normed), v, heads-first."""
        cfg = self.cfg
        q, k, v = split_heads(conv_out, cfg.gdn_num_k_heads, cfg.gdn_k_head_dim, cfg.gdn_num_v_heads,
                              cfg.gdn_v_head_dim)
        to_heads = lambda a: jnp.swapaxes(a, 1, 2)
        return to_heads(q), to_heads(k), to_heads(v)

    def output(self, o: jax.Array, z: jax.Array, dtype, impl: str = "xla") -> jax.Array:
        """o [B,H,T,dv] float32 -> projected output [B,T,hidden]."""
        o = jnp.swapaxes(o, 1, 2).astype(dtype)
        y = self.norm(o, z)
        return self.out_proj(y.reshape(*y.shape[:2], -1), impl)

    # ---- append tokens to the committed state -----------------------------------------
    def __call__(
        self, x: jax.Array, cache: RecurrentCache, n_valid: jax.Array, *, chunked: bool, impl: str = "xla"
    ) -> tuple[jax.Array, RecurrentCache]:
        """Consume the first n_valid[b] of T tokens; later (padding) tokens leave the state alone.

        impl "pallas" / "pallas_interpret": a single-token step (decoding) runs its conv, norms,
        recurrent step, gated norm and window slide as one kernel (pallas_kernels/gdn_decode.py)
        between the projections; a layer shape the kernel cannot take is announced by a warning
        when traced and runs the XLA form."""
        t = x.shape[1]
        if impl != "xla" and t == 1 and not chunked and not DECODE_KERNEL:
            warnings.warn("the GDN decode step uses the XLA form, not the Pallas kernel: "
                          "ddtree_jax.models.gdn.DECODE_KERNEL is False", stacklevel=2)
        if impl != "xla" and t == 1 and not chunked and DECODE_KERNEL and self._decode_kernel_takes(x):
            return self._decode_kernel(x, cache, n_valid, impl)
        mixed, z, beta, g = self.project(x, impl)
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
        return self.output(o, z, x.dtype, impl), new_cache

    def _decode_kernel_takes(self, x: jax.Array) -> bool:
        """Whether the decode kernel takes this layer's shape; if not, say why (a warning when traced)."""
        from pallas_kernels.gdn_decode import kernel_problems

        cfg = self.cfg
        problems = kernel_problems(cfg.gdn_conv_dim, cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim,
                                   cfg.gdn_v_head_dim, self.conv_weight.shape[0], x.shape[-1])
        if problems:
            warnings.warn("the GDN decode step uses the XLA form, not the Pallas kernel: " + "; ".join(problems),
                          stacklevel=4)
        return not problems

    def _decode_kernel(self, x: jax.Array, cache: RecurrentCache, n_valid, impl: str):
        """One token through the layer with the core as one kernel; the a / b products happen in it."""
        from pallas_kernels.gdn_decode import gdn_decode

        cfg = self.cfg
        b = x.shape[0]
        whole = getattr(self, "in_proj_qkvzba", None)
        if whole is not None:  # one product holds the conv inputs, z and the b / a products: read in place
            from pallas_kernels.gdn_decode import gdn_decode_packed

            y, state, window = gdn_decode_packed(
                whole(x)[:, 0], self.A_log[...], self.dt_bias[...], cache.conv, self.conv_weight[...], cache.state,
                self.norm.weight[...], n_valid, num_k_heads=cfg.gdn_num_k_heads, head_v_dim=cfg.gdn_v_head_dim,
                eps=self.norm.eps, impl=impl)
            return self.out_proj(y.reshape(b, 1, -1), impl), RecurrentCache(conv=window, state=state)
        mixed, z = self.qkv_z_outputs(x)
        mixed, z = mixed[:, 0], z.reshape(b, cfg.gdn_num_v_heads, cfg.gdn_v_head_dim)
        w_a, w_b = self.ab_kernels()
        y, state, window = gdn_decode(
            mixed, z, x[:, 0], w_a, w_b, self.A_log[...],
            self.dt_bias[...], cache.conv, self.conv_weight[...], cache.state, self.norm.weight[...], n_valid,
            num_k_heads=cfg.gdn_num_k_heads, eps=self.norm.eps, impl=impl)
        return self.out_proj(y.reshape(b, 1, -1), impl), RecurrentCache(conv=window, state=state)

    # ---- speculative entry points -------------------------------------------------------
    def tree(self, x, cache: RecurrentCache, visible, conv_src=None, bits=None, impl: str = "xla"
             ) -> tuple[jax.Array, RecurrentPending]:
        """Outputs of N nodes x [B, N, H], each from its own root-to-node path. Writes nothing.

        visible [B, N, N]: ancestor-or-self. conv_src [B, N, K] (tree.geometry) gathers each
        node's conv window from its ancestors and the committed window; None means a chain
        (node i's parent is i - 1: linear DFlash), its conv computed with the plain causal form.
        impl "pallas" / "pallas_interpret" run the conv .. casts of a tree or a chain as one kernel
        (TREE_PROLOGUE_KERNEL) and the nodes through the fused tree delta-rule kernel (path sums from the ancestor `bits`, no per-node state anywhere); on the
        H200 it took 8.9 us for 16 nodes where the XLA form (a triangular solve over dense
        visibility, ~8 kernels) took 41.5 (docs/benchmarks.md section 2).
        """
        prologue = impl != "xla" and self._prologue_route(x, conv_src)
        w = self.conv_weight[...]
        whole = getattr(self, "in_proj_qkvzba", None)
        if prologue and whole is not None:  # the prologue kernel computes the gates from the b | a columns too
            cfg = self.cfg
            y = whole(x, impl, split_k=IN_PROJ_PARTS_SLICES if IN_PROJ_PARTS else None)
            if isinstance(y, SplitKParts):  # the prologue adds the conv and gate columns' partials
                c, vd = cfg.gdn_conv_dim, cfg.gdn_value_dim
                mixed, z = y.parts, SplitKParts(y.parts[..., c : c + vd]).total(x.dtype)
            else:
                mixed, z, _ = self._split_qkvzba(y, wide_conv_in=True)
            z = z.reshape(*x.shape[:2], cfg.gdn_num_v_heads, cfg.gdn_v_head_dim)
            gates, g, beta = (self.A_log[...], self.dt_bias[...]), None, None
        else:
            mixed, z, beta, g = self.project(x, impl, wide_conv_in=prologue)
            beta, g = jnp.swapaxes(beta, 1, 2), jnp.swapaxes(g, 1, 2)
            gates = None
        if prologue:
            # the conv .. casts in one kernel, reading the conv's channels of the whole qkv | z
            # product; the commit takes the float32 k per key head and v in the model dtype (exact:
            # v is rounded to it before the float32 cast) and the conv inputs' first conv_dim columns
            from pallas_kernels.gdn_tree_prologue import gdn_tree_prologue

            cfg = self.cfg
            if conv_src is None:  # a chain: node i's m-th tap is node i - m, or the window before node 0
                taps, n = w.shape[0], x.shape[1]
                chain = (taps - 1) + jnp.arange(n, dtype=jnp.int32)[:, None] - jnp.arange(taps, dtype=jnp.int32)[None]
                conv_src = jnp.broadcast_to(chain, (x.shape[0], n, taps))
            out = gdn_tree_prologue(mixed, cache.conv, w, conv_src, num_k_heads=cfg.gdn_num_k_heads,
                                    head_k_dim=cfg.gdn_k_head_dim, head_v_dim=cfg.gdn_v_head_dim, out_dtype=x.dtype,
                                    impl=impl, gates=gates, ba_col=cfg.gdn_conv_dim + cfg.gdn_value_dim)
            q, k, v, k32 = out[:4]
            if gates is not None:
                g, beta = out[4:6]
            conv_in = out[-1] if mixed.ndim == 4 else mixed  # partials: the kernel's summed conv inputs
            return self._tree_kernel(q, k, v, g, beta, cache, bits, z, x.dtype, impl,
                                     RecurrentPending(conv_in, k32, v, g, beta))
        conv = causal_conv(mixed, cache.conv, w) if conv_src is None else tree_conv(mixed, cache.conv, w, conv_src)
        q, k, v = self.heads(jax.nn.silu(conv).astype(x.dtype))
        if impl != "xla":  # trees and chains (linear DFlash): a chain is a tree of depth N - 1
            # 16-bit models hand the kernel q / k / v in the model dtype (as FLA takes them): its
            # loads halve and its float32 products run as one-pass TF32, below the bf16 rounding
            # of o (on the H200: 24 us per layer at 64 nodes with bf16 inputs, 68 us with float32).
            # The state stays exact: the commit replays the float32 k / v of `pending`.
            lo = (lambda a: a.astype(x.dtype)) if x.dtype in (jnp.bfloat16, jnp.float16) else (lambda a: a)
            return self._tree_kernel(lo(q), lo(k), lo(v), g, beta, cache, bits, z, x.dtype, impl,
                                     RecurrentPending(mixed, k, v, g, beta))
        if conv_src is None:
            path_g = jnp.cumsum(g, axis=-1)
        else:
            path_g = jnp.einsum("bij,bhj->bhi", visible.astype(jnp.float32), g, precision=delta_rule.HIGHEST)
        o, _ = delta_rule.block(q, k, v, path_g, beta, cache.state, visible)
        return self.output(o, z, x.dtype, impl), RecurrentPending(mixed, k, v, g, beta)

    def _prologue_route(self, x: jax.Array, conv_src) -> bool:
        """Whether a tree pass with kernels takes the prologue kernel (TREE_PROLOGUE_KERNEL); when it
        is on but cannot be taken, say why (a warning when traced)."""
        if not TREE_PROLOGUE_KERNEL:
            warnings.warn("the GDN tree prologue uses the XLA form, not the Pallas kernel: "
                          "ddtree_jax.models.gdn.TREE_PROLOGUE_KERNEL is False", stacklevel=4)
            return False
        from pallas_kernels.gdn_tree_prologue import kernel_problems

        cfg = self.cfg
        problems = kernel_problems(x.shape[1], cfg.gdn_num_k_heads, cfg.gdn_k_head_dim, cfg.gdn_num_v_heads,
                                    cfg.gdn_v_head_dim, self.conv_weight.shape[0])
        if problems:
            warnings.warn("the GDN tree prologue uses the XLA form, not the Pallas kernel: " + "; ".join(problems),
                          stacklevel=4)
        return not problems

    def _tree_kernel(self, q, k, v, g, beta, cache: RecurrentCache, bits, z, dtype, impl: str,
                     pending: RecurrentPending):
        """The tree delta-rule kernel over q / k / v (heads first) and the layer's output."""
        from pallas_kernels.gdn_tree import gdn_tree_verify

        o = gdn_tree_verify(q, k, v, g, beta, cache.state, bits, impl=impl)
        return self.output(o, z, dtype, impl), pending

    @staticmethod
    def commit(pending: RecurrentPending, path, count, cache: RecurrentCache, impl: str = "xla") -> RecurrentCache:
        """State after the accepted path (path [B, P], first count[b] real): a scan from the
        committed state over the path's nodes, and the conv window slid over their inputs.
        impl "pallas" / "pallas_interpret": the fused path-commit kernel (one launch, all heads, the
        conv window slid in the same launch; state and window in place)."""
        if impl != "xla":
            from pallas_kernels.gdn_commit import gdn_path_commit

            state, window = gdn_path_commit(pending.k, pending.v, pending.g, pending.beta, cache.state, path, count,
                                            window=cache.conv, conv_in=pending.conv_in, impl=impl)
            return RecurrentCache(conv=window, state=state)
        conv_in = jnp.take_along_axis(pending.conv_in, path[:, :, None], axis=1)[..., : cache.conv.shape[-1]]
        window = next_window(conv_in, cache.conv, count)
        p, h = path.shape[1], pending.v.shape[1]
        on = (jnp.arange(p)[None, :] < count[:, None])[:, None, :]
        take = lambda a: jnp.take_along_axis(jnp.repeat(a, h // a.shape[1], axis=1), path[:, None, :, None], axis=2)
        take1 = lambda a: jnp.where(on, jnp.take_along_axis(a, path[:, None, :], axis=2), 0.0)
        state = delta_rule.path_state(take(pending.k), take(pending.v), take1(pending.g), take1(pending.beta), cache.state)
        return RecurrentCache(conv=window, state=state)
