"""budget="auto" chosen once a generation by the host (decide_on "generation",
speculative/generation_choice.py): the choice follows the table and what generations realised,
a choice never run follows the others' correction, plain runs are probed, a table lacking what
the form needs is refused by name; end to end the Engine runs the chosen choice's own fixed
program (equal to plain decoding, streamed alike), reports it, and carries what it learned."""

import numpy as np
import pytest

from ddtree_jax.speculative.choice import AR, DFLASH, FIRST_TREE, AutoBudget
from ddtree_jax.speculative.cost_table import CostTable
from ddtree_jax.speculative.generation_choice import GenerationPolicy

AUTO = AutoBudget(budgets=(4, 8), decide_on="generation")
LEFT = np.full((1,), 127)


def table(ms, accepted, batch=1):
    """A table of one context: ms of ar, dflash, 4, 8; accepted draft tokens of dflash, 4, 8."""
    names = ("ar", "dflash", "4", "8")
    return CostTable(batch, (64.0,), {n: (m,) for n, m in zip(names, ms)}, "test",
                     accepted=dict(zip(names[1:], accepted)))


def test_the_choice_follows_the_table():
    """Plain decoding where drafts do not pay for their steps, the best draft where they do."""
    cheap_plain = GenerationPolicy.start(AUTO, table([1.0, 3.0, 3.0, 3.2], [0.5, 0.8, 1.0]))
    assert cheap_plain.choose(LEFT, 64.0) == (AR, False)
    trees = GenerationPolicy.start(AUTO, table([1.0, 2.0, 2.0, 2.1], [0.8, 1.5, 2.5]))
    assert trees.choose(LEFT, 64.0) == (FIRST_TREE + 1, False)
    chain = GenerationPolicy.start(AUTO, table([1.0, 1.5, 2.0, 2.1], [2.0, 1.5, 2.5]))
    assert chain.choose(LEFT, 64.0) == (DFLASH, False)


def test_the_makespan_spread_keeps_plain_steps_at_a_large_batch():
    """A draft 3 % better than plain decoding by the mean rate wins at batch 1 and loses at batch
    16, where the slowest of 16 rows sets the time (AutoBudget.spread); spread 0 drafts again."""
    t = table([1.0, 9.0, 1.94, 9.0], [0.0, 1.0, 0.0])
    assert GenerationPolicy.start(AUTO, t).choose(LEFT, 64.0)[0] == FIRST_TREE
    sixteen = np.full((16,), 127)
    assert GenerationPolicy.start(AUTO, t).choose(sixteen, 64.0)[0] == AR
    no_spread = AutoBudget(budgets=(4, 8), decide_on="generation", spread=0.0)
    assert GenerationPolicy.start(no_spread, t).choose(sixteen, 64.0)[0] == FIRST_TREE


def test_learning_moves_the_run_choice_and_the_others_with_it():
    """A choice that realised twice the table's acceptance is valued near what it realised; a
    choice never run moves by the global ratio; both converge as generations accumulate."""
    p = GenerationPolicy.start(AUTO, table([1.0, 2.0, 2.0, 2.1], [0.5, 1.0, 1.2]))
    before = p.expected()
    p.learn(FIRST_TREE, accepted=200.0, row_steps=100.0)  # 2.0 a row-step against the table's 1.0
    after = p.expected()
    assert after[AR] == 0.0
    assert 1.9 < after[FIRST_TREE] < 2.0
    ratio = after[DFLASH] / before[DFLASH]
    assert 1.9 < ratio < 2.0 and after[FIRST_TREE + 1] / before[FIRST_TREE + 1] == pytest.approx(ratio)
    for _ in range(20):  # then it realises 1.5: the decayed sums follow
        p.learn(FIRST_TREE, accepted=150.0, row_steps=100.0)
    assert abs(p.expected()[FIRST_TREE] - 1.5) < 0.05


def test_plain_generations_are_probed():
    """After a run of plain generations the best draft runs once (a probe), at a wait that grows
    with its predicted loss, within probe_wait; a draft generation restarts the count."""
    auto = AutoBudget(budgets=(4, 8), decide_on="generation", probe_wait=(3, 40), probe_budget=0.05)
    p = GenerationPolicy.start(auto, table([1.0, 3.0, 2.0, 2.2], [0.2, 0.9, 1.0]))
    picks = []
    for _ in range(40):
        c, probe = p.choose(LEFT, 64.0)
        picks.append((c, probe))
        p.learn(c, accepted=0.9 * 100 if c != AR else 0.0, row_steps=100.0)
    probes = [i for i, (c, probe) in enumerate(picks) if probe]
    assert probes and all(picks[i][0] == FIRST_TREE for i in probes)
    assert all(c == AR for i, (c, probe) in enumerate(picks) if i not in probes)
    gaps = np.diff([-1] + probes)
    assert np.all(gaps >= 4) and np.all(gaps <= 41)  # 3 to 40 plain generations between probes


def test_a_table_without_acceptance_is_refused_by_name():
    """The form needs each draft choice's measured acceptance (and every choice's time): one error
    naming all that is missing and how to get a table that has it."""
    t = CostTable(1, (64.0,), {"ar": (1.0,), "dflash": (2.0,), "4": (2.0,)}, "old.json", accepted={"4": 1.0})
    with pytest.raises(ValueError) as e:
        GenerationPolicy.start(AUTO, t)
    msg = str(e.value)
    assert "old.json" in msg and "no step times for ['8']" in msg
    assert "no measured acceptance for ['dflash', '8']" in msg
    assert "--decide-on generation" in msg


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from ddtree_jax.engine import Engine
    from tests.cli_fixtures import write_drafter, write_target

    root = tmp_path_factory.mktemp("generation_choice")
    return Engine.load(write_target(str(root / "target")), write_drafter(str(root / "drafter")))


def test_engine_runs_the_chosen_program_and_learns(engine, monkeypatch):
    """Engine.generate(decide_on="generation"): the choices' programs compile on worker threads
    (as a host of 8 cores does); the start-up table times each choice's own program; the output
    equals plain decoding, streamed or not; the statistics name the form, the one choice and its
    steps; the next generation starts from what this one learned; with a table that makes a tree
    cheap the tree runs, still equal to plain decoding."""
    import ddtree_jax.engine as eng

    monkeypatch.setattr(eng.os, "cpu_count", lambda: 8)
    prompt = [[5, 6, 7, 8], [9, 10, 11]]
    ref = engine.generate(prompt, mode="ar", max_new_tokens=12)
    got = engine.generate(prompt, auto_budgets=(2,), max_new_tokens=12, decide_on="generation")
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    a = got[0].stats.adaptive
    assert a["form"] == "per generation" and a["cost_table"]["program"] == "per generation"
    assert "each choice's own program" in a["cost_table"]["source"] and a["calibration_seconds"] > 0
    assert set(a["cost_table"]["accepted"]) == {"dflash", "2"} and a["cost_table"]["ratios"] == {}
    [(name, steps)] = a["choices"].items()
    assert steps == got[0].stats.steps == len(a["trace"]) and a["calibration_from"] == "the table"
    streamed = {0: [], 1: []}
    again = engine.generate(prompt, auto_budgets=(2,), max_new_tokens=12, decide_on="generation",
                            stream=lambda r, ids: streamed[r].extend(ids), stream_every=2)
    assert [c.token_ids for c in again] == [c.token_ids for c in ref] == [streamed[0], streamed[1]]
    assert again[0].stats.adaptive["calibration_from"] == "the earlier generations of this program"
    tree_wins = CostTable(2, (64.0,), {"ar": (50.0,), "dflash": (9.0,), "2": (1.0,)}, "synthetic",
                          accepted={"dflash": 0.1, "2": 0.5}, program="per generation")
    tree = engine.generate(prompt, auto_budgets=(2,), max_new_tokens=12, decide_on="generation",
                           cost_table=tree_wins)
    assert [c.token_ids for c in tree] == [c.token_ids for c in ref]
    t = tree[0].stats.adaptive
    assert list(t["choices"]) == ["2"] and t["acceptance"]["2"]["predicted"] == pytest.approx(0.5, rel=0.2)


def test_default_form_by_device_and_size(engine, monkeypatch):
    """decide_on None: once a generation on a GPU for a small target, device chunks on a CPU or
    for a target of GENERATION_FORM_MAX_BYTES and more."""
    import ddtree_jax.engine as eng

    assert engine.default_decide_on is None  # this CPU
    monkeypatch.setattr(eng.jax, "default_backend", lambda: "gpu")
    assert engine.default_decide_on == "generation"
    assert engine.auto_budget().form == "per generation"
    assert engine.auto_budget(decide_on="device").form == "device chunks of 32"
    monkeypatch.setattr(eng, "GENERATION_FORM_MAX_BYTES", 1)
    assert engine.default_decide_on is None


def test_cli_names_decide_every_without_effect(engine, capsys):
    """--decide-every with --decide-on generation has no effect: a named error, nothing printed."""
    from ddtree_jax.cli import generate as cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--prompt", "x", "--decide-on", "generation", "--decide-every", "4"])
    captured = capsys.readouterr()
    assert e.value.code == 2 and "--decide-every has no effect with --decide-on generation" in captured.err
    assert captured.out == ""
