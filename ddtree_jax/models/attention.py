"""Softmax attention over a preallocated KV cache: plain Qwen3 and gated Qwen3.5 attention.

`__call__` appends T tokens per sequence at that sequence's committed length, writes their
K/V into the cache and attends causally over everything up to each query's position.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import KVCache
from ddtree_jax.config import TargetConfig
from ddtree_jax.models.layers import Linear, RMSNorm, apply_rope, rope_cos_sin, unmerged_inputs

NEG_INF = -1e30
# Single-token steps (decoding) with kernels on go through the tree-attention kernel as a one-node
# tree (faster than the XLA form at every measured shape, `Attention.__call__`). False routes them
# to the XLA form: an A/B switch for measurements (`scripts/bench_e2e.py --override`).
DECODE_KERNEL = True
# Layout switch (on: measured with models.layers.MERGED_GATE_UP, see there): Attention modules
# built while it is True hold one [hidden, q + k + v] weight (`qkv_proj`) and make one product for
# q, k and v in every pass: in decoding one GEMV, where the separate layout's K / V products (5120 x
# 1024 each at the 27B shape, under XLA's dot threshold) ran as multiply + reduce fusions at ~1.6
# TB/s (12.8 us a layer); in a verify one cuBLAS GEMM. (It replaced session 7's opt-in route that
# concatenated the separate weights at trace time: the same product plus a weight copy.)
# Checkpoints in either layout load (converters/layout.py).
MERGED_QKV = True
# With kernels on (impl != "xla"), a merged-layout layer's q / k norms and RoPE run as one kernel
# reading the q | k | v product in place (pallas_kernels/attn_prologue.py) instead of ~6 XLA
# launches (two slices, two norms, two rope concatenations: ~12 us of a 27B verify's attention
# layer, ~7 us of a decode step's). Timed on the H200 (2026-11-30, docs/benchmarks.md section 1,
# session 10): the decode step's kernels 13.45 -> 13.34 ms (64 fewer launches), but at a verify's
# 65 rows the kernel took 22.3 us a layer (32 programs at batch 1, five row blocks each) and the
# verify's kernels went 16.69 -> 16.83 ms. The kernel now runs a program per (head, 16-row block),
# 160 at batch 1; timed on the H200 (2026-11-30, session 11, docs/benchmarks.md section 1): 3.9 us a
# verify layer, the verify's kernels 16.62 ms in 876 launches against 16.64-16.80 ms in 940-1004,
# the decode step unchanged end to end (13.10 vs 13.05 ms, same GPU). On. Layers without q / k
# norms (NemotronH, Mamba2 hybrids) have nothing for it to fuse and keep the XLA form quietly.
PROLOGUE_KERNEL = True


def write_kv(cache: KVCache, k_new: jax.Array, v_new: jax.Array, start: jax.Array) -> KVCache:
    """Write k_new/v_new [B, T, kv, hd] at per-sequence offsets `start` [B]."""

    def put(buf, new, s):
        return jax.lax.dynamic_update_slice(buf, new.transpose(1, 0, 2).astype(buf.dtype), (0, s, 0))

    return KVCache(jax.vmap(put)(cache.k, k_new, start), jax.vmap(put)(cache.v, v_new, start))


class KVPending(NamedTuple):
    """What an attention layer's commit needs from a tree pass: the tree nodes' K/V [B, N, kv, hd]."""

    k: jax.Array
    v: jax.Array


def attend(q: jax.Array, parts, scale: float) -> jax.Array:
    """Grouped-query attention over one or more key/value parts with one joint softmax.

    q [B, T, nh, hd]; parts: sequence of (k, v [B, kv, S_p, hd], visible [B, T, S_p] bool).
    Several parts let the tree pass read the committed cache and the tree's own K/V without
    copying the cache. Softmax in float32, the weighted sum in the value dtype (as HF's eager
    attention). Returns [B, T, nh, hd].
    """
    b, t, nh, hd = q.shape
    kv = parts[0][0].shape[1]
    qg = q.reshape(b, t, kv, nh // kv, hd)
    scores = []
    for k, _, visible in parts:
        s = jnp.einsum("btkgd,bksd->bkgts", qg, k.astype(q.dtype)).astype(jnp.float32) * scale
        scores.append(jnp.where(visible[:, None, None], s, NEG_INF))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out, offset = 0.0, 0
    for (_, v, _), s in zip(parts, scores):
        p = probs[..., offset : offset + s.shape[-1]].astype(v.dtype)
        out = out + jnp.einsum("bkgts,bksd->btkgd", p, v)
        offset += s.shape[-1]
    return out.reshape(b, t, nh, hd).astype(q.dtype)


class Attention(nnx.Module):
    """Qwen3 attention (q/k norms, RoPE, GQA); with `attn_output_gate` the Qwen3.5 gated form."""

    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        h, nh, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out = nh * hd * (2 if cfg.attn_output_gate else 1)
        bias = cfg.attention_bias
        if MERGED_QKV:
            self.qkv_proj = Linear(h, q_out + 2 * kv * hd, bias=bias, dtype=dtype, rngs=rngs)
        else:
            self.q_proj = Linear(h, q_out, bias=bias, dtype=dtype, rngs=rngs)
            self.k_proj = Linear(h, kv * hd, bias=bias, dtype=dtype, rngs=rngs)
            self.v_proj = Linear(h, kv * hd, bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nh * hd, h, bias=bias, dtype=dtype, rngs=rngs)
        zc = cfg.norm_zero_centered
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centered=zc, dtype=dtype, rngs=rngs)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centered=zc, dtype=dtype, rngs=rngs)

    def project(self, x: jax.Array, positions: jax.Array, impl: str = "xla"):
        """q [B,T,nh,hd], k, v [B,T,kv,hd] with norms and RoPE applied, and the output gate (or None)."""
        cfg = self.cfg
        b, t, _ = x.shape
        merged = getattr(self, "qkv_proj", None)
        if impl != "xla" and PROLOGUE_KERNEL and cfg.qk_norm and self._prologue_takes():
            from pallas_kernels.attn_prologue import attn_prologue

            proj = merged(x, impl)
            cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
            q, k, v = attn_prologue(proj, self.q_norm.weight[...], self.k_norm.weight[...], cos, sin,
                                    num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                    gated=cfg.attn_output_gate, eps=self.q_norm.eps,
                                    zero_centered=self.q_norm.zero_centered, impl=impl)
            gate = None
            if cfg.attn_output_gate:
                nq = 2 * cfg.num_heads * cfg.head_dim
                gate = proj[..., :nq].reshape(b, t, cfg.num_heads, 2 * cfg.head_dim)[..., cfg.head_dim :]
                gate = gate.reshape(b, t, -1)
            return q, k, v, gate
        if merged is not None:
            q, k_lin, v_lin = self._split_qkv(merged(x, impl))
        else:
            xq, xk, xv = unmerged_inputs(x, (self.q_proj,), (self.k_proj,), (self.v_proj,))
            q, k_lin, v_lin = self.q_proj(xq, impl), self.k_proj(xk, impl), self.v_proj(xv, impl)
        gate = None
        if cfg.attn_output_gate:
            q = q.reshape(b, t, cfg.num_heads, 2 * cfg.head_dim)
            q, gate = q[..., : cfg.head_dim], q[..., cfg.head_dim :].reshape(b, t, -1)
        q = self.q_norm(q.reshape(b, t, cfg.num_heads, cfg.head_dim))
        k = self.k_norm(k_lin.reshape(b, t, cfg.num_kv_heads, cfg.head_dim))
        v = v_lin.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def _prologue_takes(self) -> bool:
        """Whether the prologue kernel takes this layer (PROLOGUE_KERNEL on); if not, say why (a
        warning when traced)."""
        from pallas_kernels.attn_prologue import kernel_problems

        cfg = self.cfg
        problems = kernel_problems(cfg.head_dim, cfg.rotary_dim)
        if getattr(self, "qkv_proj", None) is None:
            problems.append("separate q / k / v projections (the kernel reads the merged product: MERGED_QKV)")
        if self.q_norm.weight_fp32 or self.k_norm.weight_fp32 or self.q_norm.eps != self.k_norm.eps:
            problems.append("q / k norms with float32 weights or different eps")
        if problems:
            warnings.warn("the attention prologue uses the XLA form, not the Pallas kernel: " + "; ".join(problems),
                          stacklevel=4)
        return not problems

    def _split_qkv(self, y: jax.Array):
        """[..., q + k + v] -> q (with the gate half when gated), k, v."""
        kv = self.cfg.num_kv_heads * self.cfg.head_dim
        nq = y.shape[-1] - 2 * kv
        return y[..., :nq], y[..., nq : nq + kv], y[..., nq + kv :]

    def output(self, attn: jax.Array, gate: jax.Array | None, impl: str = "xla") -> jax.Array:
        b, t = attn.shape[:2]
        attn = attn.reshape(b, t, -1)
        if gate is not None:
            attn = attn * jax.nn.sigmoid(gate)
        return self.o_proj(attn, impl)

    def __call__(self, x: jax.Array, cache: KVCache, start: jax.Array, impl: str = "xla"
                 ) -> tuple[jax.Array, KVCache]:
        """Append x [B, T, H] at positions start[b] + t; returns y and the cache with their K/V.

        impl "pallas" / "pallas_interpret" run single-token steps (T = 1: decoding) through the
        tree-attention kernel as a one-node tree: it reads the cache only up to each sequence's
        length, where the XLA form reads the whole capacity under a mask (and XLA pads a copy of
        V for its split-K PV product). On the H200 the kernel's single-query decode took 11.6 /
        18.2 / 48.6 us at 1k / 8k / 32k caches against 12.5 / 24.0 / 57.5 for the XLA form (batch 1;
        16.8 / 67.1 / 233 vs 27.4 / 96.1 / 331 at batch 8; docs/benchmarks.md section 2).
        Longer appends (prefill chunks) use the XLA form."""
        t = x.shape[1]
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        q, k, v, gate = self.project(x, positions, impl)
        if impl != "xla" and t == 1 and not DECODE_KERNEL:
            warnings.warn("plain decoding's attention uses the XLA form, not the Pallas kernel: "
                          "ddtree_jax.models.attention.DECODE_KERNEL is False", stacklevel=2)
        if impl != "xla" and t == 1 and DECODE_KERNEL:
            from pallas_kernels.tree_attention import tree_attention

            from ddtree_jax.tree import all_visible_bits

            attn = tree_attention(q, cache.k, cache.v, start, k, v, all_visible_bits(x.shape[0], 1),  # sees itself
                                  scale=self.cfg.head_dim**-0.5, impl=impl)
            return self.output(attn, gate, impl), write_kv(cache, k, v, start)
        cache = write_kv(cache, k, v, start)
        key_pos = jnp.arange(cache.capacity, dtype=jnp.int32)
        visible = key_pos[None, None, :] <= positions[:, :, None]
        attn = attend(q, [(cache.k, cache.v, visible)], self.cfg.head_dim**-0.5)
        return self.output(attn, gate, impl), cache

    # ---- speculative entry points -------------------------------------------------------
    def tree(self, x, cache: KVCache, start, positions, visible, bits=None, impl: str = "xla"
             ) -> tuple[jax.Array, KVPending]:
        """Outputs of N tree nodes x [B, N, H] at `positions`; node i sees the committed cache
        (< start) and the nodes in visible[b, i] (its ancestors and itself). Writes nothing.

        impl "pallas" / "pallas_interpret" use the fused tree-attention kernel, which reads the
        compact ancestor `bits` [B, N, W] instead of the dense `visible`."""
        q, k, v, gate = self.project(x, positions, impl)
        if impl != "xla":
            from pallas_kernels.tree_attention import tree_attention

            attn = tree_attention(q, cache.k, cache.v, start, k, v, bits, scale=self.cfg.head_dim**-0.5, impl=impl)
            return self.output(attn, gate, impl), KVPending(k, v)
        key_pos = jnp.arange(cache.capacity, dtype=jnp.int32)
        committed = jnp.broadcast_to(key_pos[None, None, :] < start[:, None, None], (*positions.shape, cache.capacity))
        tree_k, tree_v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        attn = attend(q, [(cache.k, cache.v, committed), (tree_k, tree_v, visible)], self.cfg.head_dim**-0.5)
        return self.output(attn, gate, impl), KVPending(k, v)

    @staticmethod
    def commit(pending: KVPending, path, count, cache: KVCache, start) -> KVCache:
        """Write the K/V of the accepted nodes (path [B, P], first count[b] real) contiguously at start.

        Entries past count land beyond the new length: masked until later writes replace them.
        """
        take = lambda a: jnp.take_along_axis(a, path[:, :, None, None], axis=1)
        return write_kv(cache, take(pending.k), take(pending.v), start)
