"""Key maps for the Qwen3 family targets: qwen3, qwen3_5_text, qwen3_5, qwen3_next (dense)."""

from __future__ import annotations

import numpy as np

from converters.keymap import Rule, depthwise_conv, linear
from ddtree_jax.config import TargetConfig

L = r"layers\.(\d+)\."

_COMMON = [
    Rule(r"embed_tokens\.weight", "embed_tokens/embedding"),
    Rule(r"norm\.weight", "norm/weight"),
    Rule(r"lm_head\.weight", "lm_head/kernel", linear),
    Rule(L + r"(input_layernorm|post_attention_layernorm)\.weight", r"layers/\1/\2/weight"),
    Rule(L + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", r"layers/\1/self_attn/\2/kernel", linear),
    Rule(L + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.bias", r"layers/\1/self_attn/\2/bias"),
    Rule(L + r"self_attn\.(q_norm|k_norm)\.weight", r"layers/\1/self_attn/\2/weight"),
    Rule(L + r"mlp\.(gate_proj|up_proj|down_proj)\.weight", r"layers/\1/mlp/\2/kernel", linear),
    Rule(L + r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight", r"layers/\1/linear_attn/\2/kernel", linear),
    Rule(L + r"linear_attn\.conv1d\.weight", r"layers/\1/linear_attn/conv_weight", depthwise_conv),
    Rule(L + r"linear_attn\.(dt_bias|A_log)", r"layers/\1/linear_attn/\2"),
    Rule(L + r"linear_attn\.norm\.weight", r"layers/\1/linear_attn/norm/weight"),
]


def _split_qkvz(cfg: TargetConfig):
    """Qwen3-Next in_proj_qkvz [Hk*(2dk + 2r dv), H], grouped per k-head -> qkv and z kernels."""
    hk, dk, dv = cfg.gdn_num_k_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim
    r = cfg.gdn_num_v_heads // hk

    def split(w: np.ndarray) -> dict[str, np.ndarray]:
        per = 2 * dk + 2 * r * dv
        if w.ndim != 2 or w.shape[0] != hk * per:
            raise ValueError(f"in_proj_qkvz has shape {tuple(w.shape)}, expected ({hk * per}, hidden)")
        g = w.reshape(hk, per, w.shape[1])
        q, k, v, z = np.split(g, np.cumsum([dk, dk, r * dv])[:3], axis=1)
        flat = lambda a: a.reshape(-1, w.shape[1])
        qkv = np.concatenate([flat(q), flat(k), flat(v)], axis=0)
        return {"in_proj_qkv/kernel": linear(qkv), "in_proj_z/kernel": linear(flat(z))}

    return split


def _split_ba(cfg: TargetConfig):
    """Qwen3-Next in_proj_ba [2 Hv, H] grouped per k-head as [b_g (r) | a_g (r)]."""
    hk = cfg.gdn_num_k_heads
    r = cfg.gdn_num_v_heads // hk

    def split(w: np.ndarray) -> dict[str, np.ndarray]:
        if w.ndim != 2 or w.shape[0] != 2 * hk * r:
            raise ValueError(f"in_proj_ba has shape {tuple(w.shape)}, expected ({2 * hk * r}, hidden)")
        g = w.reshape(hk, 2 * r, w.shape[1])
        b, a = g[:, :r].reshape(-1, w.shape[1]), g[:, r:].reshape(-1, w.shape[1])
        return {"in_proj_b/kernel": linear(b), "in_proj_a/kernel": linear(a)}

    return split


def rules_for(cfg: TargetConfig) -> list[Rule]:
    rules = list(_COMMON)
    if cfg.model_type == "qwen3_next":
        rules += [
            Rule(L + r"linear_attn\.in_proj_qkvz\.weight", r"layers/\1/linear_attn", _split_qkvz(cfg)),
            Rule(L + r"linear_attn\.in_proj_ba\.weight", r"layers/\1/linear_attn", _split_ba(cfg)),
        ]
    return rules


def prefixes_for(cfg: TargetConfig) -> tuple[str, ...]:
    """Prefixes stripped from HF names (lm_head has none)."""
    if cfg.model_type == "qwen3_5":
        return ("model.language_model.", "model.")
    return ("model.",)


def ignored_for(cfg: TargetConfig) -> tuple[str, ...]:
    """Tensors present in real checkpoints that the text target does not use."""
    ignored = [r".*rotary_emb\.inv_freq"]
    if cfg.model_type == "qwen3_5":
        ignored += [r"model\.visual\..*", r"mtp\..*"]
    if cfg.model_type in ("qwen3_5_text", "qwen3_next"):
        ignored += [r"mtp\..*"]
    if cfg.tie_word_embeddings:
        ignored += [r"lm_head\.weight"]  # some writers store the tied copy anyway
    return tuple(ignored)
