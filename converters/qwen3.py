"""Key maps for the Qwen3 family targets: qwen3, qwen3_5_text, qwen3_5, qwen3_next (dense or with
experts), qwen3_5_moe_text, qwen3_5_moe.

Sparse MoE layers (names after the prefix):
    layers.i.mlp.gate.weight [E, H]                      -> layers/i/mlp/router/kernel [H, E]
    layers.i.mlp.experts.gate_up_proj [E, 2I, H] (gate rows first) and .down_proj [E, H, I]
                                                         -> layers/i/mlp/experts/{gate_up_proj, down_proj}
                                                            [E, H, 2I] / [E, I, H] (each expert [in, out])
    layers.i.mlp.experts.{e}.{gate,up,down}_proj.weight  (per expert, as save_pretrained writes them):
                                                            stacked into the same two tensors
    layers.i.mlp.shared_expert.{gate,up,down}_proj.weight, layers.i.mlp.shared_expert_gate.weight [1, H]
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

import numpy as np

from converters.keymap import Rule, checked_linear, depthwise_conv, linear, stacked_linear
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
    Rule(L + r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight",
         r"layers/\1/linear_attn/\2/kernel", linear),
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


def _moe_rules(cfg: TargetConfig) -> list[Rule]:
    """Router, stacked experts and shared expert of the sparse layers; the shapes that follow from the
    config are checked in the transforms, so a wrong one is named with the config sizes it breaks."""
    h, e, inter = cfg.hidden_size, cfg.moe_num_experts, cfg.moe_intermediate_size
    sizes = f"num_experts {e}, moe_intermediate_size {inter}, hidden_size {h}"
    return [
        Rule(L + r"mlp\.gate\.weight", r"layers/\1/mlp/router/kernel",
             checked_linear((e, h), f"one router row per expert: num_experts {e}, hidden_size {h}")),
        Rule(L + r"mlp\.experts\.(gate_up_proj)", r"layers/\1/mlp/experts/\2",
             stacked_linear((e, 2 * inter, h), sizes)),
        Rule(L + r"mlp\.experts\.(down_proj)", r"layers/\1/mlp/experts/\2", stacked_linear((e, h, inter), sizes)),
        Rule(L + r"mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight", r"layers/\1/mlp/shared_expert/\2/kernel",
             linear),
        Rule(L + r"mlp\.shared_expert_gate\.weight", r"layers/\1/mlp/shared_expert_gate/kernel", linear),
    ]


def rules_for(cfg: TargetConfig) -> list[Rule]:
    rules = list(_COMMON)
    if cfg.sparse_ffn_layers:
        rules += _moe_rules(cfg)
    if cfg.model_type == "qwen3_next":
        rules += [
            Rule(L + r"linear_attn\.in_proj_qkvz\.weight", r"layers/\1/linear_attn", _split_qkvz(cfg)),
            Rule(L + r"linear_attn\.in_proj_ba\.weight", r"layers/\1/linear_attn", _split_ba(cfg)),
        ]
    return rules


def prefixes_for(cfg: TargetConfig) -> tuple[str, ...]:
    """Prefixes stripped from HF names (lm_head has none)."""
    if cfg.model_type in ("qwen3_5", "qwen3_5_moe"):
        return ("model.language_model.", "model.")
    return ("model.",)


def ignored_for(cfg: TargetConfig) -> tuple[str, ...]:
    """Tensors present in real checkpoints that the text target does not use."""
    ignored = [r".*rotary_emb\.inv_freq"]
    if cfg.model_type in ("qwen3_5", "qwen3_5_moe"):
        ignored += [r"model\.visual\..*", r"mtp\..*"]  # the vision tower and the MTP head: text target only
    if cfg.model_type in ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"):
        ignored += [r"mtp\..*"]
    if cfg.tie_word_embeddings:
        ignored += [r"lm_head\.weight"]  # some writers store the tied copy anyway
    return tuple(ignored)


_PER_EXPERT = re.compile(r"(.*\bmlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # stacked name -> parts, in order


def stack_experts(
    cfg: TargetConfig, names: Iterable[str], load: Callable[[str], np.ndarray], on_tensor=None,
    unavailable: Iterable[str] = (),
):
    """Present per-expert tensors (`...mlp.experts.{e}.{gate,up,down}_proj.weight`, what
    save_pretrained writes) as HF's stacked in-memory tensors `...mlp.experts.gate_up_proj`
    [E, 2I, H] (gate rows, then up rows, per expert) and `...mlp.experts.down_proj` [E, H, I], so
    the fused rules map both on-disk forms.

    A stacked tensor is read lazily, one layer at a time: its experts' tensors are loaded one by
    one into one preallocated array. Missing or unexpected experts and per-expert shapes that
    disagree with the config raise one ValueError per stacked tensor listing them all (collected by
    map_checkpoint with the other problems). Stacks with a part in `unavailable` (a missing shard,
    reported by the caller) are left out and listed as unavailable themselves.
    Returns (names, load, on_tensor, unavailable)."""
    groups: dict[str, dict[str, dict[int, str]]] = {}  # stacked name -> part -> expert -> tensor name

    def add(name: str) -> str | None:
        """Record a per-expert tensor; returns its stacked name (None for any other tensor)."""
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            return None
        part = m.group(3)
        kind = next(s for s, parts in _STACKS.items() if part in parts)
        stacked = m.group(1) + kind
        groups.setdefault(stacked, {p: {} for p in _STACKS[kind]})[part][int(m.group(2))] = name
        return stacked

    out: list[str] = []
    for name in names:
        stacked = add(name)
        if stacked is None:
            out.append(name)
        elif sum(map(len, groups[stacked].values())) == 1:  # the stack's first tensor: list it once
            out.append(stacked)
    other_unavailable, missing_shard = [], []
    for name in unavailable:
        stacked = add(name)
        if stacked is None:
            other_unavailable.append(name)
        elif stacked not in missing_shard:
            missing_shard.append(stacked)
    if not groups:
        return out, load, on_tensor, other_unavailable
    out = [n for n in out if n not in missing_shard]
    e, h, inter = cfg.moe_num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    part_shape = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}

    def ticks(name: str) -> None:
        if on_tensor is not None:
            for part in (n for parts in groups[name].values() for n in parts.values()) if name in groups else [name]:
                on_tensor(part)

    def stacked_load(name: str) -> np.ndarray:
        if name not in groups:
            return load(name)
        problems, stack = [], None
        for part, experts in groups[name].items():
            missing, extra = sorted(set(range(e)) - set(experts)), sorted(set(experts) - set(range(e)))
            if missing:
                problems.append(f"{part} missing for experts {_ids(missing)}")
            if extra:
                problems.append(f"{part} of experts {_ids(extra)} beyond num_experts {e}")
        for col, part in enumerate(groups[name]):
            for i in range(e):
                if i not in groups[name][part]:
                    continue
                w = np.asarray(load(groups[name][part][i]))
                if tuple(w.shape) != part_shape[part]:
                    problems.append(
                        f"expert {i} {part} has shape {tuple(w.shape)}, the config needs {part_shape[part]}")
                    continue
                if problems:
                    continue  # keep checking shapes, fill nothing
                if stack is None:
                    rows = part_shape[part][0]
                    stack = np.empty((e, rows * len(groups[name]), part_shape[part][1]), w.dtype)
                stack[i, col * w.shape[0]:(col + 1) * w.shape[0]] = w
        if problems:
            raise ValueError("per-expert tensors: " + "; ".join(problems))
        return stack

    return out, stacked_load, ticks, other_unavailable + missing_shard


def _ids(ids: list[int], limit: int = 12) -> str:
    shown = ", ".join(map(str, ids[:limit]))
    return f"[{shown}{', ...' if len(ids) > limit else ''}] ({len(ids)})"
