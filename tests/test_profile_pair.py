"""scripts/profile_pair.py and scripts/profile_step.py run end to end on the CPU (no GPU kernels
to count there, but every phase loop compiles and runs: the demo pair, the smoke-size model)."""

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


def test_profile_step_smoke_writes_hlo(tmp_path):
    """scripts/profile_step.py end to end at smoke size, with the optimized HLO of each phase
    written gzipped (what the kernel table's fusion names refer to) and `--sources` (the same HLO
    indexed: scripts/hlo_index.py)."""
    import gzip
    import json

    from scripts.profile_step import main

    out, hlo = tmp_path / "p.json", tmp_path / "hlo"
    assert main(["--smoke", "--gemm-m", "", "--phases", "step,verify", "--verify-budgets", "", "--iters", "1",
                 "--inner", "1", "--hlo-dir", str(hlo), "--sources", "--out", str(out)]) == 0
    phases = json.loads(out.read_text())["phases"]
    assert set(phases) == {"step", "verify"}
    assert all("by_source" in p for p in phases.values())  # empty on a CPU: no GPU kernels in the trace
    for phase in ("step", "verify"):
        assert gzip.decompress((hlo / f"{phase}.hlo.txt.gz").read_bytes()).startswith(b"HloModule")
