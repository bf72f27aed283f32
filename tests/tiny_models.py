"""Tiny targets with every parameter randomised, built directly in JAX (no HF needed).

Used by the property tests of tree verification and speculative decoding; HF parity lives in
tests/test_parity.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.config import TargetConfig
from ddtree_jax.models.target import TargetModel

HYBRID = dict(
    model_type="qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2,
    rope_theta=10000.0, partial_rotary_factor=0.5,
)
# Mixtures of experts with few experts, so a verify's tree nodes and batch rows share experts.
HYBRID_MOE = {k: v for k, v in HYBRID.items() if k != "intermediate_size"} | dict(
    model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
    shared_expert_intermediate_size=28,
)
NEXT_MOE = dict(  # Qwen3-Next, sparse layers 1 and 5 (step 2; layer 3 dense by mlp_only_layers), no renormalisation
    HYBRID, model_type="qwen3_next", num_hidden_layers=6, full_attention_interval=3, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=28, decoder_sparse_step=2,
    mlp_only_layers=[3], norm_topk_prob=False,
)
ATTENTION_ONLY = dict(
    model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0, tie_word_embeddings=True,
)


def random_params(params, seed: int, zero_centered_norms: bool, scale: float = 0.4):
    """Replace every parameter with a random draw (norm weights included, A_log in a sane range)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(seed)
    leaves = []
    for path, leaf in flat:
        name = jax.tree_util.keystr(path)
        shape = leaf.shape
        if "A_log" in name:
            value = rng.uniform(-1.0, 1.0, shape)
        elif "dt_bias" in name:
            value = rng.uniform(-1.0, 1.0, shape)
        elif "norm" in name:
            plain = "linear_attn" in name or not zero_centered_norms  # w * x norms center on 1
            value = rng.normal(1.0 if plain else 0.0, 0.3, shape)
        elif "embedding" in name:
            value = rng.normal(0.0, 1.0, shape)
        else:
            fan_in = shape[-2] if len(shape) >= 2 else 1  # [in, out] kernels, [E, in, out] expert stacks
            value = rng.normal(0.0, scale * 2.0 / np.sqrt(max(fan_in, 1)), shape)
        leaves.append(jnp.asarray(value, leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def make_target(overrides: dict | None = None, seed: int = 0, base=HYBRID):
    """(cfg, graphdef, params) of a tiny random target."""
    raw = dict(base)
    raw.update(overrides or {})
    cfg = TargetConfig.from_hf_dict(raw)
    model = TargetModel(cfg, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    return cfg, graphdef, random_params(params, seed, cfg.norm_zero_centered)
