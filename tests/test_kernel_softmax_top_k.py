"""The softmax top-k kernel (`impl`: interpret mode, natively under -m gpu) equals its reference
(jax.nn.softmax, lax.top_k, renormalisation, rounding): the same experts in the same order, ties
to the lower index, weights within one rounding of the weights' dtype; rows that are not a power
of two long, k that is not one either; a Qwen-MoE block routes through it with kernels on and
gets the experts of the XLA route, whatever the number of tokens in the call; (-m gpu) the
Qwen3.6-35B-A3B router (256 experts, top 8) and Qwen3-Next's (512, top 10) at decode and verify
row counts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from ddtree_jax.models.moe import route_softmax_top_k
from ddtree_jax.routes import Routes
from pallas_kernels._common import summed_partials
from pallas_kernels.softmax_top_k import SOFTMAX_TOP_K_MAX_K, SOFTMAX_TOP_K_MAX_LEN, softmax_top_k
from tests.jaxpr_eqns import equations


@functools.partial(jax.jit, static_argnames=("k", "norm", "dtype", "impl"))
def _route(x, k, norm, dtype, impl):
    return softmax_top_k(x, k, norm=norm, weights_dtype=dtype, impl=impl)


def assert_route_equal(got, want, dtype):
    """The same ids; weights equal up to the order of the float32 sums (the softmax's over the row, a
    few float32 roundings), then one rounding to dtype (one of its units at most)."""
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    rtol = max(float(jnp.finfo(dtype).eps), 8 * float(jnp.finfo(jnp.float32).eps))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=rtol, atol=0)


@pytest.mark.parametrize("n, k", [(60, 10), (256, 8), (17, 17), (5, 1)])
@pytest.mark.parametrize("norm, dtype", [(True, jnp.bfloat16), (False, jnp.float32)])
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), levels=st.sampled_from([0, 1, 3]))
def test_softmax_top_k_equals_its_reference(impl, n, k, norm, dtype, seed, levels):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(3, n)).astype(np.float32) * 2
    if levels:  # coarse logits: equal probabilities, some across the top-k boundary
        x = np.round(x * levels) / levels
    x = jnp.asarray(x).astype(dtype)
    got, want = _route(x, k, norm, dtype, impl), _route(x, k, norm, dtype, "xla")
    assert_route_equal(got, want, dtype)
    assert np.all(np.diff(np.asarray(want[1]), axis=-1) <= 0)  # descending
    if norm and dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(got[1]).sum(-1), 1.0, rtol=1e-6)


def test_ties_go_to_the_lower_index(impl):
    logits = jnp.asarray([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0] * 5, [0.5, 2.0, 0.5, 2.0, 2.0]], jnp.float32)
    ids, weights = _route(logits, 2, True, jnp.float32, impl)
    np.testing.assert_array_equal(np.asarray(ids), [[1, 2], [0, 1], [1, 3]])
    np.testing.assert_allclose(np.asarray(weights), 0.5)


def test_near_ties_rank_by_the_exps_in_every_kernel_that_chooses(impl):
    """Logits a few ulps apart (their probabilities may round equal after the division by the sum,
    or not, depending on the sum's reduction order): the kernel ranks the exps, which no sum's order
    moves, so it equals lax.top_k of exp(x - max x) exactly, and the experts' decode launch that
    chooses for itself (moe_experts.chosen_expert_mlp, decision 0071) picks the same experts."""
    from pallas_kernels import moe_experts as moe

    rng = np.random.default_rng(0)
    e, k, h, inter = 16, 8, 32, 16
    steps = rng.permutation(e)[None, :] + rng.integers(0, 3, (2, e))  # many equal, the rest 1-2 ulps apart
    x = np.float32(0.5) + np.float32(2**-23) * steps.astype(np.float32)
    logits = jnp.asarray(x, jnp.float32)
    ids, _ = softmax_top_k(logits, k, norm=True, impl=impl)
    ex = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(jax.lax.top_k(ex, k)[1]))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(softmax_top_k(logits, k, norm=True)[0]))
    xs = jnp.asarray(rng.normal(size=(2, h)), jnp.float32)
    w_in = jnp.asarray(rng.normal(size=(e, h, 2 * inter)) * h**-0.5, jnp.float32)
    w_out = jnp.asarray(rng.normal(size=(e, inter, h)) * inter**-0.5, jnp.float32)
    config = moe.DecodeConfig(up=moe.GemmConfig(block_n=16, block_k=16), down=moe.GemmConfig(block_n=16, block_k=16),
                              combine="kernel")
    _, chosen, _ = moe.chosen_expert_mlp(xs, moe.Choice(logits, k, True), w_in, w_out, act="silu_glu", impl=impl,
                                         config=config)
    np.testing.assert_array_equal(np.asarray(chosen), np.asarray(ids))


def test_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match=f"rows up to {SOFTMAX_TOP_K_MAX_LEN}"):
        softmax_top_k(jnp.zeros((1, SOFTMAX_TOP_K_MAX_LEN + 1)), 4, norm=True, impl="pallas_interpret")
    with pytest.raises(ValueError, match="k in"):
        softmax_top_k(jnp.zeros((1, 100)), SOFTMAX_TOP_K_MAX_K + 1, norm=True, impl="pallas_interpret")
    with pytest.raises(ValueError, match="k in"):
        softmax_top_k(jnp.zeros((1, 3)), 4, norm=True, impl="pallas_interpret")


def test_route_announces_a_router_too_wide_for_the_kernel():
    routes = Routes(impl="pallas_interpret")
    logits = jnp.zeros((1, SOFTMAX_TOP_K_MAX_LEN + 16), jnp.float32)
    with pytest.warns(UserWarning, match="router's top-4 of .* uses XLA"):
        route_softmax_top_k(logits, top_k=4, norm=True, routes=routes)


def test_moe_block_routes_through_the_kernel_and_chooses_the_xla_routes_experts():
    """A Qwen3.5-MoE block (bf16, 16 experts, top 4, two routers' columns equal so scores tie): the
    kernel route's experts and weights equal the XLA route's, for all tokens in one call and for
    each token alone (a decode step's call), and the kernel is in the traced program."""
    from tests.test_qwen_moe import _block

    cfg, gd, params = _block({"num_experts": 16, "num_experts_per_tok": 4}, dtype=jnp.bfloat16)
    kernel = np.array(params["router"]["kernel"][...])
    kernel[:, 5] = kernel[:, 3]
    params["router"]["kernel"][...] = jnp.asarray(kernel)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(12, cfg.hidden_size)), jnp.bfloat16)
    kernels = Routes(impl="pallas_interpret")
    route = jax.jit(lambda p, x, routes: nnx.merge(gd, p).route(x, routes), static_argnums=2)
    want = route(params, x, Routes())
    got = route(params, x, kernels)
    assert_route_equal(got, want, jnp.bfloat16)
    for t in range(0, 12, 5):
        assert_route_equal(route(params, x[t : t + 1], kernels), (want[0][t : t + 1], want[1][t : t + 1]),
                           jnp.bfloat16)
    jaxpr = lambda routes, x=x: str(jax.make_jaxpr(lambda p, x: nnx.merge(gd, p).route(x, routes))(params, x))
    assert "softmax_top_k" in jaxpr(kernels) and "pallas_call" not in jaxpr(Routes())
    # a decode step's token with the router product in the row-product kernel: its float32 partials
    # go to the softmax top-k kernel, which adds them (no XLA sum between); the same experts
    rows = kernels.replace(row_product_weights=(1, 10**9))
    for t in range(0, 12, 5):
        assert_route_equal(route(params, x[t : t + 1], rows), (want[0][t : t + 1], want[1][t : t + 1]), jnp.bfloat16)
    one = jax.make_jaxpr(lambda p, x: nnx.merge(gd, p).route(x, rows))(params, x[:1])
    prims = [e.primitive.name for e in equations(one.jaxpr)]
    assert "row_product" in str(one) and "softmax_top_k" in str(one)
    assert prims.count("pallas_call") == 2 and "reduce_sum" not in prims, prims


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), parts=st.sampled_from([1, 3, 16]), n=st.sampled_from([16, 60, 256]))
def test_partial_sums_give_the_routes_of_their_rounded_sum(impl, seed, parts, n):
    """logits as float32 split-K partial sums (logits_dtype): the routes of their sum rounded to
    that dtype, kernel and XLA form alike."""
    p = jax.random.normal(jax.random.PRNGKey(seed), (parts, 2, 1, n), jnp.float32)
    want = _route(summed_partials(p, jnp.bfloat16), 8, True, jnp.bfloat16, "xla")
    for form in ("xla", impl):
        got = softmax_top_k(p, 8, norm=True, weights_dtype=jnp.bfloat16, impl=form, logits_dtype=jnp.bfloat16)
        assert got[0].shape == (2, 1, 8)
        assert_route_equal(got, want, jnp.bfloat16)
    with pytest.raises(ValueError, match="partial sums must be float32"):
        softmax_top_k(p.astype(jnp.bfloat16), 8, norm=True, impl=impl, logits_dtype=jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 65, 520])
@pytest.mark.parametrize("n, k", [(256, 8), (512, 10)])
def test_router_shapes_natively(gpu_impl, rows, n, k):
    """The real routers' shapes on the GPU, bf16 logits as a bf16 router product makes them."""
    x = (jax.random.normal(jax.random.PRNGKey(rows), (rows, n)) * 2).astype(jnp.bfloat16)
    assert_route_equal(_route(x, k, True, jnp.bfloat16, gpu_impl), _route(x, k, True, jnp.bfloat16, "xla"),
                       jnp.bfloat16)


@pytest.mark.script
def test_bench_cpu_smoke(tmp_path):
    """scripts.bench.kernels softmax_top_k --cpu-smoke: the kernel agrees with the XLA form in the
    interpreter and lands in the report."""
    import json

    from scripts.bench import kernels as bench

    out = tmp_path / "stk.json"
    assert bench.main(["softmax_top_k", "--cpu-smoke", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["ok"] and row["xla_ok"] and row["kernel_w4_ok"]
