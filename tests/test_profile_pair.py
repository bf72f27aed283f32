"""scripts/profile_pair.py runs end to end on the CPU (no GPU kernels to count there, but every
phase loop of every mode compiles and runs on the embedded demo pair)."""

import json

import pytest


@pytest.mark.slow
def test_profile_pair_smoke(tmp_path):
    from scripts.profile_pair import main

    out = tmp_path / "p.json"
    assert main(["--budgets", "16", "--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"ar", "dflash", "ddtree16"}
    assert set(report["runs"]["ddtree16"]) == {"step", "draft", "build", "verify", "commit"}
    assert all(r["wall_ms"] > 0 for run in report["runs"].values() for r in run.values())
