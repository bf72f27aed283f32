"""scripts.adaptive_bench: the simulation's bookkeeping on a hand-made trace (exact figures), its
tables from scripts.bench.e2e reports (contexts across files), and the whole script at CPU sizes."""

import json

import numpy as np

import pytest

from scripts import adaptive_bench as ab
from scripts import adaptive_simulate as sim


def trace(rows):
    return {"choices": ["ar", "dflash", "4", "16"], "budgets": [4, 16], "ar_burst": 4, "max_new_tokens": 11,
            "rows": rows}


def row(n, acc16, e16):
    return {"prompt_len": 100, "positions": n, "e": [[0.0, 0.5, 0.8, e16]] * n,
            "accepted": [[0, 0, 1, acc16]] * n}


def test_fixed_policies_count_steps_and_time_exactly():
    """One row of 10 positions: plain takes 10 steps, budget 16 accepting 1 a step takes 5, DFlash
    accepting none 10; tokens = 11 (the prefill's and one a position)."""
    tr = trace([row(10, 1, 1.0)])
    ms = {"ar": [1.0], "dflash": [2.0], "4": [2.0], "16": [3.0]}
    res = sim.run_simulation(tr, {1: ([0.0], ms, {})}, [1], None)["1"]["policies"]
    assert res["ar"]["steps"] == {"ar": 10} and abs(res["ar"]["tokens_per_s"] - 1000 * 11 / 10) < 1e-6
    assert res["16"]["steps"] == {"16": 5} and abs(res["16"]["tokens_per_s"] - 1000 * 11 / 15) < 1e-6
    assert res["dflash"]["steps"] == {"dflash": 10}
    assert sum(res["auto"]["steps"].values()) >= 5


def test_auto_chosen_once_a_generation_learns_what_the_table_understated():
    """--decide-on generation: each batch is one generation of one choice. The table says budget 16
    accepts 0.2 a step, so the first generations are plain; after probe_wait's 8 the ninth probes 16,
    which realises 1 a step, and every later generation runs 16 (the trace's best)."""
    tr = trace([row(10, 1, 1.0)])
    ms = {"ar": [1.0], "dflash": [9.0], "4": [9.0], "16": [1.5]}
    measured = {"accepted": {"dflash": 0.0, "4": 0.1, "16": 0.2}}
    res = sim.run_simulation(tr, {1: ([0.0], ms, measured)}, [1], None, decide_on="generation",
                            policy={"probe_budget": 1.0}, passes=9)["1"]
    assert res["best_fixed"] == "16"
    steps = res["policies"]["auto"]["steps"]
    assert steps["ar"] == 10 * 8 and steps["16"] == 5  # 8 plain generations (probe_wait 8), then the probe
    longer = sim.run_simulation(tr, {1: ([0.0], ms, measured)}, [1], None, decide_on="generation",
                               policy={"probe_budget": 1.0}, passes=20)["1"]["policies"]["auto"]["steps"]
    assert longer == {"ar": 80, "16": 5 * 12}


def test_a_trace_truncated_to_shorter_generations():
    """--max-new-tokens: each row's first max_new - 1 positions (a row that ended sooner keeps its
    own), so plain decoding of 6 tokens takes 5 steps; a length the trace lacks is a named error."""
    tr = sim.truncated(trace([row(10, 1, 1.0), row(3, 1, 1.0)]), 6)
    assert tr["max_new_tokens"] == 6 and [r["positions"] for r in tr["rows"]] == [5, 3]
    assert [len(r["e"]) for r in tr["rows"]] == [5, 3] and [len(r["accepted"]) for r in tr["rows"]] == [5, 3]
    ms = {"ar": [1.0], "dflash": [2.0], "4": [2.0], "16": [3.0]}
    res = sim.run_simulation(tr, {1: ([0.0], ms, {})}, [1], None)["1"]["policies"]
    assert res["ar"]["steps"] == {"ar": 8}  # 5 + 3: the two rows one after the other at batch 1
    for bad in (1, 12):
        with pytest.raises(ValueError, match="max-new-tokens"):
            sim.truncated(trace([row(10, 1, 1.0)]), bad)


def test_device_chunks_are_simulated_as_the_loop_runs_them():
    """Device chunks of 4 on one row of 40 positions where budget 16 is cheapest and accepts 1 a
    step: every step is 16's (20 steps, the first a one-step chunk with nothing learned), at
    budget 16's own time: lean steps cost what the fixed choice costs."""
    tr = trace([row(40, 1, 1.0)])
    ms = {"ar": [9.0], "dflash": [9.0], "4": [9.0], "16": [1.0]}
    res = sim.run_simulation(tr, {1: ([0.0], ms, {})}, [1], None, decide_every=4)["1"]["policies"]
    assert res["auto"]["steps"] == {"16": 20}
    assert res["auto"]["tokens_per_s"] == pytest.approx(res["16"]["tokens_per_s"])


def test_decision_cost_and_policy_settings():
    """--decision-ms charges each scored draft (here a chunk's first step: 5 chunks of 4 after the
    one-step first); --policy sets a numeric AutoBudget field and names a wrong one."""
    tr = trace([row(40, 1, 1.0)])
    ms = {"ar": [9.0], "dflash": [9.0], "4": [9.0], "16": [1.0]}
    free = sim.run_simulation(tr, {1: ([0.0], ms, {})}, [1], None, decide_every=4)["1"]["policies"]["auto"]
    paid = sim.run_simulation(tr, {1: ([0.0], ms, {})}, [1], None, decide_every=4, decision_ms=0.5,
                             policy={"chunk_weight": 0.5})["1"]["policies"]["auto"]
    assert paid["steps"] == free["steps"] == {"16": 20}
    scored = 1 + (20 - 1 + 3) // 4  # the first (learning) chunk of one step, then chunks of 4
    assert 1000 * 41 / paid["tokens_per_s"] == pytest.approx(1000 * 41 / free["tokens_per_s"] + 0.5 * scored)
    assert sim._setting("ar_margin=0.1") == ("ar_margin", 0.1)
    for bad in ("margin=1", "ar_margin=", "ar_margin=x"):
        with pytest.raises(SystemExit, match="--policy"):
            sim._setting(bad)


def test_batches_take_every_row_and_the_slowest_sets_the_time():
    """Batch 2 of a fast and a slow row: a fixed choice steps until the slow row is done."""
    tr = trace([row(10, 4, 3.0), row(10, 0, 0.1)])
    ms = {"ar": [1.0], "dflash": [2.0], "4": [2.0], "16": [3.0]}
    res = sim.run_simulation(tr, {2: ([0.0], ms, {})}, [2], None)["2"]
    assert res["policies"]["16"]["steps"] == {"16": 10}  # the slow row accepts nothing
    assert res["best_fixed"] == "ar"
    assert [len(g) for g in sim.batches_of(tr["rows"], 3)] == [3]  # rows cycled to fill a batch


def test_tables_from_bench_e2e_reports_join_contexts(tmp_path):
    paths = []
    for ctx, scale in ((4096, 1.0), (32768, 1.5)):
        p = tmp_path / f"e2e_{ctx}.json"
        p.write_text(json.dumps({"runs": [{"batch": 1, "context": ctx, "step_ms_by_choice":
                                           {"ar": 13.0 * scale, "dflash": 16.0 * scale, "64": 18.0 * scale}}]}))
        paths.append(str(p))
    costs = tmp_path / "demo_costs.json"
    costs.write_text(json.dumps({"tables": {"1": {"ratios": {"dflash": 1.3}, "accepted": {"dflash": 1.9}}}}))
    tables = sim.tables_from_files(None, paths, str(costs))
    contexts, ms, measured = tables[1]
    assert contexts == [4096.0, 32768.0] and ms["64"] == [18.0, 27.0] and measured["ratios"] == {"dflash": 1.3}


@pytest.mark.slow
def test_smoke_runs_trace_simulation_and_latency(tmp_path):
    assert ab.main(["smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["simulation"]) == {"1", "2"}
    assert set(report["latency"]) == {"ar", "ddtree-4", "auto-per-step", "auto-chunks-on-device", "auto-chunks-on-host",
                                      "auto-per-generation"}
    tr = json.loads((tmp_path / "trace.json").read_text())
    assert tr["choices"] == ["ar", "dflash", "4", "8"] and all(r["positions"] == 23 for r in tr["rows"])
    for r in tr["rows"]:  # the target's confidence in each root: none at the first position
        top1, ent = r["root_top1"], r["root_entropy"]
        assert len(top1) == len(ent) == 23 and top1[0] is None and ent[0] is None
        vocab = 8192  # the demo pair's
        for p, h in zip(top1[1:], ent[1:]):
            # a distribution's top-1 probability is at least exp(-entropy), its entropy at most log(V)
            assert 0.0 < p <= 1.0 and 0.0 <= h <= np.log(vocab) + 1e-4 and p >= np.exp(-h) - 1e-4


def test_demo_smoke_passes_where_auto_chooses(tmp_path, monkeypatch):
    """`demo --smoke --decide-on generation` runs ddtree-bench with that form (the smoke sizes
    otherwise): the smoke run checks the form the GPU run will use."""
    seen = []
    monkeypatch.setattr(ab, "demo", lambda out, batches, budgets, auto_budgets, repeats, max_new, prompts, extra=():
                        seen.append((batches, budgets, repeats, max_new, extra)) or {})
    assert ab.main(["demo", "--smoke", "--decide-on", "generation", "--out", str(tmp_path)]) == 0
    [(batches, budgets, repeats, max_new, extra)] = seen
    assert (batches, budgets, repeats, max_new) == ([1, 2], "4,8", 1, 16)
    assert extra == ("--cost-repeats", "1", "--decide-on", "generation")
