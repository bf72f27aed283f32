"""gdn_path_commit: the Pallas kernel (`impl`: interpreted on CPU, native under -m gpu) against
the gather + scan reference, the reference against a float64 sequential oracle and against
GatedDeltaNet.commit, the committed state against the tree outputs (a node's tree output is one
recurrent step from the state committed along the path to its parent), and (-m gpu) the kernel
at the 27B GDN layer.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ddtree_jax.cache import RecurrentCache
from pallas_kernels.ref import delta_rule
from ddtree_jax.models.gdn import GatedDeltaNet, RecurrentPending
from tests.tree_harness import routes_for
from pallas_kernels.gdn_commit import gdn_path_commit
from pallas_kernels.gdn_tree import gdn_tree_verify
from scripts.bench.kernels_gdn import gdn_args, gdn_problem, leaf_path

B, HK, H, N, DK, DV, P = 3, 2, 4, 37, 16, 32, 8  # odd batch and node counts on purpose
REP = H // HK


def draw_inputs(seed, n=N, dk=DK, dv=DV):
    rng = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    k = unit(rng.normal(size=(B, HK, n, dk)))
    v = rng.normal(size=(B, H, n, dv))
    g = -rng.uniform(0.01, 2.0, size=(B, H, n))
    beta = rng.uniform(0.05, 1.0, size=(B, H, n))
    state = rng.normal(size=(B, H, dk, dv))
    return k, v, g, beta, state


def oracle(k, v, g, beta, state, path, count):
    """float64: feed path[b, :count[b]] one by one into each sequence's state."""
    s = np.array(state, np.float64)
    kv = np.repeat(k, REP, axis=1)
    for b in range(B):
        for i in path[b, : count[b]]:
            s[b] = s[b] * np.exp(g[b, :, i])[:, None, None]
            u = beta[b, :, i][:, None] * (v[b, :, i] - np.einsum("hkv,hk->hv", s[b], kv[b, :, i]))
            s[b] = s[b] + kv[b, :, i][:, :, None] * u[:, None, :]
    return s


def assert_close(out, ref, tol):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(out).any(), "NaN in the committed state"
    err = np.abs(out - ref).max() / max(1.0, np.abs(ref).max())
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


f32 = lambda *xs: [jnp.asarray(x, jnp.float32) for x in xs]


@functools.cache
def kernel(impl, **kw):
    return jax.jit(functools.partial(gdn_path_commit, impl=impl, **kw))


ref_fn = jax.jit(functools.partial(gdn_path_commit, impl="xla"))

paths = st.lists(st.lists(st.integers(0, N - 1), min_size=P, max_size=P), min_size=B, max_size=B)
counts = st.lists(st.integers(0, P), min_size=B, max_size=B)


@settings(max_examples=15)
@given(seed=st.integers(0, 2**31 - 1), path=paths, count=counts, block_dv=st.sampled_from([8, 32]))
def test_kernel_matches_reference_and_oracle(impl, seed, path, count, block_dv):
    k, v, g, beta, state = draw_inputs(seed)
    path, count = np.array(path, np.int32), np.array(count, np.int32)
    args = (*f32(k, v, g, beta, state), jnp.asarray(path), jnp.asarray(count))
    ref = ref_fn(*args)
    assert_close(ref, oracle(k, v, g, beta, state, path, count), 1e-5)
    assert_close(kernel(impl, block_dv=block_dv)(*args), ref, 1e-5)


@settings(max_examples=5)
@given(seed=st.integers(0, 2**31 - 1), path=paths, count=st.lists(st.integers(1, P), min_size=B, max_size=B))
def test_kernel_bf16_inputs(impl, seed, path, count):
    k, v, g, beta, state = draw_inputs(seed)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (bf(k), bf(v), *f32(g, beta, state), jnp.asarray(path, jnp.int32), jnp.asarray(count, jnp.int32))
    out = kernel(impl)(*args)
    assert out.dtype == jnp.float32
    assert_close(out, ref_fn(*args), 1e-5)
    # ... and within bf16 rounding of the float32-input result.
    assert_close(out, ref_fn(*f32(k, v, g, beta, state), *args[5:]), 3e-2)


def test_every_count_along_one_path(impl):
    """count = 0 (state untouched) .. P on a fixed path, per sequence."""
    k, v, g, beta, state = draw_inputs(5)
    path = np.stack([np.random.default_rng(b).permutation(N)[:P] for b in range(B)]).astype(np.int32)
    for c in range(P + 1):
        count = np.full(B, c, np.int32)
        args = (*f32(k, v, g, beta, state), jnp.asarray(path), jnp.asarray(count))
        out = kernel(impl, block_dv=8)(*args)
        assert_close(out, oracle(k, v, g, beta, state, path, count), 1e-5)
        if c == 0:
            np.testing.assert_array_equal(np.asarray(out), np.asarray(state, np.float32))


KEEP, C = 3, 96  # conv window rows (K - 1) and channels: 96 = 3 blocks of 32


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), path=paths, count=counts, block_dv=st.sampled_from([8, 32]),
       wide=st.booleans())
def test_kernel_slides_the_conv_window(impl, seed, path, count, block_dv, wide):
    """With window / conv_in the kernel also returns the conv window after the path (in place),
    equal to models.conv.next_window over the path's conv inputs; conv_in may be wider than the
    window (the merged product's columns after conv_dim are not read); the state is unchanged."""
    k, v, g, beta, state = draw_inputs(seed)
    rng = np.random.default_rng(seed)
    window = jnp.asarray(rng.normal(size=(B, KEEP, C)), jnp.bfloat16)
    conv_in = jnp.asarray(rng.normal(size=(B, N, C + (40 if wide else 0))), jnp.bfloat16)
    path, count = jnp.asarray(path, jnp.int32), jnp.asarray(count, jnp.int32)
    args = (*f32(k, v, g, beta, state), path, count)
    state_ref, window_ref = ref_fn(*args, window=window, conv_in=conv_in)
    state_got, window_got = kernel(impl, block_dv=block_dv)(*args, window=window, conv_in=conv_in)
    assert window_got.dtype == window.dtype
    np.testing.assert_array_equal(np.asarray(window_got, np.float32), np.asarray(window_ref, np.float32))
    assert_close(state_got, state_ref, 1e-5)
    assert_close(state_got, ref_fn(*args), 1e-5)
    for b in range(B):  # oracle: the last KEEP rows of [window ; conv_in[path[:count]]]
        seq = np.concatenate([np.asarray(window[b], np.float32),
                              np.asarray(conv_in[b, np.asarray(path[b, : int(count[b])]), :C], np.float32)])
        np.testing.assert_array_equal(np.asarray(window_got[b], np.float32), seq[-KEEP:])


def test_window_arguments_are_checked():
    k, v, g, beta, state = f32(*draw_inputs(1))
    path, count = jnp.zeros((B, P), jnp.int32), jnp.ones((B,), jnp.int32)
    window = jnp.zeros((B, KEEP, C))
    with pytest.raises(ValueError, match="both window and conv_in"):
        gdn_path_commit(k, v, g, beta, state, path, count, window=window)
    with pytest.raises(ValueError, match="do not fit"):
        gdn_path_commit(k, v, g, beta, state, path, count, window=window, conv_in=jnp.zeros((B, N, C - 1)))


def test_reference_matches_gdn_commit(impl):
    """The xla impl is exactly what GatedDeltaNet.commit does to the recurrent state."""
    k, v, g, beta, state = f32(*draw_inputs(9))
    path = jnp.asarray(np.random.default_rng(9).integers(0, N, size=(B, P)), jnp.int32)
    count = jnp.asarray([0, 3, P], jnp.int32)
    pending = RecurrentPending(jnp.zeros((B, N, 4)), jnp.repeat(k, REP, axis=1), v, g, beta)
    cache = RecurrentCache(conv=jnp.zeros((B, 3, 4)), state=state)
    want = GatedDeltaNet.commit(pending, path, count, cache).state
    np.testing.assert_allclose(gdn_path_commit(k, v, g, beta, state, path, count), want, rtol=1e-6, atol=1e-6)
    # GatedDeltaNet.commit with kernels: state and conv window from the one launch, as the XLA form
    pending = pending._replace(conv_in=jnp.asarray(np.random.default_rng(3).normal(size=(B, N, 6)), jnp.float32))
    want = GatedDeltaNet.commit(pending, path, count, cache)
    got = GatedDeltaNet.commit(pending, path, count, cache, routes=routes_for(impl))
    np.testing.assert_allclose(got.state, want.state, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.conv), np.asarray(want.conv))


def test_commit_then_step_equals_tree_output(impl):
    """Tree output of node i == one recurrent step at i from the state committed along the path
    to i's parent (the tree verify and the commit agree on the semantics)."""
    n = 16
    rng = np.random.default_rng(4)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    anc = lambda i: [i] + anc(parents[i]) if i >= 0 else []
    bits = np.zeros((B, n, 1), np.uint32)
    for i in range(n):
        for j in anc(i):
            bits[:, i, 0] |= np.uint32(1 << j)
    k, v, g, beta, state = draw_inputs(4, n=n)
    q = k[:, :, ::-1] * DK**-0.5  # any unit vectors, scaled
    args = f32(q, k, v, g, beta, state)
    o = np.asarray(gdn_tree_verify(*args, jnp.asarray(bits), impl="xla"))
    for i in (0, 5, n - 1):
        path = anc(i)[::-1]
        parent_path = np.zeros((B, P), np.int32)
        parent_path[:, : len(path) - 1] = path[:-1]
        count = np.full(B, len(path) - 1, np.int32)
        s = kernel(impl)(*args[1:], jnp.asarray(parent_path), jnp.asarray(count))
        rep = lambda a: jnp.repeat(a, REP, axis=1)[:, :, i]
        step_o, _ = delta_rule.recurrent_step(rep(args[0]), rep(args[1]), args[2][:, :, i], args[3][:, :, i],
                                              args[4][:, :, i], s)
        np.testing.assert_allclose(o[:, :, i], step_o, rtol=1e-5, atol=1e-5)


def test_the_kernel_writes_state_and_window_in_place():
    """The state (and the window) are aliased input -> output: inside the generation loop a fresh
    output made XLA copy it into the loop-carried buffer per layer (docs/kernels_gdn.md)."""
    k, v, g, beta, state = f32(*draw_inputs(2))
    path, count = jnp.zeros((B, P), jnp.int32), jnp.ones((B,), jnp.int32)
    window, conv_in = jnp.zeros((B, KEEP, C), jnp.bfloat16), jnp.zeros((B, N, C), jnp.bfloat16)
    for kw, want in (({}, ((6, 0),)), (dict(window=window, conv_in=conv_in), ((6, 0), (8, 1)))):
        jaxpr = jax.make_jaxpr(lambda *a: gdn_path_commit(*a, impl="pallas_interpret", **kw))(
            k, v, g, beta, state, path, count)
        calls = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        assert len(calls) == 1 and tuple(calls[0].params["input_output_aliases"]) == want


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("b", [1, 8])
def test_native_at_the_27b_layer(gpu_impl, dtype, b):
    """The 27B GDN layer (16 k / 48 v heads of 128): the deepest path of a DDTree-like 64-node tree
    committed (P = 16), with and without the conv window, within 1e-5 of the reference."""
    pb = gdn_problem(9, b, 64)
    lp = [leaf_path(t, 16) for t in pb["trees"]]
    path, count = jnp.asarray([x for x, _ in lp], jnp.int32), jnp.asarray([c for _, c in lp], jnp.int32)
    _, k, v, g, beta, state, _ = gdn_args(pb, dtype)
    args = (k, v, g, beta, state, path, count)
    assert_close(kernel(gpu_impl)(*args), ref_fn(*args), 1e-5)
    rng = np.random.default_rng(b)
    conv_dim = 2 * k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]
    window = jnp.asarray(rng.normal(size=(b, 3, conv_dim)), jnp.bfloat16)
    conv_in = jnp.asarray(rng.normal(size=(b, 64, conv_dim + v.shape[1] * v.shape[3])), jnp.bfloat16)
    state_got, window_got = kernel(gpu_impl)(*args, window=window, conv_in=conv_in)
    state_ref, window_ref = ref_fn(*args, window=window, conv_in=conv_in)
    assert_close(state_got, state_ref, 1e-5)
    np.testing.assert_array_equal(np.asarray(window_got, np.float32), np.asarray(window_ref, np.float32))
