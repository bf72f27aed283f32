"""Key maps for the Mamba2 family targets: mamba2 (Mamba2ForCausalLM), bamba, nemotron_h.

Names after the prefix is stripped:
- mamba2:      backbone.{embeddings, layers.i.{norm, mixer.*}, norm_f}, lm_head (older files: embedding.)
- bamba:       model.{embed_tokens, layers.i.{input_layernorm, pre_ff_layernorm, mamba.* | self_attn.*,
               feed_forward.*}, final_layernorm}, lm_head
- nemotron_h:  backbone.{embeddings, layers.i.{norm, mixer.*}, norm_f}, lm_head on disk; HF renames
               `backbone.` to `model.` in memory, so a torch state dict says `model.` (both accepted).
               MoE experts are per expert on disk (mixer.experts.{e}.{up,down}_proj.weight) and fused in
               memory (mixer.experts.up_proj [E, I, H], down_proj [E, H, I]): both accepted.
Mamba2 mixer tensors: in_proj [I + conv_dim + H, hidden] (+ bias), conv1d.weight [conv_dim, 1, K]
and conv1d.bias, dt_bias / A_log / D [H], norm.weight [I] (grouped gated RMSNorm), out_proj.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

import numpy as np

from converters.keymap import Rule, depthwise_conv, linear
from ddtree_jax.config import ATTENTION, MAMBA2, MLP, MOE, TargetConfig

MODEL_TYPES = ("mamba2", "bamba", "nemotron_h")
L = r"layers\.(\d+)\."


def _mamba_rules(src: str) -> list[Rule]:
    """Mixer tensors under layers.i.<src>. -> layers/i/mamba/..."""
    m = L + re.escape(src) + r"\."
    return [
        Rule(m + r"(in_proj|out_proj)\.weight", r"layers/\1/mamba/\2/kernel", linear),
        Rule(m + r"(in_proj|out_proj)\.bias", r"layers/\1/mamba/\2/bias"),
        Rule(m + r"conv1d\.weight", r"layers/\1/mamba/conv_weight", depthwise_conv),
        Rule(m + r"conv1d\.bias", r"layers/\1/mamba/conv_bias"),
        Rule(m + r"(dt_bias|A_log|D)", r"layers/\1/mamba/\2"),
        Rule(m + r"norm\.weight", r"layers/\1/mamba/norm/weight"),
    ]


def _experts(w: np.ndarray) -> np.ndarray:
    """Fused HF experts [E, out, in] -> [E, in, out]."""
    if w.ndim != 3:
        raise ValueError(f"expected fused expert weights [E, out, in], got shape {tuple(w.shape)}")
    return np.ascontiguousarray(np.swapaxes(w, 1, 2))


_MAMBA2 = [
    Rule(r"(?:embeddings|embedding)\.weight", "embed_tokens/embedding"),
    Rule(r"norm_f\.weight", "norm/weight"),
    Rule(r"lm_head\.weight", "lm_head/kernel", linear),
    Rule(L + r"norm\.weight", r"layers/\1/input_layernorm/weight"),
    *_mamba_rules("mixer"),
]

_BAMBA = [
    Rule(r"embed_tokens\.weight", "embed_tokens/embedding"),
    Rule(r"final_layernorm\.weight", "norm/weight"),
    Rule(r"lm_head\.weight", "lm_head/kernel", linear),
    Rule(L + r"input_layernorm\.weight", r"layers/\1/input_layernorm/weight"),
    Rule(L + r"pre_ff_layernorm\.weight", r"layers/\1/post_attention_layernorm/weight"),
    Rule(L + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", r"layers/\1/self_attn/\2/kernel", linear),
    Rule(L + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.bias", r"layers/\1/self_attn/\2/bias"),
    Rule(L + r"feed_forward\.(gate_proj|up_proj|down_proj)\.weight", r"layers/\1/mlp/\2/kernel", linear),
    Rule(L + r"feed_forward\.(gate_proj|up_proj|down_proj)\.bias", r"layers/\1/mlp/\2/bias"),
    *_mamba_rules("mamba"),
]


def _nemotron_rules(cfg: TargetConfig) -> list[Rule]:
    def layers_of(kind: str) -> str:
        ids = [str(i) for i, t in enumerate(cfg.layer_types) if t == kind]
        return r"layers\.(" + "|".join(ids) + r")\." if ids else r"layers\.(?!)(\d+)\."

    m, a, f, e = layers_of(MAMBA2), layers_of(ATTENTION), layers_of(MLP), layers_of(MOE)
    rules = [
        Rule(r"embeddings\.weight", "embed_tokens/embedding"),
        Rule(r"norm_f\.weight", "norm/weight"),
        Rule(r"lm_head\.weight", "lm_head/kernel", linear),
        Rule(L + r"norm\.weight", r"layers/\1/input_layernorm/weight"),
        Rule(a + r"mixer\.(q_proj|k_proj|v_proj|o_proj)\.weight", r"layers/\1/self_attn/\2/kernel", linear),
        Rule(f + r"mixer\.(up_proj|down_proj)\.weight", r"layers/\1/mlp/\2/kernel", linear),
        Rule(f + r"mixer\.(up_proj|down_proj)\.bias", r"layers/\1/mlp/\2/bias"),
        Rule(e + r"mixer\.gate\.weight", r"layers/\1/moe/router", linear),
        Rule(e + r"mixer\.gate\.e_score_correction_bias", r"layers/\1/moe/correction_bias"),
        Rule(e + r"mixer\.experts\.(up_proj|down_proj)(?:\.weight)?", r"layers/\1/moe/\2", _experts),
        Rule(e + r"mixer\.shared_experts\.(up_proj|down_proj)\.weight", r"layers/\1/moe/shared_experts/\2/kernel",
             linear),
        Rule(e + r"mixer\.shared_experts\.(up_proj|down_proj)\.bias", r"layers/\1/moe/shared_experts/\2/bias"),
        Rule(e + r"mixer\.(fc1_latent_proj|fc2_latent_proj)\.weight", r"layers/\1/moe/\2/kernel", linear),
        Rule(e + r"mixer\.(fc1_latent_proj|fc2_latent_proj)\.bias", r"layers/\1/moe/\2/bias"),
    ]
    for rule in _mamba_rules("mixer"):
        rules.append(Rule(m + rule.pattern[len(L):], rule.dest, rule.transform))
    return rules


def rules_for(cfg: TargetConfig) -> list[Rule]:
    if cfg.model_type == "mamba2":
        return list(_MAMBA2)
    if cfg.model_type == "bamba":
        return list(_BAMBA)
    return _nemotron_rules(cfg)


def prefixes_for(cfg: TargetConfig) -> tuple[str, ...]:
    """Prefixes stripped from HF names (lm_head has none)."""
    if cfg.model_type == "bamba":
        return ("model.",)
    return ("backbone.", "model.")


def ignored_for(cfg: TargetConfig) -> tuple[str, ...]:
    """Tensors present in real checkpoints that the target does not use."""
    ignored = [r".*rotary_emb\.inv_freq"]
    if cfg.model_type == "nemotron_h":
        ignored += [r"mtp\..*"]  # multi-token-prediction layers (HF ignores them too)
    if cfg.tie_word_embeddings:
        ignored += [r"lm_head\.weight"]  # some writers store the tied copy anyway
    return tuple(ignored)


_PER_EXPERT = re.compile(r"(.*\bmixer\.experts\.)(\d+)\.(up_proj|down_proj)\.weight")


def fuse_experts(
    cfg: TargetConfig, names: Iterable[str], load: Callable[[str], np.ndarray], on_tensor=None
) -> tuple[list[str], Callable[[str], np.ndarray], Callable[[str], None] | None]:
    """Present per-expert NemotronH tensors (the on-disk layout) as HF's fused in-memory tensors
    `...mixer.experts.{up,down}_proj` [E, out, in], so one Rule maps each to one parameter.

    The fused tensor is read lazily (one layer's experts at a time); a layer with missing or extra
    experts raises ValueError when read, which map_checkpoint reports with the tensor's name.
    Returns (names, load, on_tensor); the returned on_tensor reports every underlying tensor once."""
    names = list(names)
    groups: dict[str, dict[int, str]] = {}
    out: list[str] = []
    for name in names:
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            out.append(name)
            continue
        fused = f"{m.group(1)}{m.group(3)}"
        if fused not in groups:
            groups[fused] = {}
            out.append(fused)
        groups[fused][int(m.group(2))] = name
    if not groups:
        return names, load, on_tensor
    e = cfg.moe_num_experts

    def ticks(name: str) -> None:
        if on_tensor is not None:
            for part in groups[name].values() if name in groups else [name]:
                on_tensor(part)

    def fused_load(name: str) -> np.ndarray:
        if name not in groups:
            return load(name)
        parts = groups[name]
        missing = sorted(set(range(e)) - set(parts))
        extra = sorted(set(parts) - set(range(e)))
        if missing or extra:
            raise ValueError(
                f"per-expert tensors do not cover experts 0..{e - 1}: missing {missing[:8]}, unexpected {extra[:8]}"
            )
        return np.stack([np.asarray(load(parts[i])) for i in range(e)], axis=0)

    return out, fused_load, ticks
