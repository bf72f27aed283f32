"""ddtree_jax.budget_table and its CLI (scripts/bench/budget_table.py): tokens per second per decoding
choice from step times and an acceptance curve, best first; bad tables named whole."""

import json

import pytest

from ddtree_jax.budget_table import DEMO_ACCEPTANCE, format_table, load_acceptance, rank


def test_rank_orders_choices_by_tokens_per_second():
    """tokens/s = batch x tokens a step / step time: DDTree-16 at 3.0 tokens in 2 ms (1500 tok/s at
    batch 1) beats DDTree-64 at 3.6 in 3 ms (1200) and plain decoding at 1 ms (1000); batch 8 scales
    every figure by 8 and keeps the order. Choices in one table only are reported, not ranked."""
    steps = {"ar": 1.0, "16": 2.0, "64": 3.0, "128": 9.0}
    acc = {"ar": 1.0, "16": 3.0, "64": 3.6, "dflash": 2.5}
    rows, skipped = rank(steps, acc)
    assert [r.choice for r in rows] == ["16", "64", "ar"]
    assert rows[0].tokens_per_s == pytest.approx(1500) and rows[1].tokens_per_s == pytest.approx(1200)
    assert rows[0].speedup == pytest.approx(1.5) and rows[2].speedup == pytest.approx(1.0)
    assert skipped == ["dflash", "128"]
    rows8, _ = rank(steps, acc, batch=8)
    assert [r.choice for r in rows8] == ["16", "64", "ar"] and rows8[0].tokens_per_s == pytest.approx(12000)
    text = format_table(rows, skipped, 1, "title")
    assert text.splitlines()[0] == "title" and "<- best" in text.splitlines()[2] and "skipped" in text


def test_plain_decoding_wins_when_trees_cost_too_much():
    """An MoE verify reading many more experts: a 64-node tree at 12x the decode step loses to
    plain decoding even at 3.56 tokens a step."""
    rows, _ = rank({"ar": 1.5, "64": 18.0}, DEMO_ACCEPTANCE)
    assert rows[0].choice == "ar" and rows[1].speedup == pytest.approx(3.56 / 12)


def test_bad_tables_are_named_whole():
    with pytest.raises(ValueError) as e:
        rank({"ar": 0.0, "tree": 1.0}, {"16": 0.5, "32": "x"}, batch=0)
    msg = str(e.value)
    for part in ("step time of 'ar' must be a positive number", "step time of 'tree'", "acceptance of '32'",
                 "acceptance of '16' is 0.5 tokens a step: below plain decoding's 1", "batch must be >= 1"):
        assert part in msg, (part, msg)


def test_load_acceptance(tmp_path):
    curve, est = load_acceptance("demo")
    assert curve["ar"] == 1.0 and curve["64"] == 3.56 and est == ("8",)
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"acceptance": {"ar": 1, "16": 3.2}, "estimated": ["16"]}))
    assert load_acceptance(str(path)) == ({"ar": 1, "16": 3.2}, ("16",))
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="JSON object"):
        load_acceptance(str(path))


def _report(tmp_path, runs, name="e2e.json", shape="35b-a3b"):
    path = tmp_path / name
    path.write_text(json.dumps({"shape": shape, "runs": runs}))
    return str(path)


@pytest.mark.script
def test_cli_prints_the_measured_and_the_correlated_tables(tmp_path, capsys):
    """python -m scripts.bench.budget_table E2E_JSON --acceptance demo: per batch the measured
    steps' table, and on an MoE report a second with each budget's correlated-routing step (the
    timed one where present, else the estimate)."""
    from scripts.bench.budget_table import main

    moe = {"top_k": 8, "correlated_shared": 6,
           "budgets": {"16": {"correlated_step_ms_estimate": 3.0}, "64": {"correlated_step_ms": 4.0,
                                                                          "correlated_step_ms_estimate": 9.0}}}
    path = _report(tmp_path, [{"batch": 1, "step_ms_by_choice": {"ar": 2.0, "16": 7.0, "64": 12.0}, "moe": moe}])
    assert main([path, "--acceptance", "demo"]) == 0
    out = capsys.readouterr().out
    measured, corr = out.split("correlated routing")
    assert "ar" in measured.splitlines()[3] and "<- best" in measured.splitlines()[3]  # plain wins on random routing
    assert "4.000" in corr and "9.000" not in corr  # the timed step before the estimate
    assert "16" in corr.splitlines()[2] and "<- best" in corr.splitlines()[2]  # DDTree-16 wins on correlated routing
    assert "estimated / timed" in out and "6 of 8" in out


@pytest.mark.script
def test_cli_names_bad_input_before_printing(tmp_path, capsys):
    from scripts.bench.budget_table import main

    path = _report(tmp_path, [{"batch": 1, "step_ms_by_choice": {"ar": -1.0}}])
    with pytest.raises(SystemExit) as e:
        main([path, "--acceptance", "demo"])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "step time of 'ar' must be a positive number" in captured.err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.json"), "--acceptance", str(tmp_path / "none.json")])
    err = capsys.readouterr().err
    assert "missing.json" in err and "none.json" in err  # both problems at once


@pytest.mark.script
def test_cli_unites_reports_of_budgets_timed_in_separate_calls(tmp_path, capsys):
    from scripts.bench.budget_table import main

    a = _report(tmp_path, [{"batch": 1, "step_ms_by_choice": {"ar": 2.0, "64": 12.0}}], "a.json")
    b = _report(tmp_path, [{"batch": 1, "step_ms_by_choice": {"ar": 2.2, "16": 5.0}},
                           {"batch": 8, "step_ms_by_choice": {"ar": 3.0}}], "b.json")
    assert main([a, b, "--acceptance", "demo"]) == 0
    out = capsys.readouterr().out
    batch1 = out.split("batch 8")[0]
    ar = next(line for line in batch1.splitlines() if line.split()[:1] == ["ar"])
    assert ar.split()[1] == "2.200" and "12.000" in batch1 and "5.000" in batch1  # b.json's ar replaces a.json's
    assert "batch 8" in out
    c = _report(tmp_path, [{"batch": 1, "step_ms_by_choice": {"ar": 2.0}}], "c.json", shape="27b")
    with pytest.raises(SystemExit):
        main([a, c])
    assert "different shapes" in capsys.readouterr().err


def test_ddtree_bench_step_times_ranks_without_a_model(tmp_path, capsys):
    """ddtree-bench --step-times REPORT --acceptance FILE: the same tables, no --prompts, no model
    loaded; bad input named (exit 2) before anything is printed."""
    from ddtree_jax.cli import bench as bench_cli

    path = _report(tmp_path, [{"batch": 1, "step_ms_by_choice": {"ar": 2.0, "16": 5.0, "64": 12.0}}])
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"ar": 1.0, "16": 3.0, "64": 4.0}))
    assert bench_cli.main(["--step-times", path, "--acceptance", str(curve)]) == 0
    out = capsys.readouterr().out
    best = next(line for line in out.splitlines() if "<- best" in line)
    assert best.split()[0] == "16"  # 3 tokens in 5 ms beats 1 in 2 and 4 in 12
    with pytest.raises(SystemExit) as e:
        bench_cli.main(["--step-times", str(tmp_path / "missing.json")])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "missing.json" in captured.err
