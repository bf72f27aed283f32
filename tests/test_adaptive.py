"""The adaptive budget's parts without a model: E(B) against brute force, the trees of smaller
budgets cut from one selection against build_tree, the choice against synthetic cost tables, the
calibration's convergence, and the step-time table's file format and errors."""

import dataclasses
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ddtree_jax.routes import REFERENCE, Routes
from ddtree_jax.speculative import choice, cost_table
from ddtree_jax.speculative.build import build_chain, build_tree, tree_candidates, tree_from_candidates
from ddtree_jax.speculative.choice import AR, DFLASH, FIRST_TREE, AutoBudget
from ddtree_jax.speculative.expected import chain_expectation, tree_expectations


def draw_logq(seed, shape, quantized, normalized=True):
    """Per-depth log-probs; quantized: few distinct values (ties within a depth), and with
    normalized=False rounded to quarters so prefix scores tie exactly (then not a distribution)."""
    rng = np.random.default_rng(seed)
    if quantized:
        logq = jax.nn.log_softmax(jnp.asarray(rng.integers(0, 4, size=shape).astype(np.float32)), axis=-1)
        return np.asarray(logq if normalized else jnp.round(logq * 4) / 4 - 0.25)
    return np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(size=shape).astype(np.float32) * 2), axis=-1))


def accepted(tree, row: int, seq) -> int:
    """Draft tokens the tree accepts when the target continues with seq: the deepest node on its path."""
    tokens, parents, valid = (np.asarray(x[row]) for x in (tree.tokens, tree.parents, tree.valid))
    node, n = 0, 0
    for tok in seq:
        nxt = [i for i in range(1, len(tokens)) if valid[i] and parents[i] == node and tokens[i] == tok]
        if not nxt:
            break
        node, n = nxt[0], n + 1
    return n


def brute_force(logq, row: int, tree) -> float:
    """E[accepted] over every continuation, drawn from the drafter's per-depth distribution."""
    depth, vocab = logq.shape[1:]
    probs = np.exp(logq[row].astype(np.float64))
    total = 0.0
    for seq in itertools.product(range(vocab), repeat=depth):
        p = np.prod([probs[d, t] for d, t in enumerate(seq)])
        total += p * accepted(tree, row, seq)
    return total


BUDGETS = (1, 3, 7, 12)


@functools.partial(jax.jit, static_argnames=("budgets",))
def _expectations(logq, budgets):
    c = tree_candidates(logq, budgets[-1])
    roots, start = jnp.array([0, 1], jnp.int32), jnp.array([4, 6], jnp.int32)
    trees = [tree_from_candidates(c, b, roots, start) for b in budgets]
    return tree_expectations(c, budgets), trees, chain_expectation(c.best), build_chain(logq, roots, start)


@pytest.mark.parametrize("depth, vocab", [(3, 3), (2, 5)])
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), quantized=st.booleans())
def test_expected_acceptance_equals_brute_force(depth, vocab, seed, quantized):
    """E(B) from the selection's scores = the expected accepted length of the top-B tree when the
    continuation follows the drafter's distribution (every sequence enumerated); the same for the
    DFlash chain."""
    logq = draw_logq(seed, (2, depth, vocab), quantized)
    e, trees, e_chain, chain = _expectations(jnp.asarray(logq), BUDGETS)
    for row in range(2):
        for j, tree in enumerate(trees):
            want = brute_force(logq, row, tree)
            assert abs(float(e[row, j]) - want) <= 1e-5 * max(1.0, want), (row, BUDGETS[j])
        want = brute_force(logq, row, chain)
        assert abs(float(e_chain[row]) - want) <= 1e-5 * max(1.0, want)
    assert np.all(np.diff(np.asarray(e), axis=1) >= -1e-6)  # a bigger tree never expects less


_jit_fixed = jax.jit(build_tree, static_argnames=("budget", "routes"))


@functools.partial(jax.jit, static_argnames=("budgets", "routes"))
def _cut(logq, roots, start, budgets, routes):
    c = tree_candidates(logq, budgets[-1], routes=routes)
    return [tree_from_candidates(c, b, roots, start, routes) for b in budgets]


@pytest.mark.parametrize("routes", [REFERENCE, Routes(rank_select_max=1024, staged_top_k=True, sort_top_k_max=16)],
                         ids=["reference", "gpu_xla_forms"])
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), quantized=st.booleans())
def test_trees_cut_from_one_selection_equal_build_tree(routes, seed, quantized):
    """The tree of every budget b cut from the selection at the largest budget is build_tree's at
    b, array for array (ties included), so an adaptive step verifies the fixed budget's tree."""
    budgets = (1, 4, 9, 16)
    logq = jnp.asarray(draw_logq(seed, (2, 5, 24), quantized, normalized=False))
    roots, start = jnp.array([3, 4], jnp.int32), jnp.array([5, 9], jnp.int32)
    for b, got in zip(budgets, _cut(logq, roots, start, budgets, routes)):
        want = _jit_fixed(logq, roots, start, budget=b, routes=routes)
        for name, w, g in zip(want._fields, want, got):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"budget {b}: {name}")


def test_fewer_real_prefixes_than_the_budget():
    """A drafter with -inf log-probs: fewer finite prefixes than the budget; E counts only them."""
    logq = np.full((1, 2, 4), -np.inf, np.float32)
    logq[0, 0, :2] = np.log([0.75, 0.25])
    logq[0, 1, 0] = 0.0
    c = tree_candidates(jnp.asarray(logq), 8)
    e = np.asarray(tree_expectations(c, (1, 2, 8)))[0]
    np.testing.assert_allclose(e, [0.75, 1.5, 2.0], rtol=1e-6)  # 0.75, + 0.75 (depth 2), + 0.25 (+ 0.25)
    assert int(np.asarray(c.valid).sum()) == 4


# ---- the choice and the calibration (choice.py) ---------------------------------------------
AUTO = AutoBudget(budgets=(4, 16), probe_wait=(16, 128), decide_every=0)
draft_next = jax.jit(choice.draft_next, static_argnums=0)
choose = jax.jit(choice.choose, static_argnums=0)
after_spec = jax.jit(choice.after_spec, static_argnums=0)
after_ar = jax.jit(choice.after_ar)


def state(ms, batch=2):
    return choice.init_state(AUTO, batch, 64, choice.TableArrays(np.asarray(ms, np.float32)[:, None], np.zeros(1),
                                                                 -np.ones(4), -np.ones(4)))


def test_choice_follows_the_cost_table():
    """With the same drafts, a cheap plain step wins before any draft (once a speculative step has
    taught E), cheap big trees win the speculative choice, a cheap chain wins it too."""
    left = jnp.full((2,), 100, jnp.int32)
    e_raw = jnp.asarray([[0, 2.0, 2.5, 3.5], [0, 1.0, 1.5, 2.0]], jnp.float32)
    for ms, want in (([1, 9, 9, 9], None), ([9, 9, 9, 1], FIRST_TREE + 1), ([9, 1, 9, 9], DFLASH),
                     ([9, 3, 3.1, 3.2], FIRST_TREE + 1)):
        a = state(ms)
        costs = choice.step_costs(AUTO, a, jnp.float32(0))
        assert bool(draft_next(AUTO, a, left, costs))  # nothing learned yet: draft
        c, e_cal = choose(AUTO, a, e_raw, left, costs)
        a = after_spec(AUTO, a, c, e_raw, e_cal, jnp.asarray([2, 1]), left, 0, costs)
        if want is None:  # plain steps cost 1 ms for 1 token a row: no draft (3.5 / 9 per row) beats that
            assert not bool(draft_next(AUTO, a, left, costs))
        else:
            assert int(c) == want and bool(draft_next(AUTO, a, left, costs))


def test_device_chunk_choice_blends_the_draft_with_the_rows_average():
    """In device chunks the choice values each draft at chunk_weight x its own calibrated E plus
    the rest of the rows' moving average (row_e): a draft whose E disagrees with the history
    steers a chunk less. The per-step policy values the draft alone; the returned E is the
    draft's either way (what the policy learns from)."""
    left = jnp.full((2,), 100, jnp.int32)
    e_raw = jnp.asarray([[0, 0, 0.2, 3.0]] * 2, jnp.float32)  # this draft: only budget 16 looks good
    history = jnp.asarray([[0, 0, 2.0, 0.5]] * 2, jnp.float32)  # the past: budget 4 accepted more
    for weight, auto, want in ((1.0, AUTO, FIRST_TREE + 1),
                               (0.25, dataclasses.replace(AUTO, decide_every=32, chunk_weight=0.25), FIRST_TREE),
                               (1.0, dataclasses.replace(AUTO, decide_every=32, chunk_weight=1.0), FIRST_TREE + 1)):
        a = state([9, 9, 1, 1])._replace(row_e=history, have_e=jnp.bool_(True))
        costs = choice.step_costs(auto, a, jnp.float32(0))
        c, e_cal = choose(auto, a, e_raw, left, costs)
        assert int(c) == want, weight
        np.testing.assert_allclose(e_cal, e_raw, rtol=1e-6)  # no calibration learned: ratio 1


def test_probes_after_plain_steps_and_backs_off():
    """Plain steps run until the wait ends, then one speculative step probes; while probes keep
    finding plain steps better, the wait doubles up to its cap. The wait keeps the probes' extra
    cost near probe_budget: here the cheapest draft costs 1.5x a plain step, 0.5 / 0.03 -> 17."""
    a = state([1, 1.5, 1.6, 1.7], batch=1)
    left = jnp.full((1,), 100, jnp.int32)
    costs = choice.step_costs(AUTO, a, jnp.float32(0))
    e_raw = jnp.asarray([[0, 0.1, 0.1, 0.1]], jnp.float32)
    waits, plain = [], 0
    for i in range(600):
        if bool(draft_next(AUTO, a, left, costs)):
            c, e_cal = choose(AUTO, a, e_raw, left, costs)
            a = after_spec(AUTO, a, c, e_raw, e_cal, jnp.asarray([0]), left, i, costs)
            waits.append(plain)
            plain = 0
        else:
            a = after_ar(a, left, i)
            plain += 1
    assert waits[:6] == [0, 17, 34, 68, 128, 128]
    # chosen on the host, a probe is an advance call of its own: its cost (here 3 plain steps) waits
    # too, (0.5 + 3) / 0.03 -> 117; chosen on device it costs no call
    host = dataclasses.replace(AUTO, decide_every=16, decide_on="host")
    dev = dataclasses.replace(AUTO, decide_every=0)
    chunks = dataclasses.replace(AUTO, decide_every=16, decide_on="device")
    calls = a._replace(call_ms=jnp.float32(3.0), have_e=jnp.bool_(True), gap=jnp.int32(1))
    for policy, wait in ((host, 117), (dev, 17), (chunks, 17)):
        assert not bool(choice._probe_due(policy, calls._replace(since=jnp.int32(wait - 1)), costs))
        assert bool(choice._probe_due(policy, calls._replace(since=jnp.int32(wait)), costs))
    cpu_like = state([1, 9, 9, 9], batch=1)  # drafting costs 9 plain steps: a probe waits 267 (cap 128)
    assert not bool(draft_next(AUTO, cpu_like._replace(have_e=jnp.bool_(True), since=jnp.int32(127)), left,
                               choice.step_costs(AUTO, cpu_like, jnp.float32(0))))


@pytest.mark.parametrize("true_ratio", [0.5, 1.4])
def test_calibration_converges_to_the_realised_acceptance(true_ratio):
    """Predicted E off by a constant factor (an over- or under-confident drafter): after a few
    dozen steps the calibrated E of the choice run matches the realised mean, and a choice never
    run takes the learned overall ratio."""
    rng = np.random.default_rng(0)
    rows = 16
    a = state([9, 1, 9, 9], batch=rows)  # the chain is cheapest: it runs every step
    left = jnp.full((rows,), 100, jnp.int32)
    costs = choice.step_costs(AUTO, a, jnp.float32(0))
    for i in range(60):
        e_raw = jnp.asarray(np.stack([np.zeros(rows), rng.uniform(1, 3, rows), np.full(rows, 3.0),
                                      np.full(rows, 4.0)], 1), jnp.float32)
        c, e_cal = choose(AUTO, a, e_raw, left, costs)
        real = rng.poisson(true_ratio * np.asarray(e_raw[:, DFLASH]))
        a = after_spec(AUTO, a, c, e_raw, e_cal, jnp.asarray(real), left, i, costs)
    assert int(c) == DFLASH
    test = jnp.asarray([[0, 2.0, 3.0, 4.0]], jnp.float32)
    e = np.asarray(choice.calibrated(AUTO, a, test))[0]
    assert abs(e[DFLASH] / 2.0 - true_ratio) < 0.15 * true_ratio
    assert abs(e[FIRST_TREE] / 3.0 - true_ratio) < 0.2 * true_ratio  # never run: the overall ratio
    s = choice.summary(AUTO, a)
    assert s["choices"] == {"dflash": 60} and s["trace"] == ["dflash"] * 60
    assert abs(s["acceptance"]["dflash"]["calibrated"] / s["acceptance"]["dflash"]["realised"] - 1) < 0.15


def test_objectives_differ_on_a_batch_with_a_slow_row():
    """One confident row and one weak one: the batch's tokens per ms favour drafting (5.2 tokens for
    2.5 ms against 2 for 1 ms), but the makespan (rows at their mean E, 1.6, plus the slower row's
    spread) keeps plain steps (batch 1: the same)."""
    e = jnp.asarray([[0.0, 3.0, 3.0, 3.0], [0.0, 0.2, 0.2, 0.2]], jnp.float32)
    left = jnp.full((2,), 100, jnp.int32)
    for objective, drafts in (("tokens", True), ("makespan", False)):
        auto = AutoBudget(budgets=(4, 16), objective=objective, ar_margin=0.0)
        a = state([1.0, 2.5, 2.5, 2.5])._replace(row_e=e, have_e=jnp.bool_(True))
        assert bool(draft_next(auto, a, left, choice.step_costs(auto, a, jnp.float32(0)))) == drafts, objective
    one = AutoBudget(budgets=(4, 16), objective="makespan", ar_margin=0.0)
    a = state([1.0, 2.5, 2.5, 2.5], batch=1)._replace(row_e=e[:1], have_e=jnp.bool_(True))
    assert bool(draft_next(one, a, left[:1], choice.step_costs(one, a, jnp.float32(0))))


def test_expected_max_normal_is_close_to_exact():
    """Blom's approximation against the exact expected maxima of n standard normals."""
    exact = {1: 0.0, 2: 0.5642, 4: 1.0294, 8: 1.4236, 16: 1.7660, 64: 2.3437}
    for n, want in exact.items():
        assert abs(float(choice.expected_max_normal(n)) - want) < 0.03, n
    assert float(choice.expected_max_normal(0)) == 0.0


def test_makespan_spread_keeps_plain_steps_at_a_large_batch():
    """Drafts predicted 3 tokens a row for 2.9 ms against plain steps' 1 for 1 ms: 3 % better by the
    mean rate, so batch 1 drafts; at batch 16 the slowest row needs ~z(16) = 1.77 spreads more
    steps than the mean (decision 0050: on the H200 fixed DDTree-16 took 60 steps where the rows'
    mean needed 40), so plain steps win; without the spread term (spread=0) it drafts."""
    for batch, spread, drafts in ((1, 1.0, True), (16, 1.0, False), (16, 0.0, True)):
        auto = AutoBudget(budgets=(4, 16), spread=spread)
        e = jnp.broadcast_to(jnp.asarray([0.0, 2.0, 2.0, 2.0], jnp.float32), (batch, 4))
        a = choice.init_state(auto, batch, 64, choice.TableArrays(
            np.asarray([[1.0], [2.9], [2.9], [2.9]], np.float32), np.zeros(1), -np.ones(4), -np.ones(4)))
        a = a._replace(row_e=e, have_e=jnp.bool_(True))
        left = jnp.full((batch,), 128, jnp.int32)
        got = bool(draft_next(auto, a, left, choice.step_costs(auto, a, jnp.float32(0))))
        assert got == drafts, (batch, spread)


def test_makespan_pools_the_rows_noisy_estimates():
    """Seven rows predicted 2.5 tokens and one unlucky draft's 0.1 (a row's E comes from a draft or
    two): the makespan values the batch at the rows' mean E, so it drafts (valued at the unlucky
    row alone, plain steps would win: 128 / 1.1 x 2 ms > 128 x 1 ms)."""
    auto = AutoBudget(budgets=(4, 16))
    e = jnp.asarray([[0.0, 2.5, 2.5, 2.5]] * 7 + [[0.0, 0.1, 0.1, 0.1]], jnp.float32)
    a = choice.init_state(auto, 8, 64, choice.TableArrays(
        np.asarray([[1.0], [2.0], [2.0], [2.0]], np.float32), np.zeros(1), -np.ones(4), -np.ones(4)))
    a = a._replace(row_e=e, have_e=jnp.bool_(True))
    left = jnp.full((8,), 128, jnp.int32)
    assert bool(draft_next(auto, a, left, choice.step_costs(auto, a, jnp.float32(0))))


def test_forced_choice_overrides():
    a = state([1, 9, 9, 9])._replace(force=jnp.int32(FIRST_TREE))
    left = jnp.full((2,), 100, jnp.int32)
    costs = choice.step_costs(AUTO, a, jnp.float32(0))
    assert bool(draft_next(AUTO, a, left, costs))
    assert int(choose(AUTO, a, jnp.zeros((2, 4)), left, costs)[0]) == FIRST_TREE
    assert not bool(draft_next(AUTO, a._replace(force=jnp.int32(AR)), left, costs))


def test_cost_table_interpolates_in_context():
    ms = np.asarray([[1.0, 2.0], [2.0, 2.0], [3.0, 5.0], [4.0, 8.0]], np.float32)
    a = choice.init_state(AUTO, 1, 8, choice.TableArrays(ms, np.asarray([1000.0, 3000.0]), -np.ones(4), -np.ones(4)))
    for ctx, want in ((0.0, ms[:, 0]), (2000.0, ms.mean(1)), (9000.0, ms[:, 1])):
        np.testing.assert_allclose(np.asarray(choice.step_costs(AUTO, a, jnp.float32(ctx))), want, rtol=1e-6)
    no_ar = AutoBudget(budgets=(4, 16), ar=False)
    assert np.isinf(np.asarray(choice.step_costs(no_ar, a, jnp.float32(0)))[AR])


def test_population_expectation_and_joining_rows():
    """pop_e: the mean over the active rows of a speculative step's calibrated E, then decayed by
    `decay` per step (a table's measured acceptance seeds it); a row joining a running batch starts
    from it (choice.joining); clear_statistics zeroes the statistics and keeps the policy's state."""
    a = state([1, 2, 2, 2], batch=3)
    assert not bool(a.have_e) and not np.asarray(a.pop_e).any()
    left = jnp.asarray([100, 100, 0], jnp.int32)  # row 2 is done
    costs = choice.step_costs(AUTO, a, jnp.float32(0))
    pops = []
    for i, e_raw in enumerate(([[0, 1.0, 2.0, 3.0], [0, 3.0, 4.0, 5.0], [0, 9, 9, 9]],
                               [[0, 2.0, 2.0, 2.0], [0, 1.0, 1.0, 1.0], [0, 9, 9, 9]])):
        e_raw = jnp.asarray(e_raw, jnp.float32)
        c, e_cal = choose(AUTO, a, e_raw, left, costs)
        a = after_spec(AUTO, a, c, e_raw, e_cal, jnp.asarray([1, 2, 0]), left, i, costs)
        pops.append(np.asarray(choice.calibrated(AUTO, a, e_raw))[:2].mean(0))
    np.testing.assert_allclose(np.asarray(a.pop_e), AUTO.decay * pops[0] + (1 - AUTO.decay) * pops[1], rtol=1e-6)
    joined = choice.joining(a, state([1, 2, 2, 2], batch=1))
    np.testing.assert_array_equal(np.asarray(joined.row_e), np.asarray(a.pop_e)[None])
    cleared = choice.clear_statistics(a)
    assert not np.asarray(cleared.n_steps).any() and not np.asarray(cleared.sum_real).any()
    assert (np.asarray(cleared.trace) == -1).all() and np.asarray(a.n_steps).sum() == 2
    for f in ("real", "pred", "all_real", "pop_e", "row_e", "have_e", "since", "gap"):
        np.testing.assert_array_equal(np.asarray(getattr(cleared, f)), np.asarray(getattr(a, f)))
    seeded = choice.init_state(AUTO, 2, 8, choice.TableArrays(np.ones((4, 1), np.float32), np.zeros(1),
                                                              -np.ones(4), np.asarray([-1, 1.5, 2.0, 2.5])))
    assert bool(seeded.have_e)
    np.testing.assert_array_equal(np.asarray(seeded.pop_e), [0, 1.5, 2.0, 2.5])


def test_bad_settings_are_named():
    assert AutoBudget(budgets=(8, 4)).problems() and AutoBudget(budgets=()).problems()
    assert AutoBudget(ar_burst=0).problems() and AutoBudget(probe_wait=(4, 2)).problems()
    assert any("spread" in p for p in AutoBudget(spread=-1.0).problems())
    assert not AutoBudget().problems()


# ---- the step-time table's file ---------------------------------------------------------------
MODEL = {"fingerprint": "abc", "target": "tiny"}


def table(batch=1, **ms):
    return cost_table.CostTable(batch, (128.0,), {k: (v,) for k, v in ms.items()}, "test")


def test_cost_table_file_round_trip_and_merge(tmp_path):
    path = tmp_path / "costs.json"
    one = dataclasses.replace(table(1, ar=0.3, dflash=0.5, **{"4": 0.6, "16": 0.7}), ratios={"dflash": 1.5},
                              accepted={"dflash": 2.0, "16": 3.0}, call_ms=1.25)
    cost_table.save(path, one, device="dev", model=MODEL)
    cost_table.save(path, table(8, ar=0.4, dflash=1.0, **{"4": 1.1, "16": 1.5}), device="dev", model=MODEL)
    got = cost_table.load(path, 1, device="dev", model=MODEL)
    assert got.ms == one.ms and got.contexts == (128.0,) and str(path) in got.source
    assert set(json.loads(path.read_text())["tables"]) == {"1", "8"}
    assert got.ratios == one.ratios and got.accepted == one.accepted
    assert got.call_ms == 1.25 and float(got.arrays(AUTO).call_ms) == 1.25
    ms, ctx, ratios, accepted, _ = got.arrays(AUTO)
    assert ms.shape == (4, cost_table.POINTS) and ctx.shape == (cost_table.POINTS,)
    np.testing.assert_allclose(ms[:, -1], [0.3, 0.5, 0.6, 0.7])
    np.testing.assert_allclose(ratios, [-1, 1.5, -1, -1])
    np.testing.assert_allclose(accepted, [-1, 2.0, -1, 3.0])
    # the measured ratio as `prior` tokens of evidence for the chain and the global ratio (shrunk to 1
    # by global_prior): global (6 + 1) / (4 + 1) = 1.4, chain (6 + 4 x 1.4) / (4 + 4) = 1.45
    a = choice.init_state(AUTO, 2, 8, got.arrays(AUTO))
    np.testing.assert_allclose(np.asarray(choice.calibrated(AUTO, a, jnp.ones((1, 4))))[0, 1:], [1.45, 1.4, 1.4],
                               rtol=1e-6)
    assert not bool(a.have_e)  # budget 4's acceptance is unknown: the first step drafts
    cost_table.save(path, one, device="other", model=MODEL)  # another device: the file starts over
    assert set(json.loads(path.read_text())["tables"]) == {"1"}


def test_cost_table_mismatches_are_errors(tmp_path):
    path = tmp_path / "costs.json"
    cost_table.save(path, table(1, ar=0.3, dflash=0.5, **{"4": 0.6}), device="dev", model=MODEL)
    with pytest.raises(ValueError) as e:
        cost_table.load(path, 4, device="gpu2", model={"fingerprint": "xyz"})
    msg = str(e.value)
    assert "measured on 'dev'" in msg and "another model" in msg and "no table for batch 4 (batches: [1])" in msg
    with pytest.raises(ValueError, match=r"no times for \['16'\]"):
        cost_table.load(path, 1, device="dev", model=MODEL).arrays(AUTO)
    with pytest.raises(ValueError, match="does not exist"):
        cost_table.load(tmp_path / "none.json", 1, device="dev", model=MODEL)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not readable JSON"):
        cost_table.load(tmp_path / "bad.json", 1, device="dev", model=MODEL)
    # a table records the auto program it timed: another form's program is refused, an unrecorded one taken
    chunks = dataclasses.replace(AUTO, decide_every=32, decide_on="device")
    assert (AUTO.form, chunks.form) == ("per step", "device chunks of 32")
    assert dataclasses.replace(AUTO, decide_every=16, decide_on="host").form == "host chunks of 16"
    cost_table.save(path, dataclasses.replace(table(1, ar=0.3), program=chunks.form), device="dev", model=MODEL)
    assert cost_table.load(path, 1, device="dev", model=MODEL, program=chunks.form).program == chunks.form
    with pytest.raises(ValueError, match="measured for auto device chunks of 32, this run is auto per step"):
        cost_table.load(path, 1, device="dev", model=MODEL, program=AUTO.form)
    cost_table.save(path, table(1, ar=0.3), device="dev", model=MODEL)
    assert cost_table.load(path, 1, device="dev", model=MODEL, program=AUTO.form).program == ""


def test_carried_over_calibration_replaces_only_what_was_learned():
    """choice.carried_over: a scored choice's ratio becomes its realised / predicted sums; a
    speculative choice's accepted count becomes the population's E; plain steps and choices never
    scored keep the table's values."""
    from ddtree_jax.speculative.choice import TableArrays, carried_over

    table = TableArrays(np.ones((4, 8), np.float32), np.zeros((8,), np.float32),
                        np.asarray([-1, 1.2, 1.1, 1.3], np.float32), np.asarray([-1, 1.5, 1.7, 2.0], np.float32), 0.5)
    out = carried_over(table, real=[0, 3.0, 0, 8.0], pred=[0, 2.0, 0, 4.0], pop_e=[0, 1.8, 0, 2.4])
    np.testing.assert_allclose(out.ratios, [-1, 1.5, 1.1, 2.0])
    np.testing.assert_allclose(out.accepted, [-1, 1.8, 1.7, 2.4])
    assert out.ms is table.ms and out.call_ms == table.call_ms
