"""scripts/bench/call_overhead.py at its smoke size: a step and a call time per program, dispatch
times and the traced events per call in the report."""

import json

import pytest


@pytest.mark.script  # ~35 s on this machine's CPU
def test_smoke(tmp_path):
    from scripts.bench import call_overhead

    out = tmp_path / "co.json"
    assert call_overhead.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"fixed16", "auto_own_16", "auto_device_chunks_forced_16"}
    for r in report["results"].values():
        assert r["step_ms"] > 0 and {"seq_1", "seq_4", "queued_1", "call_ms"} <= set(r)
    prof = report["profile"]
    assert set(prof["dispatch"]) == {"advance_0_steps", "noop_same_arguments"}
    assert prof["events_per_call"]["host"]
