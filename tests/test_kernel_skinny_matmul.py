"""The skinny matmul kernel (interpret mode) equals jnp.matmul for row counts around the row-tile
edges (1, 16, 17, 65, 100), shapes that need masks (N, K not multiples of the blocks), both
layouts, split-K, float32 and bf16; configs and inputs it cannot take are named; the model routes
exactly the products of the measured window through it when the opt-in route is on. One padded set of shapes per case so one compilation serves all examples."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels.skinny_matmul import SkinnyConfig, reference, row_tiles, skinny_matmul

CONFIGS = {
    "cols": SkinnyConfig(block_n=32, block_k=32, num_stages=2),
    "rows": SkinnyConfig(block_n=32, block_k=16, layout="rows"),
    "split3": SkinnyConfig(block_n=16, block_k=32, split_k=3),
    "tile128": SkinnyConfig(block_n=64, block_k=32, max_row_tile=128),
}


@functools.partial(jax.jit, static_argnames=("cfg", "impl"))
def _mm(x, w, cfg, impl):
    return skinny_matmul(x, w, impl=impl, config=cfg)


def test_row_tiles_cover_the_rows_with_power_of_two_tiles():
    assert row_tiles(65, 64) == ((0, 64), (64, 16))
    assert row_tiles(1, 64) == ((0, 16),)
    assert row_tiles(17, 64) == ((0, 32),)
    assert row_tiles(100, 64) == ((0, 64), (64, 32), (96, 16))
    assert row_tiles(128, 128) == ((0, 128),)
    for m in range(1, 257):
        tiles = row_tiles(m, 64)
        assert tiles[0][0] == 0 and all(a + s == b for (a, s), (b, _) in zip(tiles, tiles[1:]))
        assert m <= sum(s for _, s in tiles) < m + 16


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("m, k, n", [(65, 96, 80), (16, 64, 64), (17, 100, 48), (1, 32, 16), (100, 64, 130)])
def test_skinny_matmul_equals_matmul_float32(name, m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, n)), jnp.float32)
    got = _mm(x, w, CONFIGS[name], "pallas_interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference(x, w)), rtol=1e-5, atol=1e-4)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 80), name=st.sampled_from(sorted(CONFIGS)))
def test_skinny_matmul_bf16_rounds_once_like_xla(seed, m, name):
    """bf16 inputs, float32 accumulation, one rounding to bf16: within one bf16 step of the float32
    product; rows past m are never written (the output has exactly m rows); a leading batch axis."""
    rng = np.random.default_rng(seed)
    k, n = 96, 80
    x = jnp.asarray(rng.normal(size=(1, 80, k)), jnp.bfloat16)[:, :m]
    w = jnp.asarray(rng.normal(size=(k, n)), jnp.bfloat16)
    got = _mm(x, w, CONFIGS[name], "pallas_interpret")
    assert got.shape == (1, m, n) and got.dtype == jnp.bfloat16
    exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    err = np.abs(np.asarray(got, np.float32) - exact)
    assert (err <= np.abs(exact) * 2.0**-8 + 1e-3).all()


def test_skinny_matmul_names_what_it_cannot_take():
    x, w = jnp.zeros((4, 32)), jnp.zeros((32, 16))
    with pytest.raises(ValueError, match=r"powers of two >= 16\): block_n = 24"):
        skinny_matmul(x, w, impl="pallas_interpret", config=SkinnyConfig(block_n=24))
    with pytest.raises(ValueError, match="layout = 'diag'"):
        skinny_matmul(x, w, impl="pallas_interpret", config=SkinnyConfig(layout="diag"))
    with pytest.raises(ValueError, match=r"needs a weight \[32, N\]"):
        skinny_matmul(x, jnp.zeros((16, 16)), impl="pallas_interpret")
    with pytest.raises(ValueError, match="one dtype"):
        skinny_matmul(x, w.astype(jnp.bfloat16), impl="pallas_interpret")
    with pytest.raises(ValueError, match="takes 1..256 rows, got 300"):
        skinny_matmul(jnp.zeros((300, 32)), w, impl="pallas_interpret")
    with pytest.raises(ValueError, match="impl must be one of"):
        skinny_matmul(x, w, impl="triton")


@pytest.mark.slow  # 9 s; the route is opt-in (layers.SKINNY_MATMUL) and the kernel is checked above
def test_model_routes_the_measured_window_through_the_kernel(monkeypatch):
    """With the opt-in route on, a bf16 verify with kernels sends the projections inside the route's
    window (set here to the tiny model's sizes) through skinny_matmul and gives the XLA path's logits
    within bf16 rounding; a float32 model and a decode step (1 row) do not take it; off (the
    default) nothing does."""
    from flax import nnx

    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.models import layers
    from ddtree_jax.tree import make_tree
    from tests.tiny_models import HYBRID, make_target

    from converters.layout import SWITCHES

    for path in SWITCHES:  # HF's separate projections: GDN in_proj_qkv and attention q_proj are qkv_out wide
        monkeypatch.setattr(path, False)
    n_nodes = 17
    monkeypatch.setattr(layers, "SKINNY_MATMUL", True)
    dims = dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16)  # the tree kernels' minimum
    cfg, gd, params = make_target(dict(dims, dtype="bfloat16"), seed=34, base=HYBRID)
    qkv_out = cfg.gdn_conv_dim
    monkeypatch.setattr(layers, "SKINNY_OUT", (qkv_out, qkv_out))
    cache = init_target_cache(cfg, 1, 64)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, n_nodes)), jnp.int32)
    parents = jnp.asarray([[-1] + [int(rng.integers(0, i)) for i in range(1, n_nodes)]], jnp.int32)

    def verify(params, impl):
        model = nnx.merge(gd, params)
        tree = make_tree(tokens, parents, jnp.ones((1, n_nodes), bool), cache.lengths, max_depth=n_nodes - 1)
        return model.logits(model.verify(tokens, cache, tree, impl=impl)[0])

    text = str(jax.make_jaxpr(functools.partial(verify, impl="pallas_interpret"))(params))
    # the products exactly qkv_out wide: GDN in_proj_qkv and (gated) attention q_proj, one a layer
    assert cfg.num_heads * cfg.head_dim * 2 == qkv_out
    assert text.count("name=skinny_matmul") == cfg.num_layers
    got = jax.jit(verify, static_argnums=1)(params, "pallas_interpret")
    want = jax.jit(verify, static_argnums=1)(params, "xla")
    scale = float(np.abs(np.asarray(want)).max())
    assert float(np.abs(np.asarray(got) - np.asarray(want)).max()) <= 0.05 * scale

    cfg32, gd32, params32 = make_target(dims, seed=34, base=HYBRID)
    model32 = nnx.merge(gd32, params32)
    x32 = jnp.zeros((1, n_nodes, cfg32.hidden_size), jnp.float32)
    assert not layers.skinny_route_takes(x32, model32.layers[0].linear_attn.in_proj_qkv.kernel[...])
    one_row = jnp.zeros((1, 1, cfg.hidden_size), jnp.bfloat16)
    qkv = nnx.merge(gd, params).layers[0].linear_attn.in_proj_qkv
    assert not layers.skinny_route_takes(one_row, qkv.kernel[...])
    monkeypatch.setattr(layers, "SKINNY_MATMUL", False)
    text = str(jax.make_jaxpr(functools.partial(verify, impl="pallas_interpret"))(params))
    assert "skinny_matmul" not in text


INT8_CONFIGS = {
    "magic": SkinnyConfig(block_n=32, block_k=32, num_stages=2),
    "cvt": SkinnyConfig(block_n=32, block_k=32, dequant="cvt"),
    "rows": SkinnyConfig(block_n=32, block_k=16, layout="rows"),
    "split3": SkinnyConfig(block_n=16, block_k=32, split_k=3),
}


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "out_dtype"))
def _mm8(x, q, scale, cfg, impl, out_dtype=None):
    return skinny_matmul(x, q, scale, impl=impl, config=cfg, out_dtype=out_dtype)


def test_widen_int8_is_exact_for_every_int8_value():
    from pallas_kernels.skinny_matmul import widen_int8

    q = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    for how in ("cvt", "magic"):
        for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
            got = widen_int8(q, dtype, how)
            assert got.dtype == dtype
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.arange(-128, 128, dtype=np.float32))


@pytest.mark.parametrize("name", sorted(INT8_CONFIGS))
@pytest.mark.parametrize("m, k, n", [(16, 96, 80), (15, 64, 64), (1, 32, 48), (65, 100, 40)])
def test_int8_skinny_matmul_equals_xlas_int8_product(name, m, k, n):
    """int8 weights with column scales: the kernel's (x @ q) * scale equals the reference (XLA's
    int8 product) to accumulation order, rounded once to bf16 or kept float32 (the draft head)."""
    from ddtree_jax.models.int8 import quantize

    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.normal(size=(1, m, k)), jnp.bfloat16)
    q, scale = quantize(jnp.asarray(rng.normal(size=(k, n)) * rng.uniform(0.1, 10, size=n), jnp.float32))
    exact = (np.asarray(x, np.float32)[0] @ np.asarray(q, np.float32)) * np.asarray(scale)
    got32 = _mm8(x, q, scale, INT8_CONFIGS[name], "pallas_interpret", jnp.float32)
    assert got32.shape == (1, m, n) and got32.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got32)[0], exact, rtol=1e-5, atol=1e-4 * np.abs(exact).max())
    got = _mm8(x, q, scale, INT8_CONFIGS[name], "pallas_interpret")
    assert got.dtype == jnp.bfloat16
    want = reference(x, q, scale)
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    assert (err <= np.abs(exact) * 2.0**-7 + 1e-3).all()


def test_int8_default_config_fills_the_gpu():
    from pallas_kernels.skinny_matmul import INT8_TARGET_PROGRAMS, default_config

    for k, n in [(5120, 34816), (17408, 5120), (5120, 6144), (4096, 5120), (5120, 1024), (5120, 248320)]:
        cfg = default_config(16, k, n, int8=True)
        cfg.check()
        programs = -(-n // cfg.block_n) * cfg.split_k
        assert programs >= min(INT8_TARGET_PROGRAMS, -(-n // cfg.block_n) * (k // (4 * cfg.block_k)))
        assert k // cfg.split_k >= 4 * cfg.block_k  # each K slice at least 4 tiles deep


def test_int8_skinny_matmul_names_what_it_cannot_take():
    x = jnp.zeros((4, 32), jnp.bfloat16)
    q, scale = jnp.zeros((32, 16), jnp.int8), jnp.ones((16,), jnp.float32)
    for impl in ("xla", "pallas_interpret"):
        with pytest.raises(ValueError, match="int8 weight needs its column scale"):
            skinny_matmul(x, q, impl=impl)
        with pytest.raises(ValueError, match=r"scale must be float32 \[16\], got float32 \(8,\)"):
            skinny_matmul(x, q, scale[:8], impl=impl)
        with pytest.raises(ValueError, match="scale is for int8 weights; the weight is bfloat16"):
            skinny_matmul(x, q.astype(jnp.bfloat16), scale, impl=impl)
    with pytest.raises(ValueError, match="x must be floating point"):
        skinny_matmul(x.astype(jnp.int32), q, scale, impl="pallas_interpret")
    with pytest.raises(ValueError, match="dequant = 'lut'"):
        skinny_matmul(x, q, scale, impl="pallas_interpret", config=SkinnyConfig(dequant="lut"))
