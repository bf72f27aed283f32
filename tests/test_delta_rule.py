"""The gated delta rule forms agree with a float64 token-by-token oracle.

Shapes are fixed per test so one compilation serves every hypothesis example.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

from pallas_kernels.ref import delta_rule
from ddtree_jax.tree import root_path

B, H, DK, DV = 2, 3, 8, 6


def oracle(q, k, v, g, beta, state, order):
    """float64 sequential recurrence over the tokens listed in `order` (one path)."""
    s = np.array(state, np.float64)
    outs = {}
    for i in order:
        s = s * np.exp(g[..., i])[..., None, None]
        mem = np.einsum("bhkv,bhk->bhv", s, k[:, :, i])
        u = beta[..., i][..., None] * (v[:, :, i] - mem)
        s = s + k[:, :, i][..., :, None] * u[..., None, :]
        outs[i] = np.einsum("bhkv,bhk->bhv", s, q[:, :, i])
    return outs, s


def draw_inputs(seed, n):
    rng = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(B, H, n, DK))) * DK**-0.5
    k = unit(rng.normal(size=(B, H, n, DK)))
    v = rng.normal(size=(B, H, n, DV))
    g = -rng.uniform(0.01, 2.0, size=(B, H, n))
    beta = rng.uniform(0.05, 1.0, size=(B, H, n))
    state = rng.normal(size=(B, H, DK, DV))
    return q, k, v, g, beta, state


def f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


@given(seed=st.integers(0, 2**31 - 1))
def test_recurrent_and_chunked_match_oracle(seed):
    n = 77  # more than one chunk of 64 plus a ragged tail
    q, k, v, g, beta, state = draw_inputs(seed, n)
    ref, ref_state = oracle(q, k, v, g, beta, state, range(n))
    ref_o = np.stack([ref[i] for i in range(n)], axis=2)
    o, s = jax.jit(delta_rule.recurrent)(*f32(q, k, v, g, beta, state))
    np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, ref_state, rtol=1e-5, atol=1e-5)
    o, s = jax.jit(delta_rule.chunked)(*f32(q, k, v, g, beta, state))
    np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, ref_state, rtol=1e-5, atol=1e-5)


def test_padding_leaves_state_untouched():
    q, k, v, g, beta, state = draw_inputs(0, 70)
    g[..., 50:] = 0.0
    beta[..., 50:] = 0.0
    _, ref_state = oracle(q, k, v, g, beta, state, range(50))
    _, s = delta_rule.chunked(*f32(q, k, v, g, beta, state))
    np.testing.assert_allclose(s, ref_state, rtol=1e-5, atol=1e-5)


N_TREE = 12


@st.composite
def trees(draw):
    """Random parent arrays in topological order (parent[i] < i, node 0 = root)."""
    n = draw(st.integers(1, N_TREE))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    return parents




@given(parents=trees(), seed=st.integers(0, 2**31 - 1))
def test_tree_block_equals_each_path_run_sequentially(parents, seed):
    n = len(parents)
    q, k, v, g, beta, state = draw_inputs(seed, N_TREE)
    # Pad to N_TREE nodes: padding nodes see only themselves and are ignored.
    visible = np.eye(N_TREE, dtype=bool)
    path_g = g.copy()
    for i in range(n):
        for j in root_path(parents, i):
            visible[i, j] = True
        path_g[..., i] = sum(g[..., j] for j in root_path(parents, i))
    o, u = jax.jit(delta_rule.block)(*f32(q, k, v, path_g, beta, state), jnp.asarray(visible))
    for i in range(n):
        path = root_path(parents, i)
        ref, ref_state = oracle(q, k, v, g, beta, state, path)
        np.testing.assert_allclose(o[:, :, i], ref[i], rtol=1e-5, atol=1e-5)
        # The state after the path, from the corrected values of the path's nodes only.
        on_path = np.zeros(N_TREE, bool)
        on_path[path] = True
        u_path = jnp.where(jnp.asarray(on_path)[None, None, :, None], u, 0.0)
        s = delta_rule.advance(*f32(k), u_path, *f32(path_g, state), jnp.asarray(path_g[..., i], jnp.float32))
        np.testing.assert_allclose(s, ref_state, rtol=1e-5, atol=1e-5)
