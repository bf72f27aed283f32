"""The GDN decode kernel (`impl`: interpreted on CPU, native under -m gpu) equals its reference,
which is the model's XLA decode path op for op: float32 to ~1e-6 interpreted (1e-5 natively),
bf16 within bf16 rounding; idle rows (n_valid 0) keep their state and window exactly; shapes the
kernel cannot take are refused with every reason; the model announces its XLA route for them;
(-m gpu) the same at the 27B GDN layer."""

import functools
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.cache import RecurrentCache
from ddtree_jax.models.mixer import Step
from tests.tree_harness import INTERPRET
from pallas_kernels.gdn_decode import gdn_decode, kernel_problems
from scripts.bench import kernels as bench
from scripts.bench.kernels_gdn import gdn_decode_problem
from scripts.bench.common import max_rel_err
from scripts.bench.shapes import GDN_27B
from tests.tiny_models import HYBRID, make_target
from tests.tolerance import assert_scaled_close, by_impl

HK, HV, DK, DV, K, HID = 2, 4, 16, 32, 4, 48  # hidden 48: the a / b products in chunks of 16
C = 2 * HK * DK + HV * DV
STATE, WINDOW = 9, 7  # argument positions


def draw(seed, dtype, b=3):
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return (r(b, C).astype(dtype), r(b, HV, DV).astype(dtype), r(b, HID).astype(dtype),
            (r(HID, HV) * HID**-0.5).astype(dtype), (r(HID, HV) * HID**-0.5).astype(dtype), r(HV).astype(dtype),
            r(HV).astype(dtype), r(b, K - 1, C).astype(dtype), (r(K, C) * 0.5).astype(dtype), r(b, HV, DK, DV),
            (1 + 0.1 * r(DV)).astype(dtype), jnp.asarray([1, 0, 1][:b], jnp.int32))


@functools.partial(jax.jit, static_argnames=("impl", "dv_block", "dv_split"))
def _decode(*args, impl, dv_block=None, dv_split=1):
    return gdn_decode(*args, num_k_heads=HK, eps=1e-6, impl=impl, dv_block=dv_block, dv_split=dv_split)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("seed, dv_block, dv_split", [(0, None, 1), (1, None, 1), (2, None, 1), (0, 16, 1),
                                                      (1, None, 2), (2, 16, 2)])
def test_gdn_decode_kernel_equals_reference(impl, dtype, tol, seed, dv_block, dv_split):
    """dv_block 16: the state updated in two column blocks (the norm over both); dv_split 2: each
    head's columns over two programs, the gated norm after the kernel from their sums of squares."""
    tol = by_impl(impl, tol, max(tol, 1e-5))
    args = draw(seed, dtype)
    want = _decode(*args, impl="xla")
    got = _decode(*args, impl=impl, dv_block=dv_block, dv_split=dv_split)
    for name, w, g in zip(("y", "state", "window"), want, got):
        w, g = np.asarray(w, np.float32), np.asarray(g, np.float32)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max(), err_msg=name)
    idle = 1  # n_valid 0: the cache stays as it was, bit for bit
    np.testing.assert_array_equal(np.asarray(got[1][idle]), np.asarray(args[STATE][idle]))
    np.testing.assert_array_equal(np.asarray(got[2][idle]), np.asarray(args[WINDOW][idle]))


def test_reference_is_the_model_decode_path():
    """The reference equals GatedDeltaNet's XLA single-token step (y through out_proj, new cache)."""
    cfg, gd, params = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16), seed=5,
                                  base=HYBRID)
    model = nnx.merge(gd, params)
    layer = next(lay.linear_attn for lay in model.layers if hasattr(lay, "linear_attn"))
    rng = np.random.default_rng(0)
    b = 2
    x = jnp.asarray(rng.normal(size=(b, 1, cfg.hidden_size)), jnp.float32)
    cache = RecurrentCache(conv=jnp.asarray(rng.normal(size=(b, cfg.conv_kernel - 1, cfg.gdn_conv_dim)), jnp.float32),
                           state=jnp.asarray(rng.normal(size=(b, cfg.gdn_num_v_heads, 16, 16)), jnp.float32))
    n_valid = jnp.asarray([1, 0], jnp.int32)
    y_model, c_model = layer.append(x, cache, Step(None, n_valid, False))
    mixed, z, _, _ = layer.project(x)
    hv = cfg.gdn_num_v_heads
    w_ba = layer.in_proj_qkvzba.kernel[...][:, -2 * hv:]  # the b | a columns of the merged product
    w_a, w_b = w_ba[:, hv:], w_ba[:, :hv]
    y, state, window = gdn_decode(mixed[:, 0], z[:, 0], x[:, 0], w_a, w_b, layer.A_log[...], layer.dt_bias[...],
                                  cache.conv, layer.conv_weight[...], cache.state, layer.norm.weight[...], n_valid,
                                  num_k_heads=cfg.gdn_num_k_heads, eps=layer.norm.eps, impl="xla")
    np.testing.assert_allclose(np.asarray(layer.out_proj(y.reshape(b, 1, -1))), np.asarray(y_model),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state), np.asarray(c_model.state), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(window), np.asarray(c_model.conv))


def test_kernel_refuses_shapes_it_cannot_take():
    problems = kernel_problems(conv_dim=100, num_k_heads=3, num_v_heads=4, dk=8, dv=24, taps=1, hidden=36)
    assert len(problems) == 6  # hidden, dk, dv, heads, conv_dim, taps: every reason at once
    with pytest.raises(ValueError, match="dk=8"):
        gdn_decode(jnp.zeros((1, 2 * 8 + 2 * 16)), jnp.zeros((1, 2, 16)), jnp.zeros((1, 32)), jnp.zeros((32, 2)),
                   jnp.zeros((32, 2)), jnp.zeros((2,)), jnp.zeros((2,)), jnp.zeros((1, 3, 48)), jnp.zeros((4, 48)),
                   jnp.zeros((1, 2, 8, 16)), jnp.ones((16,)), jnp.ones((1,), jnp.int32), num_k_heads=1, eps=1e-6,
                   impl="pallas_interpret")
    args = draw(0, jnp.float32)
    with pytest.raises(ValueError, match="dv_split=3 must be a power of two dividing dv=32"):
        _decode(*args, impl="pallas_interpret", dv_split=3)
    with pytest.raises(ValueError, match="dv_block=24 must be a power of two"):
        _decode(*args, impl="pallas_interpret", dv_block=24)


def test_fitting_split_fills_the_gpu_without_crowding_it():
    """fitting_split: a head's columns over up to `most` programs, >= 16 columns each, the grid
    within two programs per SM (132): batch 1 at 32 heads splits 4 ways, batch 8 not at all."""
    from pallas_kernels.gdn_decode import fitting_split

    assert fitting_split(1, 32, 128, 4) == 4 and fitting_split(1, 32, 128, 8) == 8
    assert fitting_split(8, 32, 128, 4) == 1 and fitting_split(4, 32, 128, 4) == 2
    assert fitting_split(1, 4, 32, 8) == 2 and fitting_split(1, 32, 128, 1) == 1
    assert fitting_split(8, 32, 128, 4, per_sm=8) == 4 and fitting_split(8, 32, 128, 4, per_sm=4) == 2


def test_model_announces_the_xla_route():
    """A layer shape the kernel cannot take (head dims of 8) decodes through XLA, with a warning."""
    cfg, gd, params = make_target(dict(head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8), seed=6,
                                  base=HYBRID)
    model = nnx.merge(gd, params)
    layer = next(lay.linear_attn for lay in model.layers if hasattr(lay, "linear_attn"))
    b = 1
    cache = RecurrentCache(conv=jnp.zeros((b, cfg.conv_kernel - 1, cfg.gdn_conv_dim)),
                           state=jnp.zeros((b, cfg.gdn_num_v_heads, 8, 8)))
    x = jnp.ones((b, 1, cfg.hidden_size))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = layer.append(x, cache, Step(None, jnp.ones((b,), jnp.int32), False), INTERPRET)
    assert any("GDN decode step uses the XLA form" in str(w.message) for w in caught)
    want = layer.append(x, cache, Step(None, jnp.ones((b,), jnp.int32), False))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_deferred_norm_is_the_row_the_split_kernel_norms(impl, dtype):
    """gdn_decode_packed(defer_norm=True) with a split returns y as a row_product.NormedRow (the
    rounded o, the splits' sums of squares, z read from the product at its offset): its XLA form is
    the split kernel's y, and the row-product kernel's product of it is that of y; unsplit it
    returns y itself."""
    from pallas_kernels import row_product as rp
    from pallas_kernels.gdn_decode import gdn_decode_packed

    args = draw(3, dtype)
    mixed, z, x, w_a, w_b = args[:5]
    b = mixed.shape[0]
    ba = jnp.concatenate([jnp.einsum("bi,io->bo", x, w_b), jnp.einsum("bi,io->bo", x, w_a)], axis=-1).astype(dtype)
    proj = jnp.concatenate([mixed, z.reshape(b, -1), ba], axis=-1)
    w = jnp.asarray(np.random.default_rng(4).normal(size=(z.shape[1] * DV, 48)) * 0.1, dtype)

    @functools.partial(jax.jit, static_argnames=("split", "defer"))
    def run(proj, split, defer):
        y, state, window = gdn_decode_packed(proj, *args[5:], num_k_heads=HK, head_v_dim=DV, eps=1e-6, impl=impl,
                                             dv_block=16, dv_split=split, defer_norm=defer)
        if isinstance(y, rp.NormedRow):
            rows = [rp.row_product(y._replace(x=y.x[i : i + 1], squares=y.squares[i : i + 1], gate=y.gate[i : i + 1]),
                                   w, impl=impl) for i in range(b)]
            return y.value(), jnp.concatenate(rows), state, window
        y = y.reshape(b, -1)
        return y, jnp.concatenate([rp.row_product(y[i : i + 1], w, impl=impl) for i in range(b)]), state, window

    value, product, state, window = run(proj, 2, True)
    want_y, want_product, want_state, want_window = run(proj, 2, False)
    tol = 1e-5 if dtype == jnp.float32 else 2**-7
    assert_scaled_close(np.asarray(value, np.float32), np.asarray(want_y, np.float32), tol, "normed row")
    assert_scaled_close(np.asarray(product, np.float32), np.asarray(want_product, np.float32), tol, "its product")
    np.testing.assert_array_equal(np.asarray(state), np.asarray(want_state))
    np.testing.assert_array_equal(np.asarray(window), np.asarray(want_window))
    unsplit = run(proj, 1, True)[0]
    np.testing.assert_array_equal(np.asarray(unsplit), np.asarray(run(proj, 1, False)[0]))


@pytest.mark.script
def test_bench_cpu_smoke(tmp_path):
    """scripts.bench.kernels gdn_decode in interpret mode: correctness check and the carried-loop
    timing, of the x form and of the packed product (--packed), unsplit and with dv_split 2."""
    for extra in ([], ["--packed"]):
        out = tmp_path / "gdn_decode.json"
        assert bench.main(["gdn_decode", "--cpu-smoke", *extra, "--out", str(out)]) == 0
        [row] = json.loads(out.read_text())["rows"]
        assert row["float32_ok"] and row["bfloat16_ok"] and row["xla_us"] > 0, extra
        assert row["kernel_us"] > 0 and row["kernel_s2_us"] > 0, row


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("split", [1, 2])
def test_packed_product_form_equals_the_x_form(impl, dtype, tol, split):
    """gdn_decode_packed (gdn.MERGED_QKVZ_BA: one product qkv | z | b | a) gives, kernel and
    reference alike, what gdn_decode gives with x, w_a, w_b making the same b / a products; a
    product of the wrong width is refused."""
    from pallas_kernels.gdn_decode import gdn_decode_packed

    args = draw(7, dtype)
    mixed, z, x, w_a, w_b = args[:5]
    b = mixed.shape[0]
    ba = jnp.concatenate([jnp.einsum("bi,io->bo", x, w_b), jnp.einsum("bi,io->bo", x, w_a)], axis=-1).astype(dtype)
    proj = jnp.concatenate([mixed, z.reshape(b, -1), ba], axis=-1)
    run = lambda impl, p=proj: gdn_decode_packed(p, *args[5:], num_k_heads=HK, head_v_dim=DV, eps=1e-6, impl=impl,
                                                 dv_block=16, dv_split=split)
    want, got, full = run("xla"), run(impl), _decode(*args, impl="xla")
    for name, w, g, f in zip(("y", "state", "window"), want, got, full):
        w, g, f = (np.asarray(a, np.float32) for a in (w, g, f))
        kt = by_impl(impl, tol, max(tol, 1e-5))
        np.testing.assert_allclose(g, w, rtol=kt, atol=kt * np.abs(w).max(), err_msg=name)
        np.testing.assert_allclose(w, f, rtol=tol, atol=tol * np.abs(f).max(), err_msg=name)
    with pytest.raises(ValueError, match="qkv \\| z \\| b \\| a"):
        run(impl, proj[:, :-1])


@pytest.mark.parametrize("batch, dv_block, dv_split", [(1, None, 1), (8, None, 1), (1, 32, 1), (8, 64, 1), (1, None, 4),
                                                       (8, 32, 2)])
def test_native_at_the_27b_layer(gpu_impl, batch, dv_block, dv_split):
    """The 27B GDN layer (hidden 5120, 16 k / 48 v heads of 128, conv 4): y, state and window within
    1e-5 of the reference in float32 (its a / b products at full precision), 3e-2 in bf16; idle
    rows (every 4th) keep their state."""
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        args = gdn_decode_problem(batch, batch, **GDN_27B, dtype=dtype)
        run = lambda impl: jax.jit(lambda *a: gdn_decode(*a, num_k_heads=GDN_27B["hk"], eps=1e-6, impl=impl,
                                                         dv_block=dv_block, dv_split=dv_split))(*args)
        with jax.default_matmul_precision("highest"):
            want = run("xla")
        got = run(gpu_impl)
        assert max_rel_err(want, got) <= tol, jnp.dtype(dtype).name
        for i in range(batch):
            if int(args[-1][i]) == 0:
                np.testing.assert_array_equal(np.asarray(got[1][i]), np.asarray(args[STATE][i]))
