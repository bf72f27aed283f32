"""scripts/dispatch_cost.py runs end to end: the hashes and both advance forms are timed."""

import json


def test_dispatch_cost_script(tmp_path):
    from scripts.dispatch_cost import main

    out = tmp_path / "dispatch.json"
    assert main(["--layers", "4", "--repeats", "3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for key in ("hash_target_graphdef_ms", "hash_spec_first_ms", "hash_spec_cached_ms",
                "advance_static_graphdef_ms", "advance_bound_ms"):
        assert report[key] > 0, key
    assert report["hash_spec_cached_ms"] < report["hash_spec_first_ms"]  # the proposer's cached hash
