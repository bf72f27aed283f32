"""scripts/bench/generation_profile.py: program names, the per-kernel difference, and the tool at
its smoke size (timings and one profiled generation per program in the report)."""

import json

import pytest

from scripts.bench import generation_profile as gp


def test_program_names_and_their_errors():
    assert gp.program_kwargs("plain") == {"mode": "ar"}
    assert gp.program_kwargs("fixed32") == {"mode": "ddtree", "budget": 32}
    assert gp.program_kwargs("auto_step0") == {"mode": "ddtree", "budget": "auto", "decide_every": 0,
                                               "decide_on": "device"}
    assert gp.program_kwargs("auto_host16")["decide_on"] == "host"
    with pytest.raises(ValueError, match="unknown program 'fixed'"):
        gp.program_kwargs("fixed")


def test_kernel_difference_sorts_by_the_largest_change():
    a = {"k1": {"count": 2, "ms": 1.0}, "k2": {"count": 1, "ms": 0.5}}
    b = {"k1": {"count": 2, "ms": 1.1}, "k3": {"count": 4, "ms": 2.0}}
    rows = gp.kernel_difference(a, b)
    assert [r["kernel"] for r in rows] == ["k3", "k2", "k1"]
    assert rows[0] == {"kernel": "k3", "count": 4, "ms": 2.0} and rows[1]["count"] == -1


def test_gaps_go_to_the_innermost_host_event_and_the_next_kernel():
    """Kernels at 0-10, 30-40, 41-50 and 100-110 us: gaps of 20 us (>= 5) and 50 us, 1 us left out.
    The first gap's middle (20 us) lies in a while loop (0-120) and, inside it, a predicate read
    (15-25): the read gets it; the second's (75) only in the loop."""
    us = 1000
    gpu = [(0, 10 * us, "a"), (30 * us, 40 * us, "b"), (41 * us, 50 * us, "c"), (100 * us, 110 * us, "b")]
    host = [(0, 120 * us, "while."), (15 * us, 25 * us, "MemcpyDH")]
    g = gp.gap_causes(gpu, host)
    assert g["count"] == 2 and abs(g["ms"] - 0.07) < 1e-9
    assert {r["name"]: (r["count"], round(r["ms"], 3)) for r in g["by_host_event"]} == {
        "while.": (1, 0.05), "MemcpyDH": (1, 0.02)}
    assert g["by_next_kernel"] == [{"name": "b", "count": 2, "ms": 0.07}]
    assert gp.gap_causes(gpu, [])["by_host_event"][0]["name"] == "(no host event)"


@pytest.mark.script  # ~65 s on this machine's CPU
def test_smoke(tmp_path):
    out = tmp_path / "gp.json"
    assert gp.main(["--smoke", "--programs", "fixed16,auto", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for name in ("fixed16", "auto"):
        r = report["programs"][name]
        assert r["tokens_per_second"] > 0 and r["steps_per_generation"] > 0
        prof = r["profile_first_batch"]
        assert prof["steps"] > 0 and prof["host"]  # on a CPU there is no GPU plane: kernels 0
    assert report["programs"]["auto"]["profile_first_batch"]["choices"]
