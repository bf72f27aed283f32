"""scripts/pick_autotune_cache.py: of several autotuning tries the one with the least DDTree-step
kernel time has its cache installed as DIR (replacing what was there, atomically); failed tries
are reported, not chosen; when no try gives a figure DIR is left as it was."""

import json
import os

import pytest


def fake_runner(loops):
    """A runner that 'profiles' with the given DDTree-step times (None: the try fails) and leaves a
    cache entry naming its try."""
    calls = iter(enumerate(loops))

    def run(cache_dir, out_json, extra, smoke, timeout_s):
        i, loop = next(calls)
        assert extra == ["--int8-drafter"] and os.path.isdir(cache_dir) and not os.listdir(cache_dir)
        with open(os.path.join(cache_dir, f"fusion_from_try{i}.textproto"), "w") as f:
            f.write(str(i))
        return {"error": "scripts.bench.profile exited 1: boom"} if loop is None else {"loop_ms": loop, "step_ms": 13.4}

    return run


def test_the_fastest_try_s_cache_replaces_the_directory(tmp_path):
    from scripts.pick_autotune_cache import main

    cache, out = tmp_path / "atc", tmp_path / "pick.json"
    cache.mkdir()
    (cache / "stale.textproto").write_text("old")
    argv = ["--tries", "4", "--cache", str(cache), "--out", str(out), "--", "--int8-drafter"]
    assert main(argv, runner=fake_runner([18.31, 18.12, None, 18.40])) == 0
    assert sorted(os.listdir(cache)) == ["fusion_from_try1.textproto"]
    report = json.loads(out.read_text())
    assert report["chosen"] == 1 and report["profile_args"] == ["--int8-drafter"]
    assert report["spread_ms"] == pytest.approx(18.40 - 18.12)
    assert "boom" in report["tries"][2]["error"] and [t["entries"] for t in report["tries"]] == [1, 1, 1, 1]


def test_no_figure_leaves_the_directory_as_it_was(tmp_path, capsys):
    from scripts.pick_autotune_cache import main

    cache, out = tmp_path / "atc", tmp_path / "pick.json"
    cache.mkdir()
    (cache / "kept.textproto").write_text("old")
    argv = ["--tries", "2", "--cache", str(cache), "--out", str(out), "--", "--int8-drafter"]
    assert main(argv, runner=fake_runner([None, None])) == 1
    assert os.listdir(cache) == ["kept.textproto"]
    assert "left as it was" in capsys.readouterr().err
    assert json.loads(out.read_text())["chosen"] is None
    with pytest.raises(SystemExit):
        main(["--tries", "0", "--cache", str(cache)])


@pytest.mark.script  # 15 s: one real scripts.bench.profile --smoke process (no GPU here: no kernel times)
def test_smoke_runs_the_profile_for_real(tmp_path):
    from scripts.pick_autotune_cache import main

    out = tmp_path / "pick.json"
    assert main(["--smoke", "--tries", "1", "--cache", str(tmp_path / "atc"), "--out", str(out)]) == 1
    row = json.loads(out.read_text())["tries"][0]
    assert "error" not in row and row["loop_ms"] == 0.0
