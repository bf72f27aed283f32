"""scripts.bench.hf at its --smoke size: our plain greedy decoding and HF transformers' generate on
the same random weights, both timed, and their tokens agree."""

import json

import pytest


@pytest.mark.script
def test_hf_compare_smoke(tmp_path):
    from scripts.bench.hf import main

    out = tmp_path / "hf.json"
    assert main(["--smoke", "--prompt-len", "8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ours_tokens_per_s"] > 0 and report["hf_tokens_per_s"] > 0
    assert report["greedy_tokens_agree_prefix"] == report["new_tokens"] == 16  # float32 on the CPU: no near ties
