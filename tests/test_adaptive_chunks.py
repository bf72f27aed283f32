"""budget="auto" chosen once per chunk of decide_every steps (AutoBudget.decide_every > 0).

On the host (decide_on "host"): one program per choice, none with a data-dependent conditional per
step; the policy's plan read between chunks; output equal to plain decoding whatever the plan; the
choice following the cost table; the calibration still learning every budget's E. On device
(decide_on "device"): one program, a chunk's draft scored and chosen from, then the choice's
fixed-budget loop; lossless, following the table, probes of one step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.choice import AR, DFLASH, FIRST_TREE, summary
from ddtree_jax.speculative.sampling import Sampling
from tests.test_adaptive_generate import AUTO, MIXED, NEW, check_features, costs, oracle, setup

CHUNKED = dataclasses.replace(AUTO, decide_every=5, decide_on="host")


def run_planned(name, ms, auto=CHUNKED):
    """A generation driven as the Engine drives it: read the plan, run its choice's program for
    its steps. Returns (final state, [(choice, steps asked, steps run)] per chunk)."""
    cfg, gd, params, prompt, lens, ref, table = setup(name)
    proposer = oracle(cfg)
    spec = gen.GenSpec("ddtree", auto, None, NEW, Sampling(), 0, proposer)
    programs = gen.choice_programs(spec)
    s = gen.start(gd, params, table, prompt, lens, None, jax.random.PRNGKey(0), spec, costs=costs(ms))
    chunks = []
    while not bool(np.asarray(s.done).all()):
        c, n = (int(x) for x in np.asarray(s.adapt.plan))
        i0 = int(s.i)
        s = gen.advance(gd, params, table, s, None, jnp.int32(n), programs[c])
        chunks.append((c, n, int(s.i) - i0))
    return s, chunks


def test_each_choice_has_its_own_program_without_conditionals():
    """choice_programs: one GenSpec per enabled choice, each running that choice at every step: no
    cond / switch in its advance (the per-step auto program has them); a plain chunk is one burst."""
    cfg, gd, params, prompt, lens, ref, table = setup("qwen3_5")
    proposer = oracle(cfg)
    spec = gen.GenSpec("ddtree", CHUNKED, None, NEW, Sampling(), 0, proposer)
    programs = gen.choice_programs(spec)
    assert sorted(programs) == [AR, DFLASH, FIRST_TREE, FIRST_TREE + 1]
    assert programs[AR].budget.ar_burst == CHUNKED.decide_every and programs[DFLASH].budget.ar_burst == AUTO.ar_burst
    assert gen.choice_programs(dataclasses.replace(spec, budget=AUTO.program(AR))) == {}
    s = gen.start(gd, params, table, prompt, lens, None, jax.random.PRNGKey(0), spec, costs=costs(MIXED))

    def text(program):
        return str(jax.make_jaxpr(lambda st: gen._advance_from(gd, params, table, st, None, jnp.int32(4),
                                                                program))(s))

    assert "cond[" in text(dataclasses.replace(spec, budget=dataclasses.replace(CHUNKED, decide_every=0)))
    for c, program in programs.items():
        assert "cond[" not in text(program), f"choice {c}"


@pytest.mark.slow  # ~31 s: host-planned chunks (decide_on "host", not a default); device chunks are checked below
def test_planned_chunks_equal_plain_decoding():
    """The oracle with errors under three tables: the tokens are plain greedy decoding's; the
    chunks follow the table (cheap plain steps: plain chunks but for one-step probes; cheap big
    trees: budget 8 throughout); the drafter's features stay in step."""
    cfg, gd, params, prompt, lens, ref, table = setup("qwen3_5")
    for ms in (MIXED, [0.2, 5, 5, 5], [9, 5, 5, 1]):
        s, chunks = run_planned("qwen3_5", ms)
        np.testing.assert_array_equal(np.asarray(s.out), ref, err_msg=str(ms))
        check_features("qwen3_5", oracle(cfg), s, table)
        st = summary(CHUNKED, s.adapt)
        assert sum(st["choices"].values()) == int(s.steps.max())
        assert all(n in (1, CHUNKED.decide_every) for _, n, _ in chunks)
        if ms == [0.2, 5, 5, 5]:
            assert st["choices"]["ar"] >= 0.8 * sum(st["choices"].values())
            assert all(n == 1 for c, n, _ in chunks if c != AR)  # drafts here are one-step probes
        if ms == [9, 5, 5, 1]:
            assert set(st["choices"]) == {"8"}
            # every budget's E learned while budget 8 ran: the rows' averaged E covers each choice
            assert np.all(np.asarray(s.adapt.row_e)[:, DFLASH:] > 0)


def test_choice_programs_only_when_the_host_decides():
    """Chosen on device (every step, or once a chunk: one program), no per-choice programs; chosen
    by the host, one per enabled choice."""
    from ddtree_jax.speculative.choice import AutoBudget

    for device in (AutoBudget(decide_every=0), AutoBudget(decide_every=16, decide_on="device")):
        assert gen.choice_programs(gen.GenSpec("ddtree", device, None, NEW, Sampling(), 0, None)) == {}
    spec = gen.GenSpec("ddtree", AutoBudget(decide_every=16, decide_on="host"), None, NEW, Sampling(), 0, None)
    assert len(gen.choice_programs(spec)) == 2 + len(AutoBudget().budgets)
    no_ar = AutoBudget(decide_every=16, decide_on="host", ar=False, dflash=False)
    assert sorted(gen.choice_programs(gen.GenSpec("ddtree", no_ar, None, NEW, Sampling(), 0, None))) == [
        FIRST_TREE + j for j in range(len(no_ar.budgets))]


DEVICE_CHUNKS = dataclasses.replace(AUTO, decide_every=5, decide_on="device")


def test_device_chunks_equal_plain_decoding_and_follow_the_table():
    """Chosen on device once per chunk of 5 (a deciding step, then the choice's fixed-budget steps):
    greedy output is plain decoding's under the policy's own choices and with every choice forced;
    the drafter's features stay in step; every step is counted once; under cheap big trees a chunk
    decides (and learns) once; under cheap plain steps a probe that confirms them is one step, not
    a chunk of drafts."""
    from tests.test_adaptive_generate import CHOICES, run_auto

    cfg, gd, params, prompt, lens, ref, table = setup("qwen3_5")
    proposer = oracle(cfg)
    # force size + c: choice c in one-step chunks (the step-time table's calibration pass)
    calibrating = [(MIXED, DEVICE_CHUNKS.size + c) for c in (DFLASH, FIRST_TREE + 1)]
    for ms, force in [(MIXED, -1), ([0.2, 5, 5, 5], -1), ([9, 5, 5, 1], -1)] + [(MIXED, c) for c in CHOICES] + \
            calibrating:
        res = run_auto(gd, params, prompt, lens, proposer, table, ms, force, auto=DEVICE_CHUNKS)
        np.testing.assert_array_equal(np.asarray(res.out), ref, err_msg=f"{ms} force {force}")
        check_features("qwen3_5", proposer, res, table)
        st = summary(DEVICE_CHUNKS, res.adapt)
        steps = int(res.steps.max())
        assert sum(st["choices"].values()) == steps
        if force >= 0:
            name = DEVICE_CHUNKS.names[force % DEVICE_CHUNKS.size]
            assert set(st["choices"]) == {name}
            a = st["acceptance"][name]
            if force >= DEVICE_CHUNKS.size:  # every draft scored
                assert a["scored_row_steps"] == a["row_steps"] == int(np.sum(np.asarray(res.steps)))
            else:
                assert a["scored_row_steps"] < a["row_steps"]
        if ms == [9, 5, 5, 1]:
            assert set(st["choices"]) == {"8"}
            # only a chunk's first step is scored; the first chunk (nothing learned yet) is one step
            deciding = st["acceptance"]["8"]["scored_row_steps"]
            assert st["acceptance"]["8"]["row_steps"] == int(np.sum(np.asarray(res.steps)))  # every row-step
            assert deciding <= 2 * (1 + -(-(steps - 1) // DEVICE_CHUNKS.decide_every))
            assert np.all(np.asarray(res.adapt.row_e)[:, DFLASH:] > 0)  # every budget's E learned
        if ms == [0.2, 5, 5, 5]:
            trace = st["trace"]
            assert trace.count("ar") >= 0.8 * steps
            runs = "".join("a" if c == "ar" else "s" for c in trace).split("a")
            assert max(len(r) for r in runs[1:]) <= 1, trace  # after the first, drafts are lone probes


@pytest.mark.slow  # ~25 s; the default run keeps test_each_choice_has_its_own_program_without_conditionals
def test_device_chunks_are_one_program_with_fixed_budget_steps():
    """The device-chunk program: one advance for every choice (no per-choice programs), whose lean
    loops run each speculative choice's fixed-budget step; it stops where the call's steps end."""
    from tests.test_adaptive_generate import costs as table_costs

    cfg, gd, params, prompt, lens, ref, table = setup("qwen3_5")
    proposer = oracle(cfg)
    spec = gen.GenSpec("ddtree", DEVICE_CHUNKS, None, NEW, Sampling(), 0, proposer)
    assert gen.choice_programs(spec) == {}
    s = gen.start(gd, params, table, prompt, lens, None, jax.random.PRNGKey(0), spec, costs=table_costs([9, 5, 5, 1]))
    seen = []
    for steps in (1, 3, 7):
        s = gen.advance(gd, params, table, s, None, jnp.int32(steps), spec)
        seen.append(int(s.i))
    assert seen == [1, 4, 11]


def test_device_chunks_go_on_across_calls():
    """A generation streamed in calls of 2 steps scores the same chunks as one call (a chunk the
    call's end cuts short goes on unscored in the next: AdaptiveState.plan), with the same tokens,
    choices and statistics; under cheap plain steps the plain bursts go on the same way."""
    from tests.test_adaptive_generate import costs as table_costs

    cfg, gd, params, prompt, lens, ref, table = setup("qwen3_5")
    proposer = oracle(cfg)
    spec = gen.GenSpec("ddtree", DEVICE_CHUNKS, None, NEW, Sampling(), 0, proposer)
    for ms in ([9, 5, 5, 1], [0.2, 5, 5, 5]):
        runs = {}
        for per_call in (2**30, 2):
            s = gen.start(gd, params, table, prompt, lens, None, jax.random.PRNGKey(0), spec, costs=table_costs(ms))
            calls = 0
            while not bool(np.asarray(s.done).all()):
                s = gen.advance(gd, params, table, s, None, np.int32(per_call), spec)
                calls += 1
            runs[per_call] = (s, calls)
        (one, _), (streamed, calls) = runs[2**30], runs[2]
        assert calls > 5
        np.testing.assert_array_equal(np.asarray(streamed.out), ref)
        a, b = summary(DEVICE_CHUNKS, one.adapt), summary(DEVICE_CHUNKS, streamed.adapt)
        assert a == b, ms
