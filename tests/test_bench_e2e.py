"""scripts/bench_e2e.py (issue #6's measurement) at its --smoke shapes: the decode / DDTree loop
figures, the roofline and the phase split land in its JSON."""

import json


def test_bench_e2e_smoke_writes_every_figure(tmp_path):
    from scripts.bench_e2e import main

    out = tmp_path / "e2e.json"
    assert main(["--smoke", "--batches", "1", "--repeats", "1", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["runs"]
    for key in ("ar_loop_step_ms", "ddtree_loop_step_ms", "roofline_ms", "decode_fraction_of_roofline",
                "ddtree_over_decode"):
        assert row[key] > 0, key
    assert set(row["phases_ms"]) == {"draft", "build", "verify", "commit"}
    assert all(v >= 0 for v in row["phases_ms"].values())
    assert row["phase_inner"] == 2 and row["phases_sum_ms"] == sum(row["phases_ms"].values())
