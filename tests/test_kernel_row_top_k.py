"""The row top-k kernel (`impl`: interpret mode, natively under -m gpu) equals lax.top_k: values,
indices, ties to the lower index, -inf, signed zeros, rows that are not a power of two long, k up
to 32; one padded shape per case so one compilation serves all hypothesis examples; a DDTree build
routes the demo-sized vocabulary through it and announces the XLA route for longer rows; (-m gpu)
the draft's 15 rows of 2048 / 8192 entries at batch 1 and 8."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels.row_top_k import ROW_TOP_K_MAX_K, ROW_TOP_K_MAX_LEN, row_top_k
from scripts.bench import kernels as bench
from scripts.bench.kernels_tree_build import row_top_k_problem
from scripts.bench.shapes import DRAFT_DEPTHS
from tests.build_harness import assert_gpu_build_equals_cpu


@functools.partial(jax.jit, static_argnames=("k", "impl"))
def _top_k(x, k, impl):
    return row_top_k(x, k, impl=impl)


@pytest.mark.parametrize("n, k", [(300, 16), (300, 32), (17, 17), (5, 1)])
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), levels=st.sampled_from([0, 1, 3]))
def test_row_top_k_equals_lax_top_k(impl, n, k, seed, levels):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 3, n)).astype(np.float32)
    if levels:
        x = np.round(x * levels) / levels
    x[rng.random(x.shape) < 0.1] = -np.inf
    x[rng.random(x.shape) < 0.1] = -0.0
    x[rng.random(x.shape) < 0.1] = 0.0
    want_v, want_i = _top_k(jnp.asarray(x), k, "xla")
    got_v, got_i = _top_k(jnp.asarray(x), k, impl)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    np.testing.assert_array_equal(np.signbit(np.asarray(got_v)), np.signbit(np.asarray(want_v)))


def test_row_top_k_full_length_row(impl):
    """A row of the kernel's maximum length (the demo's 8k vocabulary)."""
    x = jax.nn.log_softmax(jax.random.normal(jax.random.PRNGKey(0), (1, 2, ROW_TOP_K_MAX_LEN)) * 3)
    for got, want in zip(_top_k(x, 16, impl), _top_k(x, 16, "xla")):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_row_top_k_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match=f"rows up to {ROW_TOP_K_MAX_LEN}"):
        row_top_k(jnp.zeros((1, ROW_TOP_K_MAX_LEN + 1)), 4, impl="pallas_interpret")
    with pytest.raises(ValueError, match=f"k up to {ROW_TOP_K_MAX_K}"):
        row_top_k(jnp.zeros((1, 100)), ROW_TOP_K_MAX_K + 1, impl="pallas_interpret")
    with pytest.raises(ValueError, match="k must be"):
        row_top_k(jnp.zeros((1, 3)), 4, impl="pallas_interpret")


@pytest.mark.parametrize("vocab, routed", [(80, False), (ROW_TOP_K_MAX_LEN + 8, True)])
def test_build_routes_the_vocabulary_top_k(vocab, routed):
    """build_tree with kernels takes the kernel for the demo-sized vocabulary and XLA's staged top-k
    (with a warning) above it; both trees equal the CPU's."""
    rng = np.random.default_rng(vocab)
    logq = jax.nn.log_softmax(jnp.asarray(rng.integers(0, 4, size=(2, 4, vocab)).astype(np.float32)), axis=-1)
    caught = assert_gpu_build_equals_cpu(logq, 8)
    assert any("vocabulary top-8" in w for w in caught) == routed  # announced, never silent


@pytest.mark.script
def test_bench_cpu_smoke(tmp_path):
    """scripts.bench.kernels row_top_k in interpret mode: equality check and the timing path."""
    out = tmp_path / "topk.json"
    assert bench.main(["row_top_k", "--cpu-smoke", "--sizes", "300", "--ks", "8", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["kernel_equal"] and row["kernel_us"] > 0 and row["xla_us"] > 0


@pytest.mark.parametrize("n, k", [(2048, 16), (2048, 32), (8192, 16), (8192, 32)])
@pytest.mark.parametrize("batch", [1, 8])
def test_native_at_the_draft_rows(gpu_impl, batch, n, k):
    """The draft's 15 rows per sequence of log-probabilities with exact ties and -inf: values and
    indices equal lax.top_k's."""
    [x] = row_top_k_problem(batch * 1000 + n + k, batch, DRAFT_DEPTHS, n, 1)
    for got, want in zip(_top_k(x, k, gpu_impl), jax.jit(lambda v: jax.lax.top_k(v, k))(x)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
