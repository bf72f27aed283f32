"""scripts/bench/loop_sync.py at its smoke size: the three loops (while, chunked, fori) run the asked
steps from one state, and the report has each program's per-step times and their ratios."""

import json

import pytest


@pytest.mark.script
def test_smoke(tmp_path):
    from scripts.bench import loop_sync

    out = tmp_path / "loop.json"
    assert loop_sync.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"ar_b1", "ddtree4_b1"}
    for r in results.values():
        assert set(r["step_ms"]) == {"while", "chunked", "fori"} and r["while_over_fori"] > 0
        assert r["chunked_over_fori"] > 0 and r["chunk"] == 2
        assert {"while_2_ms", "while_4_ms", "chunked_4_ms", "fori_2_ms", "fori_4_ms"} <= set(r)


def test_bad_arguments_are_refused():
    from scripts.bench import loop_sync

    with pytest.raises(SystemExit):
        loop_sync.main(["--out", "x.json", "--programs", "beam"])
    with pytest.raises(SystemExit):
        loop_sync.main(["--out", "x.json", "--steps", "8,4"])
    with pytest.raises(SystemExit):
        loop_sync.main(["--out", "x.json", "--chunk", "1"])
