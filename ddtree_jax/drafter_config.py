"""DFlash drafter configuration, parsed and validated from a z-lab HF config.json.

A z-lab drafter config is a Qwen3 config (`model_type: "qwen3"`,
`architectures: ["DFlashDraftModel"]`) plus DFlash fields. Each DFlash field is read from the
`dflash_config` object first and from the top level second, as the reference loader does
(z-lab/dflash `dflash/model.py::_draft_value`):

- `mask_token_id` (required),
- `target_layer_ids`: 0-based target layer indices; the drafter reads HF
  `hidden_states[id + 1]` (the output of layer `id`). When absent, the reference default
  `build_target_layer_ids(num_target_layers, num_hidden_layers)` is used: K = the number of
  DRAFTER layers, spread evenly over [1, L-3] with Python `round` (K = 1 -> [L // 2]),
- `block_size` (default 16, as the reference),
- `input_embedding_scale` (default 1), `output_multiplier` (default 1),
  `final_logit_softcapping` (default none).

Sliding-window drafters follow HF Qwen3Config: the window is `sliding_window` only when
`use_sliding_window` is true; `layer_types` defaults to sliding for layers
i >= `max_window_layers` (28) when a window is set. A layer attends causally iff the config's
`is_causal` says so, or, when `is_causal` is absent, iff it is a sliding layer (reference
`Qwen3DFlashAttention`). Every parsing problem is collected into one ConfigError.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from ddtree_jax.config import ConfigError, TargetConfig, read_dtype, FieldReader, read_rope

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
SUPPORTED_ARCHITECTURES = ("DFlashDraftModel",)
DEFAULT_BLOCK_SIZE = 16


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference default: num_draft_layers ids spread evenly over [1, num_target_layers - 3].

    Qwen3-8B (36 layers) with a 5-layer drafter -> (1, 9, 17, 25, 33). One draft layer -> L // 2.
    Python's round (half to even) is used, as in the reference.
    """
    if num_draft_layers <= 0:
        raise ValueError(f"num_draft_layers must be > 0, got {num_draft_layers}")
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Everything the JAX DFlash drafter needs. Frozen and hashable (a static jit argument)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int
    rms_norm_eps: float
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    num_target_layers: int | None = None
    attention_bias: bool = False
    # per layer: sliding window size (None = full attention) and causal flag
    layer_windows: tuple[int | None, ...] = ()
    layer_causal: tuple[bool, ...] = ()
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    dtype: str = "float32"

    def __post_init__(self):
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        if not self.layer_causal:
            object.__setattr__(self, "layer_causal", (False,) * self.num_layers)

    # ---- derived sizes -------------------------------------------------------------
    @property
    def num_features(self) -> int:
        """K: number of target layers whose outputs are concatenated."""
        return len(self.target_layer_ids)

    @property
    def fc_in_dim(self) -> int:
        """Input width of `fc`: K * hidden_size (the target's hidden size, which must match)."""
        return self.num_features * self.hidden_size

    @property
    def target_hidden_ids(self) -> tuple[int, ...]:
        """Indices into HF `hidden_states` (TargetModel's `hidden_ids`): id + 1 per target layer id."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size - 1

    def replace(self, **changes: Any) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)

    # ---- parsing -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "DrafterConfig":
        return _parse_drafter(raw, source)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "DrafterConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            return cls.from_hf_dict(json.load(f), source=path)


def _draft_value(raw: Mapping[str, Any], dflash: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """dflash_config[name] if present, else the top-level field, else default (the reference order)."""
    if name in dflash and dflash[name] is not None:
        return dflash[name]
    value = raw.get(name)
    return default if value is None else value


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _layer_attention(raw: Mapping[str, Any], num_layers: int, problems: list[str]):
    """Per-layer (window, causal) following HF Qwen3Config + the reference attention."""
    use_sw = bool(raw.get("use_sliding_window", False))
    window = raw.get("sliding_window") if use_sw else None
    if window is not None and (not _is_int(window) or window <= 0):
        problems.append(f"field 'sliding_window' must be a positive integer, got {window!r}")
        window = None
    types = raw.get("layer_types")
    if types is None:
        max_window_layers = raw.get("max_window_layers", 28)
        if not _is_int(max_window_layers):
            problems.append(f"field 'max_window_layers' must be an integer, got {max_window_layers!r}")
            max_window_layers = 28
        types = [
            SLIDING_ATTENTION if window is not None and i >= max_window_layers else FULL_ATTENTION
            for i in range(num_layers)
        ]
    elif not isinstance(types, (list, tuple)):
        problems.append("field 'layer_types' must be a list")
        types = [FULL_ATTENTION] * num_layers
    else:
        types = list(types)
        for i, t in enumerate(types):
            if t not in (FULL_ATTENTION, SLIDING_ATTENTION):
                problems.append(
                    f"layer_types[{i}] = {t!r} is not supported (only 'full_attention' / 'sliding_attention')"
                )
        if num_layers and len(types) != num_layers:
            problems.append(f"layer_types has {len(types)} entries but num_hidden_layers = {num_layers}")
            types = (types + [FULL_ATTENTION] * num_layers)[:num_layers]
    is_causal = raw.get("is_causal")
    windows = tuple(window if t == SLIDING_ATTENTION else None for t in types)
    causal = tuple((t == SLIDING_ATTENTION) if is_causal is None else bool(is_causal) for t in types)
    return windows, causal


def _parse_drafter(raw: Mapping[str, Any], source: str) -> DrafterConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError([f"expected a JSON object, got {type(raw).__name__}"], source)
    problems: list[str] = []
    archs = raw.get("architectures")
    if archs is not None:
        if not isinstance(archs, (list, tuple)) or not archs:
            problems.append(f"field 'architectures' must be a non-empty list, got {archs!r}")
        else:
            bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
            if bad:
                problems.append(
                    f"architecture(s) {bad} not supported: only {list(SUPPORTED_ARCHITECTURES)} "
                    "(DFlash2DraftModel's dynamic convolutions and candidate selector are not implemented)"
                )
    model_type = raw.get("model_type")
    if model_type != "qwen3":
        problems.append(f"model_type {model_type!r} is not supported for a DFlash drafter (expected 'qwen3')")
    dflash = raw.get("dflash_config")
    if dflash is None:
        dflash = {}
    elif not isinstance(dflash, Mapping):
        problems.append(f"field 'dflash_config' must be an object, got {type(dflash).__name__}")
        dflash = {}
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if _draft_value(raw, dflash, key) is not None:
            problems.append(f"DFlash2 field '{key}' found: DFlash2 drafters are not supported")

    r = FieldReader(raw, problems)
    hidden = r.positive_int("hidden_size")
    inter = r.positive_int("intermediate_size")
    num_layers = r.positive_int("num_hidden_layers")
    num_heads = r.positive_int("num_attention_heads")
    num_kv = r.positive_int("num_key_value_heads")
    head_dim = r.positive_int("head_dim")
    vocab = r.positive_int("vocab_size")
    eps = r.get("rms_norm_eps", 1e-6, kind=(int, float))
    rotary_dim, theta = read_rope(r, head_dim, 1.0)
    if num_heads and num_kv and num_heads % num_kv:
        problems.append(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv})")
    if r.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {raw.get('hidden_act')!r} is not supported (only 'silu')")
    dtype = read_dtype(r)

    # num_target_layers: needed only for the default target_layer_ids
    ntl = raw.get("num_target_layers")
    if ntl is not None and (not _is_int(ntl) or ntl <= 0):
        problems.append(f"field 'num_target_layers' must be a positive integer, got {ntl!r}")
        ntl = None

    ids = _draft_value(raw, dflash, "target_layer_ids")
    if ids is None:
        if ntl is None:
            problems.append(
                "no dflash_config.target_layer_ids and no num_target_layers to build the default ids from"
            )
            ids_t: tuple[int, ...] = ()
        elif num_layers:
            ids_t = default_target_layer_ids(ntl, num_layers)
        else:
            ids_t = ()
    elif not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(i) for i in ids):
        problems.append(f"target_layer_ids must be a non-empty list of integers, got {ids!r}")
        ids_t = ()
    else:
        ids_t = tuple(ids)
        neg = [i for i in ids_t if i < 0]
        if neg:
            problems.append(f"target_layer_ids {neg} are negative (ids are 0-based target layer indices)")
        if ntl is not None:
            out = [i for i in ids_t if i >= ntl]
            if out:
                problems.append(f"target_layer_ids {out} out of range for num_target_layers = {ntl}")
        if len(set(ids_t)) != len(ids_t):
            problems.append(f"target_layer_ids {list(ids_t)} has duplicates")

    block = _draft_value(raw, dflash, "block_size", DEFAULT_BLOCK_SIZE)
    if not _is_int(block) or block < 2:
        problems.append(f"block_size must be an integer >= 2 (bonus token + at least one draft), got {block!r}")
        block = DEFAULT_BLOCK_SIZE

    mask = _draft_value(raw, dflash, "mask_token_id")
    if mask is None:
        problems.append("missing dflash_config.mask_token_id (the drafter's <|MASK|> token id)")
        mask = 0
    elif not _is_int(mask) or mask < 0:
        problems.append(f"mask_token_id must be a non-negative integer, got {mask!r}")
        mask = 0
    elif vocab and mask >= vocab:
        problems.append(f"mask_token_id {mask} >= vocab_size {vocab}")

    floats = {}
    for key, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0)):
        value = _draft_value(raw, dflash, key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            problems.append(f"field '{key}' must be a number, got {value!r}")
            value = default
        floats[key] = float(value)
    softcap = _draft_value(raw, dflash, "final_logit_softcapping")
    if softcap is not None:
        if not isinstance(softcap, (int, float)) or isinstance(softcap, bool):
            problems.append(f"field 'final_logit_softcapping' must be a number, got {softcap!r}")
            softcap = None
        else:
            softcap = float(softcap) if softcap > 0 else None

    windows, causal = _layer_attention(raw, num_layers, problems)
    if problems:
        raise ConfigError(problems, source)
    return DrafterConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rope_theta=theta,
        rotary_dim=rotary_dim,
        rms_norm_eps=float(eps),
        vocab_size=vocab,
        target_layer_ids=ids_t,
        block_size=int(block),
        mask_token_id=int(mask),
        num_target_layers=ntl,
        attention_bias=bool(raw.get("attention_bias", False)),
        layer_windows=windows,
        layer_causal=causal,
        input_embedding_scale=floats["input_embedding_scale"],
        output_multiplier=floats["output_multiplier"],
        final_logit_softcapping=softcap,
        dtype=dtype,
    )


def target_mismatches(dcfg: DrafterConfig, tcfg: TargetConfig) -> list[str]:
    """Every way the drafter does not fit the target (empty when they pair)."""
    problems: list[str] = []
    nl = tcfg.num_layers
    out = [i for i in dcfg.target_layer_ids if i < 0 or i >= nl]
    if out:
        problems.append(
            f"target_layer_ids {out} out of range for a target with {nl} layers (valid: 0..{nl - 1})"
        )
    if dcfg.num_target_layers is not None and dcfg.num_target_layers != nl:
        problems.append(f"drafter num_target_layers = {dcfg.num_target_layers} but the target has {nl} layers")
    if dcfg.hidden_size != tcfg.hidden_size:
        problems.append(f"drafter hidden_size {dcfg.hidden_size} != target hidden_size {tcfg.hidden_size}")
    want_fc = dcfg.num_features * tcfg.hidden_size
    if dcfg.fc_in_dim != want_fc:
        problems.append(
            f"fc input dim {dcfg.fc_in_dim} (= {dcfg.num_features} x drafter hidden {dcfg.hidden_size}) != "
            f"{want_fc} (= {dcfg.num_features} target layers x target hidden {tcfg.hidden_size})"
        )
    if dcfg.vocab_size != tcfg.vocab_size:
        problems.append(f"drafter vocab_size {dcfg.vocab_size} != target vocab_size {tcfg.vocab_size}")
    if dcfg.mask_token_id >= tcfg.vocab_size:
        problems.append(f"mask_token_id {dcfg.mask_token_id} >= target vocab_size {tcfg.vocab_size}")
    return problems


def validate_against_target(dcfg: DrafterConfig, tcfg: TargetConfig, source: str = "drafter vs target") -> None:
    """Raise one ConfigError listing every mismatch between the drafter and its target."""
    problems = target_mismatches(dcfg, tcfg)
    if problems:
        raise ConfigError(problems, source)
