"""The router's product and choice in one launch (pallas_kernels/router_choice.py; `impl`: interpret
mode, natively under -m gpu) equals the two launches it replaces, row_product's float32 partials
then softmax_top_k's choice of their rounded sum: the same experts in the same order (ties to the
lower index), the same weights; and its XLA reference within float32 summation order; bad
operands named together; (-m gpu) the Qwen3.6-35B-A3B router (2048 x 256, top 8) and Qwen3-Next's
(2048 x 512, top 10)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import row_product as rp
from pallas_kernels.router_choice import router_choice
from pallas_kernels.softmax_top_k import softmax_top_k
from tests.test_kernel_softmax_top_k import assert_route_equal


@functools.partial(jax.jit, static_argnames=("k", "norm", "dtype", "config", "impl"))
def _one(x, w, *, k, norm, dtype, config, impl):
    return router_choice(x, w, k, norm=norm, weights_dtype=dtype, config=config, impl=impl)


@functools.partial(jax.jit, static_argnames=("k", "norm", "dtype", "config", "impl"))
def _two(x, w, *, k, norm, dtype, config, impl):
    parts = rp.row_product(x, w, config=config, partials=True, impl=impl)
    return softmax_top_k(parts, k, norm=norm, weights_dtype=dtype, impl=impl, logits_dtype=x.dtype)


def _problem(seed, kk, n, dtype, ties=False):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(1, 1, kk)), dtype)
    w = rng.normal(size=(kk, n)) * kk**-0.5
    if ties:  # equal columns: equal logits, equal probabilities
        w[:, 1::3] = w[:, 0:1]
    return x, jnp.asarray(w, dtype)


CASES = {  # (K, E, k, norm, dtype, config)
    "bf16_default_tiling": (256, 64, 8, True, jnp.bfloat16, None),
    "bf16_split4": (128, 48, 3, True, jnp.bfloat16, rp.RowConfig(block_n=16, block_k=16, split_k=4)),
    "f32_no_norm_split2": (64, 32, 4, False, jnp.float32, rp.RowConfig(block_n=16, block_k=32, split_k=2)),
    "k_equals_e": (64, 16, 16, True, jnp.bfloat16, rp.RowConfig(block_n=16, block_k=16, split_k=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("ties", [False, True])
def test_one_launch_equals_product_then_choice(case, ties, impl):
    kk, n, k, norm, dtype, config = CASES[case]
    x, w = _problem(len(case) + ties, kk, n, dtype, ties)
    got = _one(x, w, k=k, norm=norm, dtype=dtype, config=config, impl=impl)
    assert got[0].shape == got[1].shape == (1, 1, k) and got[0].dtype == jnp.int32 and got[1].dtype == jnp.float32
    want = _two(x, w, k=k, norm=norm, dtype=dtype, config=config, impl=impl)
    assert_route_equal(got, want, dtype)
    ref = _one(x, w, k=k, norm=norm, dtype=dtype, config=config, impl="xla")
    assert_route_equal(got, ref, dtype) if dtype == jnp.bfloat16 else np.testing.assert_allclose(
        np.asarray(got[1]), np.asarray(ref[1]), rtol=1e-5)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), ties=st.booleans())
def test_random_routers_choose_as_two_launches(seed, ties):
    x, w = _problem(seed, 128, 64, jnp.bfloat16, ties)
    config = rp.RowConfig(block_n=16, block_k=16, split_k=4)
    got = _one(x, w, k=6, norm=True, dtype=jnp.bfloat16, config=config, impl="pallas_interpret")
    want = _two(x, w, k=6, norm=True, dtype=jnp.bfloat16, config=config, impl="pallas_interpret")
    assert_route_equal(got, want, jnp.bfloat16)


def test_bad_operands_are_named_together():
    x = jnp.ones((2, 64), jnp.bfloat16)
    w = jnp.ones((64, 40), jnp.float32)
    with pytest.raises(ValueError, match=r"one row of K = 64.*share a dtype.*N = 40 is not a multiple.*k = 50"):
        router_choice(x, w, 50, norm=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(256, 8), (512, 10)])
def test_real_routers_natively(gpu_impl, n, k):
    x, w = _problem(n, 2048, n, jnp.bfloat16)
    got = _one(x, w, k=k, norm=True, dtype=jnp.bfloat16, config=None, impl=gpu_impl)
    want = _two(x, w, k=k, norm=True, dtype=jnp.bfloat16, config=None, impl=gpu_impl)
    assert_route_equal(got, want, jnp.bfloat16)
