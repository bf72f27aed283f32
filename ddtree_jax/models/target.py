"""The hybrid target stack, driven by the config's layer pattern: Qwen3 / Qwen3.5 / Qwen3-Next
(attention + Gated DeltaNet; each block's FFN dense or a sparse MoE, cfg.ffn_types), Bamba
(attention + Mamba2), NemotronH (one mixer per block: Mamba2, attention, relu^2 MLP or MoE) and
Mamba2ForCausalLM (pure Mamba2).

Every token mixer offers the same entry points (models/mixer.py: append, tree, commit), so a
decoder layer and `verify` / `commit` below drive any pattern generically. Blocks without a cache
(NemotronH "mlp" / "moe") have layer cache None and pending None.

Layers are a Python list run unrolled under jit: a lax.scan over stacked layer weights ran
2.8x slower on the H200 (docs/decisions/0004-unrolled-layers.md).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import KVCache, TargetCache
from ddtree_jax.config import ATTENTION, GDN, MAMBA2, MLP, MOE, TargetConfig
from ddtree_jax.models.attention import Attention, write_kv
from ddtree_jax.models.gdn import GatedDeltaNet
from ddtree_jax.models.layers import Embedding, Linear, RMSNorm, Relu2MLP, SplitKParts, SwiGLU, dense
from ddtree_jax.models.mamba2 import Mamba2Mixer
from ddtree_jax.models.mixer import Step
from ddtree_jax.models.moe import NemotronMoE, SparseMoeBlock
from ddtree_jax.routes import REFERENCE, Routes
from ddtree_jax.tree import Tree, TreeGeometry, chain_geometry, geometry
from pallas_kernels.add_rms_norm import add_rms_norm
from pallas_kernels.ref.rope import apply_rope, rope_cos_sin


class Stream(NamedTuple):
    """The residual stream as x + delta: the add is left to the next norm, which does both in one
    kernel (routes.add_norm_kernel)."""

    x: jax.Array
    delta: jax.Array

    def total(self) -> jax.Array:
        return self.x + dense(self.delta, self.x.dtype)


def add_norm(norm: RMSNorm, x: jax.Array, delta, routes: Routes):
    """(x + delta, norm(x + delta)) in one kernel launch; delta may be SplitKParts (the kernel adds
    the partial products too)."""
    mode = "zero_centered" if norm.zero_centered else "fp32_weight" if norm.weight_fp32 else "plain"
    delta = delta.parts if isinstance(delta, SplitKParts) else delta
    return add_rms_norm(x, delta, norm.weight[...], eps=norm.eps, mode=mode, impl=routes.impl)


def fuses_add_norm(cfg: TargetConfig, routes: Routes, tokens: int) -> bool:
    """Whether the residual adds of a call of `tokens` tokens a row run inside the norms' kernels:
    with kernels on and a stream in the params dtype (not Mamba2ForCausalLM's float32 stream), in
    blocks with an FFN (Qwen3 / Qwen3.5 / Bamba) always, in one-mixer blocks (NemotronH) from
    routes.add_norm_one_mixer_min_tokens tokens a row (decision 0072)."""
    if not (routes.kernels and routes.add_norm_kernel) or cfg.residual_in_fp32:
        return False
    return cfg.block_ffn or tokens >= routes.add_norm_one_mixer_min_tokens


class PlainAttention(Attention):
    """Attention without q/k norms or output gate (Bamba, NemotronH); RoPE only if rotary_dim > 0.
    Reuses Attention's append / tree / commit entry points through `project`."""

    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        h, nh, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(h, nh * hd, bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, kv * hd, bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, kv * hd, bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nh * hd, h, bias=bias, dtype=dtype, rngs=rngs)

    def project(self, x: jax.Array, positions: jax.Array, routes: Routes = REFERENCE, cache: KVCache | None = None):
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x, routes).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x, routes).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x, routes).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.rotary_dim:
            cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            return q, k, v, None
        return q, k, v, None, write_kv(cache, k, v, positions[:, 0])


def _ffn(cfg: TargetConfig, inter: int, *, dtype, rngs, kind: str = MLP):
    if kind == MOE:  # a sparse FFN slot (Qwen3.5-MoE, Qwen3-Next)
        return SparseMoeBlock(cfg, dtype=dtype, rngs=rngs)
    if cfg.mlp_kind == "relu2":
        return Relu2MLP(cfg.hidden_size, inter, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
    return SwiGLU(cfg.hidden_size, inter, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)


# The attribute each kind's mixer lives under (the checkpoint's parameter paths).
MIXER_ATTRS = {ATTENTION: "self_attn", GDN: "linear_attn", MAMBA2: "mamba", MOE: "moe", MLP: "mlp"}


def _mixer(cfg: TargetConfig, kind: str, *, dtype, rngs: nnx.Rngs):
    if kind == ATTENTION:
        plain = not cfg.qk_norm and not cfg.attn_output_gate
        return (PlainAttention if plain else Attention)(cfg, dtype=dtype, rngs=rngs)
    if kind == GDN:
        return GatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
    if kind == MAMBA2:
        return Mamba2Mixer(cfg, dtype=dtype, rngs=rngs)
    if kind == MOE:
        return NemotronMoE(cfg, dtype=dtype, rngs=rngs)
    return _ffn(cfg, cfg.intermediate_size, dtype=dtype, rngs=rngs)  # MLP


class DecoderLayer(nnx.Module):
    """x += mixer(input_layernorm(x)); then, if cfg.block_ffn, x += mlp(post_attention_layernorm(x)).

    The mixer (models/mixer.py) is attention (`self_attn`), Gated DeltaNet (`linear_attn`), Mamba2
    (`mamba`), or, in one-mixer-per-block models (NemotronH), a relu^2 MLP (`mlp`) or a MoE (`moe`)
    without a cache.
    """

    def __init__(self, cfg: TargetConfig, kind: str, *, dtype, rngs: nnx.Rngs, ffn: str = MLP):
        """ffn: the FFN slot's kind when cfg.block_ffn (cfg.ffn_kinds[i]): MLP or MOE (SparseMoeBlock)."""
        if kind not in MIXER_ATTRS:
            raise ValueError(f"unknown layer kind {kind!r}")
        if kind == MLP and cfg.block_ffn:
            raise ValueError("an 'mlp' mixer block needs block_ffn=False")
        self.kind = kind
        self.block_ffn = cfg.block_ffn
        self.residual_in_fp32 = cfg.residual_in_fp32
        zc, eps, w32 = cfg.norm_zero_centered, cfg.rms_norm_eps, cfg.norm_weight_fp32
        norm = lambda: RMSNorm(cfg.hidden_size, eps, zero_centered=zc, dtype=dtype, rngs=rngs, weight_fp32=w32)
        self.input_layernorm = norm()
        setattr(self, MIXER_ATTRS[kind], _mixer(cfg, kind, dtype=dtype, rngs=rngs))
        if cfg.block_ffn:
            self.post_attention_layernorm = norm()
            self.mlp = _ffn(cfg, cfg.intermediate_size, dtype=dtype, rngs=rngs, kind=ffn)
        if not cfg.residual_in_fp32:  # the add + norm kernels take split-K partials
            out = {ATTENTION: "o_proj", GDN: "out_proj", MAMBA2: "out_proj", MLP: "down_proj"}.get(kind)
            down = [self.mlp.down_proj] if cfg.block_ffn and isinstance(self.mlp, (SwiGLU, Relu2MLP)) else []
            for proj in ([getattr(self.mixer(), out)] if out else []) + down:
                proj.split_k_out = True
            if cfg.block_ffn and isinstance(self.mlp, SparseMoeBlock):  # its experts' weighted products
                self.mlp.parts_out = True  # (NemotronH's MoE sums its own)

    def mixer(self):
        return getattr(self, MIXER_ATTRS[self.kind])

    def _pre(self, x, routes: Routes):
        """(residual, normed input) as HF: the norm reads x in the params dtype; Mamba2ForCausalLM
        keeps the residual stream in float32. A Stream's pending add runs inside the norm's kernel."""
        if isinstance(x, Stream):
            return add_norm(self.input_layernorm, x.x, x.delta, routes)
        w = self.input_layernorm.weight[...]
        residual = x.astype(jnp.float32) if self.residual_in_fp32 else x
        return residual, self.input_layernorm(x.astype(w.dtype) if self.residual_in_fp32 else x)

    def _post(self, residual, h, routes: Routes, fused: bool):
        if fused and not self.block_ffn:
            return Stream(residual, h)  # the next norm adds the mixer's output
        if fused:
            x, normed = add_norm(self.post_attention_layernorm, residual, h, routes)
            return Stream(x, self.mlp(normed, routes))  # the next norm adds the MLP's output
        x = residual + dense(h, residual.dtype)
        if self.block_ffn:
            x = x + dense(self.mlp(self.post_attention_layernorm(x), routes), x.dtype)
        return x

    def __call__(self, x, layer_cache, step: Step, routes: Routes = REFERENCE, fused: bool = False):
        """Append tokens. x: the stream (an array, or a Stream when `fused`: the residual adds then
        run inside the norms' kernels and the layer returns a Stream)."""
        residual, h = self._pre(x, routes)
        h, layer_cache = self.mixer().append(h, layer_cache, step, routes)
        return self._post(residual, h, routes, fused), layer_cache

    def tree(self, x, layer_cache, start, geo: TreeGeometry, routes: Routes = REFERENCE, fused: bool = False):
        """Tree (or chain: geo.conv_src None) pass of this layer; returns (x, pending). Writes nothing."""
        residual, h = self._pre(x, routes)
        h, pending = self.mixer().tree(h, layer_cache, geo, start, routes)
        return self._post(residual, h, routes, fused), pending

    def commit(self, pending, path, count, layer_cache, start, routes: Routes = REFERENCE):
        return self.mixer().commit(pending, path, count, layer_cache, start, routes)


class TargetModel(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype=None):
        self.cfg = cfg
        dtype = jnp.dtype(dtype or cfg.dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, kind, dtype=dtype, rngs=rngs, ffn=ffn)
                                for kind, ffn in zip(cfg.layer_types, cfg.ffn_kinds)])
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, zero_centered=cfg.norm_zero_centered, dtype=dtype, rngs=rngs,
            weight_fp32=cfg.norm_weight_fp32,
        )
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs))

    def logits(self, h: jax.Array) -> jax.Array:
        if self.cfg.residual_in_fp32:  # HF Mamba2: the float32 stream meets the head in the params dtype
            h = h.astype(self.embed_tokens.embedding[...].dtype)
        out = self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        return out.astype(jnp.float32)

    def _run(self, x, step, hidden_ids, routes: Routes):
        """Embed -> every layer via step(i, layer, x, fused) -> final norm; collects chosen hidden
        states. fused: the stream between layers is a Stream (`fuses_add_norm`)."""
        fused = fuses_add_norm(self.cfg, routes, x.shape[1])
        saved = {0: x} if 0 in hidden_ids else {}
        outs = []
        for i, layer in enumerate(self.layers):
            x, out = step(i, layer, x, fused)
            outs.append(out)
            if i + 1 in hidden_ids and i + 1 < self.cfg.num_layers:
                saved[i + 1] = x.total() if isinstance(x, Stream) else x
        x = add_norm(self.norm, x.x, x.delta, routes)[1] if isinstance(x, Stream) else self.norm(x)
        saved[self.cfg.num_layers] = x
        features = jnp.concatenate([saved[i] for i in hidden_ids], axis=-1) if hidden_ids else None
        return x, features, tuple(outs)

    def verify(self, tokens: jax.Array, cache: TargetCache, tree: Tree | None, *, hidden_ids=(),
               routes: Routes = REFERENCE):
        """One forward over draft nodes without touching the committed state.

        tokens [B, N]; tree None means a chain at positions lengths + t (linear DFlash, plain causal
        forms); otherwise every node sees the committed prefix and its own ancestors only.
        Returns (final hidden [B,N,H], features, per-layer pending for `commit`).
        """
        start = cache.lengths
        if tree is None:
            geo = chain_geometry(start, tokens.shape[1])
        else:
            geo = geometry(tree, self.cfg.conv_kernel)
        step = lambda i, layer, x, fused: layer.tree(x, cache.layers[i], start, geo, routes, fused)
        return self._run(self.embed_tokens(tokens), step, hidden_ids, routes)

    def commit(self, pending, path: jax.Array, count: jax.Array, cache: TargetCache, routes: Routes = REFERENCE
               ) -> TargetCache:
        """Commit the accepted nodes path [B, P] (first count[b] real, root first) after the prefix."""
        start = cache.lengths
        layers = tuple(
            layer.commit(p, path, count, c, start, routes) for layer, p, c in zip(self.layers, pending, cache.layers)
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
        routes: Routes = REFERENCE,
    ):
        """Append tokens [B, T] (the first n_valid[b] of each row are real) after the committed ones;
        routes: which kernels the layers take (ddtree_jax/routes.py).

        Returns (final normed hidden [B,T,H], features [B,T,len(hidden_ids)*H] or None, new cache).
        hidden_ids index HF's `hidden_states`: 0 = embeddings, i = output of layer i-1, and
        num_layers = the final normed output (HF ties the last entry to it).
        """
        start = cache.lengths
        where = Step(start, n_valid, chunked)
        step = lambda i, layer, x, fused: layer(x, cache.layers[i], where, routes, fused)
        x, features, layers = self._run(self.embed_tokens(tokens), step, hidden_ids, routes)
        return x, features, TargetCache(layers, start + n_valid.astype(jnp.int32))
