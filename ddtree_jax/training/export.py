"""Write trained params as Hugging Face directories: the inverse of the converters' key maps.

Target (`Qwen3_5ForCausalLM`, model_type qwen3_5_text, or `Qwen3_5MoeForCausalLM`, qwen3_5_moe_text):
    config.json, model.safetensors (names `model.layers.{i}...`, torch layouts; experts fused as HF
    holds them in memory and Qwen3.5-MoE checkpoints store them, `mlp.experts.gate_up_proj`
    [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]), tokenizer.json
Drafter (z-lab `DFlashDraftModel`):
    config.json (dflash_config {mask_token_id, target_layer_ids, block_size}), model.safetensors
    (names without a `model.` prefix).

The HF name of every parameter is derived from the converter's forward rules
(converters/qwen3.py `rules_for`, converters/dflash.py `RULES`): a rule's destination template
is matched against the parameter path, and its source pattern is filled with the captured
groups; the forward rule must then match the produced name again. Layout transforms are
inverted (Linear kernel [in, out] -> weight [out, in]; depthwise conv [K, C] -> [C, 1, K]).
So an exported directory always loads back through `converters.load.load_target` /
`converters.dflash.load_drafter` to the same params (tested).
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Mapping

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from converters import dflash as dflash_rules
from converters import layout
from converters import qwen3 as qwen3_rules
from converters.keymap import Rule, depthwise_conv, flatten_paths, linear
from ddtree_jax.atomic import staged_dir
from ddtree_jax.config import TargetConfig
from safetensors.numpy import save_file

EXPORTED_TARGETS = ("qwen3_5_text", "qwen3_5_moe_text")  # the model types export_target writes
SAFETENSORS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _inverse_transform(transform) -> Callable[[np.ndarray], np.ndarray]:
    if transform is None:
        return lambda x: x
    if transform is linear:
        return lambda x: np.ascontiguousarray(x.T)
    if transform is depthwise_conv:
        return lambda x: np.ascontiguousarray(x.T[:, None, :])
    if getattr(transform, "inverse", None) is not None:  # keymap.stacked_linear / checked_linear
        return transform.inverse
    raise ValueError(f"no inverse known for transform {transform!r} (multi-output rules cannot be exported)")


def _pattern_segments(pattern: str) -> list[tuple[str, str]]:
    """Split a rule pattern into ('lit', text) and ('group', regex) segments (no nested groups)."""
    segs: list[tuple[str, str]] = []
    i, lit = 0, []
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            lit.append(pattern[i + 1])
            i += 2
        elif c == "(":
            j = pattern.index(")", i)
            if lit:
                segs.append(("lit", "".join(lit)))
                lit = []
            segs.append(("group", pattern[i + 1:j]))
            i = j + 1
        else:
            lit.append(c)
            i += 1
    if lit:
        segs.append(("lit", "".join(lit)))
    return segs


def _dest_regex(dest: str) -> str:
    parts = re.split(r"\\(\d)", dest)
    out = []
    for k, part in enumerate(parts):
        out.append(f"(?P<g{part}>[^/]+)" if k % 2 else re.escape(part))
    return "".join(out)


def hf_name_for(path: str, rules: list[Rule]) -> tuple[str, Callable[[np.ndarray], np.ndarray]]:
    """(HF tensor name without prefix, inverse layout transform) of one param path."""
    for rule in rules:
        m = re.fullmatch(_dest_regex(rule.dest), path)
        if m is None:
            continue
        values = iter(m.group(f"g{i}") for i in range(1, rule.dest.count("\\") + 1))
        name = "".join(text if kind == "lit" else next(values) for kind, text in _pattern_segments(rule.pattern))
        if rule.match(name) and rule.match(name).expand(rule.dest) == path:
            return name, _inverse_transform(rule.transform)
    raise KeyError(f"no converter rule produces the parameter '{path}'")


def params_to_hf(params, rules: list[Rule], prefix: str = "", no_prefix: tuple[str, ...] = (),
                 dtype: str = "bfloat16", kv_width: int | None = None) -> dict[str, np.ndarray]:
    """{HF name: array in torch layout and `dtype`} for every leaf of an nnx params State; merged
    projection weights (converters/layout.py) are cut into HF's parts (kv_width: a q | k | v's)."""
    flat = flatten_paths(nnx.to_pure_dict(params))
    _, plan = layout.to_parts({k: (tuple(v.shape), v.dtype) for k, v in flat.items()}, kv_width)
    flat = layout.split(flat, plan)
    out: dict[str, np.ndarray] = {}
    np_dtype = _NP_DTYPES[dtype]
    for path in sorted(flat):
        name, inv = hf_name_for(path, rules)
        full = name if name.startswith(no_prefix) else prefix + name
        value = np.asarray(jax.device_get(flat[path]), np.float32)
        out[full] = np.ascontiguousarray(inv(value).astype(np_dtype))
    return out


def _write_safetensors(path: str, tensors: Mapping[str, np.ndarray]) -> None:

    save_file(dict(tensors), path, metadata={"format": "pt"})


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def export_target(out_dir: str, hf_config: dict, params, *, tokenizer=None, dtype: str = "bfloat16") -> dict:
    """Write a qwen3_5_text / qwen3_5_moe_text HF directory (atomically: replaces out_dir once
    complete); returns {file: bytes}."""
    cfg = TargetConfig.from_hf_dict(hf_config)
    if cfg.model_type not in EXPORTED_TARGETS:
        raise ValueError(f"export_target writes {' / '.join(EXPORTED_TARGETS)} directories, got {cfg.model_type!r}")
    tensors = params_to_hf(params, qwen3_rules.rules_for(cfg), prefix="model.", no_prefix=("lm_head.",), dtype=dtype,
                           kv_width=cfg.num_kv_heads * cfg.head_dim)
    config = dict(hf_config, dtype=dtype)
    with staged_dir(out_dir) as tmp:  # out_dir appears (or is replaced) only once complete
        _write_json(os.path.join(tmp, CONFIG), config)
        _write_safetensors(os.path.join(tmp, SAFETENSORS), tensors)
        if tokenizer is not None:
            tokenizer.save(os.path.join(tmp, TOKENIZER))
    return _sizes(out_dir)


def export_drafter(out_dir: str, hf_config: dict, params, *, dtype: str = "bfloat16") -> dict:
    """Write a z-lab DFlashDraftModel directory (tensor names without `model.`; atomically, as
    export_target); returns {file: bytes}."""
    tensors = params_to_hf(params, dflash_rules.RULES, dtype=dtype)
    with staged_dir(out_dir) as tmp:
        _write_json(os.path.join(tmp, CONFIG), dict(hf_config, dtype=dtype))
        _write_safetensors(os.path.join(tmp, SAFETENSORS), tensors)
    return _sizes(out_dir)


def _sizes(out_dir: str) -> dict:
    return {name: os.path.getsize(os.path.join(out_dir, name)) for name in sorted(os.listdir(out_dir))}
