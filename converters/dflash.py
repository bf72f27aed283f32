"""DFlash drafter checkpoints (z-lab HF format) -> DrafterModel params.

A z-lab drafter directory holds `config.json` (see ddtree_jax/drafter_config.py) and
`model.safetensors` whose tensor names have no `model.` prefix:
    fc.weight [H, K*H], hidden_norm.weight, norm.weight,
    layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias with attention_bias),
    layers.{i}.self_attn.{q,k}_norm.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
    layers.{i}.{input,post_attention}_layernorm.weight.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from converters.keymap import CheckpointError, Rule, flatten_paths, linear, unflatten_paths
from converters.layout import map_into_layout
from converters.safetensors_io import SafetensorsCheckpoint
from ddtree_jax.config import DTYPES, ConfigError
from ddtree_jax.drafter_config import DrafterConfig
from ddtree_jax.models.drafter import DrafterModel

L = r"layers\.(\d+)\."

RULES = [
    Rule(r"fc\.weight", "fc/kernel", linear),
    Rule(r"(hidden_norm|norm)\.weight", r"\1/weight"),
    Rule(L + r"(input_layernorm|post_attention_layernorm)\.weight", r"layers/\1/\2/weight"),
    Rule(L + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", r"layers/\1/self_attn/\2/kernel", linear),
    Rule(L + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.bias", r"layers/\1/self_attn/\2/bias"),
    Rule(L + r"self_attn\.(q_norm|k_norm)\.weight", r"layers/\1/self_attn/\2/weight"),
    Rule(L + r"mlp\.(gate_proj|up_proj|down_proj)\.weight", r"layers/\1/mlp/\2/kernel", linear),
]

# Some writers prefix names with `model.`; z-lab's files do not. Strip it if present.
PREFIXES = ("model.",)
# Not part of the drafter: RoPE buffers, and copies of the target's embedding / head that the
# drafter never uses (the reference DFlashDraftModel has no such parameters either).
IGNORED = (r".*rotary_emb\.inv_freq", r"(model\.)?embed_tokens\.weight", r"lm_head\.weight")


def _dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: choose one of float32, bfloat16, float16")
    return DTYPES[name]


def abstract_drafter(dcfg: DrafterConfig, dtype=None):
    """(graphdef, abstract params) of the drafter without allocating weights."""
    model = nnx.eval_shape(lambda: DrafterModel(dcfg, rngs=nnx.Rngs(0), dtype=dtype))
    return nnx.split(model)


def drafter_params_from_tensors(
    dcfg: DrafterConfig,
    names: Iterable[str],
    load: Callable[[str], np.ndarray],
    dtype=None,
    *,
    source: str = "drafter checkpoint",
    on_tensor: Callable[[str], None] | None = None,
):
    """Map HF drafter tensors onto DrafterModel; returns (graphdef, params).

    Raises CheckpointError listing every unexpected, missing or mis-shaped tensor.
    dtype: params dtype (default: the config's dtype).
    """
    graphdef, abstract = abstract_drafter(dcfg, _dtype_name(dtype))
    expected = {
        k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in flatten_paths(nnx.to_pure_dict(abstract)).items()
    }
    flat = map_into_layout(  # the merged gate | up layout (converters/layout.py) joins the parts
        names,
        load,
        RULES,
        expected,
        strip_prefixes=PREFIXES,
        ignore=IGNORED,
        source=source,
        on_tensor=on_tensor,
    )
    arrays = {}
    for key in list(flat):
        arrays[key] = jnp.asarray(flat.pop(key))
    params = jax.tree_util.tree_map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(params, unflatten_paths(arrays))
    return graphdef, params


def load_drafter(path: str | os.PathLike, dtype=None):
    """Read a z-lab drafter directory (config.json + safetensors); returns (dcfg, graphdef, params).

    The returned config's dtype is the params dtype (so `init_drafter_cache` matches).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"drafter directory {path} does not exist")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"{path} is a file, expected a directory (the drafter directory, not a file in it)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError([f"not valid JSON: {e}"], cfg_path) from None
    dcfg = DrafterConfig.from_hf_dict(raw, source=cfg_path)
    dcfg = dcfg.replace(dtype=_dtype_name(dtype) or dcfg.dtype)
    with SafetensorsCheckpoint(path) as ckpt:
        if ckpt.unreadable_unknown:  # the root cause of every missing parameter: report only it
            raise CheckpointError(ckpt.problems, path)
        problems = list(ckpt.problems)
        try:
            graphdef, params = drafter_params_from_tensors(dcfg, ckpt.names, ckpt.load, source=path)
        except CheckpointError as e:
            problems.extend(e.problems)
        if problems:
            raise CheckpointError(problems, path)
    return dcfg, graphdef, params
