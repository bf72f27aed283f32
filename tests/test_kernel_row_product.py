"""The row-product kernel (`impl`: interpret mode, natively under -m gpu) equals its reference:
x @ w of one row in x's dtype, or the float32 partial products over the K slices; both forms
("fma", "dot"), splits, blocks that do not divide evenly into the defaults, float32 and bfloat16;
refusals named; the Linear route (Routes.row_product_weights) runs it for one-row products only,
hands split_k_out products' partials to the add + RMSNorm kernel and changes the compiled program;
a batch-1 decode step of a Qwen3.5-MoE target gives the hidden states of the XLA route; (-m gpu)
the Qwen3.6-35B-A3B one-row products at their real shapes."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from ddtree_jax.cache import init_target_cache
from ddtree_jax.models.layers import Linear, SplitKParts, dense
from ddtree_jax.routes import REFERENCE, Routes
from pallas_kernels import row_product as rp
from tests.jaxpr_eqns import equations, kernel_name
from tests.tiny_models import HYBRID_MOE, make_target
from tests.tolerance import assert_scaled_close


@functools.partial(jax.jit, static_argnames=("config", "partials", "impl"))
def _product(x, w, config, partials, impl):
    return rp.row_product(x, w, config=config, partials=partials, impl=impl)


def _operands(seed, k, n, dtype, lead=(1,)):
    key = jax.random.PRNGKey(seed)
    x = jax.random.normal(key, (*lead, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (k, n), jnp.float32) * k**-0.5).astype(dtype)
    return x, w


def _exact(x, w):
    """x @ w in float64 (the truth both forms are held to)."""
    return np.asarray(x, np.float64).reshape(-1, x.shape[-1]) @ np.asarray(w, np.float64)


def _check(got, x, w, dtype, partials: bool, split: int):
    k, n = w.shape
    if partials:
        assert got.shape == (split, *x.shape[:-1], n) and got.dtype == jnp.float32
        total = np.asarray(got, np.float64).sum(0)
        tol = 1e-5  # float32 sums of exact products
    else:
        assert got.shape == (*x.shape[:-1], n) and got.dtype == x.dtype
        total = np.asarray(got, np.float64)
        tol = 1e-5 if dtype == jnp.float32 else 2**-8  # one rounding to the output dtype
    want = _exact(x, w).reshape(total.shape)
    assert_scaled_close(total, want, tol, f"row product ({'partials' if partials else 'rounded'})")


CONFIGS = {
    "fma": rp.RowConfig(block_n=32, block_k=32),
    "fma_split4": rp.RowConfig(block_n=16, block_k=16, split_k=4),
    "dot_split2": rp.RowConfig(block_n=32, block_k=64, split_k=2, form="dot"),
    "fma_unrolled": rp.RowConfig(block_n=16, block_k=16, split_k=2, unroll=True),
    "dot_unrolled": rp.RowConfig(block_n=16, block_k=32, form="dot", unroll=True),
    "default": None,
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("partials", [False, True])
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       shape=st.sampled_from([(256, 96), (128, 16), (512, 48), (64, 2048)]))
def test_row_product_equals_the_exact_product(impl, name, partials, seed, dtype, shape):
    k, n = shape
    if impl == "pallas":
        k, n = 8 * k, 8 * n
    x, w = _operands(seed, k, n, dtype, lead=(1, 1))
    config = CONFIGS[name]
    got = _product(x, w, config, partials, impl)
    split = (config or rp.default_config(k, n, partials=partials)).fit(k, n).split_k
    _check(got, x, w, dtype, partials, split)
    ref = _product(x, w, config, partials, "xla")  # the reference: same shapes, same values up to order
    assert ref.shape == got.shape
    assert_scaled_close(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                        1e-5 if partials or dtype == jnp.float32 else 2**-7, "against the reference")


def test_fit_and_default_tilings():
    cfg = rp.RowConfig(block_n=64, block_k=64, split_k=8).fit(96, 48)  # 48 = 16 x 3; 96 / 8 is no multiple of 16
    assert (cfg.block_n, cfg.split_k, cfg.block_k) == (16, 2, 16)
    # the 35B-A3B shapes: the out projection's partials fill the GPU; the GDN input product has
    # enough column blocks unsplit; the router splits
    assert rp.default_config(4096, 2048, partials=True).split_k > 1
    assert rp.default_config(2048, 12352).split_k == 1
    assert rp.default_config(2048, 256).split_k > 1
    for k, n, partials in ((4096, 2048, True), (2048, 12352, False), (2048, 256, False), (2048, 248320, False)):
        c = rp.default_config(k, n, partials=partials)
        assert not c.problems() and n % c.block_n == 0 and (k // c.split_k) % c.block_k == 0


def test_refusals_name_every_problem():
    assert rp.problems(100, 30, jnp.int8) == ["K = 100 is not a multiple of 16", "N = 30 is not a multiple of 16",
                                             "dtype int8 (the kernel takes bfloat16, float16, float32)"]
    bad = rp.RowConfig(block_n=24, block_k=8, split_k=3, form="mma").problems()
    assert len(bad) == 4 and "form = 'mma'" in bad[-1]
    x, w = _operands(0, 64, 32, jnp.float32, lead=(2,))
    with pytest.raises(ValueError, match="must hold one row"):
        rp.row_product(x, w, impl="pallas_interpret")
    with pytest.raises(ValueError, match="share a dtype"):
        rp.row_product(x[:1], w.astype(jnp.bfloat16), impl="pallas_interpret")
    with pytest.raises(ValueError, match=r"N = 40 is not a multiple of 16 \(use impl='xla'\)"):
        rp.row_product(x[:1, :], jnp.ones((64, 40)), impl="pallas_interpret")


# ---- a row gated-RMS-normed as the kernel loads it (NormedRow) --------------------------------------
def _normed_row_args(seed, k, group, sums, dtype, offset):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(1, k)), dtype)
    squares = jnp.asarray(rng.uniform(0.3, 3.0, size=(k // group, sums)) * group / sums, jnp.float32)
    gate = jnp.asarray(rng.normal(size=(1, k + 2 * offset + 8)), dtype)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, size=(group,)), dtype)
    return x, squares, gate, weight


@pytest.mark.parametrize("partials", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group, sums, name", [(32, 1, "fma"), (16, 4, "fma_split4"), (32, 2, "dot_split2"),
                                               (64, 4, "fma_unrolled"), (128, 4, "default")])
def test_a_normed_row_equals_its_xla_form(impl, partials, dtype, group, sums, name):
    """row_product(NormedRow): each K step normed as it is loaded (K steps cut to the group) equals
    the product of NormedRow.value (XLA's norm); the norm's steps round to the row's dtype as XLA's
    form does, where XLA's fusions may round an intermediate product differently (16-bit: within the
    output's rounding)."""
    k, n, offset = (256, 96, 24) if impl != "pallas" else (2048, 768, 4096)
    x, squares, gate, weight = _normed_row_args(group + sums, k, group, sums, dtype, offset)
    w = _operands(7, k, n, dtype)[1]
    config = CONFIGS[name]

    @functools.partial(jax.jit, static_argnames="how")
    def run(x, squares, gate, weight, w, how):
        row = rp.NormedRow(x, squares, gate, weight, group, offset, 1e-6)
        if how == "xla":
            return rp.row_product(row.value(), w, config=config, partials=partials, impl="xla")
        return rp.row_product(row, w, config=config, partials=partials, impl=impl)

    got, want = run(x, squares, gate, weight, w, "kernel"), run(x, squares, gate, weight, w, "xla")
    assert got.shape == want.shape and got.dtype == want.dtype
    total = lambda y: np.asarray(y, np.float64).sum(0) if partials else np.asarray(y, np.float64)
    tol = 1e-5 if dtype == jnp.float32 and impl == "pallas_interpret" else 2**-7
    assert_scaled_close(total(got), total(want), tol, "normed row")
    # and the XLA route of a NormedRow is the product of its value
    xla = jax.jit(lambda *a: rp.row_product(rp.NormedRow(*a[:4], group, offset, 1e-6), a[4], impl="xla"))
    np.testing.assert_array_equal(np.asarray(xla(x, squares, gate, weight, w)),
                                  np.asarray(jax.jit(lambda *a: rp.row_product(
                                      rp.NormedRow(*a[:4], group, offset, 1e-6).value(), a[4]))(
                                      x, squares, gate, weight, w)))


def test_a_normed_row_names_every_problem():
    x, squares, gate, weight = _normed_row_args(0, 96, 32, 3, jnp.float32, 8)
    row = rp.NormedRow(x, squares[:2], gate[:, :100], weight[:16], 24, 8, 1e-6)
    bad = row.problems()
    assert len(bad) == 4, bad
    assert "norm group 24" in bad[0] and "squares (2, 3)" in bad[1] and "norm weight (16,)" in bad[2]
    assert "gate columns 8 .. 104 outside its 100" in bad[3]
    with pytest.raises(ValueError, match="norm group 24"):
        rp.row_product(row, jnp.ones((96, 32)), impl="pallas_interpret")


# ---- the Linear route ------------------------------------------------------------------------------
K, N = 64, 48
ON = Routes(impl="pallas_interpret", row_product_weights=(1, 10**9))


def _pallas_names(f, *args) -> list[str]:
    return [kernel_name(e) for e in equations(jax.make_jaxpr(f)(*args).jaxpr) if e.primitive.name == "pallas_call"]


@pytest.mark.parametrize("bias", [False, True])
def test_linear_takes_the_kernel_for_one_row_only(bias):
    lin = Linear(K, N, bias=bias, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    if bias:
        lin.bias = nnx.Param(jnp.linspace(-1, 1, N).astype(jnp.bfloat16))
    for shape in [(K,), (1, K), (1, 1, K)]:
        x = jax.random.normal(jax.random.PRNGKey(len(shape)), shape, jnp.float32).astype(jnp.bfloat16)
        got, want = jax.jit(lambda x: lin(x, ON))(x), jax.jit(lambda x: lin(x, REFERENCE))(x)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_scaled_close(np.asarray(got, np.float32), np.asarray(want, np.float32), 2**-7, str(shape))
        assert any("row_product" in n for n in _pallas_names(lambda x: lin(x, ON), x))
    two = jnp.ones((2, K), jnp.bfloat16)
    assert not _pallas_names(lambda x: lin(x, ON), two)  # more rows: XLA's product
    one = jnp.ones((1, K), jnp.bfloat16)
    offs = (ON.replace(row_product_weights=(0, 0)), ON.replace(impl="xla"), ON.replace(row_product_weights=(1, 10)))
    for off in offs:
        assert not _pallas_names(lambda x: lin(x, off), one)


def test_linear_norms_a_normed_row_in_the_kernel_or_says_why_not():
    """Linear given a NormedRow: the row kernel norms it where that kernel runs the product; at two
    rows XLA's norm comes first (no kernel); a NormedRow the kernel cannot take (a group of 24)
    warns naming why and runs XLA's norm. Every form equals the product of NormedRow.value."""
    k, n, group = 96, 48, 32
    lin = Linear(k, n, dtype=jnp.float32, rngs=nnx.Rngs(1))
    x, squares, gate, weight = _normed_row_args(3, k, group, 2, jnp.float32, 8)
    want = lin(rp.NormedRow(x, squares, gate, weight, group, 8, 1e-6).value(), REFERENCE)
    row = lambda x: rp.NormedRow(x, squares, gate, weight, group, 8, 1e-6)
    assert_scaled_close(np.asarray(jax.jit(lambda x: lin(row(x), ON))(x)), np.asarray(want), 1e-5, "kernel")
    names = [kernel_name(e) for e in equations(jax.make_jaxpr(lambda x: lin(row(x), ON))(x).jaxpr)
             if e.primitive.name == "pallas_call"]
    assert len(names) == 1 and "row_product" in names[0]
    two = lambda x: rp.NormedRow(jnp.concatenate([x, x]), jnp.concatenate([squares[None]] * 2),
                                 jnp.concatenate([gate, gate]), weight, group, 8, 1e-6)
    assert not _pallas_names(lambda x: lin(two(x), ON), x)
    np.testing.assert_allclose(np.asarray(lin(two(x), ON))[0], np.asarray(want)[0], rtol=1e-6, atol=1e-6)
    sq24 = jnp.asarray(np.random.default_rng(5).uniform(1, 2, size=(k // 24, 2)), jnp.float32)
    odd = rp.NormedRow(x, sq24, gate, jnp.ones((24,), jnp.float32), 24, 8, 1e-6)
    with pytest.warns(UserWarning, match="gated norm runs in XLA.*norm group 24"):
        got = lin(odd, ON)
    np.testing.assert_allclose(np.asarray(got), np.asarray(lin(odd.value(), REFERENCE)), rtol=1e-6, atol=1e-6)


def test_split_k_out_returns_the_kernels_partials():
    """A product the add + RMSNorm kernel consumes (split_k_out) returns the kernel's float32
    partials at one row; dense() of them is the product."""
    lin = Linear(256, N, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    lin.split_k_out = True
    x = jax.random.normal(jax.random.PRNGKey(2), (1, 1, 256), jnp.float32).astype(jnp.bfloat16)
    got = jax.jit(lambda x: lin(x, ON))(x)
    assert isinstance(got, SplitKParts) and got.parts.dtype == jnp.float32
    assert got.parts.shape[1:] == (1, 1, N) and got.parts.shape[0] == rp.default_config(256, N, partials=True).split_k
    want = jax.jit(lambda x: lin(x, REFERENCE))(x)
    assert_scaled_close(np.asarray(dense(got, jnp.bfloat16), np.float32), np.asarray(want, np.float32), 2**-7, "sum")


def test_a_weight_the_kernel_cannot_take_is_announced():
    lin = Linear(K, 40, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jnp.ones((1, K), jnp.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(lambda x: lin(x, ON)).lower(x)
    assert any("row-product kernel" in str(w.message) and "N = 40" in str(w.message) for w in caught)
    mixed = Linear(K, N, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))  # a float32 row, bf16 weights
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(lambda x: mixed(x, ON)).lower(x)
    assert any("the row is float32, the weight bfloat16" in str(w.message) for w in caught)


def test_the_route_is_part_of_the_program():
    lin = Linear(K, N, dtype=jnp.float32, rngs=nnx.Rngs(0))
    f = jax.jit(lambda x, routes: lin(x, routes), static_argnames="routes")
    x = jnp.ones((1, K), jnp.float32)
    text_on = f.lower(x, routes=ON).as_text()
    text_off = f.lower(x, routes=ON.replace(row_product_weights=(0, 0))).as_text()
    assert text_on != text_off  # interpret mode lowers the kernel to loops: no dot, unlike XLA's product
    assert "stablehlo.dot_general" in text_off and "stablehlo.dot_general" not in text_on


WIDE = dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16)  # the kernels' smallest head dims


@pytest.mark.filterwarnings("ignore:the MoE expert products use the XLA form")
@pytest.mark.filterwarnings("ignore:a one-row product of a")  # tiny weights the kernel cannot take: announced
def test_a_decode_step_through_the_row_kernel_gives_the_same_hidden_states():
    """A batch-1 decode step of the tiny Qwen3.5-MoE target (float32, kernels in interpret mode)
    with every one-row product through the kernel: the hidden states of the XLA products."""
    cfg, gd, params = make_target(WIDE, base=HYBRID_MOE, seed=5)
    cache = init_target_cache(cfg, 1, 16)
    kernels = Routes.resolve(impl="pallas_interpret")

    @functools.partial(jax.jit, static_argnames="routes")
    def step(p, t, routes):
        return nnx.merge(gd, p)(t, cache, jnp.ones((1,), jnp.int32), chunked=False, routes=routes)[0]

    on = kernels.replace(row_product_weights=(1, 10**9))
    tokens = jnp.asarray([[7]], jnp.int32)
    names = _pallas_names(lambda p: step.__wrapped__(p, tokens, on), params)
    # the tiny sizes leave some products to XLA (GDN in: N = 200, shared expert: 56 / 28, router: 4;
    # announced); every mixer's output projection takes the kernel
    assert sum("row_product" in n for n in names) >= cfg.num_layers
    a, b = step(params, tokens, routes=on), step(params, tokens, routes=kernels)
    assert_scaled_close(np.asarray(a), np.asarray(b), 1e-5, "decode step")


# ---- native, at the 35B-A3B shapes --------------------------------------------------------------
@pytest.mark.parametrize("k, n, partials", [(2048, 256, False), (2048, 12352, False), (4096, 2048, True),
                                            (2048, 9216, False)])
def test_35b_a3b_products(gpu_impl, k, n, partials):
    x, w = _operands(k + n, k, n, jnp.bfloat16)
    got = _product(x, w, None, partials, gpu_impl)
    _check(got, x, w, jnp.bfloat16, partials, rp.default_config(k, n, partials=partials).split_k)


@pytest.mark.script
def test_bench_cpu_smoke(tmp_path):
    """scripts.bench.kernels row_product --cpu-smoke: the kernel and XLA's forms agree in the
    interpreter (the rounded product and the partials into add + RMSNorm) and land in the report."""
    import json

    from scripts.bench import kernels as bench

    out = tmp_path / "rp.json"
    assert bench.main(["row_product", "--cpu-smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["partials"] for r in rows] == [False, True]
    assert all(r["ok"] and r["xla_pad_ok"] and r["kernel_ok"] for r in rows)
