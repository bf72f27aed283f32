"""Softmax attention over a preallocated KV cache: plain Qwen3 and gated Qwen3.5 attention.

`__call__` appends T tokens per sequence at that sequence's committed length, writes their
K/V into the cache and attends causally over everything up to each query's position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import KVCache
from ddtree_jax.config import TargetConfig
from ddtree_jax.models.layers import Linear, RMSNorm, apply_rope, rope_cos_sin

NEG_INF = -1e30


def write_kv(cache: KVCache, k_new: jax.Array, v_new: jax.Array, start: jax.Array) -> KVCache:
    """Write k_new/v_new [B, T, kv, hd] at per-sequence offsets `start` [B]."""

    def put(buf, new, s):
        return jax.lax.dynamic_update_slice(buf, new.transpose(1, 0, 2).astype(buf.dtype), (0, s, 0))

    return KVCache(jax.vmap(put)(cache.k, k_new, start), jax.vmap(put)(cache.v, v_new, start))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float) -> jax.Array:
    """Grouped-query attention.

    q [B, T, nh, hd]; k, v [B, kv, S, hd]; visible [B, T, S] bool. Softmax in float32, the
    weighted sum in the value dtype (as HF's eager attention). Returns [B, T, nh, hd].
    """
    b, t, nh, hd = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, t, kv, nh // kv, hd)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k.astype(q.dtype)).astype(jnp.float32) * scale
    scores = jnp.where(visible[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v)
    return out.reshape(b, t, nh, hd).astype(q.dtype)


class Attention(nnx.Module):
    """Qwen3 attention (q/k norms, RoPE, GQA); with `attn_output_gate` the Qwen3.5 gated form."""

    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        h, nh, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out = nh * hd * (2 if cfg.attn_output_gate else 1)
        bias = cfg.attention_bias
        self.q_proj = Linear(h, q_out, bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, kv * hd, bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, kv * hd, bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nh * hd, h, bias=bias, dtype=dtype, rngs=rngs)
        zc = cfg.norm_zero_centered
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centered=zc, dtype=dtype, rngs=rngs)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centered=zc, dtype=dtype, rngs=rngs)

    def project(self, x: jax.Array, positions: jax.Array):
        """q [B,T,nh,hd], k, v [B,T,kv,hd] with norms and RoPE applied, and the output gate (or None)."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x)
        gate = None
        if cfg.attn_output_gate:
            q = q.reshape(b, t, cfg.num_heads, 2 * cfg.head_dim)
            q, gate = q[..., : cfg.head_dim], q[..., cfg.head_dim :].reshape(b, t, -1)
        q = self.q_norm(q.reshape(b, t, cfg.num_heads, cfg.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim))
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def output(self, attn: jax.Array, gate: jax.Array | None) -> jax.Array:
        b, t = attn.shape[:2]
        attn = attn.reshape(b, t, -1)
        if gate is not None:
            attn = attn * jax.nn.sigmoid(gate)
        return self.o_proj(attn)

    def __call__(self, x: jax.Array, cache: KVCache, start: jax.Array) -> tuple[jax.Array, KVCache]:
        """Append x [B, T, H] at positions start[b] + t; returns y and the cache with their K/V."""
        t = x.shape[1]
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        q, k, v, gate = self.project(x, positions)
        cache = write_kv(cache, k, v, start)
        key_pos = jnp.arange(cache.capacity, dtype=jnp.int32)
        visible = key_pos[None, None, :] <= positions[:, :, None]
        attn = attend(q, cache.k, cache.v, visible, self.cfg.head_dim**-0.5)
        return self.output(attn, gate), cache
