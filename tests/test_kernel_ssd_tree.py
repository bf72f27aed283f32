"""ssd_tree_verify / ssd_path_commit: the Pallas kernels (`impl`: interpreted on CPU, native under
-m gpu; -m gpu also at the Nemotron-H 8B layer) against the jnp references
(pallas_kernels/ref/ssd.py, itself checked against a float64 per-path oracle in
tests/test_mamba_tree.py). On the GPU the float32 products run as tf32x3: 1e-4 there.

Shapes are fixed per configuration so one compilation serves every hypothesis example; N is not
a power of two (padding inside the kernel wrapper) and trees carry padding slots. Two
configurations: several 16-node row blocks (cross-block ancestors, one ancestor word per tile)
and one 64-node block (two ancestor words per tile). The interpreter fills outputs with NaN
before the kernel runs, so an unwritten output fails the finiteness checks.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ddtree_jax.tree import make_tree
from pallas_kernels.ssd_tree import ssd_path_commit, ssd_tree_verify
from scripts.bench.kernels_ssd import ssd_problem
from scripts.bench.shapes import SSD_NEMOTRON_H_8B
from tests.jaxpr_eqns import equations
from tests.tolerance import by_impl

B, H, G, HD, NS = 2, 4, 2, 16, 16
CONFIGS = {"blocks16": dict(n=37, block_n=16, block_p=8), "block64": dict(n=40, block_n=64, block_p=None)}


def draw(seed, n):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    x, bm, cm, d, s0 = f(B, n, H, HD), f(B, n, G, NS), f(B, n, G, NS), f(H), f(B, H, HD, NS)
    dt = jnp.asarray(rng.uniform(0.01, 1.5, (B, n, H)), jnp.float32)
    a = -jnp.asarray(rng.uniform(0.1, 3.0, (H,)), jnp.float32)  # deep paths: large positive non-ancestor exponents
    return rng, x, dt, a, bm, cm, d, s0


def random_tree(rng, n, kind):
    """parents [B, n] (topological), valid [B, n]: each row a tree of a random size + padding slots."""
    parents = np.full((B, n), -1)
    valid = np.zeros((B, n), bool)
    for b in range(B):
        size = int(rng.integers(n // 2, n + 1))
        for i in range(1, size):
            parents[b, i] = {"chain": i - 1, "star": 0}.get(kind, int(rng.integers(max(0, i - 5), i)))
        valid[b, :size] = True
    return jnp.asarray(parents, jnp.int32), jnp.asarray(valid)


@functools.partial(jax.jit, static_argnames=("impl", "block_n", "block_p", "peel_root", "masked_rows"))
def verify(x, dt, a, bm, cm, d, s0, parents, valid, *, impl, block_n=None, block_p=None, peel_root=None,
           masked_rows=False):
    n = x.shape[1]
    tree = make_tree(jnp.zeros(parents.shape, jnp.int32), parents, valid, jnp.zeros((B,), jnp.int32), max_depth=n - 1)
    dt = jnp.where(valid[..., None], dt, 0.0)
    return ssd_tree_verify(x, dt, a, bm, cm, d, s0, tree.ancestor_bits, impl=impl, block_n=block_n, block_p=block_p,
                           peel_root=peel_root, masked_rows=masked_rows)


@pytest.mark.parametrize("masked", [False, True], ids=["padded", "masked_rows"])
@pytest.mark.parametrize("config", list(CONFIGS))
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["random", "chain", "star"]))
@settings(max_examples=4)
def test_tree_verify_kernel_matches_reference(impl, config, masked, seed, kind):
    """Padded by XLA or read masked (`masked_rows`: 37 nodes in 16-row blocks leave the last
    block without a node)."""
    c = CONFIGS[config]
    rng, x, dt, a, bm, cm, d, s0 = draw(seed, c["n"])
    parents, valid = random_tree(rng, c["n"], kind)
    want = verify(x, dt, a, bm, cm, d, s0, parents, valid, impl="xla")
    got = verify(x, dt, a, bm, cm, d, s0, parents, valid, impl=impl, block_n=c["block_n"], block_p=c["block_p"],
                 masked_rows=masked)
    got, want = np.asarray(got), np.asarray(want)
    assert np.all(np.isfinite(got))
    scale = max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= by_impl(impl, 2e-5, 1e-4) * scale


@pytest.mark.parametrize("n, peel_root, block_n", [(33, True, 16), (17, None, None), (21, True, None)])
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["random", "chain", "star"]))
@settings(max_examples=3)
def test_tree_verify_kernel_root_peel(impl, n, peel_root, block_n, seed, kind):
    """Node 0 solved on its own: forced at 33 slots (32 rows in two 16-row blocks) and 21, automatic
    at 17 (root + 16 drafts fill 16 rows); padding slots do not descend from node 0."""
    rng, x, dt, a, bm, cm, d, s0 = draw(seed, n)
    parents, valid = random_tree(rng, n, kind)
    want = verify(x, dt, a, bm, cm, d, s0, parents, valid, impl="xla")
    got = verify(x, dt, a, bm, cm, d, s0, parents, valid, impl=impl, block_n=block_n, peel_root=peel_root)
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    assert float(np.abs(got - want).max()) <= by_impl(impl, 2e-5, 1e-4) * max(1.0, float(np.abs(want).max()))


def test_masked_rows_take_the_node_arrays_unpadded():
    """With masked_rows (the default where it applies) the kernel gets x / dt / B / C of N rows and
    writes N rows: four pads fewer than the padded form (masked_rows=False); a peel refuses it; a
    power-of-two N needs no mask (the same program)."""
    def program(n, **kw):
        rng, x, dt, a, bm, cm, d, s0 = draw(0, n)
        parents, valid = random_tree(rng, n, "random")
        tree = make_tree(jnp.zeros((B, n), jnp.int32), parents, valid, jnp.zeros((B,), jnp.int32), max_depth=n - 1)
        args = (x, dt, a, bm, cm, d, s0, tree.ancestor_bits)
        fn = functools.partial(ssd_tree_verify, impl="pallas_interpret", **kw)
        return jax.make_jaxpr(fn)(*args).jaxpr, args

    pads = lambda jx: sum(e.primitive.name == "pad" for e in equations(jx))
    jaxpr, args = program(9, masked_rows=True)
    [eqn] = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert eqn.invars[0].aval.shape == (B, 9, H, HD) and [v.aval.shape for v in eqn.outvars] == [(B, 9, H, HD)]
    assert pads(program(9, masked_rows=False)[0]) - pads(jaxpr) == 4
    assert str(program(9)[0]) == str(jaxpr)
    assert str(program(16, masked_rows=True)[0]) == str(program(16)[0]) == str(program(16, masked_rows=False)[0])
    with pytest.raises(ValueError, match="masked_rows is the unpeeled form"):
        ssd_tree_verify(*args, impl="pallas_interpret", masked_rows=True, peel_root=True)


@functools.partial(jax.jit, static_argnames=("impl",))
def commit(x, dt, a, bm, s0, path, count, *, impl):
    return ssd_path_commit(x, dt, a, bm, s0, path, count, impl=impl)


@given(seed=st.integers(0, 2**31 - 1))
@settings(max_examples=6)
def test_path_commit_kernel_matches_reference(impl, seed):
    n, p = 21, 12  # P not a power of two either
    rng, x, dt, a, bm, _, _, s0 = draw(seed, n)
    path = jnp.asarray(np.sort(rng.integers(0, n, (B, p)), axis=1), jnp.int32)
    count = jnp.asarray(rng.integers(0, p + 1, B), jnp.int32)
    want = commit(x, dt, a, bm, s0, path, count, impl="xla")
    got = np.asarray(commit(x, dt, a, bm, s0, path, count, impl=impl))
    assert np.all(np.isfinite(got))
    tol = by_impl(impl, 1e-6, 1e-5)
    np.testing.assert_allclose(got, np.asarray(want), rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


def test_bad_arguments():
    _, x, dt, a, bm, cm, d, s0 = draw(0, 8)
    bits = jnp.ones((B, 8, 1), jnp.uint32)
    with pytest.raises(ValueError, match="impl must be one of"):
        ssd_tree_verify(x, dt, a, bm, cm, d, s0, bits, impl="triton")
    with pytest.raises(ValueError, match="head_dim=12 must be a power of two"):
        ssd_tree_verify(x[..., :12], dt, a, bm, cm, d, s0[:, :, :12], bits, impl="pallas_interpret")
    with pytest.raises(ValueError, match="block_p=3"):
        ssd_path_commit(x, dt, a, bm, s0, jnp.zeros((B, 2), jnp.int32), jnp.ones((B,), jnp.int32),
                        impl="pallas_interpret", block_p=3)


MIXER_16 = dict(hidden_size=64, head_dim=16, state_size=16)  # 8 heads of 16 (expand 2)


def test_mamba2_mixer_tree_and_commit_with_the_kernels(impl):
    """The Mamba2 mixer's kernel route: tree outputs and committed states through the kernels
    (interpreted, or natively under -m gpu) equal the XLA path (random tree with padding, ragged
    accepted paths). Heads of 16 and a state of 16: what the native verify kernel takes."""
    from flax import nnx

    from tests.tree_harness import routes_for

    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.tree import geometry
    from tests.hf_mamba_models import make_jax_target

    cfg, gd, params = make_jax_target("mamba2", seed=4, overrides=MIXER_16)
    mixer = nnx.merge(gd, params).layers[0].mamba
    n = 13
    rng = np.random.default_rng(0)
    parents, valid = random_tree(rng, n, "random")
    tree = make_tree(jnp.zeros((B, n), jnp.int32), parents, valid, jnp.asarray([3, 5], jnp.int32), max_depth=n - 1)
    geo = geometry(tree, cfg.conv_kernel)
    cache = init_target_cache(cfg, B, 16).layers[0]
    cache = cache._replace(conv=jnp.asarray(rng.normal(size=cache.conv.shape), jnp.float32),
                           state=jnp.asarray(rng.normal(size=cache.state.shape), jnp.float32))
    x = jnp.asarray(rng.normal(size=(B, n, cfg.hidden_size)), jnp.float32)
    y_ref, pending = mixer.tree(x, cache, geo)
    tol = by_impl(impl, 2e-5, 1e-4)
    for routes in (routes_for(impl), routes_for(impl).replace(ssd_tree_masked_rows=False)):
        y_pl, _ = mixer.tree(x, cache, geo, routes=routes)
        np.testing.assert_allclose(np.asarray(y_pl), np.asarray(y_ref), rtol=tol, atol=tol)
    path = jnp.asarray([[0, 1, 2, 2], [0, 3, 3, 3]], jnp.int32)
    path = jnp.minimum(path, jnp.sum(valid, axis=1, keepdims=True) - 1)
    count = jnp.asarray([3, 2], jnp.int32)
    ref = mixer.commit(pending, path, count, cache)
    got = mixer.commit(pending, path, count, cache, routes=routes_for(impl))
    tol = by_impl(impl, 1e-6, 1e-5)
    np.testing.assert_allclose(np.asarray(got.state), np.asarray(ref.state), rtol=tol,
                               atol=tol * max(1.0, float(np.abs(np.asarray(ref.state)).max())))
    np.testing.assert_array_equal(np.asarray(got.conv), np.asarray(ref.conv))


@pytest.mark.parametrize("n", [9, 16, 64, 128, 256])
@pytest.mark.parametrize("kind", ["ddtree", "chain"])
def test_native_at_the_nemotron_h_layer(gpu_impl, n, kind):
    """The Nemotron-H 8B Mamba2 layer (128 heads x 64, 8 groups, state 128), batch 2, DDTree-like
    trees and chains (9 nodes: read with masked rows, and padded): float32 outputs finite and within
    1e-4 of the reference (of its magnitude, at least 1) with tf32x3 products, 2e-5 with IEEE
    float32 ones."""
    inputs = ssd_problem(np.random.default_rng(n), 2, n, **SSD_NEMOTRON_H_8B, kind=kind)
    want = np.asarray(ssd_tree_verify(*inputs, impl="xla"))
    scale = max(1.0, float(np.abs(want).max()))
    for masked in (None, False) if n == 9 else (None,):
        for precision, tol in (("tf32x3", 1e-4), ("ieee", 2e-5)):
            got = np.asarray(jax.jit(lambda *a: ssd_tree_verify(*a, impl=gpu_impl, precision=precision,
                                                                masked_rows=masked))(*inputs))
            assert np.all(np.isfinite(got)), (precision, masked)
            assert float(np.abs(got - want).max()) <= tol * scale, (precision, masked)


def test_native_commit_at_the_nemotron_h_layer(gpu_impl):
    """A 16-node path committed (all, and half) at the Nemotron-H 8B layer: within 1e-5 of the
    reference (of its magnitude, at least 1)."""
    rng = np.random.default_rng(0)
    x, dt, a, bm, _, _, s0, _ = ssd_problem(rng, 2, 256, **SSD_NEMOTRON_H_8B)
    path = jnp.asarray(np.sort(rng.integers(0, 256, (2, 16)), axis=1), jnp.int32)
    count = jnp.asarray([16, 8], jnp.int32)
    want = np.asarray(commit(x, dt, a, bm, s0, path, count, impl="xla"))
    got = np.asarray(commit(x, dt, a, bm, s0, path, count, impl=gpu_impl))
    assert float(np.abs(got - want).max()) <= 1e-5 * max(1.0, float(np.abs(want).max()))


def test_a_layer_the_native_kernel_refuses_takes_the_xla_form_with_a_warning():
    """Heads of 8 (the tiny fixture): the native verify kernel needs 16 (tl.dot's smallest side), so
    a GPU's routes verify such a layer in XLA and say so when traced, instead of failing; the
    path-commit kernel (powers of two only) still runs. Traced on a CPU, never run."""
    import warnings

    from flax import nnx

    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.routes import Routes
    from ddtree_jax.tree import geometry
    from tests.hf_mamba_models import make_jax_target

    cfg, gd, params = make_jax_target("mamba2", seed=4)
    assert cfg.mamba_head_dim == 8
    mixer = nnx.merge(gd, params).layers[0].mamba
    n = 9
    parents, valid = random_tree(np.random.default_rng(0), n, "random")
    tree = make_tree(jnp.zeros((B, n), jnp.int32), parents, valid, jnp.asarray([3, 5], jnp.int32), max_depth=n - 1)
    geo = geometry(tree, cfg.conv_kernel)
    cache = init_target_cache(cfg, B, 16).layers[0]
    x = jnp.ones((B, n, cfg.hidden_size), jnp.float32)
    routes = Routes.resolve(impl="pallas", platform="gpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = str(jax.make_jaxpr(lambda v: mixer.tree(v, cache, geo, routes=routes))(x))
    assert "name=ssd_tree_verify" not in text
    assert any("head_dim=8 must be a power of two (>= 16 on GPU)" in str(w.message) for w in caught)
    path, count = jnp.zeros((B, 2), jnp.int32), jnp.ones((B,), jnp.int32)
    pending = mixer.tree(x, cache, geo)[1]
    text = str(jax.make_jaxpr(lambda c: mixer.commit(pending, path, count, c, routes=routes))(cache))
    assert "name=ssd_path_commit" in text
