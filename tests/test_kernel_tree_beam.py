"""The one-launch beam kernel (interpret mode) equals the XLA beam array for array: random
per-depth candidates with ties, -inf and signed zeros, budgets 1-16, fewer candidates than the
budget, batch 2; and a whole DDTree build through it equals the CPU's tree."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ddtree_jax.spec.build import build_tree
from pallas_kernels.tree_beam import BEAM_KERNEL_MAX_ENTRIES, beam

D = 5


def draw_top_val(seed, k, levels):
    """[2, D, k] descending per depth (as lax.top_k returns), with ties / -inf / signed zeros."""
    rng = np.random.default_rng(seed)
    x = -np.abs(rng.normal(size=(2, D, k))).astype(np.float32) * 3
    if levels:
        x = np.round(x * levels) / levels
    x[rng.random(x.shape) < 0.08] = -np.inf
    x[rng.random(x.shape) < 0.08] = -0.0
    return np.asarray(jax.lax.top_k(jnp.asarray(x), k)[0])


@functools.partial(jax.jit, static_argnames=("budget", "impl"))
def _beam(top_val, budget, impl):
    return beam(top_val, budget, impl=impl)


@pytest.mark.parametrize("budget, k", [(1, 1), (2, 2), (5, 5), (16, 16), (16, 3), (7, 7)])
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), levels=st.sampled_from([0, 1, 4]))
def test_beam_kernel_equals_xla(budget, k, seed, levels):
    top_val = jnp.asarray(draw_top_val(seed, k, levels))
    want = _beam(top_val, budget, "xla")
    got = _beam(top_val, budget, "pallas_interpret")
    for name, w, g in zip(("scores", "parents", "ranks"), want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
        if name == "scores":
            np.testing.assert_array_equal(np.signbit(np.asarray(g)), np.signbit(np.asarray(w)))


def test_beam_kernel_refuses_what_it_cannot_rank():
    top_val = jnp.zeros((1, 3, 17), jnp.float32)
    assert 17 * 17 > BEAM_KERNEL_MAX_ENTRIES
    with pytest.raises(ValueError, match="at most 256 extensions"):
        beam(top_val, 17, impl="pallas_interpret")


@pytest.mark.parametrize("budget", [4, 16, 32])
def test_ddtree_build_through_the_kernel_equals_cpu_tree(budget, monkeypatch):
    """build_tree with kernels on a (reported) GPU runs the beam kernel up to 16 x 16 extensions
    (32 x 32 takes the XLA beam) and builds the CPU's tree array for array, ties included."""
    rng = np.random.default_rng(budget)
    logits = rng.integers(0, 4, size=(2, 6, 50)).astype(np.float32)  # few values: many exact ties
    logq = jnp.round(jax.nn.log_softmax(jnp.asarray(logits), axis=-1) * 4) / 4 - 0.25
    args = (logq, jnp.array([3, 4], jnp.int32), jnp.array([5, 9], jnp.int32))
    want = jax.jit(lambda *a: build_tree(*a, budget=budget))(*args)
    with monkeypatch.context() as m, warnings.catch_warnings(record=True) as caught:
        m.setattr(jax, "default_backend", lambda: "gpu")
        warnings.simplefilter("always")
        got = jax.jit(lambda *a: build_tree(*a, budget=budget, impl="pallas_interpret"))(*args)
    routed = [w for w in caught if "uses the XLA form" in str(w.message)]
    assert bool(routed) == (budget * budget > BEAM_KERNEL_MAX_ENTRIES)  # announced, never silent
    for name, w, g in zip(want._fields, want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_gpu_script_smoke(tmp_path):
    """scripts/gpu_tree_beam.py in interpret mode: equality check and the timing path."""
    import json

    from scripts.gpu_tree_beam import main

    out = tmp_path / "beam.json"
    assert main(["--cpu-smoke", "--budgets", "4", "--batches", "2", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["equal"] and row["kernel_us"] > 0 and row["xla_us"] > 0
