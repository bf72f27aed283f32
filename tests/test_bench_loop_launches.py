"""scripts/bench/loop_launches.py (decision 0075): the tool runs at the smoke shape (a CPU traces no
GPU kernels: empty counts) and refuses chunks that do not divide the traced steps."""

import json

import pytest


def test_chunks_must_divide_the_steps():
    from scripts.bench import loop_launches

    with pytest.raises(SystemExit):
        loop_launches.main(["--smoke", "--chunks", "1,3", "--steps", "8", "--out", "x.json"])


@pytest.mark.script
def test_smoke(tmp_path):
    from scripts.bench import loop_launches

    out = tmp_path / "ll.json"
    assert loop_launches.main(["--smoke", "--steps", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["chunk"] for r in rows] == [1, 2]
