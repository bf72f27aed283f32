"""The residual add + RMSNorm kernel (interpret mode) computes what models.layers.RMSNorm computes
on x + delta, in each norm mode and dtype, for rows that are not a power of two wide; bad inputs
are named; a decode step and a verify with kernels route every add + norm of a Qwen3.5-style
stack through it (A/B switch announced when off) and keep the DFlash features exact."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from ddtree_jax.models.layers import RMSNorm
from pallas_kernels.add_rms_norm import MODES, add_rms_norm


@functools.partial(jax.jit, static_argnames=("mode", "impl"))
def _run(x, d, w, mode, impl):
    return add_rms_norm(x, d, w, eps=1e-6, mode=mode, impl=impl)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_add_rms_norm_matches_the_module(mode, dtype, seed, scale):
    rng = np.random.default_rng(seed)
    h = 80  # not a power of two: the kernel pads to 128 and masks
    x = jnp.asarray(rng.normal(size=(2, 3, h)) * scale, dtype)
    d = jnp.asarray(rng.normal(size=(2, 3, h)) * scale, dtype)
    w = jnp.asarray(rng.normal(size=(h,)) * 0.5, dtype)
    norm = RMSNorm(h, 1e-6, zero_centered=mode == "zero_centered", dtype=dtype, rngs=nnx.Rngs(0),
                   weight_fp32=mode == "fp32_weight")
    norm.weight[...] = w
    want_stream = x + d
    want = norm(want_stream)
    stream, normed = _run(x, d, w, mode, "pallas_interpret")
    np.testing.assert_array_equal(np.asarray(stream), np.asarray(want_stream))  # one rounding of the sum
    assert normed.dtype == want.dtype
    tol = 1e-5 if dtype == "float32" else 1e-2  # bf16: one rounding step at most (sum order of the mean)
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    ref_stream, ref_normed = _run(x, d, w, mode, "xla")
    np.testing.assert_array_equal(np.asarray(ref_stream), np.asarray(want_stream))
    np.testing.assert_allclose(np.asarray(ref_normed, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_add_rms_norm_names_bad_inputs():
    x = jnp.zeros((2, 8))
    with pytest.raises(ValueError, match="mode must be one of"):
        add_rms_norm(x, x, jnp.zeros(8), eps=1e-6, mode="layer")
    with pytest.raises(ValueError, match="do not match"):
        add_rms_norm(x, x[:, :4], jnp.zeros(8), eps=1e-6, mode="plain")
    with pytest.raises(ValueError, match="impl must be one of"):
        add_rms_norm(x, x, jnp.zeros(8), eps=1e-6, mode="plain", impl="cuda")


def test_model_routes_add_and_norm_through_the_kernel(monkeypatch):
    """With kernels a Qwen3.5-style decode step traces one add_rms_norm launch per norm after a
    residual add (2 per layer + the final norm - the first input norm); hidden states for the drafter
    (hidden_ids) equal the XLA path's; ADD_NORM_KERNEL=False takes the route out with a warning."""
    import warnings

    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.models import target
    from tests.tiny_models import HYBRID, make_target

    cfg, gd, params = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16),
                                  seed=33, base=HYBRID)
    cache = init_target_cache(cfg, 2, 32)
    ids = (1, 2, cfg.num_layers)

    def step(c, t, impl):
        return nnx.merge(gd, params)(t[:, None], c, jnp.ones((2,), jnp.int32), chunked=False, impl=impl,
                                     hidden_ids=ids)

    tok = jnp.asarray([3, 7], jnp.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = str(jax.make_jaxpr(functools.partial(step, impl="pallas_interpret"))(cache, tok))
    # every norm but the first layer's input norm (nothing to add to the embeddings yet)
    assert text.count("name=add_rms_norm") == 2 * cfg.num_layers
    h_ref, f_ref, _ = jax.jit(step, static_argnums=2)(cache, tok, "xla")
    h_got, f_got, _ = jax.jit(step, static_argnums=2)(cache, tok, "pallas_interpret")
    np.testing.assert_allclose(np.asarray(f_got), np.asarray(f_ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(h_got), np.asarray(h_ref), rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(target, "ADD_NORM_KERNEL", False)
    with pytest.warns(UserWarning, match="target.ADD_NORM_KERNEL is False"):
        text = str(jax.make_jaxpr(functools.partial(step, impl="pallas_interpret"))(cache, tok))
    assert "add_rms_norm" not in text
