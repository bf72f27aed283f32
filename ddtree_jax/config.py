"""Target model configuration, parsed and validated from a Hugging Face config.json.

One frozen dataclass describes every supported target family; it is hashable so jitted
functions can take it as a static argument. Parsing collects every problem before raising,
so a user with a broken config sees all of them at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from ddtree_jax import config_mamba
from ddtree_jax.config_fields import (  # noqa: F401 (re-exported: the project imports them from here)
    ATTENTION,
    GDN,
    MAMBA2,
    MLP,
    MOE,
    MIXER_KINDS,
    RECURRENT_KINDS,
    FFN_KINDS,
    ROUTER_SOFTMAX,
    ROUTER_SIGMOID_GROUPED,
    QWEN_MOE_MODEL_TYPES,
    QWEN_WRAPPER_MODEL_TYPES,
    QWEN_MODEL_TYPES,
    MAMBA_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    DTYPES,
    ConfigError,
    FieldReader,
    read_rope,
    read_dtype,
    read_eos,
)


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Everything the JAX target model needs, in this project's own terms."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]  # per layer: one of MIXER_KINDS
    # attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    attn_output_gate: bool  # Qwen3.5 / Qwen3-Next gated attention (q_proj carries a gate per head)
    attention_bias: bool
    # norms
    rms_norm_eps: float
    norm_zero_centered: bool  # out = norm(x) * (1 + w) for the block / final / q,k norms
    # Gated DeltaNet
    gdn_num_k_heads: int = 0
    gdn_num_v_heads: int = 0
    gdn_k_head_dim: int = 0
    gdn_v_head_dim: int = 0
    conv_kernel: int = 4
    # embedding and outputs
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # ---- block structure (defaults: the Qwen3 family) ----
    # block_ffn: every block is x += mixer(norm(x)); x += ffn(norm2(x)) (Qwen, Bamba). False: one
    # mixer per block, x += mixer(norm(x)), where the mixer may be an MLP / MoE (NemotronH, Mamba2).
    block_ffn: bool = True
    mlp_kind: str = "swiglu"  # "swiglu": down(silu(gate x) * up x); "relu2": down(relu(up x)^2)
    # block_ffn models: per layer, the FFN slot's kind: MLP (dense, mlp_kind) or MOE (sparse mixture of
    # experts, moe_* below). Empty: every layer MLP.
    ffn_types: tuple[str, ...] = ()
    mlp_bias: bool = False
    qk_norm: bool = True  # RMSNorm on q and k per head (Qwen3); rotary_dim = 0 means no RoPE
    # RMSNorm: (w_f32 * normed_f32).astype(x) (NemotronH) instead of w * normed.astype(x)
    norm_weight_fp32: bool = False
    residual_in_fp32: bool = False  # keep the residual stream in float32 (Mamba2ForCausalLM)
    # ---- Mamba2 / SSD mixer (conv_kernel above is shared) ----
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_n_groups: int = 1
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False  # bias on in_proj / out_proj
    # dt = clip(softplus(dt_raw + dt_bias), *mamba_dt_limit) in prefill, decode AND tree verify
    # (one function on every path; see ddtree_jax/models/mamba2.py for why).
    mamba_dt_limit: tuple[float, float] = (0.0, float("inf"))
    # ---- mixture of experts: Qwen (softmax router, gated shared SwiGLU expert) or NemotronH (sigmoid
    # router, grouped top-k, relu^2 shared expert); n_group .. latent_size are NemotronH's only ----
    moe_router: str = ""  # ROUTER_SOFTMAX or ROUTER_SIGMOID_GROUPED
    moe_num_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    moe_shared_intermediate_size: int = 0
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_norm_topk_prob: bool = True
    moe_routed_scaling_factor: float = 1.0
    moe_latent_size: int = 0  # 0: experts read the hidden size directly

    # ---- derived sizes -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def gdn_key_dim(self) -> int:
        return self.gdn_num_k_heads * self.gdn_k_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn_num_v_heads * self.gdn_v_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.mamba_n_groups * self.mamba_state_size

    @property
    def conv_dim(self) -> int:
        """Channels of the recurrent layers' short conv (a model has GDN or Mamba2 layers, not both)."""
        return self.mamba_conv_dim if MAMBA2 in self.layer_types else self.gdn_conv_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t in RECURRENT_KINDS)

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        """Per layer, the kind of the block's FFN slot (MLP or MOE); meaningful when block_ffn."""
        return self.ffn_types or (MLP,) * self.num_layers

    @property
    def sparse_ffn_layers(self) -> tuple[int, ...]:
        """Layers whose FFN slot is a mixture of experts (block_ffn models)."""
        return tuple(i for i, t in enumerate(self.ffn_kinds) if t == MOE) if self.block_ffn else ()

    def replace(self, **changes: Any) -> "TargetConfig":
        return dataclasses.replace(self, **changes)

    # ---- parsing -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "TargetConfig":
        return _parse_target(raw, source)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TargetConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            return cls.from_hf_dict(json.load(f), source=path)


def _layer_types(reader: FieldReader, num_layers: int) -> tuple[str, ...]:
    raw_types = reader.raw.get("layer_types")
    if raw_types is None:
        interval = reader.raw.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval <= 0:
            reader.problems.append(f"full_attention_interval must be a positive integer, got {interval!r}")
            interval = 4
        return tuple(ATTENTION if (i + 1) % interval == 0 else GDN for i in range(num_layers))
    names = {"full_attention": ATTENTION, "linear_attention": GDN}
    out = []
    for i, t in enumerate(raw_types):
        if t not in names:
            reader.problems.append(f"layer_types[{i}] = {t!r} is not one of {sorted(names)}")
            out.append(ATTENTION)
        else:
            out.append(names[t])
    if num_layers and len(out) != num_layers:
        reader.problems.append(f"layer_types has {len(out)} entries but num_hidden_layers = {num_layers}")
    return tuple(out)


def _parse_target(raw: Mapping[str, Any], source: str) -> TargetConfig:
    problems: list[str] = []
    if not isinstance(raw, Mapping):
        raise ConfigError([f"expected a JSON object, got {type(raw).__name__}"], source)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            [f"unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"], source
        )
    if model_type in MAMBA_MODEL_TYPES:
        return _mamba_family(raw, model_type, source)
    outer = raw
    if model_type in QWEN_WRAPPER_MODEL_TYPES:
        text = raw.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError([f"model_type {model_type!r} needs a 'text_config' object"], source)
        # Fields the composite config keeps at top level (dtype, tie) are defaults for the text part.
        merged = {k: outer[k] for k in ("dtype", "torch_dtype") if outer.get(k) is not None}
        merged.update({k: v for k, v in text.items() if v is not None or k not in merged})  # null: no override
        # Qwen3_5(Moe)ForConditionalGeneration ties lm_head by the TOP-LEVEL flag; text_config keeps its
        # own (ignored) copy, which save_pretrained always writes.
        if "tie_word_embeddings" in outer:
            merged["tie_word_embeddings"] = outer["tie_word_embeddings"]
        raw = merged
    r = FieldReader(raw, problems)
    hidden = r.positive_int("hidden_size")
    num_heads = r.positive_int("num_attention_heads")
    num_kv = r.positive_int("num_key_value_heads", num_heads or None)
    head_dim = r.positive_int("head_dim", (hidden // num_heads) if hidden and num_heads else None)
    num_layers = r.positive_int("num_hidden_layers")
    vocab = r.positive_int("vocab_size")
    eps = float(r.get("rms_norm_eps", 1e-6))
    qwen35_like = model_type != "qwen3"
    rotary_dim, theta = read_rope(r, head_dim, 0.25 if qwen35_like else 1.0)
    if num_heads and num_kv and num_heads % num_kv:
        problems.append(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv})")
    fields: dict[str, Any] = {}
    if qwen35_like:
        layer_types = _layer_types(r, num_layers)
        if GDN in layer_types:
            fields = dict(
                gdn_num_k_heads=r.positive_int("linear_num_key_heads"),
                gdn_num_v_heads=r.positive_int("linear_num_value_heads"),
                gdn_k_head_dim=r.positive_int("linear_key_head_dim"),
                gdn_v_head_dim=r.positive_int("linear_value_head_dim"),
                conv_kernel=r.positive_int("linear_conv_kernel_dim", 4),
            )
            hk, hv = fields["gdn_num_k_heads"], fields["gdn_num_v_heads"]
            if hk and hv and hv % hk:
                problems.append(
                    f"linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk})"
                )
    else:
        layer_types = tuple([ATTENTION] * num_layers)
        if raw.get("use_sliding_window") and raw.get("sliding_window"):
            problems.append("qwen3 sliding-window attention (use_sliding_window) is not supported")
    ffn_types = _qwen_ffn_types(r, model_type, num_layers)
    fields.update(_qwen_moe_fields(r, model_type) if MOE in ffn_types else {})
    # Qwen3.5-MoE text configs have no intermediate_size (no dense FFN): needed only by dense layers.
    inter = r.positive_int("intermediate_size") if MLP in ffn_types else 0
    if r.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {raw.get('hidden_act')!r} is not supported (only 'silu')")
    dtype = read_dtype(r)
    if problems:
        raise ConfigError(problems, source)
    return TargetConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        layer_types=layer_types,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        attn_output_gate=qwen35_like,
        attention_bias=bool(raw.get("attention_bias", False)),
        rms_norm_eps=eps,
        norm_zero_centered=qwen35_like,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=dtype,
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        eos_token_ids=read_eos(raw) or read_eos(outer),
        bos_token_id=raw.get("bos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        ffn_types=ffn_types,
        **fields,
    )


def _qwen_ffn_types(r: FieldReader, model_type: str, num_layers: int) -> tuple[str, ...]:
    """Per layer MLP or MOE, as HF builds the decoder layers: every layer sparse in Qwen3.5-MoE; in
    Qwen3-Next layer i is sparse iff num_experts > 0, i not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0."""
    if model_type in QWEN_MOE_MODEL_TYPES:
        return (MOE,) * num_layers
    if model_type != "qwen3_next":
        return (MLP,) * num_layers
    experts = r.get("num_experts", 512, kind=int)  # HF's default: 512 experts
    if experts < 0:
        r.problems.append(f"field 'num_experts' must be >= 0, got {experts}")
    if experts <= 0:
        return (MLP,) * num_layers
    step = r.positive_int("decoder_sparse_step", 1) or 1  # a bad one is reported; go on to check the rest
    mlp_only = r.get("mlp_only_layers", [], kind=(list, tuple))
    if any(not isinstance(i, int) or isinstance(i, bool) for i in mlp_only):
        r.problems.append(f"field 'mlp_only_layers' must list layer indices, got {mlp_only!r}")
        mlp_only = []
    return tuple(MOE if i not in mlp_only and (i + 1) % step == 0 else MLP for i in range(num_layers))


def _qwen_moe_fields(r: FieldReader, model_type: str) -> dict[str, Any]:
    """The sparse MoE block's sizes (HF defaults where a field is absent). Qwen3.5-MoE always
    renormalises the top-k weights (its config has no norm_topk_prob); Qwen3-Next if norm_topk_prob."""
    moe35 = model_type in QWEN_MOE_MODEL_TYPES
    experts = r.positive_int("num_experts", 256 if moe35 else 512)
    top_k = r.positive_int("num_experts_per_tok", 8 if moe35 else 10)
    if experts and top_k and top_k > experts:
        r.problems.append(f"num_experts_per_tok ({top_k}) exceeds num_experts ({experts})")
    norm = True if moe35 else r.get("norm_topk_prob", True, kind=bool)
    return dict(
        moe_router=ROUTER_SOFTMAX, moe_num_experts=experts, moe_top_k=top_k,
        moe_intermediate_size=r.positive_int("moe_intermediate_size", 512),
        moe_shared_intermediate_size=r.positive_int("shared_expert_intermediate_size", 512),
        moe_norm_topk_prob=norm,
    )


# ---- Mamba2 family: mamba2 (Mamba2ForCausalLM), bamba, nemotron_h ------------------------------


def _mamba_family(raw: Mapping[str, Any], model_type: str, source: str) -> TargetConfig:
    return TargetConfig(**config_mamba.mamba_fields(raw, model_type, source))
