"""Tree verification and commit on hybrid targets (shared/specs/hybrid_tree_state.md invariants 1-3, 6).

Random trees (chains, stars, deep, wide, single node, full, with padding) and random accepted
paths inside fixed padded shapes, so one compilation serves every example.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from ddtree_jax import decode
from ddtree_jax.cache import KVCache, init_target_cache
from ddtree_jax.tree import make_tree
from tests.tiny_models import ATTENTION_ONLY, HYBRID, make_target

B, PROMPT, N, CAP = 2, 9, 12, 40
MODELS = {"hybrid": make_target(HYBRID, seed=1), "attention": make_target(ATTENTION_ONLY, seed=2)}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def tree_logits(graphdef, params, cache, tokens, parents, valid):
    model = nnx.merge(graphdef, params)
    tree = make_tree(tokens, parents, valid, cache.lengths, max_depth=N - 1)
    h, _, pending = model.verify(tokens, cache, tree)
    return model.logits(h), pending


@functools.partial(jax.jit, static_argnames=("graphdef",))
def chain_logits(graphdef, params, cache, tokens):
    model = nnx.merge(graphdef, params)
    h, _, pending = model.verify(tokens, cache, None)
    return model.logits(h), pending


@functools.partial(jax.jit, static_argnames=("graphdef",))
def commit(graphdef, params, pending, path, count, cache):
    return nnx.merge(graphdef, params).commit(pending, path, count, cache)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def sequential(graphdef, params, cache, tokens, count):
    """Decode tokens [B, P] one by one (rows stop after count[b]); logits after each token."""
    model = nnx.merge(graphdef, params)

    def body(cache, xs):
        tok, t = xs
        h, _, cache = model(tok[:, None], cache, (t < count).astype(jnp.int32), chunked=False)
        return cache, model.logits(h[:, 0])

    cache, logits = jax.lax.scan(body, cache, (tokens.T, jnp.arange(tokens.shape[1])))
    return cache, jnp.swapaxes(logits, 0, 1)


def committed_cache(name, seed):
    cfg, gd, params = MODELS[name]
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, PROMPT)), jnp.int32)
    n_valid = jnp.asarray(rng.integers(1, PROMPT + 1, B), jnp.int32)  # different lengths per row
    cache = init_target_cache(cfg, B, CAP)
    return decode.prefill(gd, params, cache, prompt, n_valid).cache


@st.composite
def tree_shapes(draw):
    kind = draw(st.sampled_from(["random", "chain", "star", "deep", "wide", "single", "full"]))
    n = {"single": 1, "full": N}.get(kind, draw(st.integers(2, N)))
    if kind == "chain" or kind == "deep":
        parents = [-1] + list(range(n - 1))
    elif kind == "star":
        parents = [-1] + [0] * (n - 1)
    elif kind == "wide":
        parents = [-1] + [min(i // 4, i - 1) if i > 1 else 0 for i in range(1, n)]
    else:
        parents = [-1] + [draw(st.integers(max(0, i - 3), i - 1)) for i in range(1, n)]
    return parents


def path_to(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def pad_tree(parents_rows, rng, vocab):
    tokens = rng.integers(0, vocab, (B, N))
    parents = np.full((B, N), -1)
    valid = np.zeros((B, N), bool)
    for b, p in enumerate(parents_rows):
        parents[b, : len(p)] = p
        valid[b, : len(p)] = True
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32), jnp.asarray(valid)


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


def assert_same_committed_state(got, ref):
    np.testing.assert_array_equal(got.lengths, ref.lengths)
    lengths = np.asarray(ref.lengths)
    for layer_got, layer_ref in zip(got.layers, ref.layers):
        if isinstance(layer_ref, KVCache):
            for b, n in enumerate(lengths):
                np.testing.assert_allclose(layer_got.k[b, :, :n], layer_ref.k[b, :, :n], rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(layer_got.v[b, :, :n], layer_ref.v[b, :, :n], rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_allclose(layer_got.state, layer_ref.state, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(layer_got.conv, layer_ref.conv, rtol=1e-5, atol=1e-5)


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
