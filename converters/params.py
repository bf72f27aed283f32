"""Build the target's params pytree from named HF tensors (any source: safetensors, a torch state dict)."""

from __future__ import annotations

from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from converters import mamba, qwen3
from converters.keymap import flatten_paths, unflatten_paths
from converters.layout import map_into_layout
from ddtree_jax.config import TargetConfig
from ddtree_jax.models.target import TargetModel


def abstract_target(cfg: TargetConfig, dtype=None):
    """(graphdef, abstract params) of the target without allocating weights."""
    model = nnx.eval_shape(lambda: TargetModel(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    return nnx.split(model)


def expected_shapes(abstract_params) -> dict[str, tuple[tuple[int, ...], object]]:
    flat = flatten_paths(nnx.to_pure_dict(abstract_params))
    return {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in flat.items()}


def kv_width(cfg: TargetConfig) -> int:
    """Width of the k (and of the v) projection: what splits a merged q | k | v weight."""
    return cfg.num_kv_heads * cfg.head_dim


def family_for(cfg: TargetConfig):
    """The key-map module of the config's model family (rules_for / prefixes_for / ignored_for)."""
    return mamba if cfg.model_type in mamba.MODEL_TYPES else qwen3


def target_params_from_tensors(
    cfg: TargetConfig,
    names: Iterable[str],
    load: Callable[[str], np.ndarray],
    *,
    dtype=None,
    source: str = "checkpoint",
    on_tensor: Callable[[str], None] | None = None,
    unavailable: Iterable[str] = (),
):
    """Map HF tensors onto the target model; returns (graphdef, params) ready for decode.*."""
    graphdef, abstract = abstract_target(cfg, dtype)
    family = family_for(cfg)
    if cfg.model_type == "nemotron_h":
        names, load, on_tensor = mamba.fuse_experts(cfg, names, load, on_tensor)
    elif cfg.sparse_ffn_layers:  # per-expert tensors -> the stacked ones the rules map
        names, load, on_tensor, unavailable = qwen3.stack_experts(cfg, names, load, on_tensor, unavailable)
    flat = map_into_layout(  # the key maps fill HF's separate projections; merged layouts join them
        names,
        load,
        family.rules_for(cfg),
        expected_shapes(abstract),
        kv_width=kv_width(cfg),
        strip_prefixes=family.prefixes_for(cfg),
        ignore=family.ignored_for(cfg),
        source=source,
        on_tensor=on_tensor,
        unavailable=unavailable,
    )
    params = jax.tree_util.tree_map(lambda x: x, abstract)
    # Pop while converting so host memory peaks near one copy of the weights, not two.
    arrays = {}
    for key in list(flat):
        arrays[key] = jnp.asarray(flat.pop(key))
    nnx.replace_by_pure_dict(params, unflatten_paths(arrays))
    return graphdef, params
