"""The Mamba2 decode kernel (`impl`: interpreted on CPU, native under -m gpu) equals its reference,
which is the model's XLA decode path: float32 within float32 rounding, bf16 within bf16 rounding,
at head / state sizes that are and are not powers of two (padded, masked tiles), with and without
a conv bias and a dt clamp; idle rows (n_valid 0) keep their state and window exactly; shapes that
are no Mamba2 layer are refused with every reason; (-m gpu) the same at the Nemotron-H-8B layer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.mamba2_decode import kernel_problems, mamba2_decode
from tests.tolerance import assert_scaled_close, by_impl

STATE, WINDOW = 7, 1  # argument positions


def draw(seed, dtype, *, b, h, p, n, g, taps, bias=True, idle=(1,)):
    """One layer's decode inputs: proj (z | xBC | dt), window, conv weight / bias, dt_bias, a_log,
    D, state, norm weight, n_valid (rows in `idle` are 0)."""
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    inter, c = h * p, h * p + 2 * g * n
    n_valid = jnp.asarray([0 if i in idle else 1 for i in range(b)], jnp.int32)
    return (r(b, inter + c + h).astype(dtype), r(b, taps - 1, c).astype(dtype), (r(taps, c) * 0.5).astype(dtype),
            (0.1 * r(c)).astype(dtype) if bias else None, (0.5 * r(h)).astype(dtype),
            (0.3 * r(h)).astype(dtype), (1.0 + 0.2 * r(h)).astype(dtype), r(b, h, p, n),
            (1.0 + 0.1 * r(inter)).astype(dtype), n_valid)


@functools.partial(jax.jit, static_argnames=("impl", "h", "g", "dt_limit", "p_split", "norm"))
def _decode(*args, impl, h, g, dt_limit=(0.0, float("inf")), p_split=1, norm=False):
    return mamba2_decode(*args, num_heads=h, groups=g, eps=1e-5, dt_limit=dt_limit, impl=impl, p_split=p_split,
                         norm_in_kernel=norm)


def _check(got, want, tol, args):
    for name, w, o in zip(("y", "state", "window"), want, got):
        assert o.shape == w.shape and o.dtype == w.dtype, name
        assert_scaled_close(np.asarray(o, np.float32), np.asarray(w, np.float32), tol, name)
    for i in np.flatnonzero(np.asarray(args[-1]) == 0):  # idle rows: the cache as it was, bit for bit
        np.testing.assert_array_equal(np.asarray(got[1][i]), np.asarray(args[STATE][i]))
        np.testing.assert_array_equal(np.asarray(got[2][i]), np.asarray(args[WINDOW][i]))


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("p, n, h, g, taps, bias, dt_limit, p_split, norm", [
    (16, 16, 4, 2, 4, True, (0.0, float("inf")), 1, False),  # powers of two (Bamba-like)
    (8, 8, 4, 1, 3, False, (0.05, float("inf")), 1, True),  # below the 16-wide tile, no bias, NemotronH's clamp
    (12, 24, 6, 3, 2, True, (0.0, 0.9), 1, False),  # odd sizes, two taps, an upper clamp
    (32, 16, 4, 2, 4, True, (0.0, float("inf")), 2, True),  # a head's rows over two programs
    (12, 8, 2, 1, 4, False, (0.05, float("inf")), 3, False),  # ... over three, four rows each (padded to 16)
    (12, 24, 6, 3, 2, True, (0.0, 0.9), 3, True),  # odd groups of 24 channels normed in the kernel
])
def test_mamba2_decode_kernel_equals_reference(impl, dtype, tol, p, n, h, g, taps, bias, dt_limit, p_split, norm):
    """norm: the group norm by each group's last program (norm_in_kernel), not an XLA fusion."""
    tol = by_impl(impl, tol, max(tol, 2e-5))
    args = draw(p + n, dtype, b=3, h=h, p=p, n=n, g=g, taps=taps, bias=bias)
    want = _decode(*args, impl="xla", h=h, g=g, dt_limit=dt_limit)
    got = _decode(*args, impl=impl, h=h, g=g, dt_limit=dt_limit, p_split=p_split, norm=norm)
    _check(got, want, tol, args)


@settings(max_examples=6)
@given(b=st.integers(1, 3), rep=st.integers(1, 3), g=st.integers(1, 2), p=st.sampled_from([4, 8, 16]),
       n=st.sampled_from([8, 16, 32]), split=st.sampled_from([1, 2, 4]), norm=st.booleans(),
       seed=st.integers(0, 2**16))
def test_mamba2_decode_kernel_over_shapes(b, rep, g, p, n, split, norm, seed):
    """Interpreted, float32: every grid shape the layer can take, idle and live rows mixed."""
    h = g * rep
    args = draw(seed, jnp.float32, b=b, h=h, p=p, n=n, g=g, taps=4, idle=(seed % (b + 1),))
    got = _decode(*args, impl="pallas_interpret", h=h, g=g, p_split=split, norm=norm)
    _check(got, _decode(*args, impl="xla", h=h, g=g), 2e-6, args)


def test_decode_kernel_refuses_what_is_no_mamba2_layer():
    """Every reason at once: a state of the wrong heads is refused alone (nothing else can be
    checked against it); otherwise groups, conv width, proj width, taps, window and norm weight."""
    assert len(kernel_problems((1, 10), (1, 2, 7), (1, 7), (1, 3, 4, 8), 3, 2, (5,))) == 6
    with pytest.raises(ValueError, match="state .* must be"):
        mamba2_decode(jnp.zeros((1, 10)), jnp.zeros((1, 2, 7)), jnp.zeros((3, 7)), None, jnp.zeros(3), jnp.zeros(3),
                      jnp.zeros(3), jnp.zeros((1, 2, 4, 8)), jnp.zeros(12), jnp.ones(1, jnp.int32), num_heads=3,
                      groups=1, eps=1e-5, impl="pallas_interpret")
    args = draw(0, jnp.float32, b=1, h=2, p=8, n=8, g=1, taps=4)
    bad = list(args)
    bad[STATE] = bad[STATE].astype(jnp.bfloat16)
    bad[3] = jnp.zeros((5,))
    with pytest.raises(ValueError, match=r"conv bias \(5,\).*state dtype bfloat16.*p_split=3 must be a positive "
                       "divisor of the head dim P = 8"):
        mamba2_decode(*bad, num_heads=2, groups=1, eps=1e-5, impl="pallas_interpret", p_split=3)


def test_default_warps_keep_the_tile_per_thread():
    """2 warps for the measured 64 x 128 state tile and smaller ones; more for larger tiles, at most 8."""
    from pallas_kernels.mamba2_decode import default_warps

    assert default_warps(64, 128) == 2 and default_warps(16, 16) == 2 and default_warps(16, 128) == 2
    assert default_warps(64, 256) == 4 and default_warps(128, 256) == 8 and default_warps(256, 256) == 8


@pytest.mark.parametrize("batch, p_split, norm", [(1, 1, False), (1, 1, True), (1, 4, True), (8, 1, True),
                                                  (8, 2, False)])
def test_nemotron_h_8b_layer_natively(gpu_impl, batch, p_split, norm):
    """The Nemotron-H-8B Mamba2 layer (128 heads of 64, 8 groups, state 128, 4 taps), bf16."""
    args = draw(batch, jnp.bfloat16, b=batch, h=128, p=64, n=128, g=8, taps=4, idle=(1,) if batch > 1 else ())
    want = _decode(*args, impl="xla", h=128, g=8, dt_limit=(0.001, float("inf")))
    got = _decode(*args, impl=gpu_impl, h=128, g=8, dt_limit=(0.001, float("inf")), p_split=p_split, norm=norm)
    _check(got, want, 2e-2, args)


# ---- in the model ----------------------------------------------------------------------------------

def _tiny(name, **overrides):
    from tests.hf_mamba_models import make_jax_target

    # attention heads of 16 where the family has attention (the attention kernels' smallest)
    heads = {"nemotron_h": dict(head_dim=16), "bamba": dict(num_attention_heads=2, num_key_value_heads=2),
             "mamba2": {}}[name]
    return make_jax_target(name, seed=11, overrides={**heads, **overrides})


def test_reference_is_the_model_decode_path():
    """The reference equals Mamba2Mixer's XLA single-token step (y through out_proj, new cache),
    NemotronH's dt clamp included."""
    from ddtree_jax.cache import RecurrentCache
    from ddtree_jax.models.mixer import Step
    from flax import nnx

    cfg, gd, params = _tiny("nemotron_h")
    assert cfg.mamba_dt_limit[0] > 0
    layer = next(lay.mamba for lay in nnx.merge(gd, params).layers if hasattr(lay, "mamba"))
    rng = np.random.default_rng(0)
    b, h, p, n = 2, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size
    x = jnp.asarray(rng.normal(size=(b, 1, cfg.hidden_size)), jnp.float32)
    cache = RecurrentCache(conv=jnp.asarray(rng.normal(size=(b, cfg.conv_kernel - 1, cfg.mamba_conv_dim)), jnp.float32),
                           state=jnp.asarray(rng.normal(size=(b, h, p, n)), jnp.float32))
    n_valid = jnp.asarray([1, 0], jnp.int32)
    y_model, c_model = layer.append(x, cache, Step(None, n_valid, False))
    y, state, window = mamba2_decode(layer.in_proj(x)[:, 0], cache.conv, layer.conv_weight[...], layer._conv_bias(),
                                     layer.dt_bias[...], layer.A_log[...], layer.D[...], cache.state,
                                     layer.norm.weight[...], n_valid, num_heads=h, groups=cfg.mamba_n_groups,
                                     eps=layer.norm.eps, dt_limit=cfg.mamba_dt_limit, impl="xla")
    np.testing.assert_allclose(np.asarray(layer.out_proj(y[:, None])), np.asarray(y_model), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state), np.asarray(c_model.state), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(window), np.asarray(c_model.conv))


SPLIT_NORM = dict(mamba2_decode_p_split=2, mamba2_decode_norm_in_kernel=True)


@pytest.mark.parametrize("name, routes",
                         [("nemotron_h", {}), ("bamba", {}), ("mamba2", {}), ("nemotron_h", SPLIT_NORM)],
                         ids=["nemotron_h", "bamba", "mamba2", "nemotron_h_split_norm_in_kernel"])
def test_decoding_through_the_kernel(name, routes):
    """Kernels on (interpreted; also with a head's rows split and the norm in the kernel): each
    Mamba2 layer of a decode step is one mamba2_decode launch (none with
    routes.mamba2_decode_kernel off); one step's hidden states and recurrent caches agree with the
    XLA form's within float32 rounding, for a batch of two prompts of different lengths; and
    (NemotronH, the default routes) whole greedy generations are the XLA form's."""
    from flax import nnx

    from ddtree_jax import decode
    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.config_fields import MAMBA2
    from ddtree_jax.routes import REFERENCE
    from ddtree_jax.speculative.generate import generate
    from tests.jaxpr_eqns import equations, kernel_name
    from tests.tree_harness import INTERPRET

    # the split case's Mamba2 heads of 32 (two programs of >= 16 rows each: fitting_split)
    cfg, gd, params = _tiny(name, **({"mamba_head_dim": 32} if routes else {}))
    interpret = INTERPRET.replace(**routes)
    if routes:
        from pallas_kernels.mamba2_decode import fitting_split

        assert fitting_split(2, cfg.mamba_num_heads, cfg.mamba_head_dim, interpret.mamba2_decode_p_split,
                             per_sm=interpret.mamba2_decode_programs_per_sm) == 2
    rng = np.random.default_rng(2)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    lens = jnp.asarray([9, 5], jnp.int32)
    if name == "nemotron_h" and not routes:  # whole generations once (their compiles dominate the test)
        ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=12)
        got = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=12, routes=interpret)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))

    cache = decode.prefill(gd, params, init_target_cache(cfg, 2, 64), prompt, lens).cache
    tok = jnp.asarray([3, 7], jnp.int32)

    def fn(c, routes):
        return nnx.merge(gd, params)(tok[:, None], c, jnp.ones((2,), jnp.int32), chunked=False, routes=routes)

    launches = lambda routes: sum("mamba2_decode" in kernel_name(e) for e in equations(jax.make_jaxpr(
        lambda c: fn(c, routes))(cache).jaxpr) if e.primitive.name == "pallas_call")
    assert launches(interpret) == sum(t == MAMBA2 for t in cfg.layer_types)
    assert launches(interpret.replace(mamba2_decode_kernel=False)) == 0
    run = jax.jit(fn, static_argnums=1)
    (h_ref, _, c_ref), (h_got, _, c_got) = run(cache, REFERENCE), run(cache, interpret)
    assert_scaled_close(np.asarray(h_got), np.asarray(h_ref), 1e-4, "hidden states")
    for a, r in zip(c_got.layers, c_ref.layers):
        if hasattr(r, "state"):
            assert_scaled_close(np.asarray(a.state), np.asarray(r.state), 1e-5, "state")
            assert_scaled_close(np.asarray(a.conv), np.asarray(r.conv), 1e-5, "window")


@pytest.mark.script
def test_bench_cpu_smoke(tmp_path):
    """scripts.bench.kernels mamba2_decode in interpret mode: the correctness check and the carried-loop
    timing of the XLA form and the kernel."""
    import json

    from scripts.bench import kernels as bench

    out = tmp_path / "mamba2_decode.json"
    assert bench.main(["mamba2_decode", "--cpu-smoke", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["float32_ok"] and row["bfloat16_ok"] and row["xla_us"] > 0 and row["kernel_us"] > 0, row
