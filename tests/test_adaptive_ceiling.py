"""scripts/adaptive_ceiling.py: the exact per-step optimum equals brute force, the bounds' walks
agree with the simulation's, a calibration fed its own outcomes chooses as the oracle does, and the
choices fitted on other prompts (binned, nearest positions) are fitted only there."""

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scripts import adaptive_bench as ab
from scripts import adaptive_simulate as asim
from scripts import adaptive_ceiling as ac


def brute_force(acc, end, ms):
    """The least time over every sequence of per-step choices (a step at p advances 1 + acc[p, c])."""
    best = np.inf
    for seq in itertools.product(range(acc.shape[1]), repeat=end):
        p, t = 0, 0.0
        for c in seq:
            if p >= end:
                break
            t += ms[c]
            p += 1 + acc[p, c]
        best = min(best, t)
    return best


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.data())
def test_exact_oracle_is_the_brute_force_optimum(end, choices, data):
    acc = np.asarray(data.draw(st.lists(st.lists(st.integers(0, 3), min_size=choices, max_size=choices),
                                        min_size=end, max_size=end)))
    ms = data.draw(st.lists(st.floats(0.5, 4.0), min_size=choices, max_size=choices))
    got = ac.oracle_single(acc, end, lambda c, p: ms[c])
    assert abs(got - brute_force(acc, end, ms)) < 1e-9


def trace(rows):
    return {"choices": ["ar", "dflash", "4", "16"], "budgets": [4, 16], "ar_burst": 4, "max_new_tokens": 11,
            "rows": rows}


def random_rows(rng, n_rows, n):
    rows = []
    for _ in range(n_rows):
        acc = np.zeros((n, 4), int)
        acc[:, 1:] = rng.integers(0, 4, (n, 3))
        acc[:, 3] = np.maximum(acc[:, 3], acc[:, 2])  # the bigger tree accepts at least the smaller one's
        e = np.c_[np.zeros(n), acc[:, 1:] + rng.normal(0, 0.3, (n, 3))]
        rows.append({"prompt_len": 50, "positions": n, "e": e.tolist(), "accepted": acc.tolist()})
    return rows


def test_fixed_walks_match_the_simulation_and_the_oracle_bounds_them():
    rng = np.random.default_rng(0)
    tr = trace(random_rows(rng, 3, 20))
    ms = {"ar": [1.0, 2.0], "dflash": [1.6, 2.5], "4": [1.8, 3.0], "16": [2.2, 3.1]}
    tables = {1: ([0.0, 100.0], ms, {}), 2: ([0.0, 100.0], ms, {})}
    ceil = ac.ceiling(tr, tables, [1, 2], None, asim.batches_of)
    sim = asim.run_simulation(tr, tables, [1, 2], None)
    for b in ("1", "2"):
        for n in ms:  # the same walk and step costs as simulate's fixed policies (its table is float32)
            want = sim[b]["policies"][n]["tokens_per_s"]
            assert abs(ceil[b]["tokens_per_s"][n] - want) < 1e-6 * want
    over = ceil["1"]["over_best"]
    assert over["oracle_exact"] >= over["oracle"] - 1e-9 and over["oracle_exact"] >= 1.0 - 1e-9


def test_a_calibration_fed_its_own_outcomes_chooses_as_the_oracle():
    """E equal to the realised acceptance: the binned calibration maps each E to itself, so the
    calibrated choice is the oracle's (batch 1, the same greedy rule)."""
    rng = np.random.default_rng(1)
    rows = random_rows(rng, 2, 30)
    for r in rows:
        r["e"] = [[float(a) for a in acc] for acc in r["accepted"]]
    ceil = ac.ceiling(trace(rows), {1: ([0.0], {"ar": [1.0], "dflash": [1.5], "4": [1.7], "16": [2.0]}, {})},
                      [1], None, asim.batches_of, bins=64)["1"]
    assert abs(ceil["over_best"]["calibrated"] - ceil["over_best"]["oracle"]) < 1e-9


def test_ceiling_command_names_missing_tables(tmp_path, capsys):
    rng = np.random.default_rng(2)
    tpath = tmp_path / "trace.json"
    tpath.write_text(json.dumps(trace(random_rows(rng, 2, 10))))
    e2e = tmp_path / "e2e.json"
    e2e.write_text(json.dumps({"runs": [{"batch": 1, "context": 64, "step_ms_by_choice":
                                         {"ar": 1.0, "dflash": 1.5, "4": 1.7, "16": 2.0}}]}))
    out = tmp_path / "ceiling.json"
    assert ab.main(["ceiling", "--trace", str(tpath), "--e2e", str(e2e), "--batches", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["ceiling"]["1"]["over_best"]) == {"oracle", "calibrated", "calibrated_outside", "oracle_exact"}
    assert "batch   1: best fixed" in capsys.readouterr().out
    # a trace without the target's figures: --knn says it runs the E view only
    assert ab.main(["ceiling", "--trace", str(tpath), "--e2e", str(e2e), "--batches", "1", "--knn", "3",
                    "--out", str(out)]) == 0
    assert set(json.loads(out.read_text())["ceiling"]["1"]["over_best"]) == {
        "oracle", "calibrated", "calibrated_outside", "knn_e_outside", "oracle_exact"}
    assert "no target figures" in capsys.readouterr().err
    try:
        ab.main(["ceiling", "--trace", str(tpath), "--e2e", str(e2e), "--batches", "1,8", "--out", str(out)])
    except SystemExit as e:
        assert "batch(es) [8]" in str(e)
    else:
        raise AssertionError("a batch without a table was accepted")


def test_nearest_positions_score_their_mean_acceptance():
    """k = 1 returns the nearest training position's realised acceptance (features standardised);
    k = every position, their mean."""
    f = [np.asarray([[0.0, 0.0], [1.0, 10.0], [2.0, 20.0]])]
    a = [np.asarray([[1, 0], [2, 5], [3, 9]])]
    one = ac.knn_calibration(f, a, 1)
    assert one(np.asarray([0.9, 11.0])).tolist() == [2.0, 5.0]
    assert one(np.asarray([2.4, 19.0])).tolist() == [3.0, 9.0]
    assert np.allclose(ac.knn_calibration(f, a, 50)(np.asarray([0.0, 0.0])), [2.0, 14 / 3])


def test_row_features_and_their_refusal():
    row = {"e": [[0.0, 1.0], [0.0, 3.0], [0.0, 0.0]], "accepted": [[0, 1]] * 3,
           "root_top1": [None, 0.5, 0.9], "root_entropy": [None, 1.0, 0.2]}
    e = ac.row_features(row, [1], "e")
    assert np.allclose(e[:, 0], np.log1p([1.0, 3.0, 0.0]))
    both = ac.row_features(row, [1], "e+target")
    assert both.shape == (3, 3)
    assert np.allclose(both[:, 1], [0.7, 0.5, 0.9]) and np.allclose(both[:, 2], [0.6, 1.0, 0.2])
    with pytest.raises(ValueError, match="root_top1"):
        ac.row_features({"e": row["e"]}, [1], "e+target")


def test_choices_fitted_outside_each_batch():
    """With the target's figures in the trace every kNN view runs; the exact oracle bounds each
    choice at batch 1; a batch holding every row has no rows outside it, so those choices are left
    out; and where each prompt's text repeats another's (rows in pairs of equal traces), the choice
    fitted on the others at k = 1 is the in-sample calibration of E itself (exact outcomes)."""
    rng = np.random.default_rng(3)
    rows = random_rows(rng, 4, 25)
    for r in rows:
        r["root_top1"] = [None] + rng.uniform(0.05, 1.0, 24).round(4).tolist()
        r["root_entropy"] = [None] + rng.uniform(0.0, 5.0, 24).round(4).tolist()
    ms = {"ar": [1.0], "dflash": [1.5], "4": [1.7], "16": [2.0]}
    tables = {1: ([0.0], ms, {}), 4: ([0.0], ms, {})}
    ceil = ac.ceiling(trace(rows), tables, [1, 4], None, asim.batches_of, knn=5)
    over = ceil["1"]["over_best"]
    assert set(over) == {"oracle", "calibrated", "calibrated_outside", "knn_e_outside", "knn_e+target_outside",
                         "oracle_exact"}
    assert all(over["oracle_exact"] >= v - 1e-9 for v in over.values())
    assert set(ceil["4"]["over_best"]) == {"oracle", "calibrated"}
    twins = [dict(r) for r in rows[:2] for _ in range(2)]
    for r in twins:
        r["e"] = [[float(a) for a in acc] for acc in r["accepted"]]  # E = the realised acceptance
    ceil = ac.ceiling(trace(twins), tables, [1], None, asim.batches_of, knn=1)["1"]["over_best"]
    assert abs(ceil["knn_e_outside"] - ceil["oracle"]) < 1e-9
