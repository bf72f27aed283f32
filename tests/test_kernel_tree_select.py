"""The one-launch node selection kernel (`impl`: interpret mode, natively under -m gpu) equals the
XLA form array for array, node scores included: random per-depth candidates with ties, -inf and
signed zeros, budgets 1-64, fewer candidates than the budget, fewer real prefixes than the budget,
batch 2; a whole DDTree build through it equals the CPU's tree; (-m gpu) 15 draft depths at
budgets 8-64, batch 1 and 8. Shapes are padded per case so one compilation serves all hypothesis
examples."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels.tree_select import SELECT_KERNEL_MAX_BUDGET, path_words, rank_place, select_nodes
from scripts.bench import kernels as bench
from scripts.bench.kernels_tree_build import tree_select_problem
from scripts.bench.shapes import DRAFT_DEPTHS
from tests.build_harness import assert_gpu_build_equals_cpu


def draw_top_val(seed, depth, k, levels):
    """[2, depth, k] descending per depth (as lax.top_k returns), with ties / -inf / signed zeros."""
    rng = np.random.default_rng(seed)
    x = -np.abs(rng.normal(size=(2, depth, k))).astype(np.float32) * 3
    if levels:
        x = np.round(x * levels) / levels
    x[rng.random(x.shape) < 0.08] = -np.inf
    x[rng.random(x.shape) < 0.08] = -0.0
    return np.asarray(jax.lax.top_k(jnp.asarray(x), k)[0])


@functools.partial(jax.jit, static_argnames=("budget", "impl", "with_scores"))
def _select(top_val, budget, impl, with_scores=False):
    return select_nodes(top_val, budget, impl=impl, with_scores=with_scores)


def assert_same(want, got):
    assert len(want) == len(got)
    for name, w, g in zip(("depth", "rank", "parent", "valid", "score"), want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


@pytest.mark.parametrize("budget, k, depth", [(1, 1, 5), (2, 2, 5), (7, 7, 5), (16, 16, 15), (16, 3, 5),
                                              (20, 2, 3), (33, 33, 4), (64, 64, 3)])
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), levels=st.sampled_from([0, 1, 4]))
def test_select_kernel_equals_xla(impl, budget, k, depth, seed, levels):
    """With the node scores (the kernel's other outputs are the same code with or without them;
    test_ddtree_build_through_the_kernel_equals_cpu_tree runs the form without)."""
    top_val = jnp.asarray(draw_top_val(seed, depth, k, levels))
    want = _select(top_val, budget, "xla", with_scores=True)
    assert_same(want, _select(top_val, budget, impl, with_scores=True))


def test_invalid_nodes_last_and_canonical(impl):
    """Fewer finite prefixes than the budget: the valid nodes first in tree order, the rest
    (0, 0, 0, False), in the kernel and the XLA form."""
    top_val = np.full((2, 3, 4), -np.inf, np.float32)
    top_val[:, 0, :2] = [-0.5, -1.0]
    top_val[:, 1, :1] = -0.25  # 2 depth-1 + 2 depth-2 finite prefixes
    top_val = jnp.asarray(top_val)
    for form in ("xla", impl):
        d, r, p, v, sc = (np.asarray(a) for a in _select(top_val, 6, form, with_scores=True))
        np.testing.assert_array_equal(sc[0], [-0.5, -1.0, -0.75, -1.25] + [-np.inf] * 2)
        np.testing.assert_array_equal(v[0], [True] * 4 + [False] * 2)
        np.testing.assert_array_equal(d[0], [0, 0, 1, 1, 0, 0])
        np.testing.assert_array_equal(p[0], [0, 0, 1, 2, 0, 0])
        np.testing.assert_array_equal(r[0], [0, 1, 0, 0, 0, 0])


def test_path_words_order_paths():
    """(depth, path) order = the packed words' order, for every rank width and word boundary."""
    rng = np.random.default_rng(0)
    for k, depth in ((2, 31), (16, 15), (33, 15), (64, 9)):
        bits, first, per, nw = path_words(depth, k)

        def pack(path):
            words = [0] * nw
            words[0] = len(path) << 25
            for p, r in enumerate(path):
                w, off = rank_place(p, bits, first, per)
                words[w] += r << off
            assert all(0 <= x < 2**30 for x in words)
            return tuple(words)

        paths = [tuple(rng.integers(0, k, size=rng.integers(1, depth + 1))) for _ in range(300)]
        by_words = sorted(paths, key=pack)
        assert by_words == sorted(paths, key=lambda p: (len(p), p))


def test_select_kernel_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match=f"budgets up to {SELECT_KERNEL_MAX_BUDGET}"):
        select_nodes(jnp.zeros((1, 3, 4), jnp.float32), SELECT_KERNEL_MAX_BUDGET + 1, impl="pallas_interpret")
    with pytest.raises(ValueError, match="at most 31 draft depths"):
        select_nodes(jnp.zeros((1, 32, 4), jnp.float32), 8, impl="pallas_interpret")


@pytest.mark.parametrize("budget", [4, 16, 65])
def test_ddtree_build_through_the_kernel_equals_cpu_tree(budget):
    """build_tree with kernels on a (reported) GPU selects nodes with the kernel up to budget 64
    (65 takes the XLA form, announced) and builds the CPU's tree array for array, ties included."""
    rng = np.random.default_rng(budget)
    logits = rng.integers(0, 4, size=(2, 6, 80)).astype(np.float32)  # few values: many exact ties
    logq = jnp.round(jax.nn.log_softmax(jnp.asarray(logits), axis=-1) * 4) / 4 - 0.25
    routed = [w for w in assert_gpu_build_equals_cpu(logq, budget) if "node selection" in w]
    assert bool(routed) == (budget > SELECT_KERNEL_MAX_BUDGET)  # announced, never silent


@pytest.mark.script
def test_bench_cpu_smoke(tmp_path):
    """scripts.bench.kernels tree_select in interpret mode: equality check and the timing path."""
    out = tmp_path / "select.json"
    assert bench.main(["tree_select", "--cpu-smoke", "--budgets", "4", "--batches", "2", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["kernel_equal"] and row["kernel_us"] > 0 and row["xla_us"] > 0


@pytest.mark.parametrize("budget", [8, 16, 32, 64])
@pytest.mark.parametrize("batch", [1, 8])
def test_native_at_the_draft_depths(gpu_impl, batch, budget):
    """15 draft depths of `budget` candidates each, with ties and -inf: the kernel's arrays equal
    the XLA form's."""
    [top_val] = tree_select_problem(batch * 100 + budget, batch, DRAFT_DEPTHS, budget, 1)
    assert_same(_select(top_val, budget, "xla"), _select(top_val, budget, gpu_impl))
