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
from ddtree_jax.models.layers import Linear, RMSNorm
from ddtree_jax.models.mixer import Step
from ddtree_jax.routes import REFERENCE, Routes
from ddtree_jax.tree import TreeGeometry
from pallas_kernels import attn_prologue
from pallas_kernels.ref.rope import apply_rope, rope_cos_sin
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_mask import all_visible_bits

NEG_INF = -1e30


def write_kv(cache: KVCache, k_new: jax.Array, v_new: jax.Array, start: jax.Array) -> KVCache:
    """Write k_new/v_new [B, T, kv, hd] at per-sequence offsets `start` [B] (the prologue kernel's
    reference form, which the kernel's in-place write equals: attn_prologue.written_cache)."""
    return KVCache(*attn_prologue.written_cache((cache.k, cache.v), k_new, v_new, start))


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
    """Qwen3 attention (q/k norms, RoPE, GQA); with `attn_output_gate` the Qwen3.5 gated form.
    q, k and v come from one [hidden, q + k + v] weight (`qkv_proj`; the converters join HF's
    separate projections: docs/decisions/0005-merged-projection-layouts.md)."""

    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        h, nh, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out = nh * hd * (2 if cfg.attn_output_gate else 1)
        bias = cfg.attention_bias
        self.qkv_proj = Linear(h, q_out + 2 * kv * hd, bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nh * hd, h, bias=bias, dtype=dtype, rngs=rngs)
        zc = cfg.norm_zero_centered
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centered=zc, dtype=dtype, rngs=rngs)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centered=zc, dtype=dtype, rngs=rngs)

    def project(self, x: jax.Array, positions: jax.Array, routes: Routes = REFERENCE, cache: KVCache | None = None):
        """q [B,T,nh,hd], k, v [B,T,kv,hd] with norms and RoPE applied, and the output gate (or None).
        With kernels on, the q / k norms and RoPE run as one kernel reading the q | k | v product in
        place (routes.attention_prologue_kernel), instead of ~6 XLA launches. Given the layer's
        cache (positions' first column: each row's write offset), also returns it with k / v
        written: by the prologue kernel in place where it runs and
        routes.attention_prologue_writes_kv, else by `write_kv`."""
        cfg = self.cfg
        b, t, _ = x.shape
        proj = self.qkv_proj(x, routes)
        if routes.kernels and routes.attention_prologue_kernel and cfg.qk_norm and self._prologue_takes():
            cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
            writes = cache is not None and routes.attention_prologue_writes_kv
            out = attn_prologue.attn_prologue(
                proj, self.q_norm.weight[...], self.k_norm.weight[...], cos, sin, num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, gated=cfg.attn_output_gate,
                eps=self.q_norm.eps, zero_centered=self.q_norm.zero_centered, impl=routes.impl,
                cache=tuple(cache) if writes else None, start=positions[:, 0] if writes else None)
            q, k, v = out[:3]
            gate = None
            if cfg.attn_output_gate:
                nq = 2 * cfg.num_heads * cfg.head_dim
                gate = proj[..., :nq].reshape(b, t, cfg.num_heads, 2 * cfg.head_dim)[..., cfg.head_dim :]
                gate = gate.reshape(b, t, -1)
            if cache is None:
                return q, k, v, gate
            return q, k, v, gate, KVCache(*out[3:]) if writes else write_kv(cache, k, v, positions[:, 0])
        q, k_lin, v_lin = self._split_qkv(proj)
        gate = None
        if cfg.attn_output_gate:
            q = q.reshape(b, t, cfg.num_heads, 2 * cfg.head_dim)
            q, gate = q[..., : cfg.head_dim], q[..., cfg.head_dim :].reshape(b, t, -1)
        q = self.q_norm(q.reshape(b, t, cfg.num_heads, cfg.head_dim))
        k = self.k_norm(k_lin.reshape(b, t, cfg.num_kv_heads, cfg.head_dim))
        v = v_lin.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            return q, k, v, gate
        return q, k, v, gate, write_kv(cache, k, v, positions[:, 0])

    def _prologue_takes(self) -> bool:
        """Whether the prologue kernel takes this layer; if not, say why (a warning when traced)."""
        cfg = self.cfg
        problems = attn_prologue.kernel_problems(cfg.head_dim, cfg.rotary_dim)
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

    def output(self, attn: jax.Array, gate: jax.Array | None, routes: Routes = REFERENCE) -> jax.Array:
        b, t = attn.shape[:2]
        attn = attn.reshape(b, t, -1)
        if gate is not None:
            attn = attn * jax.nn.sigmoid(gate)
        return self.o_proj(attn, routes)

    def append(self, x: jax.Array, cache: KVCache, step: Step, routes: Routes = REFERENCE
               ) -> tuple[jax.Array, KVCache]:
        """Append x [B, T, H] at positions step.start[b] + t; returns y and the cache with their K/V.

        With kernels on, single-token steps (T = 1: decoding) go through the tree-attention kernel
        as a one-node tree (routes.attention_decode_kernel): it reads the cache only up to each
        sequence's length, where the XLA form reads the whole capacity under a mask
        (docs/decisions/0023-attention-decode-tree-kernel.md). Longer appends (prefill
        chunks) use the XLA form."""
        t, start = x.shape[1], step.start
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        q, k, v, gate, cache = self.project(x, positions, routes, cache=cache)  # the cache with k / v written
        if routes.kernels and t == 1 and routes.attention_decode_kernel:
            # the kernel reads the cache's first start[b] rows and k / v as the one node (the
            # written cache, so that XLA need not keep the old one: no copy)
            attn = tree_attention(q, cache.k, cache.v, start, k, v, all_visible_bits(x.shape[0], 1),  # sees itself
                                  scale=self.cfg.head_dim**-0.5, impl=routes.impl,
                                  min_split=routes.attention_split_keys)
            return self.output(attn, gate, routes), cache
        key_pos = jnp.arange(cache.capacity, dtype=jnp.int32)
        visible = key_pos[None, None, :] <= positions[:, :, None]
        attn = attend(q, [(cache.k, cache.v, visible)], self.cfg.head_dim**-0.5)
        return self.output(attn, gate, routes), cache

    # ---- speculative entry points -------------------------------------------------------
    def tree(self, x, cache: KVCache, geo: TreeGeometry, start, routes: Routes = REFERENCE
             ) -> tuple[jax.Array, KVPending]:
        """Outputs of N tree nodes x [B, N, H] at geo.positions; node i sees the committed cache
        (< start) and the nodes in geo.visible[b, i] (its ancestors and itself). Writes nothing.

        With kernels on, the fused tree-attention kernel, which reads the compact ancestor bits
        [B, N, W] instead of the dense visibility."""
        positions, visible = geo.positions, geo.visible
        q, k, v, gate = self.project(x, positions, routes)
        if routes.kernels:
            attn = tree_attention(q, cache.k, cache.v, start, k, v, geo.bits, scale=self.cfg.head_dim**-0.5,
                                  impl=routes.impl, min_split=routes.attention_split_keys)
            return self.output(attn, gate, routes), KVPending(k, v)
        key_pos = jnp.arange(cache.capacity, dtype=jnp.int32)
        committed = jnp.broadcast_to(key_pos[None, None, :] < start[:, None, None], (*positions.shape, cache.capacity))
        tree_k, tree_v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        attn = attend(q, [(cache.k, cache.v, committed), (tree_k, tree_v, visible)], self.cfg.head_dim**-0.5)
        return self.output(attn, gate, routes), KVPending(k, v)

    @staticmethod
    def commit(pending: KVPending, path, count, cache: KVCache, start, routes: Routes = REFERENCE) -> KVCache:
        """Write the K/V of the accepted nodes (path [B, P], first count[b] real) contiguously at start.

        Entries past count land beyond the new length: masked until later writes replace them.
        """
        take = lambda a: jnp.take_along_axis(a, path[:, :, None, None], axis=1)
        return write_kv(cache, take(pending.k), take(pending.v), start)
