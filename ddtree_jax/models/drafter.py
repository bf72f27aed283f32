"""The DFlash drafter (Flax NNX) and its pure, jitted entry points.

Architecture (z-lab/dflash `DFlashDraftModel`): target features of the committed context
[.., K*H] -> `fc` (no bias) -> `hidden_norm`, computed once per committed token. A stack of
Qwen3-style layers runs on the block only, [bonus, MASK x (Bs-1)] embedded with the TARGET's
embedding. In every layer ("KV injection"):

    q    = rope(q_norm(q_proj(input_layernorm(x_block))))               block positions
    keys = rope(k_norm(k_proj([ctx ; input_layernorm(x_block)])))       absolute positions
    vals = v_proj([ctx ; input_layernorm(x_block)])

`ctx` (the fused context features) is NOT passed through the layer's input_layernorm; the
same k/v projections, k_norm and RoPE serve context and block. Attention is non-causal: each
block query sees every valid context token and the whole block (sliding / causal layers are
supported when the config asks for them). The output is the final `norm`; logits come from
the TARGET's lm_head.

Context K/V (after k_norm and RoPE) live in a `DrafterCache`, so each committed token is
projected once (`extend_context`); `draft_hidden` never writes the block into the cache.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import KVCache
from ddtree_jax.drafter_config import DrafterConfig
from ddtree_jax.models.attention import NEG_INF
from ddtree_jax.models.layers import Linear, RMSNorm, SwiGLU, distinct_operands
from ddtree_jax.routes import REFERENCE, Routes
from pallas_kernels.ref.rope import apply_rope, rope_cos_sin
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_mask import all_visible_bits

class DrafterCache(NamedTuple):
    """Per-layer context K/V [B, kv_heads, capacity, head_dim] (k after k_norm + RoPE) and lengths [B]."""

    layers: tuple[KVCache, ...]
    lengths: jax.Array  # [batch] int32: committed context tokens of each sequence

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity


def init_drafter_cache(dcfg: DrafterConfig, batch: int, capacity: int, dtype=None) -> DrafterCache:
    """Zeroed drafter cache for `batch` sequences of up to `capacity` context tokens."""
    if capacity <= 0 or batch <= 0:
        raise ValueError(f"drafter cache needs batch > 0 and capacity > 0, got batch={batch}, capacity={capacity}")
    dtype = jnp.dtype(dtype or dcfg.dtype)
    shape = (batch, dcfg.num_kv_heads, capacity, dcfg.head_dim)
    layers = tuple(KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(dcfg.num_layers))
    return DrafterCache(layers, jnp.zeros((batch,), jnp.int32))


def check_drafter_fits(dcache: DrafterCache, new_tokens: int) -> None:
    """Host-side guard: the context plus `new_tokens` must fit the drafter cache capacity."""
    need = int(jnp.max(dcache.lengths)) + int(new_tokens)
    if need > dcache.capacity:
        raise ValueError(
            f"drafter context of {need} tokens does not fit its cache capacity {dcache.capacity}; "
            "create the drafter cache with a larger capacity"
        )


def _scatter_kv(buf: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """buf [B, kv, S, hd]; new [B, T, kv, hd] written at slots positions [B, T] (out of range: dropped)."""

    def put(b, n, p):
        return b.at[:, p, :].set(n.transpose(1, 0, 2).astype(b.dtype), mode="drop")

    return jax.vmap(put)(buf, new, positions)


class DrafterAttention(nnx.Module):
    """Qwen3 attention (q/k norms, RoPE, GQA) with context K/V injection."""

    def __init__(self, dcfg: DrafterConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        self.cfg = dcfg
        self.window = dcfg.layer_windows[layer_idx]
        self.causal = dcfg.layer_causal[layer_idx]
        h, nh, kv, hd = dcfg.hidden_size, dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim
        bias = dcfg.attention_bias
        self.q_proj = Linear(h, nh * hd, bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, kv * hd, bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, kv * hd, bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nh * hd, h, bias=bias, dtype=dtype, rngs=rngs)
        eps = dcfg.rms_norm_eps
        self.q_norm = RMSNorm(hd, eps, zero_centered=False, dtype=dtype, rngs=rngs)
        self.k_norm = RMSNorm(hd, eps, zero_centered=False, dtype=dtype, rngs=rngs)

    def kv(self, x: jax.Array, cos: jax.Array, sin: jax.Array, x_v: jax.Array | None = None,
           routes: Routes = REFERENCE) -> tuple[jax.Array, jax.Array]:
        """k (k_norm + RoPE), v of x [B, T, H]: each [B, T, kv, hd]. x_v: v_proj's own handle on
        the same values (`DrafterModel.extend`), default x."""
        b, t, _ = x.shape
        cfg = self.cfg
        k = self.k_norm(self.k_proj(x, routes).reshape(b, t, cfg.num_kv_heads, cfg.head_dim))
        v = self.v_proj(x if x_v is None else x_v, routes).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        return apply_rope(k, cos, sin), v

    def kernel_problems(self, q: jax.Array, cache: KVCache, routes: Routes) -> list[str]:
        """Why this layer's attention cannot go through the tree-attention kernel (empty: it can)."""
        hd = self.cfg.head_dim
        out = [] if routes.drafter_attention_kernel else ["routes.drafter_attention_kernel is off"]
        if self.causal or self.window is not None:
            out.append("the layer is causal or windowed inside the block")
        if hd < 16 or hd & (hd - 1):
            out.append(f"head_dim {hd} is not a power of two >= 16")
        if cache.k.dtype != q.dtype:
            out.append(f"the context cache is {cache.k.dtype}, the queries {q.dtype}")
        return out

    def __call__(self, x: jax.Array, cache: KVCache, lengths: jax.Array, cos, sin, routes: Routes = REFERENCE
                 ) -> jax.Array:
        """x [B, Bs, H] (already input-normed) at positions lengths[b] + j; cache holds the context.
        With kernels on, a layer that sees its whole context and the whole block (non-causal, no
        sliding window: the DFlash default) attends through the tree-attention kernel as a tree
        whose every node sees every block position (routes.drafter_attention_kernel; it reads the
        context only up to each row's length); a layer that cannot is announced by a warning when
        traced."""
        cfg = self.cfg
        b, t, _ = x.shape
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        g = nh // kvh
        q = apply_rope(self.q_norm(self.q_proj(x, routes).reshape(b, t, nh, hd)), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin, routes=routes)
        scale = hd**-0.5
        if routes.kernels:
            problems = self.kernel_problems(q, cache, routes)
            if not problems:  # every block position sees every other
                out = tree_attention(q, cache.k, cache.v, lengths, k_blk, v_blk, all_visible_bits(b, t), scale=scale,
                                     impl=routes.impl)
                return self.o_proj(out.reshape(b, t, nh * hd).astype(x.dtype), routes)
            warnings.warn("the drafter's attention uses the XLA form, not the tree-attention kernel: "
                          + "; ".join(problems), stacklevel=2)
        qg = q.reshape(b, t, kvh, g, hd)
        # Scores against the cached context and the block separately (no copy of the cache).
        s_ctx = jnp.einsum("btkgd,bksd->bkgts", qg, cache.k.astype(q.dtype)).astype(jnp.float32) * scale
        s_blk = jnp.einsum("btkgd,bskd->bkgts", qg, k_blk.astype(q.dtype)).astype(jnp.float32) * scale
        q_pos = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
        ctx_pos = jnp.arange(cache.capacity, dtype=jnp.int32)
        vis_ctx = ctx_pos[None, None, :] < lengths[:, None, None]  # [B, 1, S]
        vis_ctx = jnp.broadcast_to(vis_ctx, (b, t, cache.capacity))
        vis_blk = jnp.ones((b, t, t), bool)
        if self.causal:
            vis_blk = vis_blk & (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])[None]
        if self.window is not None:
            w = self.window
            dq = q_pos[:, :, None] - ctx_pos[None, None, :]
            vis_ctx = vis_ctx & (dq < w)
            if not self.causal:
                vis_ctx = vis_ctx & (-dq < w)
            rel = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
            vis_blk = vis_blk & ((rel < w) & (-rel < w))[None]
        scores = jnp.concatenate(
            [
                jnp.where(vis_ctx[:, None, None], s_ctx, NEG_INF),
                jnp.where(vis_blk[:, None, None], s_blk, NEG_INF),
            ],
            axis=-1,
        )
        probs = jax.nn.softmax(scores, axis=-1)
        p_ctx = probs[..., : cache.capacity].astype(cache.v.dtype)
        p_blk = probs[..., cache.capacity :].astype(v_blk.dtype)
        out = jnp.einsum("bkgts,bksd->btkgd", p_ctx, cache.v) + jnp.einsum("bkgts,bskd->btkgd", p_blk, v_blk)
        return self.o_proj(out.reshape(b, t, nh * hd).astype(x.dtype), routes)


class DrafterLayer(nnx.Module):
    """x += attn(input_layernorm(x), ctx); x += mlp(post_attention_layernorm(x))."""

    def __init__(self, dcfg: DrafterConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        h, eps = dcfg.hidden_size, dcfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, zero_centered=False, dtype=dtype, rngs=rngs)
        self.self_attn = DrafterAttention(dcfg, layer_idx, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(h, eps, zero_centered=False, dtype=dtype, rngs=rngs)
        self.mlp = SwiGLU(h, dcfg.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, cache: KVCache, lengths, cos, sin, routes: Routes = REFERENCE):
        x = x + self.self_attn(self.input_layernorm(x), cache, lengths, cos, sin, routes)
        return x + self.mlp(self.post_attention_layernorm(x), routes)


class DrafterModel(nnx.Module):
    """DFlash drafter: fc + hidden_norm on target features, Qwen3 layers with KV injection, norm.

    No embedding and no LM head: the caller embeds the block with the target's embedding and
    applies the target's lm_head (see `draft_logits`).
    """

    def __init__(self, dcfg: DrafterConfig, *, rngs: nnx.Rngs, dtype=None):
        self.cfg = dcfg
        dtype = jnp.dtype(dtype or dcfg.dtype)
        self.compute_dtype = dtype.name  # activations' dtype (the kernels may be int8: models/int8.py)
        h, eps = dcfg.hidden_size, dcfg.rms_norm_eps
        self.fc = Linear(dcfg.fc_in_dim, h, dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(h, eps, zero_centered=False, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DrafterLayer(dcfg, i, dtype=dtype, rngs=rngs) for i in range(dcfg.num_layers)])
        self.norm = RMSNorm(h, eps, zero_centered=False, dtype=dtype, rngs=rngs)

    def _rope(self, positions):
        return rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta)

    def extend(self, cache: DrafterCache, features: jax.Array, n_valid: jax.Array, routes: Routes = REFERENCE
               ) -> DrafterCache:
        """Append the first n_valid[b] rows of features [B, T, K*H] to the context of sequence b."""
        b, t, _ = features.shape
        n_valid = n_valid.astype(jnp.int32)
        ctx = self.hidden_norm(self.fc(features.astype(self.compute_dtype), routes))
        offs = jnp.arange(t, dtype=jnp.int32)[None]
        positions = cache.lengths[:, None] + offs
        cos, sin = self._rope(positions)
        # Padding rows go to an out-of-range slot and are dropped, so nothing valid is overwritten.
        slots = jnp.where(offs < n_valid[:, None], positions, cache.capacity)
        # every layer's k / v projection reads ctx: XLA's dot merger would join them into products
        # over weights concatenated (copied) every call; a distinct handle each keeps them apart
        attn = [layer.self_attn for layer in self.layers]
        handles = distinct_operands(ctx, *[(p,) for a in attn for p in (a.k_proj, a.v_proj)])
        new_layers = []
        for i, (layer, lc) in enumerate(zip(self.layers, cache.layers)):
            k, v = layer.self_attn.kv(handles[2 * i], cos, sin, handles[2 * i + 1], routes)
            new_layers.append(KVCache(_scatter_kv(lc.k, k, slots), _scatter_kv(lc.v, v, slots)))
        return DrafterCache(tuple(new_layers), cache.lengths + n_valid)

    def __call__(self, block_embeds: jax.Array, cache: DrafterCache, routes: Routes = REFERENCE) -> jax.Array:
        """block_embeds [B, Bs, H] at positions cache.lengths[b] + j -> final-normed hidden [B, Bs, H]."""
        t = block_embeds.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        cos, sin = self._rope(positions)
        x = block_embeds.astype(self.compute_dtype)
        for layer, lc in zip(self.layers, cache.layers):
            x = layer(x, lc, cache.lengths, cos, sin, routes)
        return self.norm(x)
    def draft_hidden(self, target, bonus: jax.Array, cache: DrafterCache, block_size: int | None = None,
                     routes: Routes = REFERENCE) -> jax.Array:
        """Final-normed drafter hidden states [B, Bs-1, H] of block positions 1..Bs-1 after the bonus
        tokens [B] (the block embedded by the target). The cache is not modified."""
        dcfg = self.cfg
        embeds = target.embed_tokens(make_block(dcfg, bonus, block_size))
        if dcfg.input_embedding_scale != 1.0:
            embeds = embeds * jnp.asarray(dcfg.input_embedding_scale, embeds.dtype)
        return self(embeds, cache, routes)[:, 1:]

    def draft(self, target, bonus: jax.Array, cache: DrafterCache, block_size: int | None = None,
              routes: Routes = REFERENCE) -> jax.Array:
        """Draft logits float32 [B, Bs-1, V] for block positions 1..Bs-1 after the bonus tokens [B],
        with the target model's embedding and lm_head. The cache is not modified."""
        return logits_from_hidden(self.cfg, target, self.draft_hidden(target, bonus, cache, block_size, routes))


# ---- pure entry points (graphdef static, as ddtree_jax/decode.py) -------------------


@functools.partial(jax.jit, static_argnames=("graphdef",))
def extend_context(graphdef, params, dcache: DrafterCache, target_features, n_valid) -> DrafterCache:
    """Add committed tokens' target features [B, T, K*H] (n_valid[b] real rows) to the drafter context.

    fc + hidden_norm run once per token; each layer's k/v projections (k_norm, RoPE at absolute
    positions lengths[b] + t) are written at slots lengths[b] .. lengths[b] + n_valid[b] - 1.
    Callers should check capacity on the host (`check_drafter_fits`): rows past it are dropped.
    """
    model = nnx.merge(graphdef, params)
    return model.extend(dcache, target_features, n_valid)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def draft_hidden(graphdef, params, dcache: DrafterCache, block_embeds) -> jax.Array:
    """Drafter output [B, Bs, H] for a block [B, Bs, H] at positions dcache.lengths[b] .. + Bs - 1.

    block_embeds are the TARGET's embeddings of [bonus, MASK x (Bs-1)] (times the config's
    input_embedding_scale, which `draft_logits` applies). The cache is not modified.
    """
    model = nnx.merge(graphdef, params)
    return model(block_embeds, dcache)


def make_block(dcfg: DrafterConfig, bonus: jax.Array, block_size: int | None = None) -> jax.Array:
    """[B] bonus tokens -> block tokens [B, Bs] = [bonus, MASK x (Bs-1)]."""
    bs = block_size or dcfg.block_size
    mask = jnp.full((bonus.shape[0], bs - 1), dcfg.mask_token_id, jnp.int32)
    return jnp.concatenate([bonus.astype(jnp.int32)[:, None], mask], axis=1)


def logits_from_hidden(dcfg: DrafterConfig, target_model, hidden: jax.Array) -> jax.Array:
    """Target lm_head on drafter hidden states, with the drafter's output multiplier / softcap (float32)."""
    return finish_logits(dcfg, target_model.logits(hidden))


def finish_logits(dcfg: DrafterConfig, logits: jax.Array) -> jax.Array:
    """The drafter's output multiplier and softcap on float32 head logits."""
    if dcfg.output_multiplier != 1.0:
        logits = logits * dcfg.output_multiplier
    if dcfg.final_logit_softcapping is not None:
        cap = dcfg.final_logit_softcapping
        logits = jnp.tanh(logits / cap) * cap
    return logits


@functools.partial(jax.jit, static_argnames=("graphdef", "target_graphdef", "block_size"))
def draft_logits(graphdef, params, dcache: DrafterCache, target_graphdef, target_params, bonus, block_size=None):
    """Draft logits float32 [B, Bs-1, V] for block positions 1..Bs-1 after the bonus tokens [B].

    Embeds [bonus, MASK x (Bs-1)] with the target's embed_tokens, runs the drafter on the cached
    context and applies the target's lm_head (or tied embedding). The cache is not modified.
    """
    model = nnx.merge(graphdef, params)
    return model.draft(nnx.merge(target_graphdef, target_params), bonus, dcache, block_size)
