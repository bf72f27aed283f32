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

ATTENTION = "attention"
GDN = "gdn"
MAMBA2 = "mamba2"
MLP = "mlp"  # a feed-forward block in the mixer slot (NemotronH "mlp"): no cache, no state
MOE = "moe"  # a mixture-of-experts block in the mixer slot (NemotronH "moe")
MIXER_KINDS = (ATTENTION, GDN, MAMBA2, MLP, MOE)
RECURRENT_KINDS = (GDN, MAMBA2)  # kinds with a RecurrentCache (conv window + state)
FFN_KINDS = (MLP, MOE)  # kinds without any cache

QWEN_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_next", "qwen3")
MAMBA_MODEL_TYPES = ("mamba2", "bamba", "nemotron_h")
SUPPORTED_MODEL_TYPES = QWEN_MODEL_TYPES + MAMBA_MODEL_TYPES
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


class ConfigError(ValueError):
    """A config.json that this project cannot run; the message lists every problem found."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}")


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
    mlp_bias: bool = False
    qk_norm: bool = True  # RMSNorm on q and k per head (Qwen3); rotary_dim = 0 means no RoPE
    norm_weight_fp32: bool = False  # RMSNorm: (w_f32 * normed_f32).astype(x) (NemotronH) instead of w * normed.astype(x)
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
    # ---- NemotronH mixture of experts (sigmoid router, grouped top-k, shared expert) ----
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


class _Reader:
    """Reads fields from a config dict, remembering every missing or malformed one."""

    def __init__(self, raw: Mapping[str, Any], problems: list[str]):
        self.raw = raw
        self.problems = problems

    def get(self, key: str, default: Any = None, *, required: bool = False, kind: type | tuple = ()):
        if key not in self.raw or self.raw[key] is None:
            if required:
                self.problems.append(f"missing required field '{key}'")
            return default
        value = self.raw[key]
        if kind and not isinstance(value, kind) or isinstance(value, bool) and kind in (int, float):
            self.problems.append(f"field '{key}' has type {type(value).__name__}, expected {kind}")
            return default
        return value

    def positive_int(self, key: str, default: int | None = None, *, required: bool = True) -> int:
        value = self.get(key, default, required=required and default is None)
        if value is None:
            return 0
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            self.problems.append(f"field '{key}' must be a positive integer, got {value!r}")
            return 0
        return value


def _rope(reader: _Reader, head_dim: int, default_partial: float) -> tuple[int, float]:
    raw = reader.raw
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        reader.problems.append("field 'rope_parameters' must be an object")
        params = {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None):
        reader.problems.append(f"unsupported rope_type '{rope_type}' (only 'default' RoPE is implemented)")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        reader.problems.append("missing required field 'rope_theta' (top level or in rope_parameters)")
        theta = 10000.0
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default_partial))
    rotary_dim = int(head_dim * float(partial)) if head_dim else 0
    if head_dim and (rotary_dim <= 0 or rotary_dim % 2):
        reader.problems.append(
            f"rotary dim int(head_dim * partial_rotary_factor) = {rotary_dim} must be even and > 0"
        )
    return rotary_dim, float(theta)


def _layer_types(reader: _Reader, num_layers: int) -> tuple[str, ...]:
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


def _dtype(reader: _Reader) -> str:
    name = reader.raw.get("dtype", reader.raw.get("torch_dtype", "float32")) or "float32"
    if name not in DTYPES:
        reader.problems.append(f"unsupported dtype '{name}' (supported: float32, bfloat16, float16)")
        return "float32"
    return DTYPES[name]


def _eos(raw: Mapping[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


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
        return _parse_mamba_family(raw, model_type, source)
    outer = raw
    if model_type == "qwen3_5":
        text = raw.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError(["model_type 'qwen3_5' needs a 'text_config' object"], source)
        # Fields the composite config keeps at top level (dtype, tie) are defaults for the text part.
        merged = {k: outer[k] for k in ("dtype", "torch_dtype") if k in outer}
        merged.update(text)
        # Qwen3_5ForConditionalGeneration ties lm_head by the TOP-LEVEL flag; text_config keeps its
        # own (ignored) copy, which save_pretrained always writes.
        if "tie_word_embeddings" in outer:
            merged["tie_word_embeddings"] = outer["tie_word_embeddings"]
        raw = merged
    r = _Reader(raw, problems)
    hidden = r.positive_int("hidden_size")
    num_heads = r.positive_int("num_attention_heads")
    num_kv = r.positive_int("num_key_value_heads", num_heads or None)
    head_dim = r.positive_int("head_dim", (hidden // num_heads) if hidden and num_heads else None)
    num_layers = r.positive_int("num_hidden_layers")
    vocab = r.positive_int("vocab_size")
    inter = r.positive_int("intermediate_size")
    eps = float(r.get("rms_norm_eps", 1e-6))
    qwen35_like = model_type in ("qwen3_5_text", "qwen3_5", "qwen3_next")
    rotary_dim, theta = _rope(r, head_dim, 0.25 if qwen35_like else 1.0)
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
        if model_type == "qwen3_next":
            experts = r.get("num_experts", 512)
            mlp_only = set(r.get("mlp_only_layers") or [])
            step = r.get("decoder_sparse_step", 1) or 1
            moe_layers = [
                i for i in range(num_layers) if experts and i not in mlp_only and (i + 1) % step == 0
            ]
            if moe_layers:
                problems.append(
                    f"qwen3_next with mixture-of-experts layers {moe_layers[:4]}... is not supported "
                    "(only dense qwen3_next: num_experts = 0)"
                )
    else:
        layer_types = tuple([ATTENTION] * num_layers)
        if raw.get("use_sliding_window") and raw.get("sliding_window"):
            problems.append("qwen3 sliding-window attention (use_sliding_window) is not supported")
    if r.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {raw.get('hidden_act')!r} is not supported (only 'silu')")
    dtype = _dtype(r)
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
        eos_token_ids=_eos(raw) or _eos(outer),
        bos_token_id=raw.get("bos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        **fields,
    )


# ---- Mamba2 family: mamba2 (Mamba2ForCausalLM), bamba, nemotron_h ------------------------------
_NEMOTRON_KINDS = {
    "linear_attention": MAMBA2, "mamba": MAMBA2, "full_attention": ATTENTION, "attention": ATTENTION,
    "mlp": MLP, "moe": MOE,
}
_NEMOTRON_PATTERN = {"M": MAMBA2, "*": ATTENTION, "-": MLP, "E": MOE}
# NemotronH renamed several fields; HF still reads the old names (NemotronHConfig.__post_init__).
_NEMOTRON_ALIASES = {
    "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size",
}


def _flag(r: _Reader, key: str, default: bool) -> bool:
    value = r.raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        r.problems.append(f"field '{key}' must be true or false, got {value!r}")
        return default
    return value


_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _special_float(value: Any) -> Any:
    """transformers writes inf / nan in config.json as {"__float__": "Infinity"} (and plain JSON
    readers give Infinity as a float): decode the tag, leave anything else alone."""
    if isinstance(value, Mapping) and set(value) == {"__float__"} and value["__float__"] in _FLOAT_TAGS:
        return _FLOAT_TAGS[value["__float__"]]
    return value


def _number(r: _Reader, key: str, default: float) -> float:
    value = _special_float(r.raw.get(key, default))
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        r.problems.append(f"field '{key}' must be a number, got {value!r}")
        return default
    return float(value)


def _dt_limit(r: _Reader, key: str) -> tuple[float, float]:
    value = r.raw.get(key)
    if value is None:
        return (0.0, float("inf"))
    if isinstance(value, (list, tuple)):
        value = [_special_float(v) for v in value]
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    )
    if not ok or float(value[0]) > float(value[1]):
        r.problems.append(f"field '{key}' must be [low, high] with low <= high, got {value!r}")
        return (0.0, float("inf"))
    return (float(value[0]), float(value[1]))


def _need(r: _Reader, key: str, allowed: tuple, default=None) -> None:
    value = r.raw.get(key, default)
    if value not in allowed:
        r.problems.append(f"{key} {value!r} is not supported (only {', '.join(map(repr, allowed))})")


def _parse_mamba_family(raw: Mapping[str, Any], model_type: str, source: str) -> TargetConfig:
    """mamba2 / bamba / nemotron_h config.json -> TargetConfig (every problem collected)."""
    problems: list[str] = []
    if model_type == "nemotron_h":
        raw = dict(raw)
        for old, new in _NEMOTRON_ALIASES.items():
            if old in raw and raw[old] is not None:
                raw[new] = raw.pop(old)
    r = _Reader(raw, problems)
    hidden = r.positive_int("hidden_size")
    vocab = r.positive_int("vocab_size")
    fields: dict[str, Any] = {}
    num_heads = num_kv = head_dim = rotary_dim = inter = 0
    theta = 10000.0

    def attention_fields(default_head_dim):
        nonlocal num_heads, num_kv, head_dim
        num_heads = r.positive_int("num_attention_heads")
        num_kv = r.positive_int("num_key_value_heads", num_heads or None)
        if default_head_dim is None and hidden and num_heads:
            default_head_dim = hidden // num_heads
        head_dim = r.positive_int("head_dim", default_head_dim)
        if num_heads and num_kv and num_heads % num_kv:
            problems.append(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv})"
            )

    if model_type == "mamba2":
        num_layers = r.positive_int("num_hidden_layers")
        layer_types = tuple([MAMBA2] * num_layers)
        n_heads, n_groups = r.positive_int("num_heads"), r.positive_int("n_groups", 8)
        expand = r.positive_int("expand", 2)
        fields.update(
            mamba_num_heads=n_heads, mamba_head_dim=r.positive_int("head_dim", 64),
            mamba_state_size=r.positive_int("state_size", 128), mamba_n_groups=n_groups,
            conv_kernel=r.positive_int("conv_kernel", 4), mamba_chunk_size=r.positive_int("chunk_size", 256),
            mamba_conv_bias=_flag(r, "use_conv_bias", True), mamba_proj_bias=_flag(r, "use_bias", False),
            mamba_dt_limit=_dt_limit(r, "time_step_limit"),
            residual_in_fp32=_flag(r, "residual_in_fp32", True), block_ffn=False,
        )
        if hidden and expand and fields["mamba_head_dim"] and hidden * expand != n_heads * fields["mamba_head_dim"]:
            problems.append(
                f"hidden_size * expand ({hidden * expand}) must equal num_heads * head_dim "
                f"({n_heads * fields['mamba_head_dim']})"
            )
        _need(r, "hidden_act", ("silu",), "silu")
        eps = _number(r, "layer_norm_epsilon", 1e-5)
        tie = _flag(r, "tie_word_embeddings", False)
    elif model_type == "bamba":
        num_layers = r.positive_int("num_hidden_layers")
        inter = r.positive_int("intermediate_size")
        indices = raw.get("attn_layer_indices") or []
        if not isinstance(indices, (list, tuple)) or not all(isinstance(i, int) for i in indices):
            problems.append(f"attn_layer_indices must be a list of layer indices, got {indices!r}")
            indices = []
        bad = [i for i in indices if not 0 <= i < num_layers]
        if bad:
            problems.append(f"attn_layer_indices {bad} out of range for {num_layers} layers")
        layer_types = tuple(ATTENTION if i in indices else MAMBA2 for i in range(num_layers))
        if ATTENTION in layer_types:
            attention_fields(None)  # BambaAttention: head_dim = hidden_size // num_attention_heads by default
        expand = r.positive_int("mamba_expand", 2)
        n_heads = r.positive_int("mamba_n_heads", 128)
        d_head = raw.get("mamba_d_head", "auto")
        if d_head == "auto" or d_head is None:
            d_head = expand * hidden // n_heads if n_heads else 0
        elif not isinstance(d_head, int) or isinstance(d_head, bool) or d_head <= 0:
            problems.append(f"field 'mamba_d_head' must be a positive integer or 'auto', got {d_head!r}")
            d_head = 0
        fields.update(
            mamba_num_heads=n_heads, mamba_head_dim=int(d_head), mamba_state_size=r.positive_int("mamba_d_state", 256),
            mamba_n_groups=r.positive_int("mamba_n_groups", 1), conv_kernel=r.positive_int("mamba_d_conv", 4),
            mamba_chunk_size=r.positive_int("mamba_chunk_size", 256), mamba_conv_bias=_flag(r, "mamba_conv_bias", True),
            mamba_proj_bias=_flag(r, "mamba_proj_bias", False), mamba_dt_limit=_dt_limit(r, "time_step_limit"),
            qk_norm=False, mlp_bias=_flag(r, "mlp_bias", False),
        )
        if hidden and n_heads and d_head and expand * hidden != n_heads * int(d_head):
            problems.append(
                f"mamba_expand * hidden_size ({expand * hidden}) must equal mamba_n_heads * mamba_d_head "
                f"({n_heads * int(d_head)})"
            )
        _need(r, "hidden_act", ("silu",), "silu")
        eps = _number(r, "rms_norm_eps", 1e-5)
        tie = _flag(r, "tie_word_embeddings", False)
        if ATTENTION in layer_types:
            rotary_dim, theta = _rope(r, head_dim, 0.5)  # Bamba: partial_rotary_factor 0.5 unless given
    else:  # nemotron_h
        kinds = raw.get("layers_block_type")
        if kinds is None and isinstance(raw.get("layer_types"), list):
            kinds = raw["layer_types"]
        out = []
        if kinds is None and isinstance(raw.get("hybrid_override_pattern"), str):
            for i, ch in enumerate(raw["hybrid_override_pattern"]):
                if ch not in _NEMOTRON_PATTERN:
                    problems.append(f"hybrid_override_pattern[{i}] = {ch!r} is not one of {sorted(_NEMOTRON_PATTERN)}")
                out.append(_NEMOTRON_PATTERN.get(ch, MLP))
        elif isinstance(kinds, list):
            for i, t in enumerate(kinds):
                if t not in _NEMOTRON_KINDS:
                    problems.append(f"layers_block_type[{i}] = {t!r} is not one of {sorted(_NEMOTRON_KINDS)}")
                out.append(_NEMOTRON_KINDS.get(t, MLP))
        else:
            problems.append("missing 'layers_block_type' (or 'hybrid_override_pattern')")
        layer_types = tuple(out)
        if not layer_types and kinds is not None:
            problems.append("layers_block_type is empty")
        if ATTENTION in layer_types:
            attention_fields(128)
        # num_hidden_layers is ignored, as HF does: the block list defines the depth.
        inter = r.positive_int("intermediate_size", 21504) if MLP in layer_types else 0
        n_heads = r.positive_int("mamba_num_heads", 128)
        # NemotronHMamba2Mixer: time_step_limit = (time_step_min, inf); config's time_step_limit is unused.
        dt_min = _number(r, "time_step_min", 0.001)
        fields.update(
            mamba_num_heads=n_heads, mamba_head_dim=r.positive_int("mamba_head_dim", 64),
            mamba_state_size=r.positive_int("ssm_state_size", 128), mamba_n_groups=r.positive_int("n_groups", 8),
            conv_kernel=r.positive_int("conv_kernel", 4), mamba_chunk_size=r.positive_int("chunk_size", 128),
            mamba_conv_bias=_flag(r, "use_conv_bias", True), mamba_proj_bias=_flag(r, "use_bias", False),
            mamba_dt_limit=(dt_min, float("inf")), qk_norm=False, block_ffn=False, mlp_kind="relu2",
            mlp_bias=_flag(r, "mlp_bias", False), norm_weight_fp32=True,
        )
        if MOE in layer_types:
            experts = r.positive_int("n_routed_experts", 8)
            n_group, topk_group = r.positive_int("n_group", 1), r.positive_int("topk_group", 1)
            top_k = r.positive_int("num_experts_per_tok", 2)
            latent = raw.get("moe_latent_size")
            if latent is not None and (not isinstance(latent, int) or isinstance(latent, bool) or latent <= 0):
                problems.append(f"field 'moe_latent_size' must be a positive integer or null, got {latent!r}")
                latent = None
            fields.update(
                moe_num_experts=experts, moe_top_k=top_k,
                moe_intermediate_size=r.positive_int("moe_intermediate_size", 7688),
                moe_shared_intermediate_size=r.positive_int("moe_shared_expert_intermediate_size", 7688),
                moe_n_group=n_group, moe_topk_group=topk_group, moe_norm_topk_prob=_flag(r, "norm_topk_prob", True),
                moe_routed_scaling_factor=_number(r, "routed_scaling_factor", 1.0), moe_latent_size=latent or 0,
            )
            if experts and n_group and experts % n_group:
                problems.append(f"n_routed_experts ({experts}) must be a multiple of n_group ({n_group})")
            elif experts and n_group and experts // n_group < 2:
                problems.append(f"each expert group needs >= 2 experts (router sums each group's top 2), got {experts // n_group}")
            if topk_group and n_group and topk_group > n_group:
                problems.append(f"topk_group ({topk_group}) must be <= n_group ({n_group})")
            if experts and n_group and top_k and topk_group and top_k > topk_group * (experts // n_group):
                problems.append(f"num_experts_per_tok ({top_k}) exceeds the experts of the {topk_group} chosen group(s)")
        _need(r, "mlp_hidden_act", ("relu2",), "relu2")
        _need(r, "mamba_hidden_act", ("silu",), "silu")
        if raw.get("sliding_window") is not None:
            problems.append("nemotron_h sliding_window attention is not supported (sliding_window must be null)")
        eps = _number(r, "layer_norm_epsilon", 1e-5)
        _flag(r, "tie_word_embeddings", False)
        tie = False  # NemotronHForCausalLM never ties (its _tied_weights_keys is empty): lm_head is its own
    if MAMBA2 in layer_types:
        nh, g = fields.get("mamba_num_heads", 0), fields.get("mamba_n_groups", 0)
        if nh and g and nh % g:
            problems.append(f"mamba heads ({nh}) must be a multiple of the mamba n_groups ({g})")
        if not fields.get("mamba_head_dim"):
            problems.append("mamba head dim must be > 0")
    dtype = _dtype(r)
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
        attn_output_gate=False,
        attention_bias=bool(raw.get("attention_bias", False)) if model_type == "bamba" else False,
        rms_norm_eps=eps,
        norm_zero_centered=False,
        tie_word_embeddings=tie,
        dtype=dtype,
        max_position_embeddings=int(raw.get("max_position_embeddings") or 1 << 20),
        eos_token_ids=_eos(raw),
        bos_token_id=raw.get("bos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        **fields,
    )
