"""ddtree_jax.atomic: nothing half-written is ever visible under the final name."""

import json
import os

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
