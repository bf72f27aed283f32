"""End-to-end speculative generation: lossless greedy output, exact committed state, drafter context.

DFlash linear and DDTree must reproduce plain greedy decoding token for token on hybrid,
attention-only and mixture-of-experts targets (Qwen3.5-MoE; Qwen3-Next with sparse and dense layers;
4 experts, top 2: tree nodes and batch rows share experts), with a random drafter (almost nothing
accepted) and with the target's own continuation with injected errors (long accepts and rejects at
every depth).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import decode
from ddtree_jax.cache import KVCache, init_target_cache
from ddtree_jax.speculative.generate import generate
from tests.scripted_proposers import RecordingProposer, ScriptedProposer
from tests.tiny_models import ATTENTION_ONLY, HYBRID, HYBRID_MOE, NEXT_MOE, make_target
from tests.tolerance import scaled_error

B, T, NEW, BLOCK = 2, 12, 128, 6
MODELS = {"qwen3_5": make_target(HYBRID, seed=3), "qwen3": make_target(ATTENTION_ONLY, seed=4),
          "qwen3_5_moe": make_target(HYBRID_MOE, seed=8), "qwen3_next_moe": make_target(NEXT_MOE, seed=9)}


def prompts(cfg, seed=0):
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    return prompt, jnp.asarray([T, T - 5], jnp.int32)


def greedy_table(name):
    """Prompt + plain greedy continuation (the AR reference), as absolute-position tables."""
    cfg, gd, params = MODELS[name]
    prompt, lens = prompts(cfg)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=NEW + BLOCK + 2)
    table = np.zeros((B, T + NEW + 2 * BLOCK + 4), np.int32)
    for b in range(B):
        n = int(lens[b])
        table[b, :n] = np.asarray(prompt[b, :n])
        table[b, n : n + ref.tokens.shape[1]] = np.asarray(ref.tokens[b])
    return jnp.asarray(table), np.asarray(ref.tokens[:, :NEW])


TABLES = {}


def reference(name):
    if name not in TABLES:
        TABLES[name] = greedy_table(name)
    return TABLES[name]


def test_ar_generate_matches_greedy_decode_loop():
    cfg, gd, params = MODELS["qwen3_5"]
    prompt, lens = prompts(cfg)
    res = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=40)
    for b in range(B):
        n = int(lens[b])
        cache = init_target_cache(cfg, 1, 64)
        pre = decode.prefill(gd, params, cache, prompt[b : b + 1, :n], jnp.array([n]))
        toks, _, _ = decode.greedy_decode(gd, params, pre.cache, pre.logits, 40)  # first token from prefill
        np.testing.assert_array_equal(np.asarray(res.tokens[b]), np.asarray(toks[0]))


def _lossless_cases():
    """Every target x mode x drafter; on the MoE targets the random drafter (almost nothing accepted,
    so little beyond what the oracle cases verify) runs under -m slow."""
    for drafter in ("oracle_with_errors", "random"):
        for mode, budget in (("dflash", 0), ("ddtree", 12)):
            for name in MODELS:
                slow = drafter == "random" and "moe" in name
                yield pytest.param(name, mode, budget, drafter, id=f"{drafter}-{mode}-{budget}-{name}",
                                   marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("name,mode,budget,drafter", list(_lossless_cases()))
def test_greedy_speculative_equals_plain_greedy(name, mode, budget, drafter):
    cfg, gd, params = MODELS[name]
    table, ref = reference(name)
    prompt, lens = prompts(cfg)
    error_rate, runner_up = (0.2, True) if drafter == "oracle_with_errors" else (1.0, False)
    proposer = ScriptedProposer(BLOCK, cfg.vocab_size, error_rate, seed=11, runner_up=runner_up)
    res = generate(gd, params, prompt, lens, proposer=proposer, drafter_params=table, mode=mode,
                   budget=budget or 1, max_new_tokens=NEW)
    np.testing.assert_array_equal(np.asarray(res.tokens), ref)
    emitted = np.asarray(res.num_tokens).sum()
    mean_accept = emitted / np.asarray(res.steps).sum()
    if drafter == "oracle_with_errors":
        assert mean_accept > 2.5, f"scripted oracle should accept long runs, got {mean_accept:.2f}"
        hist = np.asarray(res.accepted_hist)
        if mode == "dflash":  # a reject at every depth, and full blocks
            assert np.all(hist[1 : BLOCK + 1] > 0), f"need rejects at every depth and full accepts: {hist}"
        else:
            assert hist[BLOCK] > 0 and hist[1:BLOCK].sum() > 0, f"need rejects and full accepts: {hist}"
    else:
        assert mean_accept < 1.5


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_final_committed_state_equals_sequential_prefill(mode):
    """After 100+ steps of accepts and rejects, the caches equal a plain run of the committed tokens."""
    cfg, gd, params = MODELS["qwen3_5"]
    table, ref = reference("qwen3_5")
    prompt, lens = prompts(cfg)
    proposer = ScriptedProposer(BLOCK, cfg.vocab_size, 0.2, seed=5)
    res = generate(gd, params, prompt, lens, proposer=proposer, drafter_params=table, mode=mode,
                   budget=10, max_new_tokens=NEW)
    lengths = np.asarray(res.cache.lengths)
    # Sequential reference: the same prompt prefill, then the emitted tokens decoded one by one.
    cache = decode.prefill(gd, params, init_target_cache(cfg, B, res.cache.capacity), prompt, lens).cache
    for t in range(int(lengths.max() - np.asarray(lens).min())):
        pos = np.asarray(lens) + t
        active = jnp.asarray(pos < lengths)
        tok = jnp.asarray(np.asarray(table)[np.arange(B), np.minimum(pos, table.shape[1] - 1)], jnp.int32)
        cache = decode.decode_step(gd, params, cache, tok, active).cache
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    worst = 0.0
    for got, want in zip(res.cache.layers, cache.layers):
        for b in range(B):
            if isinstance(want, KVCache):
                pairs = [(got.k[b, :, : lengths[b]], want.k[b, :, : lengths[b]]),
                         (got.v[b, :, : lengths[b]], want.v[b, :, : lengths[b]])]
            else:
                pairs = [(got.state[b], want.state[b]), (got.conv[b], want.conv[b])]
            for x, y in pairs:
                worst = max(worst, scaled_error(x, y))
    assert worst <= 1e-5, f"committed state drifted from sequential decoding: {worst:.2e} of its magnitude"


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_drafter_receives_features_of_accepted_nodes(mode):
    """The features given to the drafter at every committed position are the target's features of
    the committed token there (not the first rows of the tree)."""
    cfg, gd, params = MODELS["qwen3_5"]
    table, _ = reference("qwen3_5")
    prompt, lens = prompts(cfg)
    proposer = RecordingProposer(ScriptedProposer(BLOCK, cfg.vocab_size, 0.3, seed=9), feature_dim=2 * cfg.hidden_size)
    new = 48
    res = generate(gd, params, prompt, lens, proposer=proposer, drafter_params=table, mode=mode, budget=10,
                   max_new_tokens=new, capacity=T + new + BLOCK + 1)
    lengths = np.asarray(res.cache.lengths)
    recorded = np.asarray(res.drafter_state.features)
    for b in range(B):
        committed = jnp.asarray(table[b, : lengths[b]])[None]
        pre = decode.prefill(gd, params, init_target_cache(cfg, 1, 256), committed, jnp.asarray([lengths[b]]),
                             hidden_ids=proposer.hidden_ids, all_logits=True)
        np.testing.assert_allclose(recorded[b, : lengths[b]], pre.features[0], atol=2e-5, rtol=1e-5)
        assert not np.any(recorded[b, lengths[b] :]), "features written past the committed length"


def test_generation_is_one_device_loop_without_host_callbacks_or_recompiles():
    """The whole generation is one jitted while_loop (no callbacks), and streaming in chunks of
    steps reuses one compilation whatever the chunk size."""
    from ddtree_jax.speculative import generate as g

    cfg, gd, params = MODELS["qwen3_5"]
    table, ref = reference("qwen3_5")
    prompt, lens = prompts(cfg)
    proposer = ScriptedProposer(BLOCK, cfg.vocab_size, 0.2, seed=5)
    jaxpr = jax.make_jaxpr(
        lambda p, t: g.generate(gd, params, p, lens, proposer=proposer, drafter_params=t, mode="ddtree",
                                budget=8, max_new_tokens=32)
    )(prompt, table)
    text = str(jaxpr)
    assert "while[" in text
    assert "callback" not in text, "host callback inside the decode loop"
    spec = g.GenSpec("ddtree", 8, None, NEW, g.Sampling(), 0, proposer)
    state = g.start(gd, params, table, prompt, lens, None, jax.random.PRNGKey(0), spec)
    before = g.advance._cache_size()
    chunks = []
    for steps in (1, 3, 7, 1000):
        state = g.advance(gd, params, table, state, None, jnp.int32(steps), spec)
        chunks.append(int(state.i))
    assert g.advance._cache_size() <= before + 1, "advance recompiled between chunks"
    assert chunks[:3] == [1, 4, 11]
    np.testing.assert_array_equal(np.asarray(state.out), ref)


def test_bad_generation_settings_are_rejected():
    cfg, gd, params = MODELS["qwen3_5"]
    prompt, lens = prompts(cfg)
    proposer = ScriptedProposer(BLOCK, cfg.vocab_size, 0.2)
    with pytest.raises(ValueError, match="budget"):
        generate(gd, params, prompt, lens, proposer=proposer, mode="ddtree", budget=0)
    with pytest.raises(ValueError, match="mode"):
        generate(gd, params, prompt, lens, proposer=proposer, mode="beam")
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(gd, params, prompt, lens, mode="dflash")
    with pytest.raises(ValueError, match="capacity"):
        generate(gd, params, prompt, lens, mode="ar", max_new_tokens=50, capacity=20)


def test_bound_start_advance_match_the_static_graphdef_forms(monkeypatch):
    """generate.bind(graphdef): start / advance with the graphdef bound once (the engine's per-chunk
    calls) are the same functions for the same graphdef, hash no GraphDef per call, and produce
    what the static-graphdef forms produce, chunk after chunk."""
    from flax import nnx

    from ddtree_jax.speculative import generate as gen
    from ddtree_jax.speculative.sampling import Sampling

    cfg, gd, params = MODELS["qwen3_5"]
    prompt, lens = prompts(cfg, seed=3)
    eos = jnp.zeros((0,), jnp.int32)
    spec = gen.GenSpec("ar", 4, None, 12, Sampling(), 64, None)
    start, advance = gen.bind(gd)
    assert gen.bind(gd) == (start, advance)
    s_ref = gen.start(gd, params, None, prompt, lens, eos, jax.random.PRNGKey(0), spec)
    s_got = start(params, None, prompt, lens, eos, jax.random.PRNGKey(0), spec=spec)
    start(params, None, prompt, lens, eos, jax.random.PRNGKey(0), spec=spec)  # compiled: no GraphDef hash below
    hashed = []
    real_hash = nnx.GraphDef.__hash__
    monkeypatch.setattr(nnx.GraphDef, "__hash__", lambda self: hashed.append(1) or real_hash(self))
    for _ in range(3):
        s_ref = gen.advance(gd, params, None, s_ref, eos, jnp.int32(3), spec)
        n_static = len(hashed)
        s_got = advance(params, None, s_got, eos, jnp.int32(3), spec=spec)
        assert len(hashed) == n_static  # the bound call hashed no GraphDef
        np.testing.assert_array_equal(np.asarray(s_got.out), np.asarray(s_ref.out))
    assert hashed  # the static form did
