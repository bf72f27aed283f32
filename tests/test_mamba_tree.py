"""Tree verification and commit on Mamba2-family targets (docs/tree_state.md
invariants 1, 2, 3, 6), plus the SSD math against a float64 per-path oracle.

Targets (tests/hf_mamba_models.py TINY, all parameters random): NemotronH (Mamba2 + MoE +
attention without RoPE + relu^2 MLP, one mixer per block, dt clamp ACTIVE on some tokens), Bamba
(Mamba2 + RoPE attention + SwiGLU, n_groups 1, conv 3) and pure Mamba2 (fp32 residual, tied head).
Random trees (chains, stars, deep, wide, single node, full, with padding) and random accepted
paths inside fixed padded shapes, so one compilation serves every example.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from ddtree_jax.routes import Routes
from ddtree_jax.tree import make_tree
from pallas_kernels.ref import ssd
from tests.hf_mamba_models import make_jax_target
from tests.tree_harness import (
    INTERPRET, B, N, assert_same_committed_state, chain_logits, commit, committed_cache as _committed, pad_tree,
    path_to, sequential, tree_logits, tree_shapes,
)

MODELS = {name: make_jax_target(name, seed=s) for name, s in (("nemotron_h", 1), ("bamba", 2), ("mamba2", 3))}


def committed_cache(name, seed):
    return _committed(MODELS[name], seed)


@pytest.mark.parametrize("name", list(MODELS))
@given(shapes=st.lists(tree_shapes(), min_size=B, max_size=B), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=8)
def test_node_logits_and_commit_match_sequential(name, shapes, seed):
    cfg, gd, params = MODELS[name]
    rng = np.random.default_rng(seed)
    cache = committed_cache(name, seed)
    tokens, parents, valid = pad_tree(shapes, rng, cfg.vocab_size)
    logits, pending = tree_logits(gd, params, cache, tokens, parents, valid)
    assert np.all(np.isfinite(np.asarray(logits)))
    # Invariant 1: every node's logits == the target run sequentially on root..node.
    paths, path_counts, ref_cache = None, None, None
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
    # Invariants 2-3: committing an accepted path == sequential decoding of its tokens (fp32, 1e-5).
    got = commit(gd, params, pending, jnp.asarray(paths), jnp.asarray(path_counts), cache)
    assert_same_committed_state(got, ref_cache)


@pytest.mark.parametrize("name", list(MODELS))
@given(seed=st.integers(0, 2**31 - 1), count=st.integers(1, N))
@settings(max_examples=6)
def test_chain_tree_equals_linear_verify(name, seed, count):
    """Invariant 6: a chain-shaped tree gives exactly the linear (causal) verify and commit."""
    cfg, gd, params = MODELS[name]
    rng = np.random.default_rng(seed)
    cache = committed_cache(name, seed)
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


def test_dt_clamp_is_active_in_the_nemotron_fixture():
    """The tree fixture really exercises the clamp (time_step_min = 0.05 with dt_bias -7 heads)."""
    cfg, gd, params = MODELS["nemotron_h"]
    model = nnx.merge(gd, params)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 16, cfg.hidden_size))
    mixer = model.layers[0].mamba
    raw = jax.nn.softplus(mixer.in_proj(x)[..., -cfg.mamba_num_heads:] + mixer.dt_bias[...])
    _, _, dt = mixer.project(x)
    assert float(jnp.mean(raw < cfg.mamba_dt_limit[0])) > 0.1
    assert float(jnp.min(dt)) >= cfg.mamba_dt_limit[0]


# ---- SSD math vs a float64 oracle ------------------------------------------------------------------
def _random_ssd(rng, b, t, h, p, g, n, big_decay=False):
    f = lambda *s: rng.normal(size=s)
    dt = rng.uniform(0.01, 3.0 if big_decay else 1.0, (b, t, h))
    a = -rng.uniform(0.5, 8.0 if big_decay else 1.5, (h,))
    return f(b, t, h, p), dt, a, f(b, t, g, n), f(b, t, g, n), f(h), f(b, h, p, n)


def _oracle_path(x, dt, a, bm, cm, d, s0, path):
    """float64 recurrence over the tokens of `path` (one batch row): outputs at each and the state."""
    s = s0.copy()
    r = x.shape[1] // bm.shape[1]
    ys = []
    for j in path:
        bh, ch = np.repeat(bm[j], r, axis=0), np.repeat(cm[j], r, axis=0)
        s = s * np.exp(dt[j] * a)[:, None, None] + (dt[j][:, None] * x[j])[..., None] * bh[:, None, :]
        ys.append(np.einsum("hpn,hn->hp", s, ch) + d[:, None] * x[j])
    return ys, s


_chunked = jax.jit(ssd.chunked, static_argnames=("chunk",))
_recurrent = jax.jit(ssd.recurrent)


@given(seed=st.integers(0, 2**31 - 1), chunk=st.sampled_from([2, 4, 8]), groups=st.sampled_from([1, 2, 4]))
@settings(max_examples=10)
def test_ssd_chunked_and_recurrent_match_float64_oracle(seed, chunk, groups):
    rng = np.random.default_rng(seed)
    b, t, h, p, n = 2, 13, 4, 3, 5
    x, dt, a, bm, cm, d, s0 = _random_ssd(rng, b, t, h, p, groups, n)
    dt[1, 9:] = 0.0  # row 1: 9 real tokens, then padding (dt = 0 leaves the state alone)
    j32 = lambda v: jnp.asarray(v, jnp.float32)
    args = tuple(map(j32, (x, dt, a, bm, cm, d, s0)))
    y_c, s_c = _chunked(*args, chunk=chunk)
    y_r, s_r = _recurrent(*args)
    for row, real in ((0, t), (1, 9)):
        ys, s = _oracle_path(x[row], dt[row], a, bm[row], cm[row], d, s0[row], range(real))
        np.testing.assert_allclose(np.asarray(y_c)[row, :real], np.stack(ys), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(y_r)[row, :real], np.stack(ys), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(s_c)[row], s, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(s_r)[row], s, rtol=1e-4, atol=1e-4)


@given(shapes=st.lists(tree_shapes(), min_size=2, max_size=2), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=10)
def test_ssd_tree_block_and_path_commit_match_per_path_oracle(shapes, seed):
    """Every node's output from its own root->node path; the commit scan along any path gives that
    path's state. Large decays: a non-ancestor exponent Acs_i - Acs_j is large and positive, so a
    mask applied after exp would give inf * 0 = NaN."""
    rng = np.random.default_rng(seed)
    b, h, p, g, n = 2, 4, 3, 2, 5
    x, dt, a, bm, cm, d, s0 = _random_ssd(rng, b, N, h, p, g, n, big_decay=True)
    _, parents, valid = pad_tree(shapes, rng, 2)
    tree = make_tree(jnp.zeros((b, N), jnp.int32), parents, valid, jnp.zeros((b,), jnp.int32), max_depth=N - 1)
    from ddtree_jax.tree import bits_to_dense

    visible = bits_to_dense(tree.ancestor_bits, N)
    j32 = lambda v: jnp.asarray(v, jnp.float32)
    acs = ssd.path_sums(j32(dt), j32(a), visible)
    y = np.asarray(ssd.block(j32(x), j32(dt), j32(a), j32(bm), j32(cm), j32(d), j32(s0), visible, acs))
    assert np.all(np.isfinite(y))
    paths = np.zeros((b, N), np.int32)
    counts = np.zeros((b,), np.int32)
    want_states = []
    for row in range(b):
        for node in range(len(shapes[row])):
            path = path_to(shapes[row], node)
            ys, s = _oracle_path(x[row], dt[row], a, bm[row], cm[row], d, s0[row], path)
            np.testing.assert_allclose(y[row, node], ys[-1], rtol=1e-4, atol=1e-4)
        path = path_to(shapes[row], int(rng.integers(0, len(shapes[row]))))
        paths[row, : len(path)], paths[row, len(path) :], counts[row] = path, path[-1], len(path)
        want_states.append(_oracle_path(x[row], dt[row], a, bm[row], cm[row], d, s0[row], path)[1])
    on = np.arange(N)[None, :] < counts[:, None]
    take = lambda v: np.take_along_axis(v, paths.reshape(b, N, *([1] * (v.ndim - 2))), axis=1)
    got = ssd.path_state(j32(take(x)), j32(np.where(on[..., None], take(dt), 0.0)), j32(a), j32(take(bm)), j32(s0))
    np.testing.assert_allclose(np.asarray(got), np.stack(want_states), rtol=1e-4, atol=1e-4)


def test_chain_through_the_ssd_kernel_matches_xla():
    """Linear DFlash's chain (tree None) runs the SSD tree kernel with kernels on (interpret mode
    here) and gives the XLA form's logits. The pure Mamba2 fixture: the hybrids' tiny attention
    (head_dim 8) is below what the attention kernel takes."""
    name = "mamba2"
    cfg, gd, params = MODELS[name]
    rng = np.random.default_rng(5)
    cache = committed_cache(name, 5)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, N)), jnp.int32)
    want, _ = chain_logits(gd, params, cache, tokens)
    got, _ = chain_logits(gd, params, cache, tokens, INTERPRET)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("n, expect_kernel", [(16, True), (17, False)])
def test_pallas_routes_large_trees_to_the_xla_form(n, expect_kernel, chain):
    """A GPU's routes run the SSD verify kernel up to routes.ssd_kernel_max_nodes (16, the measured
    crossover on the H200) nodes only, for trees and for linear DFlash's chains (tree None); larger
    ones take the XLA form, with a warning. Traced on the CPU, never run."""
    assert Routes.resolve(impl="pallas", platform="gpu").ssd_kernel_max_nodes == 16
    routes = Routes.resolve(impl="pallas_interpret", platform="gpu", ssd_kernel_max_nodes=16)  # traced on a CPU
    cfg, gd, params = MODELS["mamba2"]
    cache = committed_cache("mamba2", 0)
    tokens = jnp.zeros((B, n), jnp.int32)
    parents = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (B, n))
    tree = make_tree(tokens, parents, jnp.ones((B, n), bool), cache.lengths, max_depth=n - 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = str(jax.make_jaxpr(lambda p: nnx.merge(gd, p).verify(tokens, cache, None if chain else tree,
                                                                     routes=routes))(params))
    assert ("name=ssd_tree_verify" in text) == expect_kernel
    routed = [w for w in caught if "uses the XLA form" in str(w.message)]
    assert bool(routed) != expect_kernel  # the route to XLA is announced, never silent
