"""scripts.bench.e2e at its --smoke shapes (the decode / DDTree loop figures, the roofline and the
phase split land in its JSON), the route overrides it takes, and the marginal-step estimators of
ddtree_jax.bench it reports."""

import json
import math

import numpy as np
import pytest


@pytest.mark.script
def test_e2e_smoke_writes_every_figure(tmp_path):
    from scripts.bench.e2e import main

    out = tmp_path / "e2e.json"
    assert main(["--smoke", "--batches", "1", "--repeats", "1", "--route", "gdn_decode_kernel=false",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["routes"]["gdn_decode_kernel"] is False and report["routes"]["impl"] == "xla"
    [row] = report["runs"]
    assert report["shape"] == "smoke" and report["context"] == 64
    for key in ("roofline_ms", "ar_loop_incl_dispatch_ms", "decode_fraction_of_roofline_incl_dispatch"):
        assert row[key] > 0, key
    # the marginal steps (T(32) - T(16)) / 16 of the smoke's microsecond-sized steps can come out
    # at or below zero on a loaded CPU (timer noise); the figures and their ratios must exist
    for key in ("ar_loop_step_ms", "ddtree_loop_step_ms", "decode_fraction_of_roofline", "ddtree_over_decode"):
        assert isinstance(row[key], float) and math.isfinite(row[key]), key
    for mode in ("ar", "ddtree"):  # T(N) = N * marginal step + one call's dispatch
        total = row[f"{mode}_loop_incl_dispatch_ms"] * 16
        assert abs(row[f"{mode}_loop_step_ms"] * 16 + row[f"{mode}_dispatch_ms"] - total) < 1e-6 * total
    assert set(row["phases_ms"]) == {"draft", "build", "verify", "commit"}
    assert all(v >= 0 for v in row["phases_ms"].values())
    assert row["phase_inner"] == 2 and row["phases_sum_ms"] == sum(row["phases_ms"].values())


@pytest.mark.script
def test_e2e_mamba2_hybrid_smoke(tmp_path):
    """--shape nemotron-h-8b --smoke (the nemotron-h-smoke shape: Mamba2, MLP and attention blocks):
    the decode and DDTree loop steps and the roofline of a Mamba2 hybrid."""
    from scripts.bench.e2e import main

    out = tmp_path / "e2e.json"
    assert main(["--smoke", "--shape", "nemotron-h-8b", "--batches", "2", "--budget", "8", "--repeats", "1",
                 "--loop-steps", "2", "--no-phases", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    [row] = report["runs"]
    assert report["shape"] == "nemotron-h-smoke" and row["roofline_ms"] > 0
    assert set(row["step_ms_by_choice"]) == {"ar", "8"}


@pytest.mark.script  # ~70 s on this machine's CPU
def test_e2e_moe_smoke_reports_experts_roofline_and_the_budget_table(tmp_path, capsys):
    """--shape 35b-a3b --smoke (the moe-smoke shape: 16 experts, top-4) at batch 2 and budgets 4 / 8:
    every choice's loop step in step_ms_by_choice; the MoE figures: distinct experts per layer at
    decode (the 2 roots: k..2k) and at every budget (no fewer than decode's, every node of the
    smaller tree found in the larger one), the decode bytes with only the chosen experts, the
    expert products' times and the correlated bracket (estimate and timed); then the MoE table and
    the budget tables. Its programs compile three at once (scripts/bench/compile_pool.py)."""
    from scripts.bench.e2e import main

    out = tmp_path / "e2e.json"
    assert main(["--smoke", "--shape", "35b-a3b", "--batches", "2", "--budget", "8", "--budgets", "4,8", "--repeats",
                 "1", "--loop-steps", "2", "--no-phases", "--moe-correlated-steps", "--acceptance", "demo",
                 "--compile-workers", "3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["shape"] == "moe-smoke" and report["elapsed_s"] > 0
    [row] = report["runs"]
    assert set(row["step_ms_by_choice"]) == {"ar", "4", "8"} and row["compile_wait_s"] >= 0
    moe = row["moe"]
    k, e, layers = moe["top_k"], moe["experts"], moe["layers"]
    assert (k, e, layers, moe["correlated_shared"]) == (4, 16, 4, 3)
    decode = moe["decode"]["distinct_per_layer"]
    assert len(decode) == layers and all(k <= d <= 2 * k for d in decode)
    assert moe["unmatched_nodes"] == {"4": 0, "8": 0}
    unchosen = (layers * e - sum(decode)) * moe["expert_bytes"]
    assert row["decode_bytes"] == moe["decode_bytes"] and row["roofline_ms"] > 0 and unchosen > 0
    for b in ("4", "8"):
        fig = moe["budgets"][b]
        assert fig["nodes"] == int(b) + 1 and fig["tokens"] == 2 * fig["nodes"]
        assert all(d >= dd for d, dd in zip(fig["distinct_per_layer"], decode))
        assert fig["ratio_to_decode"] >= 1 and fig["correlated_distinct_mean"] <= e
        for key in ("step_ms", "experts_ms", "correlated_experts_ms", "correlated_step_ms_estimate",
                    "correlated_step_ms", "experts_x_roofline"):
            assert isinstance(fig[key], float) and math.isfinite(fig[key]), key
    assert math.isfinite(moe["decode"]["experts_ms"])
    printed = capsys.readouterr().out
    assert "MoE decode step" in printed and "DDTree steps (random" in printed
    assert "measured steps" in printed or "no budget table" in printed  # smoke steps may time at <= 0 ms


def test_marginal_ms_separates_the_per_call_cost():
    """bench.marginal_ms (the unpaired form; scripts.bench.e2e's step, scripts.bench.profile's
    figures and the phase split take the paired form below): from a call costing 7 ms plus 2.5 ms an iteration it
    recovers both, where T(16) / 16 would read 2.94 ms an iteration."""
    from ddtree_jax.bench import marginal_ms

    calls = []
    per, fixed = marginal_ms(lambda k: calls.append(k) or 7.0 + 2.5 * k, 16)
    assert calls == [16, 32]
    assert abs(per - 2.5) < 1e-12 and abs(fixed - 7.0) < 1e-12


def test_paired_marginal_ms_times_n_and_2n_back_to_back(monkeypatch):
    """bench.paired_marginal_ms (scripts.bench.e2e's step): each repeat times an n- and a 2n-iteration call
    back to back and the step is the median of the pairs' differences. A slow stretch of the GPU
    (here calls 6..9 in time order run 1 ms an iteration slower) covers two of five pairs and
    leaves the median alone (2.5 ms), where the difference of a median of five n-calls and a median
    of five 2n-calls timed after them (marginal_ms over two medians) reads 4.5."""
    import ddtree_jax.bench as B

    clock = {"t": 0.0, "i": 0}

    def call(k):
        def run():
            per = 2.5 + (1.0 if 6 <= clock["i"] <= 9 else 0.0)
            clock["t"] += (7.0 + per * k) / 1000
            clock["i"] += 1
        return run

    monkeypatch.setattr(B.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(B.jax, "block_until_ready", lambda x: x)
    per, fixed, pairs = B.paired_marginal_ms(call, 16, 5)
    assert len(pairs) == 5 and clock["i"] == 2 + 2 * 5
    assert abs(per - 2.5) < 1e-9 and abs(fixed - 7.0) < 1e-9
    assert np.allclose(sorted(pairs)[-2:], [3.5, 3.5])  # the slow pairs are recorded, not used
    clock.update(t=0.0, i=0)
    old, _ = B.marginal_ms(lambda k: B.median_ms(call(k), 5), 16)  # n-calls 1..5, 2n-calls 7..11 (6: warm-up)
    assert abs(old - 4.5) < 1e-9  # all of the stretch lands in the 2n median: 2 ms an iteration too many
