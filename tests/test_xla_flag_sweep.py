"""scripts/xla_flag_sweep.py at smoke size: each flag set in its own process, an unknown flag
reported as such (not a crash of the sweep), and every flag set of the sweep known to this jaxlib."""

import json
import subprocess
import sys

import pytest


def test_sweep_smoke_reports_unknown_flags(tmp_path, monkeypatch):
    from scripts import xla_flag_sweep as sweep

    monkeypatch.setitem(sweep.FLAG_SETS, "bogus", "--xla_gpu_no_such_flag_for_the_test=true")
    out = tmp_path / "flags.json"
    assert sweep.main(["--smoke", "--sets", "baseline,bogus", "--phases", "step", "--iters", "1",
                       "--out", str(out)]) == 0
    rows = {r["set"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["baseline"]["rc"] == 0 and "step" in rows["baseline"]["phases"]
    assert rows["bogus"]["error"] == "unknown flag in this jaxlib"


@pytest.mark.parametrize("name", [n for n in __import__("scripts.xla_flag_sweep", fromlist=["x"]).FLAG_SETS if n != "baseline"])
def test_flag_sets_parse(name):
    from scripts.xla_flag_sweep import FLAG_SETS

    proc = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"],
                          env={"XLA_FLAGS": FLAG_SETS[name], "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-300:]
