"""Tree verification and commit on hybrid targets (docs/tree_state.md invariants 1-3, 6).

Random trees (chains, stars, deep, wide, single node, full, with padding) and random accepted
paths inside fixed padded shapes, so one compilation serves every example.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.tiny_models import ATTENTION_ONLY, HYBRID, make_target
from tests.tree_harness import (
    B, N, assert_same_committed_state, chain_logits, commit, committed_cache as _committed, pad_tree,
    path_to, sequential, tree_logits, tree_shapes,
)

MODELS = {"hybrid": make_target(HYBRID, seed=1), "attention": make_target(ATTENTION_ONLY, seed=2)}


def committed_cache(name, seed):
    return _committed(MODELS[name], seed)


@pytest.mark.parametrize("name", ["hybrid", "attention"])
@given(shapes=st.lists(tree_shapes(), min_size=B, max_size=B), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=12)
def test_node_logits_and_commit_match_sequential(name, shapes, seed):
    cfg, gd, params = MODELS[name]
    rng = np.random.default_rng(seed)
    cache = committed_cache(name, seed)
    tokens, parents, valid = pad_tree(shapes, rng, cfg.vocab_size)
    logits, pending = tree_logits(gd, params, cache, tokens, parents, valid)
    # Invariant 1: every node's logits == the target run sequentially on root..node.
    # One sequential run per deepest node covers all of its ancestors.
    paths = np.zeros((B, N), np.int32)
    for leaf in range(N):
        rows, counts = [], []
        for b in range(B):
            p = path_to(shapes[b], min(leaf, len(shapes[b]) - 1))
            rows.append(p + [p[-1]] * (N - len(p)))
            counts.append(len(p))
        rows = np.asarray(rows, np.int32)
        seq_tokens = jnp.take_along_axis(tokens, jnp.asarray(rows), axis=1)
        seq_cache, seq_logits = sequential(gd, params, cache, seq_tokens, jnp.asarray(counts))
        for b in range(B):
            for t in range(counts[b]):
                np.testing.assert_allclose(logits[b, rows[b, t]], seq_logits[b, t], rtol=1e-5, atol=2e-5)
        if leaf == N - 1 or rng.random() < 0.3:
            paths, path_counts, ref_cache = rows, np.asarray(counts), seq_cache
    # Invariants 2-3: committing a random accepted path == sequential decoding of its tokens.
    got = commit(gd, params, pending, jnp.asarray(paths), jnp.asarray(path_counts), cache)
    assert_same_committed_state(got, ref_cache)


@given(seed=st.integers(0, 2**31 - 1), count=st.integers(1, N))
@settings(max_examples=10)
def test_chain_tree_equals_linear_verify(seed, count):
    """Invariant 6: a chain-shaped tree gives exactly the linear (causal) verify and commit."""
    cfg, gd, params = MODELS["hybrid"]
    rng = np.random.default_rng(seed)
    cache = committed_cache("hybrid", seed)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, N)), jnp.int32)
    parents = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32) - 1, (B, N))
    tree_l, tree_pending = tree_logits(gd, params, cache, tokens, parents, jnp.ones((B, N), bool))
    lin_l, lin_pending = chain_logits(gd, params, cache, tokens)
    np.testing.assert_allclose(tree_l, lin_l, rtol=1e-5, atol=1e-5)
    path = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
    counts = jnp.full((B,), count, jnp.int32)
    a = commit(gd, params, tree_pending, path, counts, cache)
    b = commit(gd, params, lin_pending, path, counts, cache)
    assert_same_committed_state(a, b)
