"""ddtree_jax.atomic: nothing half-written is ever visible under the final name."""

import json
import os
import subprocess
import sys

import pytest

from ddtree_jax import atomic


def test_write_json_replaces_whole_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "r.json"
    atomic.write_json(path, {"a": 1})
    atomic.write_json(path, {"b": [1, 2]}, indent=1)
    assert json.loads(path.read_text()) == {"b": [1, 2]}
    assert os.listdir(path.parent) == ["r.json"]


def test_write_json_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "r.json"
    atomic.write_json(path, {"a": 1})
    with pytest.raises(TypeError):
        atomic.write_json(path, {"bad": object()})  # not serialisable: fails mid-write
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["r.json"]


def test_staged_dir_replaces_on_success_and_keeps_the_old_on_error(tmp_path):
    dst = tmp_path / "model"
    with atomic.staged_dir(dst) as d:
        (open(os.path.join(d, "config.json"), "w")).write("{}")
    assert os.listdir(dst) == ["config.json"]
    with pytest.raises(RuntimeError):
        with atomic.staged_dir(dst) as d:
            open(os.path.join(d, "weights"), "w").write("half")
            raise RuntimeError("interrupted")
    assert os.listdir(dst) == ["config.json"]
    assert sorted(os.listdir(tmp_path)) == ["model"]
    with atomic.staged_dir(dst) as d:
        open(os.path.join(d, "weights"), "w").write("full")
    assert os.listdir(dst) == ["weights"]
    assert sorted(os.listdir(tmp_path)) == ["model"]


def _dead_pid() -> int:
    """The id of a process that has ended (reused within the test's milliseconds: practically never)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_staged_dir_names_its_writer_and_the_next_write_removes_a_killed_ones_leftover(tmp_path):
    """A temporary directory carries its writer's pid and host in its name; a later staged_dir of
    the same destination removes one whose writer is gone (killed: nothing could clean up) and
    leaves, and names, those that may still be written or whose writer is unknown."""
    dst = tmp_path / "model"
    with atomic.staged_dir(dst) as d:
        name = os.path.basename(d)
        assert name.startswith(f"model.tmp-{os.getpid()}@") and atomic._writer_of(name, "model")[0] == os.getpid()
    host = atomic._host()
    dead = tmp_path / f"model.tmp-{_dead_pid()}@{host}-abc123"
    alive = tmp_path / f"model.tmp-{os.getpid()}@{host}-def456"  # this process: still running
    remote = tmp_path / "model.tmp-1@another-host.example-ghi789"
    unknown = tmp_path / "model.tmp-q1w2e3"  # written before writers were named
    other = tmp_path / "modelx.tmp-1@h-zz"  # another destination's: not looked at
    for d in (dead, alive, remote, unknown, other):
        (d / "params").mkdir(parents=True)
    removed, kept = atomic.sweep_stale(dst)
    assert removed == [str(dead)] and not dead.exists()
    assert sorted(kept) == sorted(map(str, (alive, remote, unknown)))
    assert "still running" in atomic.describe_kept(str(alive), dst)
    assert "another-host.example" in atomic.describe_kept(str(remote), dst)
    assert "writer is unknown" in atomic.describe_kept(str(unknown), dst)
    assert other.exists()


def test_discard_staged_removes_writes_under_way(tmp_path):
    """What a signal handler calls before the process ends: every temporary file / directory of a
    write under way goes; finished writes are not registered any more."""
    atomic.write_json(tmp_path / "done.json", {"a": 1})
    with atomic.staged_dir(tmp_path / "model") as d:
        open(os.path.join(d, "weights"), "w").write("half")
        assert atomic.discard_staged() == [d] and not os.path.exists(d)
        os.makedirs(d)  # for staged_dir's own rename at the end of this test
    assert atomic.discard_staged() == []
    assert sorted(os.listdir(tmp_path)) == ["done.json", "model"]
