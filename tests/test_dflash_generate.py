"""The real DFlash drafter (random weights) driving DFlash linear and DDTree on hybrid targets
(dense, and mixture-of-experts: Qwen3.5-MoE, Qwen3-Next with sparse and dense layers)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.drafter_config import DrafterConfig, validate_against_target
from ddtree_jax.models.drafter import DrafterModel
from ddtree_jax.speculative.dflash import DFlashProposer
from ddtree_jax.speculative.generate import generate
from tests.tiny_models import HYBRID, HYBRID_MOE, NEXT_MOE, make_target, random_params

NEW = 128


def drafter_for(cfg, seed=0, block_size=5, head_dim=8):
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": head_dim, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "vocab_size": cfg.vocab_size,
        "num_target_layers": cfg.num_layers, "block_size": block_size,
        "dflash_config": {"mask_token_id": cfg.vocab_size - 1, "target_layer_ids": [0, 2]},
    }
    dcfg = DrafterConfig.from_hf_dict(raw)
    validate_against_target(dcfg, cfg)
    graphdef, params = nnx.split(DrafterModel(dcfg, rngs=nnx.Rngs(seed)))
    return DFlashProposer(graphdef, dcfg), random_params(params, seed, zero_centered_norms=False)


TARGETS = {"qwen3_5": (HYBRID, 7), "qwen3_5_moe": (HYBRID_MOE, 17), "qwen3_next_moe": (NEXT_MOE, 19)}


# Under -m slow: Qwen3-Next-MoE, and DFlash on Qwen3.5-MoE (~26 s; its greedy equality on the MoE
# targets is tests/test_generate.py's oracle cases, the random drafter's DDTree case stays here)
@pytest.mark.parametrize("mode, target", [
    ("dflash", "qwen3_5"), ("ddtree", "qwen3_5"), pytest.param("dflash", "qwen3_5_moe", marks=pytest.mark.slow),
    ("ddtree", "qwen3_5_moe"), pytest.param("dflash", "qwen3_next_moe", marks=pytest.mark.slow),
    pytest.param("ddtree", "qwen3_next_moe", marks=pytest.mark.slow)])
def test_random_dflash_drafter_is_lossless(mode, target):
    cfg, gd, params = make_target(*TARGETS[target])
    proposer, dparams = drafter_for(cfg)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    lens = jnp.asarray([10, 6], jnp.int32)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=NEW)
    res = generate(gd, params, prompt, lens, proposer=proposer, drafter_params=dparams, mode=mode, budget=16,
                   max_new_tokens=NEW)
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))
    assert int(res.cache.lengths[0]) == 10 + NEW - 1
    # The drafter context tracks the target cache exactly.
    np.testing.assert_array_equal(np.asarray(res.drafter_state.lengths), np.asarray(res.cache.lengths))
