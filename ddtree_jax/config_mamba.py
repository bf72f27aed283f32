"""Mamba2-family configs (mamba2, bamba, nemotron_h) parsed into the fields of the shared
TargetConfig (ddtree_jax/config.py builds it).

Split from config.py, which dispatches here by model_type; every problem is collected into one
ConfigError, as for the Qwen family.
"""

from __future__ import annotations

from typing import Any, Mapping

from ddtree_jax.config_fields import (
    ATTENTION,
    MAMBA2,
    MLP,
    MOE,
    ROUTER_SIGMOID_GROUPED,
    ConfigError,
    read_dtype,
    read_eos,
    FieldReader,
    read_rope,
)

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


def _flag(r: FieldReader, key: str, default: bool) -> bool:
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


def _number(r: FieldReader, key: str, default: float) -> float:
    value = _special_float(r.raw.get(key, default))
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        r.problems.append(f"field '{key}' must be a number, got {value!r}")
        return default
    return float(value)


def _dt_limit(r: FieldReader, key: str) -> tuple[float, float]:
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


def _check_expand(problems: list[str], hidden, expand, n_heads, head_dim, inner: str, heads: str) -> None:
    """The Mamba2 inner width two ways: hidden * expand must equal heads * head_dim."""
    if hidden and expand and n_heads and head_dim and hidden * expand != n_heads * head_dim:
        problems.append(f"{inner} ({hidden * expand}) must equal {heads} ({n_heads * head_dim})")


def _need(r: FieldReader, key: str, allowed: tuple, default=None) -> None:
    value = r.raw.get(key, default)
    if value not in allowed:
        r.problems.append(f"{key} {value!r} is not supported (only {', '.join(map(repr, allowed))})")


def mamba_fields(raw: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """mamba2 / bamba / nemotron_h config.json -> TargetConfig's fields (every problem collected)."""
    problems: list[str] = []
    if model_type == "nemotron_h":
        raw = dict(raw)
        for old, new in _NEMOTRON_ALIASES.items():
            if old in raw and raw[old] is not None:
                raw[new] = raw.pop(old)
    r = FieldReader(raw, problems)
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
        _check_expand(problems, hidden, expand, n_heads, fields["mamba_head_dim"],
                      "hidden_size * expand", "num_heads * head_dim")
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
        _check_expand(problems, hidden, expand, n_heads, int(d_head),
                      "mamba_expand * hidden_size", "mamba_n_heads * mamba_d_head")
        _need(r, "hidden_act", ("silu",), "silu")
        eps = _number(r, "rms_norm_eps", 1e-5)
        tie = _flag(r, "tie_word_embeddings", False)
        if ATTENTION in layer_types:
            rotary_dim, theta = read_rope(r, head_dim, 0.5)  # Bamba: partial_rotary_factor 0.5 unless given
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
                moe_router=ROUTER_SIGMOID_GROUPED, moe_num_experts=experts, moe_top_k=top_k,
                moe_intermediate_size=r.positive_int("moe_intermediate_size", 7688),
                moe_shared_intermediate_size=r.positive_int("moe_shared_expert_intermediate_size", 7688),
                moe_n_group=n_group, moe_topk_group=topk_group, moe_norm_topk_prob=_flag(r, "norm_topk_prob", True),
                moe_routed_scaling_factor=_number(r, "routed_scaling_factor", 1.0), moe_latent_size=latent or 0,
            )
            if experts and n_group and experts % n_group:
                problems.append(f"n_routed_experts ({experts}) must be a multiple of n_group ({n_group})")
            elif experts and n_group and experts // n_group < 2:
                problems.append(
                    f"each expert group needs >= 2 experts (router sums each group's top 2), got {experts // n_group}")
            if topk_group and n_group and topk_group > n_group:
                problems.append(f"topk_group ({topk_group}) must be <= n_group ({n_group})")
            if experts and n_group and top_k and topk_group and top_k > topk_group * (experts // n_group):
                problems.append(
                    f"num_experts_per_tok ({top_k}) exceeds the experts of the {topk_group} chosen group(s)")
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
    dtype = read_dtype(r)
    if problems:
        raise ConfigError(problems, source)
    return dict(
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
        eos_token_ids=read_eos(raw),
        bos_token_id=raw.get("bos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        **fields,
    )
