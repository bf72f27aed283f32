"""The leaf of the config modules: layer kinds, model types, the config error and the field
readers the family parsers share (ddtree_jax/config.py for the Qwen family and the TargetConfig
itself, ddtree_jax/config_mamba.py for the Mamba2 family)."""

from __future__ import annotations

from typing import Any, Mapping

ATTENTION = "attention"
GDN = "gdn"
MAMBA2 = "mamba2"
MLP = "mlp"  # a feed-forward block in the mixer slot (NemotronH "mlp"): no cache, no state
MOE = "moe"  # a mixture-of-experts block in the mixer slot (NemotronH "moe") or in the FFN slot (Qwen)
MIXER_KINDS = (ATTENTION, GDN, MAMBA2, MLP, MOE)
RECURRENT_KINDS = (GDN, MAMBA2)  # kinds with a RecurrentCache (conv window + state)
FFN_KINDS = (MLP, MOE)  # kinds without any cache; also the kinds of a block's FFN slot (`ffn_types`)

# Mixture-of-experts routers (`moe_router`)
ROUTER_SOFTMAX = "softmax_top_k"  # Qwen3.5-MoE / Qwen3-Next: fp32 softmax, top-k, optional renormalisation
ROUTER_SIGMOID_GROUPED = "sigmoid_group_top_k"  # NemotronH: sigmoid + correction bias, grouped top-k

QWEN_MOE_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")  # every layer's FFN is a sparse MoE
QWEN_WRAPPER_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # multimodal configs: the text part under text_config
QWEN_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_next", "qwen3") + QWEN_MOE_MODEL_TYPES
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


class FieldReader:
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


def read_rope(reader: FieldReader, head_dim: int, default_partial: float) -> tuple[int, float]:
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


def read_dtype(reader: FieldReader) -> str:
    """The stored dtype: `dtype` (transformers 5) or `torch_dtype` (4.x), whichever is set (a null
    `dtype` must not hide a `torch_dtype`); float32 when neither is."""
    name = next((reader.raw[k] for k in ("dtype", "torch_dtype") if reader.raw.get(k) is not None), "float32")
    if name not in DTYPES:
        reader.problems.append(f"unsupported dtype '{name}' (supported: float32, bfloat16, float16)")
        return "float32"
    return DTYPES[name]


def read_eos(raw: Mapping[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
