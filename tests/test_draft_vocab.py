"""A restricted draft vocabulary (speculative/draft_vocab.py): the draft log-probs are the full ones at
the chosen ids, renormalised; the tree / chain map draft indices to those ids; generation stays
identical to plain decoding in every mode and engine path; bad vocabularies are named."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.speculative.build import build_chain, build_tree
from ddtree_jax.speculative.draft_vocab import HotParams, check_ids, first_ids, load_ids
from ddtree_jax.speculative.generate import generate
from tests.test_dflash_generate import drafter_for
from tests.tiny_models import HYBRID, make_target


def _pair(seed=7):
    cfg, gd, params = make_target(HYBRID, seed=seed)
    proposer, dparams = drafter_for(cfg)
    return cfg, gd, params, proposer, dparams


def test_draft_log_probs_are_the_full_ones_renormalised_over_the_ids():
    cfg, gd, params, proposer, dparams = _pair()
    target = nnx.merge(gd, params)
    ids = np.sort(np.random.default_rng(0).choice(cfg.vocab_size, 40, replace=False)).astype(np.int32)
    hot, hparams = proposer.with_draft_vocab(dparams, target, ids)
    assert hot.draft_vocab == 40 and isinstance(hparams, HotParams) and hash(hot) != hash(proposer)
    state = proposer.extend(dparams, proposer.init_state(dparams, 2, 32), jnp.ones((2, 3, 2 * cfg.hidden_size)),
                            jnp.asarray([3, 2], jnp.int32))
    bonus, start = jnp.asarray([5, 9], jnp.int32), state.lengths
    full = proposer.propose(dparams, state, target, bonus, start)
    got = hot.propose(hparams, state, target, bonus, start)
    want = jax.nn.log_softmax(full[..., ids], axis=-1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(hot.vocab_ids(hparams)), ids)
    assert proposer.vocab_ids(dparams) is None
    with pytest.raises(ValueError, match="HotParams"):
        hot.propose(dparams, state, target, bonus, start)


def test_build_maps_draft_indices_to_token_ids():
    """Building over the ids' log-probs then mapping equals building over the full vocabulary with
    every other id at -inf (the same ranks, ties by id since the ids ascend)."""
    rng = np.random.default_rng(1)
    v, n, depth = 50, 12, 4
    ids = np.sort(rng.choice(v, n, replace=False)).astype(np.int32)
    sub = jnp.asarray(np.round(rng.normal(size=(2, depth, n)), 1), jnp.float32)  # rounded: ties happen
    full = jnp.full((2, depth, v), -jnp.inf).at[..., ids].set(sub)
    root, start = jnp.asarray([3, 4], jnp.int32), jnp.asarray([7, 9], jnp.int32)
    for budget in (1, 20):
        want = build_tree(full, root, start, budget)
        got = build_tree(sub, root, start, budget, vocab_ids=jnp.asarray(ids))
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(build_chain(sub, root, start, jnp.asarray(ids)).tokens),
                                  np.asarray(build_chain(full, root, start).tokens))


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_generation_with_a_draft_vocabulary_is_lossless(mode):
    cfg, gd, params, proposer, dparams = _pair()
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    lens = jnp.asarray([10, 6], jnp.int32)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=48)
    hot, hparams = proposer.with_draft_vocab(dparams, nnx.merge(gd, params), first_ids(cfg.vocab_size // 2,
                                                                                           cfg.vocab_size))
    res = generate(gd, params, prompt, lens, proposer=hot, drafter_params=hparams, mode=mode, budget=16,
                   max_new_tokens=48)
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(res.drafter_state.lengths), np.asarray(res.cache.lengths))


@pytest.mark.slow  # ~28 s; the draft vocabulary's lossless generation stays in the default run
def test_engine_takes_a_draft_vocabulary(tmp_path):
    from ddtree_jax.engine import Engine

    cfg, gd, params, proposer, dparams = _pair()
    path = tmp_path / "hot.json"
    path.write_text(json.dumps({"ids": list(range(cfg.vocab_size - 1, 10, -2))}))  # any order: sorted on load
    prompt = [[3, 1, 4, 1, 5]]
    ref = Engine(cfg, gd, params, proposer=proposer, drafter_params=dparams).generate(prompt, mode="ar",
                                                                                      max_new_tokens=24)
    for vocab in (str(path), 40):  # a JSON file of ids; a size (ids 0..39)
        eng = Engine(cfg, gd, params, proposer=proposer, drafter_params=dparams, draft_vocab=vocab)
        assert eng.proposer.draft_vocab > 0
        out = eng.generate(prompt, mode="ddtree", budget=8, max_new_tokens=24)
        assert out[0].token_ids == ref[0].token_ids
    with pytest.raises(ValueError, match="needs a DFlash drafter"):
        Engine(cfg, gd, params, draft_vocab=40)


def test_bad_draft_vocabularies_are_named(tmp_path):
    with pytest.raises(ValueError) as e:
        check_ids([3, 3, 70, -1], 64)
    assert "outside the target's vocabulary" in str(e.value) and "repeated" in str(e.value)
    for bad in (0, 65):
        with pytest.raises(ValueError, match=r"size must be an integer in \[1, 64\]"):
            first_ids(bad, 64)
    with pytest.raises(ValueError, match="neither a size nor a JSON file"):
        load_ids("no/such/file.json", 64)
    path = tmp_path / "bad.json"
    path.write_text('{"tokens": [1, 2]}')
    with pytest.raises(ValueError, match="holds no list of token ids"):
        load_ids(str(path), 64)
    path.write_text("[1, 2, 2]")
    with pytest.raises(ValueError, match="repeated"):
        load_ids(str(path), 64)
    np.testing.assert_array_equal(load_ids("3", 64), [0, 1, 2])


def test_hot_tokens_script_writes_a_vocabulary_the_cli_loads(tmp_path):
    """scripts/hot_tokens.py counts ids with the target's tokenizer and writes the most frequent
    ones (topped up in id order) with their coverage; load_ids reads the file back."""
    from scripts.hot_tokens import hot_ids, main
    from tests.cli_fixtures import write_target

    import collections

    assert hot_ids(collections.Counter({7: 3, 2: 3, 9: 1}), 4, 20) == [0, 2, 7, 9]
    target = write_target(str(tmp_path / "target"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 20)
    jl = tmp_path / "more.jsonl"
    jl.write_text(json.dumps({"text": "print(f(2))"}) + "\n")
    out = tmp_path / "hot.json"
    assert main([str(corpus), str(jl), "--target", target, "--size", "40", "--vocab-size", "128",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["size"] == 40 and 0 < report["coverage"] <= 1
    np.testing.assert_array_equal(load_ids(str(out), 128), report["ids"])
    assert main([str(corpus), "--target", target, "--size", "0", "--out", str(out)]) == 2
