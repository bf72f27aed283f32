"""Ancestor bitsets: the doubling reference and the Pallas kernel (`impl`: interpret mode, natively
under -m gpu) against ddtree_jax.tree.ancestor_bits_from_parents and a per-node Python walk."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ddtree_jax.tree import ancestor_bits_from_parents, bits_to_dense
from pallas_kernels.tree_mask import ancestor_bits

KINDS = ("chain", "star", "random", "padded", "forest", "deep_then_wide")


def make_parents(seed, b, n, kind):
    rng = np.random.default_rng(seed)
    par = np.full((b, n), -1, np.int32)
    for bb in range(b):
        valid = n if kind != "padded" else int(rng.integers(1, n + 1))
        for i in range(1, valid):
            if kind == "chain":
                par[bb, i] = i - 1
            elif kind == "star":
                par[bb, i] = 0
            elif kind == "forest":
                par[bb, i] = rng.integers(-1, i)
            elif kind == "deep_then_wide":
                par[bb, i] = i - 1 if i < n // 2 else rng.integers(0, i)
            else:
                par[bb, i] = rng.integers(0, i)
    return par


def walk(par):
    """Dense ancestor-or-self sets by following parent pointers in Python."""
    b, n = par.shape
    vis = np.zeros((b, n, n), bool)
    for bb in range(b):
        for i in range(n):
            j = i
            while j >= 0:
                vis[bb, i, j] = True
                j = par[bb, j]
    return vis


@functools.lru_cache(maxsize=None)
def fn(impl, max_depth=None):
    return jax.jit(lambda p: ancestor_bits(p, impl=impl, max_depth=max_depth))


def check(par, impl):
    b, n = par.shape
    want = np.asarray(ancestor_bits_from_parents(jnp.asarray(par), max(n - 1, 0)))
    assert want.dtype == np.uint32 and want.shape == (b, n, -(-n // 32))
    for form in ("xla", impl):
        got = np.asarray(fn(form)(jnp.asarray(par)))
        assert got.dtype == np.uint32 and got.shape == want.shape, form
        np.testing.assert_array_equal(got, want, err_msg=form)
    np.testing.assert_array_equal(np.asarray(bits_to_dense(jnp.asarray(want), n)), walk(par))


@pytest.mark.parametrize("n", [1, 16, 33, 64])
@settings(max_examples=4)
@given(seed=st.integers(0, 2**31), kind=st.sampled_from(KINDS))
def test_bits_match_tree_module(impl, n, seed, kind):
    check(make_parents(seed, 3, n, kind), impl)


def test_large_tree_two_kinds(impl):
    """N = 129: five words, an odd padding of rows and words, depth 128 (eight doublings)."""
    check(make_parents(7, 2, 129, "chain"), impl)
    check(make_parents(8, 2, 129, "random"), impl)


def test_max_depth_bound(impl):
    """With a known depth bound fewer doubling steps give the same bits."""
    par = make_parents(3, 2, 40, "random")
    depth = 0
    for bb in range(2):
        for i in range(40):
            d, j = 0, i
            while par[bb, j] >= 0:
                j, d = par[bb, j], d + 1
            depth = max(depth, d)
    want = np.asarray(ancestor_bits_from_parents(jnp.asarray(par), 39))
    for form in ("xla", impl):
        np.testing.assert_array_equal(np.asarray(fn(form, depth)(jnp.asarray(par))), want)


def test_out_of_range_parent_is_root(impl):
    par = np.array([[-1, 0, 7, 1]], np.int32)  # node 2 points past N: treated as a root
    want = walk(np.array([[-1, 0, -1, 1]], np.int32))
    for form in ("xla", impl):
        got = fn(form)(jnp.asarray(par))
        np.testing.assert_array_equal(np.asarray(bits_to_dense(got, 4)), want)


def test_rejects_bad_impl():
    with pytest.raises(ValueError):
        ancestor_bits(jnp.zeros((1, 4), jnp.int32), impl="triton")


def test_kernel_size_limit_and_tree_route(impl):
    """The kernel refuses trees it cannot hold (N_pad^2 shared memory: budget 256 crashed the H200
    with 'Shared memory size limit exceeded'); make_tree takes the XLA doubling above
    routes.bits_kernel_max_nodes (the faster form there) with the same bits."""
    from ddtree_jax.routes import Routes
    from ddtree_jax.tree import make_tree
    from pallas_kernels.tree_mask import MAX_KERNEL_NODES
    from tests.tree_harness import routes_for

    BITS_KERNEL_MAX_NODES = Routes().bits_kernel_max_nodes

    par = make_parents(11, 2, MAX_KERNEL_NODES + 1, "random")
    with pytest.raises(ValueError, match="at most 256 nodes"):
        ancestor_bits(jnp.asarray(par), impl="pallas_interpret")
    assert BITS_KERNEL_MAX_NODES <= MAX_KERNEL_NODES
    for n in (BITS_KERNEL_MAX_NODES, BITS_KERNEL_MAX_NODES + 1, MAX_KERNEL_NODES + 1):
        par = make_parents(n, 2, n, "random")
        got = make_tree(jnp.zeros((2, n), jnp.int32), jnp.asarray(par), jnp.ones((2, n), bool),
                        jnp.zeros((2,), jnp.int32), n - 1, routes=routes_for(impl))
        np.testing.assert_array_equal(np.asarray(bits_to_dense(got.ancestor_bits, n)), walk(par), err_msg=str(n))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gpu = Routes.resolve(impl="pallas", platform="gpu")
            hlo = jax.jit(lambda p: make_tree(p, p, p >= 0, p[:, 0], n - 1, routes=gpu).ancestor_bits
                          ).trace(jnp.asarray(par)).lower(lowering_platforms=("cuda",)).as_text()
        assert ("tree_ancestor_bits" in hlo) == (n <= BITS_KERNEL_MAX_NODES), n
        routed = [w for w in caught if "use the XLA doubling" in str(w.message)]
        assert bool(routed) == (n > BITS_KERNEL_MAX_NODES), n  # the route is announced, never silent


def test_depths_from_bits_match_walk(impl):
    from ddtree_jax.tree import make_tree
    from tests.tree_harness import routes_for

    for kind in KINDS:
        par = make_parents(5, 3, 40, kind)
        tree = make_tree(jnp.zeros((3, 40), jnp.int32), jnp.asarray(par), jnp.ones((3, 40), bool),
                         jnp.asarray([0, 3, 9], jnp.int32), 39, routes=routes_for(impl))
        want = walk(par).sum(-1) - 1
        np.testing.assert_array_equal(np.asarray(tree.depths), want, err_msg=kind)
        np.testing.assert_array_equal(np.asarray(tree.positions), want + np.asarray([0, 3, 9])[:, None])


@pytest.mark.parametrize("b, n", [(1, 16), (8, 64), (8, 256), (1, 129)])
def test_native_at_ddtree_sizes(gpu_impl, b, n):
    """DDTree budgets up to the kernel's 256 nodes (and 129: five words): the bits equal the tree
    module's."""
    check(make_parents(n, b, n, "random"), gpu_impl)
