"""The row pad of one-row products (Routes.row_pad_weights): a Linear of one row whose weight size
is in the window, kernels on, multiplies the row and a zero row, so that XLA GPU keeps the product
a GEMM instead of strength-reducing the vector product to multiply + reduce (issue #26).

- Values: the padded product equals the plain one for x [H], [1, H], [1, 1, H], with and without
  a bias; more rows, the XLA impl, the reference routes and weights outside the window are left
  alone (the same program).
- Programs: with the route on, the lowered product's lhs has 2 rows; off, it has 1.
- Models: every Linear of a batch-1 decode step gets the routes (the MoE router, shared expert
  and latent projections, the Mamba2 projections, attention and GDN in / out), so all of them pad;
  the NemotronH router (float32 at HIGHEST) is not a Linear and stays as it is.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.cache import init_target_cache
from ddtree_jax.models.layers import Linear, SplitKParts
from ddtree_jax.routes import REFERENCE, Routes
from tests.hf_mamba_models import make_jax_target
from tests.jaxpr_eqns import equations
from tests.tiny_models import HYBRID_MOE, make_target
from tests.tolerance import assert_scaled_close

K, N = 64, 48
WINDOW = (1, 9_999_999)


def _linear(bias: bool, dtype, seed: int = 0) -> Linear:
    lin = Linear(K, N, bias=bias, dtype=dtype, rngs=nnx.Rngs(seed))
    if bias:  # a bias that is not zero, so adding it after the slice is checked too
        lin.bias = nnx.Param(jax.random.normal(jax.random.PRNGKey(seed + 1), (N,), jnp.float32).astype(dtype))
    return lin


def _lhs_rows(lin: Linear, x, routes: Routes) -> list[int]:
    """The lhs row counts of the dot_generals of lin(x, routes) as lowered (StableHLO)."""
    text = jax.jit(lambda x: lin(x, routes)).lower(x).as_text()
    lines = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    rows = []
    for line in lines:
        lhs = re.search(r":\s*\(tensor<([0-9x]+)x[a-z0-9]+>", line).group(1).split("x")
        rows.append(int(np.prod([int(d) for d in lhs[:-1]])))
    return rows


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_padded_row_equals_the_plain_product(bias, dtype):
    lin = _linear(bias, dtype)
    on = Routes(impl="pallas_interpret", row_pad_weights=WINDOW)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for shape in [(K,), (1, K), (1, 1, K)]:
        x = jax.random.normal(jax.random.PRNGKey(len(shape)), shape, jnp.float32).astype(dtype)
        want = jax.jit(lambda x: lin(x, REFERENCE))(x)
        got = jax.jit(lambda x: lin(x, on))(x)
        assert got.shape == want.shape == (*shape[:-1], N) and got.dtype == want.dtype
        assert_scaled_close(np.asarray(got, np.float32), np.asarray(want, np.float32), tol, str(shape))
        assert _lhs_rows(lin, x, on) == [2] and _lhs_rows(lin, x, REFERENCE) == [1]


@pytest.mark.parametrize("bias", [False, True])
def test_more_rows_and_other_routes_are_left_alone(bias):
    """Two rows or more, the XLA impl (kernels off), the reference routes and a weight outside the
    window run the plain product: the same program, so the same values exactly."""
    lin = _linear(bias, jnp.float32, seed=3)
    on = Routes(impl="pallas_interpret", row_pad_weights=WINDOW)
    same = [Routes(impl="xla", row_pad_weights=WINDOW), REFERENCE, on.replace(row_pad_weights=(0, 0)),
            on.replace(row_pad_weights=(1, K * N - 1)), on.replace(row_pad_weights=(K * N + 1, 10**7))]
    for shape in [(2, K), (1, 3, K), (4, 1, K)]:
        x = jax.random.normal(jax.random.PRNGKey(7), shape, jnp.float32)
        want = np.asarray(jax.jit(lambda x: lin(x, REFERENCE))(x))
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: lin(x, on))(x)), want)
        rows = int(np.prod(shape[:-1]))
        assert _lhs_rows(lin, x, on) == [rows]
    x = jax.random.normal(jax.random.PRNGKey(8), (1, 1, K), jnp.float32)
    want = np.asarray(jax.jit(lambda x: lin(x, REFERENCE))(x))
    for routes in same:
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: lin(x, routes))(x)), want)
        assert _lhs_rows(lin, x, routes) == [1], routes
    assert _lhs_rows(lin, x, on.replace(row_pad_weights=(K * N, K * N))) == [2]  # the window is inclusive


def test_a_single_column_weight_is_not_padded():
    """A weight of one column (the Qwen MoE shared-expert gate) is a vector itself: XLA reduces its
    product whatever the lhs, so the pad would only add work."""
    lin = Linear(K, 1, rngs=nnx.Rngs(0))
    on = Routes(impl="pallas_interpret", row_pad_weights=WINDOW)
    assert _lhs_rows(lin, jnp.ones((1, K)), on) == [1]


def test_the_route_is_part_of_the_program():
    """The route changes the lowered program (another jit cache entry), and the padded product's
    lhs has 2 rows there."""
    lin = _linear(False, jnp.float32)
    x = jnp.ones((1, 1, K), jnp.float32)
    f = jax.jit(lambda x, routes: lin(x, routes), static_argnames="routes")
    on = Routes(impl="pallas_interpret", row_pad_weights=WINDOW)
    text_on, text_off = (f.lower(x, routes=r).as_text() for r in (on, on.replace(row_pad_weights=(0, 0))))
    assert re.search(rf"stablehlo.dot_general .*: \(tensor<2x{K}xf32>, tensor<{K}x{N}xf32>\)", text_on)
    assert not re.search(r"stablehlo.dot_general .*: \(tensor<2x", text_off)


# ---- whole decode steps ----------------------------------------------------------------------------
def _weight_products(graphdef, params, cfg, routes):
    """(lhs rows, weight shape) of every product of a 2-D weight with more than one column in one
    batch-1 decode step (outside the Pallas kernels)."""
    cache = init_target_cache(cfg, 1, 16)
    step = lambda p, t: nnx.merge(graphdef, p)(t, cache, jnp.ones((1,), jnp.int32), chunked=False, routes=routes)[0]
    jaxpr = jax.make_jaxpr(step)(params, jnp.ones((1, 1), jnp.int32))
    found = []
    for e in equations(jaxpr.jaxpr):
        if e.primitive.name == "dot_general":
            lhs, rhs = e.invars[0].aval.shape, e.invars[1].aval.shape
            if len(rhs) == 2 and rhs[1] > 1:
                found.append((int(np.prod(lhs[:-1])), tuple(rhs)))
    return found


WIDE = dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16)  # the kernels' smallest head dims
TINY_EXPERTS = "ignore:the MoE expert products use the XLA form"  # tiny experts: announced, not under test


@pytest.mark.filterwarnings(TINY_EXPERTS)
@pytest.mark.parametrize("family", ["qwen_moe", "nemotron_h", "nemotron_h_latent"])
def test_every_linear_of_a_decode_step_gets_the_routes(family):
    """Qwen3.5-MoE (attention, GDN, router, shared expert) and NemotronH (Mamba2, attention, MoE
    shared expert, MLP, latent projections): with the route on, every Linear product of a batch-1
    decode step has a 2-row lhs; off, every one has 1 row. The NemotronH router, an einsum in
    float32 at HIGHEST precision and no Linear, keeps its row either way."""
    if family == "qwen_moe":
        cfg, gd, params = make_target(WIDE, base=HYBRID_MOE)
        # per layer: qkv / GDN in, o / GDN out, router, shared gate_up, shared down (the gate: 1 column)
        expect = 5 * cfg.num_layers
    else:
        overrides = dict(head_dim=16) | (dict(moe_latent_size=16) if family == "nemotron_h_latent" else {})
        cfg, gd, params = make_jax_target("nemotron_h", overrides=overrides)
        # 2 Mamba2 layers x (in, out), attention q / k / v / o, MoE shared up / down (+ latent in /
        # out), MLP up / down
        expect = 12 + (2 if family == "nemotron_h_latent" else 0)
    on = Routes.resolve(impl="pallas_interpret", row_pad_weights=WINDOW)
    got_on = _weight_products(gd, params, cfg, on)
    got_off = _weight_products(gd, params, cfg, on.replace(row_pad_weights=(0, 0)))
    if family != "qwen_moe":
        router = (cfg.hidden_size, cfg.moe_num_experts)
        assert [p for p in got_on if p[1] == router] == [p for p in got_off if p[1] == router] == [(1, router)]
        got_on, got_off = ([p for p in got if p[1] != router] for got in (got_on, got_off))
    assert len(got_on) == len(got_off) == expect, (got_on, got_off)
    assert all(rows == 2 for rows, _ in got_on), got_on
    assert all(rows == 1 for rows, _ in got_off), got_off


@pytest.mark.filterwarnings(TINY_EXPERTS)
def test_a_padded_decode_step_gives_the_same_hidden_states():
    """One batch-1 decode step of the tiny Qwen3.5-MoE target, kernels in interpret mode: the same
    hidden states with the route on and off (float32; products exact up to summation order)."""
    cfg, gd, params = make_target(WIDE, base=HYBRID_MOE, seed=5)
    cache = init_target_cache(cfg, 1, 16)
    on = Routes.resolve(impl="pallas_interpret", row_pad_weights=WINDOW)

    @functools.partial(jax.jit, static_argnames="routes")
    def step(p, t, routes):
        return nnx.merge(gd, p)(t, cache, jnp.ones((1,), jnp.int32), chunked=False, routes=routes)[0]

    tokens = jnp.asarray([[7]], jnp.int32)
    a, b = step(params, tokens, routes=on), step(params, tokens, routes=on.replace(row_pad_weights=(0, 0)))
    assert_scaled_close(np.asarray(a), np.asarray(b), 1e-5, "decode step")


def test_gpu_routes_pad_the_moe_shape_and_leave_the_demo_pair_alone():
    """The GPU default window (decisions 0049, 0054): a 35B-A3B router (2048 x 256 = 2^19 elements)
    and out projection (4096 x 2048) pad, or rather take the row-product kernel; no Linear of the
    demo pair's batch-1 decode step does (its weights hold at most 0.3M elements, where the pad
    measured slower)."""
    gpu = Routes.resolve(platform="gpu", impl="pallas_interpret")
    assert gpu.pads_row(2048 * 256) and gpu.pads_row(4096 * 2048) and not gpu.pads_row(2048 * 12352)
    # the same window runs them as the row-product kernel (decision 0054), which takes precedence;
    # the wider input projections stay XLA GEMMs
    assert gpu.row_product_kernel(2048 * 256) and gpu.row_product_kernel(4096 * 2048)
    assert not gpu.row_product_kernel(2048 * 9216) and not gpu.row_product_kernel(2048 * 12352)
    assert not Routes.resolve(platform="cpu").row_product_kernel(2048 * 256)
    from ddtree_jax.demo import demo_paths
    from ddtree_jax.engine import Engine

    engine = Engine.load(*demo_paths())
    found = _weight_products(engine.graphdef, engine.params, engine.cfg, gpu)
    assert found and all(rows == 1 for rows, _ in found), found
    assert max(w[0] * w[1] for _, w in found) < 1 << 19


def test_the_row_kernel_takes_a_wide_output_only_as_partials():
    """A one-row product in the GPU window runs as the row-product kernel where it was measured to
    win (decision 0054): a narrow output (a router), or a wide one as float32 partials for the add +
    RMSNorm kernel. A wide output wanted whole (a Nemotron-H 8B k / v projection, 4096 x 1024)
    stays XLA's padded GEMM: the kernel's unsplit form ran it in 16 programs (decision 0070)."""
    gpu = Routes.resolve(platform="gpu", impl="pallas_interpret")
    x = jnp.ones((1, 1, 4096), jnp.bfloat16)

    def launches(layer, **kw):
        jaxpr = jax.make_jaxpr(lambda v: layer(v, gpu, **kw))(x)
        return [e.params.get("name") or e.params["name_and_src_info"].name
                for e in equations(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]

    wide = Linear(4096, 1024, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert gpu.row_product_kernel(wide.kernel.size) and launches(wide) == []
    wide.split_k_out = True
    assert launches(wide) == ["row_product"] and isinstance(wide(x, gpu), SplitKParts)
    router = Linear(4096, 256, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert launches(router) == ["row_product"] and launches(router, one_row_parts=True) == ["row_product"]
