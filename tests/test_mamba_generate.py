"""Lossless speculative generation on Mamba2-family targets (NemotronH and Bamba tiny models).

Greedy DFlash (linear) and DDTree (tree) must reproduce plain greedy decoding token for token,
with the scripted oracle-with-errors proposer (long accepts and rejects at every depth: the SSM
state and the conv window are committed along scattered tree paths many times) and with a
random-weight DFlash drafter (DFlashProposer: features of the target's Mamba2 / MoE / attention
blocks, almost nothing accepted). After the run, the committed caches equal a plain sequential
run of the emitted tokens.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax import decode
from ddtree_jax.cache import KVCache, init_target_cache
from ddtree_jax.drafter_config import DrafterConfig, validate_against_target
from ddtree_jax.models.drafter import DrafterModel
from ddtree_jax.speculative.dflash import DFlashProposer
from ddtree_jax.speculative.generate import generate
from tests.hf_mamba_models import make_jax_target
from tests.scripted_proposers import ScriptedProposer
from tests.tiny_models import random_params
from tests.tolerance import scaled_error

B, T, NEW, BLOCK = 2, 12, 96, 6
MODELS = {"nemotron_h": make_jax_target("nemotron_h", seed=5), "bamba": make_jax_target("bamba", seed=6)}
_REF = {}


def prompts(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32), jnp.asarray([T, T - 5], jnp.int32)


def reference(name):
    """Plain greedy continuation and the absolute-position table the scripted oracle reads."""
    if name not in _REF:
        cfg, gd, params = MODELS[name]
        prompt, lens = prompts(cfg)
        ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=NEW + BLOCK + 2)
        table = np.zeros((B, T + NEW + 2 * BLOCK + 4), np.int32)
        for b in range(B):
            n = int(lens[b])
            table[b, :n] = np.asarray(prompt[b, :n])
            table[b, n : n + ref.tokens.shape[1]] = np.asarray(ref.tokens[b])
        _REF[name] = (jnp.asarray(table), np.asarray(ref.tokens[:, :NEW]))
    return _REF[name]


def dflash_drafter(cfg, seed=0, block_size=5):
    """A random-weight DFlash drafter built for this target (2 target layers as features)."""
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "vocab_size": cfg.vocab_size,
        "num_target_layers": cfg.num_layers, "block_size": block_size,
        "dflash_config": {"mask_token_id": cfg.vocab_size - 1, "target_layer_ids": [0, cfg.num_layers - 2]},
    }
    dcfg = DrafterConfig.from_hf_dict(raw)
    validate_against_target(dcfg, cfg)
    graphdef, params = nnx.split(DrafterModel(dcfg, rngs=nnx.Rngs(seed)))
    return DFlashProposer(graphdef, dcfg), random_params(params, seed, zero_centered_norms=False)


def assert_caches_equal_sequential(name, res, table, lens, prompt):
    """Final caches == prompt prefill + the emitted tokens decoded one by one (fp32: within 1e-5 of
    each compared array's magnitude; SSM states reach ~40)."""
    cfg, gd, params = MODELS[name]
    lengths = np.asarray(res.cache.lengths)
    cache = decode.prefill(gd, params, init_target_cache(cfg, B, res.cache.capacity), prompt, lens).cache
    for t in range(int(lengths.max() - np.asarray(lens).min())):
        pos = np.asarray(lens) + t
        tok = jnp.asarray(np.asarray(table)[np.arange(B), np.minimum(pos, table.shape[1] - 1)], jnp.int32)
        cache = decode.decode_step(gd, params, cache, tok, jnp.asarray(pos < lengths)).cache
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    worst = 0.0
    for got, want in zip(res.cache.layers, cache.layers):
        if want is None:
            continue
        for b in range(B):
            if isinstance(want, KVCache):
                n = lengths[b]
                pairs = [(got.k[b, :, :n], want.k[b, :, :n]), (got.v[b, :, :n], want.v[b, :, :n])]
            else:
                pairs = [(got.state[b], want.state[b]), (got.conv[b], want.conv[b])]
            for x, y in pairs:
                worst = max(worst, scaled_error(x, y))
    assert worst <= 1e-5, f"committed state drifted from sequential decoding: {worst:.2e} of its magnitude"


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode,budget", [("dflash", 0), ("ddtree", 12)])
def test_scripted_oracle_with_errors_is_lossless(name, mode, budget):
    cfg, gd, params = MODELS[name]
    table, ref = reference(name)
    prompt, lens = prompts(cfg)
    proposer = ScriptedProposer(BLOCK, cfg.vocab_size, 0.2, seed=11, runner_up=True)
    res = generate(gd, params, prompt, lens, proposer=proposer, drafter_params=table, mode=mode,
                   budget=budget or 1, max_new_tokens=NEW)
    np.testing.assert_array_equal(np.asarray(res.tokens), ref)
    hist = np.asarray(res.accepted_hist)
    assert np.asarray(res.num_tokens).sum() / np.asarray(res.steps).sum() > 2.5
    if mode == "dflash":
        assert np.all(hist[1 : BLOCK + 1] > 0), f"need rejects at every depth and full accepts: {hist}"
    else:
        assert hist[BLOCK] > 0 and hist[1:BLOCK].sum() > 0, f"need rejects and full accepts: {hist}"
    assert_caches_equal_sequential(name, res, table, lens, prompt)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_random_dflash_drafter_is_lossless(name, mode):
    cfg, gd, params = MODELS[name]
    _, ref = reference(name)
    prompt, lens = prompts(cfg)
    proposer, dparams = dflash_drafter(cfg)
    res = generate(gd, params, prompt, lens, proposer=proposer, drafter_params=dparams, mode=mode, budget=16,
                   max_new_tokens=NEW)
    np.testing.assert_array_equal(np.asarray(res.tokens), ref)
    np.testing.assert_array_equal(np.asarray(res.drafter_state.lengths), np.asarray(res.cache.lengths))
