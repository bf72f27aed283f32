"""DDTree construction equals a plain-Python best-first heap, ties included."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ddtree_jax.routes import Routes
from ddtree_jax.speculative.build import build_chain, build_tree
from pallas_kernels.tree_select import select_in_index_order
from ddtree_jax.tree import bits_to_dense

D, V = 5, 24


def heap_reference(logq: np.ndarray, budget: int):
    """Best-first heap over (-score, depth, rank path); returns {token path: score}."""
    depth, vocab = logq.shape
    k = min(budget, vocab)
    ranked = [np.lexsort((np.arange(vocab), -logq[d]))[:k] for d in range(depth)]

    def score(rp):
        s = np.float32(0)
        for d, r in enumerate(rp):
            s = np.float32(s + np.float32(logq[d, ranked[d][r]]))
        return s

    heap = [(-score((0,)), 1, (0,))]
    out = {}
    while heap and len(out) < budget:
        neg, d, rp = heapq.heappop(heap)
        out[tuple(int(ranked[i][r]) for i, r in enumerate(rp))] = -neg
        if rp[-1] + 1 < k:
            sib = rp[:-1] + (rp[-1] + 1,)
            heapq.heappush(heap, (-score(sib), d, sib))
        if d < depth:
            child = rp + (0,)
            heapq.heappush(heap, (-score(child), d + 1, child))
    return out


def tree_paths(tree, b):
    tokens = np.asarray(tree.tokens[b])
    parents = np.asarray(tree.parents[b])
    valid = np.asarray(tree.valid[b])
    paths = {}
    for i in range(1, len(tokens)):
        if not valid[i]:
            continue
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = parents[j]
        paths[tuple(path[::-1])] = i
    return paths


def draw_logq(seed, quantized):
    rng = np.random.default_rng(seed)
    if quantized:  # few distinct values -> many exact ties in scores
        logits = rng.integers(0, 4, size=(2, D, V)).astype(np.float32)
    else:
        logits = rng.normal(size=(2, D, V)).astype(np.float32) * 3
    logq = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    if quantized:  # make log-probs exactly representable so sums tie exactly
        logq = jnp.round(logq * 4) / 4 - 0.25
    return np.asarray(logq)


_jit_build = jax.jit(build_tree, static_argnames=("budget", "max_candidates"))


def check_against_heap(logq, budget):
    start = jnp.array([5, 9], jnp.int32)
    tree = _jit_build(jnp.asarray(logq), jnp.array([3, 4], jnp.int32), start, budget=budget)
    for b in range(2):
        ref = heap_reference(logq[b], budget)
        got = tree_paths(tree, b)
        assert set(got) == set(ref), f"budget {budget}: tree differs from the heap reference"
        parents = np.asarray(tree.parents[b])
        depths = np.asarray(tree.depths[b])
        valid = np.asarray(tree.valid[b])
        assert parents[0] == -1 and depths[0] == 0 and valid[0]
        for i in np.nonzero(valid)[0][1:]:
            assert 0 <= parents[i] < i  # topological order
            assert depths[i] == depths[parents[i]] + 1
        np.testing.assert_array_equal(np.asarray(tree.positions[b]), int(start[b]) + depths)
        vis = np.asarray(bits_to_dense(tree.ancestor_bits, tree.size))[b]
        for i in range(tree.size):
            anc, j = {i}, i
            while valid[i] and parents[j] >= 0:
                j = parents[j]
                anc.add(j)
            assert set(np.nonzero(vis[i])[0]) == anc


@given(seed=st.integers(0, 2**31 - 1), quantized=st.booleans(), budget=st.sampled_from([1, 2, 7, 16, 33, 64]))
@settings(max_examples=30)
def test_tree_matches_heap(seed, quantized, budget):
    check_against_heap(draw_logq(seed, quantized), budget)


@pytest.mark.parametrize("budget", [1, 100, 256, 512])
def test_tree_matches_heap_large_budgets(budget):
    for quantized in (False, True):
        check_against_heap(draw_logq(budget, quantized), budget)


def test_budget_validation():
    logq = jnp.zeros((1, 3, 8))
    for bad in (0, -1, 2000, 1.5):
        with pytest.raises(ValueError, match="budget"):
            build_tree(logq, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), budget=bad)
    with pytest.raises(ValueError, match="candidates"):
        build_tree(logq, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), budget=4, max_candidates=0)


def test_chain_is_argmax_path():
    logq = draw_logq(1, False)
    tree = build_chain(jnp.asarray(logq), jnp.array([3, 4]), jnp.array([0, 0]))
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1:]), logq.argmax(-1))
    np.testing.assert_array_equal(np.asarray(tree.depths[0]), np.arange(D + 1))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 2100), k=st.integers(1, 16), levels=st.sampled_from([3, 50, 0]))
def test_two_stage_top_k_equals_lax_top_k(seed, n, k, levels):
    """Same values and indices as lax.top_k, ties (quantized values, -inf) to the lower index;
    n up to 2100 with chunks of 64 runs up to three stages."""
    from pallas_kernels.row_top_k import top_k

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 3, n)).astype(np.float32)
    if levels:
        x = np.round(x * levels) / levels
    x[rng.random(x.shape) < 0.05] = -np.inf
    k = min(k, n)
    want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
    for sort_max in (0, 16):  # the GPU routes make every stage of k <= 16 a sort (sort_top_k)
        got_v, got_i = top_k(jnp.asarray(x), k, chunk=64, staged=True, sort_max=sort_max)
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v), err_msg=f"sort_max {sort_max}")
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i), err_msg=f"sort_max {sort_max}")


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 1500), k=st.integers(1, 24), block=st.sampled_from([4, 8, 16]),
       levels=st.sampled_from([3, 50, 0]), staged=st.booleans())
def test_prefiltered_top_k_equals_lax_top_k(seed, n, k, block, levels, staged):
    """The block-max prefilter (the GPU form for long vocabulary rows) gives lax.top_k's values and
    indices: ties (quantized values, -inf, +0.0 against -0.0) to the lower index, rows that are not
    a multiple of the block, fewer blocks than k (plain top_k)."""
    from pallas_kernels.row_top_k import prefiltered_top_k

    from tests.tree_harness import tie_heavy_rows

    x = tie_heavy_rows(seed, (2, 3, n), levels)
    k = min(k, n)
    want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
    got_v, got_i = prefiltered_top_k(jnp.asarray(x), k, block=block, staged=staged)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    np.testing.assert_array_equal(np.signbit(np.asarray(got_v)), np.signbit(np.asarray(want_v)))
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))


def test_long_vocabulary_rows_take_the_prefilter():
    """With routes.prefilter_top_k (a GPU's routes), the build's vocabulary top-k of rows >=
    PREFILTER_MIN_RATIO * k * PREFILTER_BLOCK goes through the prefilter (one block-max reduce in
    the program) with the same candidates as lax.top_k; without it, no prefilter."""
    from ddtree_jax.speculative import build

    rng = np.random.default_rng(5)
    logq = jnp.asarray(np.round(rng.normal(size=(1, 2, 4096)) * 20) / 20, jnp.float32)
    want = jax.lax.top_k(logq, 4)
    for routes, used in ((Routes(), False), (Routes.resolve(impl="xla", platform="gpu"), True)):
        got = build._vocab_top_k(logq, 4, routes)
        jaxpr = str(jax.make_jaxpr(lambda x: build._vocab_top_k(x, 4, routes))(logq))
        assert ("reduce_max" in jaxpr) == used, routes
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("budget", [1, 2, 7, 16, 33, 64, 100, 256])
def test_gpu_beam_forms_build_the_same_tree(budget):
    """With a GPU's routes the beam selects by pairwise ranks (rows <= rank_select_max: budgets <= 33
    here) or by a staged top-k (longer rows: 64 / 100 / 256), where the reference runs one
    lax.top_k and a sort; the vocabulary top-k of k <= 16 is a sort, the final pick over all depths
    pairwise ranks when short. The tree must equal the reference's array for array, ties included."""
    gpu = Routes.resolve(impl="xla", platform="gpu")
    for quantized in (False, True):
        logq = jnp.asarray(draw_logq(budget + 1, quantized))
        args = (logq, jnp.array([3, 4], jnp.int32), jnp.array([5, 9], jnp.int32))
        cpu_form = jax.jit(lambda *a: build_tree(*a, budget=budget))(*args)
        gpu_form = jax.jit(lambda *a: build_tree(*a, budget=budget, routes=gpu))(*args)
        for name, want, got in zip(cpu_form._fields, cpu_form, gpu_form):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 40), levels=st.sampled_from([2, 5, 0]))
def test_sort_top_k_equals_lax_top_k(seed, k, levels):
    """The sort form of top-k (used on GPUs for k <= 16) gives lax.top_k's values and indices:
    ties (quantized values, -inf) to the lower index, -0.0 below +0.0. One padded shape."""
    from pallas_kernels.row_top_k import sort_top_k

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 3, 40)).astype(np.float32)
    if levels:
        x = np.round(x * levels) / levels
    x[rng.random(x.shape) < 0.1] = -np.inf
    x[rng.random(x.shape) < 0.1] = -0.0
    x[rng.random(x.shape) < 0.1] = 0.0
    want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
    got_v, got_i = jax.jit(sort_top_k, static_argnums=1)(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.signbit(np.asarray(got_v)), np.signbit(np.asarray(want_v)))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))


_select = jax.jit(select_in_index_order, static_argnums=1)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), width=st.integers(1, 40), levels=st.sampled_from([2, 5, 0]))
def test_select_in_index_order_equals_sorted_top_k(seed, width, levels):
    """The pairwise-rank selection picks lax.top_k's set (ties to the lower index, -inf included)
    in increasing index order (signed zeros ordered as lax.top_k orders them). One padded shape
    for all examples."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(3, 40)).astype(np.float32)
    if levels:
        x = np.round(x * levels) / levels
    x[rng.random(x.shape) < 0.1] = -np.inf
    want = np.sort(np.asarray(jax.lax.top_k(jnp.asarray(x), width)[1]), axis=-1)
    got = np.asarray(_select(jnp.asarray(x), width))
    np.testing.assert_array_equal(got, want)



@pytest.mark.parametrize("n", [1, 16, 33])
def test_all_visible_bits(n):
    """Every node sees every node (the drafter's block, a decode step's single query), and no bit
    past n is set."""
    from ddtree_jax.tree import all_visible_bits, bits_to_dense

    bits = all_visible_bits(2, n)
    assert bits.shape == (2, n, -(-n // 32)) and bits.dtype == jnp.uint32
    assert bool(jnp.all(bits_to_dense(bits, n)))
    assert int(jnp.sum(jax.lax.population_count(bits))) == 2 * n * n
