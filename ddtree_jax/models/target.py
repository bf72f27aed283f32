"""The hybrid target stack (Qwen3 / Qwen3.5 / Qwen3-Next), driven by the config's layer pattern.

Layers are a Python list run unrolled under jit: a lax.scan over stacked layer weights ran
2.8x slower on the H200 (shared/specs/jax_gpu_notes.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import TargetCache
from ddtree_jax.config import ATTENTION, TargetConfig
from ddtree_jax.tree import Tree, geometry
from ddtree_jax.models.attention import Attention
from ddtree_jax.models.gdn import GatedDeltaNet
from ddtree_jax.models.layers import Embedding, Linear, RMSNorm, SwiGLU


class DecoderLayer(nnx.Module):
    """x += mixer(input_layernorm(x)); x += mlp(post_attention_layernorm(x))."""

    def __init__(self, cfg: TargetConfig, kind: str, *, dtype, rngs: nnx.Rngs):
        self.kind = kind
        zc, eps = cfg.norm_zero_centered, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, zero_centered=zc, dtype=dtype, rngs=rngs)
        if kind == ATTENTION:
            self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, zero_centered=zc, dtype=dtype, rngs=rngs)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def mixer(self):
        return self.self_attn if self.kind == ATTENTION else self.linear_attn

    def __call__(self, x, layer_cache, start, n_valid, *, chunked: bool):
        h = self.input_layernorm(x)
        if self.kind == ATTENTION:
            h, layer_cache = self.self_attn(h, layer_cache, start)
        else:
            h, layer_cache = self.linear_attn(h, layer_cache, n_valid, chunked=chunked)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, layer_cache

    def tree(self, x, layer_cache, start, positions, visible, conv_src):
        """Tree (or chain, conv_src=None) pass of this layer; returns (x, pending). Writes nothing."""
        h = self.input_layernorm(x)
        if self.kind == ATTENTION:
            h, pending = self.self_attn.tree(h, layer_cache, start, positions, visible)
        else:
            h, pending = self.linear_attn.tree(h, layer_cache, visible, conv_src)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, pending

    def commit(self, pending, path, count, layer_cache, start):
        if self.kind == ATTENTION:
            return self.self_attn.commit(pending, path, count, layer_cache, start)
        return self.linear_attn.commit(pending, path, count, layer_cache)


class TargetModel(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype=None):
        self.cfg = cfg
        dtype = jnp.dtype(dtype or cfg.dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, kind, dtype=dtype, rngs=rngs) for kind in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=cfg.norm_zero_centered, dtype=dtype, rngs=rngs)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)

    def logits(self, h: jax.Array) -> jax.Array:
        out = self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        return out.astype(jnp.float32)

    def _run(self, x, step, hidden_ids):
        """Embed -> every layer via step(i, layer, x) -> final norm; collects chosen hidden states."""
        saved = {0: x} if 0 in hidden_ids else {}
        outs = []
        for i, layer in enumerate(self.layers):
            x, out = step(i, layer, x)
            outs.append(out)
            if i + 1 in hidden_ids and i + 1 < self.cfg.num_layers:
                saved[i + 1] = x
        x = self.norm(x)
        saved[self.cfg.num_layers] = x
        features = jnp.concatenate([saved[i] for i in hidden_ids], axis=-1) if hidden_ids else None
        return x, features, tuple(outs)

    def verify(self, tokens: jax.Array, cache: TargetCache, tree: Tree | None, *, hidden_ids=()):
        """One forward over draft nodes without touching the committed state.

        tokens [B, N]; tree None means a chain at positions lengths + t (linear DFlash, plain causal
        forms); otherwise every node sees the committed prefix and its own ancestors only.
        Returns (final hidden [B,N,H], features, per-layer pending for `commit`).
        """
        start = cache.lengths
        n = tokens.shape[1]
        if tree is None:
            positions = start[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
            visible = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (tokens.shape[0], n, n))
            conv_src = None
        else:
            geo = geometry(tree, self.cfg.conv_kernel)
            positions, visible, conv_src = geo.positions, geo.visible, geo.conv_src
        step = lambda i, layer, x: layer.tree(x, cache.layers[i], start, positions, visible, conv_src)
        return self._run(self.embed_tokens(tokens), step, hidden_ids)

    def commit(self, pending, path: jax.Array, count: jax.Array, cache: TargetCache) -> TargetCache:
        """Commit the accepted nodes path [B, P] (first count[b] real, root first) after the prefix."""
        start = cache.lengths
        layers = tuple(
            layer.commit(p, path, count, c, start) for layer, p, c in zip(self.layers, pending, cache.layers)
        )
        return TargetCache(layers, start + count.astype(jnp.int32))

    def __call__(
        self,
        tokens: jax.Array,
        cache: TargetCache,
        n_valid: jax.Array,
        *,
        chunked: bool,
        hidden_ids: tuple[int, ...] = (),
    ):
        """Append tokens [B, T] (the first n_valid[b] of each row are real) after the committed ones.

        Returns (final normed hidden [B,T,H], features [B,T,len(hidden_ids)*H] or None, new cache).
        hidden_ids index HF's `hidden_states`: 0 = embeddings, i = output of layer i-1, and
        num_layers = the final normed output (HF ties the last entry to it).
        """
        start = cache.lengths
        step = lambda i, layer, x: layer(x, cache.layers[i], start, n_valid, chunked=chunked)
        x, features, layers = self._run(self.embed_tokens(tokens), step, hidden_ids)
        return x, features, TargetCache(layers, start + n_valid.astype(jnp.int32))
