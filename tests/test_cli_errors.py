"""Input errors of the three commands: each one names its problem on one line (a checkpoint: one
line per root cause), in the command's own words, exits 2, and comes before anything is written to
stdout; a runtime failure exits 1; every --help documents the codes."""

import errno
import io
import os
import shutil

import pytest

from ddtree_jax.cli import bench as bench_cli
from ddtree_jax.cli import common
from ddtree_jax.cli import convert as convert_cli
from ddtree_jax.cli import generate as generate_cli
from tests.cli_fixtures import write_drafter, write_target


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    target = write_target(str(root / "target"))
    drafter = write_drafter(str(root / "drafter"))
    truncated = str(root / "truncated")
    shutil.copytree(target, truncated)
    weights = os.path.join(truncated, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    no_tokenizer = str(root / "no_tokenizer")
    shutil.copytree(target, no_tokenizer)
    os.remove(os.path.join(no_tokenizer, "tokenizer.json"))
    return {"root": root, "target": target, "drafter": drafter, "truncated": truncated, "no_tokenizer": no_tokenizer}


def fails(capsys, main, argv, code=2) -> str:
    """Run a command that must fail: its exit code, nothing on stdout, no traceback; returns stderr."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert e.value.code == code, captured.err
    assert captured.out == "" and "Traceback" not in captured.err
    return captured.err


def test_prompt_file_with_invalid_utf8_names_the_byte_offset(dirs, capsys, tmp_path):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"def f(x):\n    return '\xff'\n")
    err = fails(capsys, generate_cli.main, ["--target", dirs["target"], "--prompt-file", bad])
    assert f"prompt file {bad} is not valid UTF-8: byte 0xff at byte offset 22" in err


def test_stdin_with_invalid_utf8_names_the_byte_offset(dirs, capsys, monkeypatch):
    monkeypatch.setattr(generate_cli.sys, "stdin", io.TextIOWrapper(io.BytesIO(b"import os\xc3(\n")))
    err = fails(capsys, generate_cli.main, ["--target", dirs["target"], "--mode", "ar"])
    assert "the prompt on stdin is not valid UTF-8: byte 0xc3 at byte offset 9" in err


def test_prompt_argument_with_invalid_utf8(dirs, capsys):
    err = fails(capsys, generate_cli.main, ["--target", dirs["target"], "--prompt", os.fsdecode(b"ab\xffc")])
    assert "--prompt is not valid UTF-8: byte 0xff at byte offset 2" in err


@pytest.mark.parametrize("case", ["target_file", "drafter_file", "prompt_dir", "tokenizer_missing"])
def test_generate_names_the_kind_of_path(dirs, capsys, case):
    config = os.path.join(dirs["target"], "config.json")
    argv = {
        "target_file": ["--target", config, "--prompt", "x"],
        "drafter_file": ["--target", dirs["target"], "--drafter", config, "--prompt", "x"],
        "prompt_dir": ["--target", dirs["target"], "--prompt-file", dirs["root"]],
        "tokenizer_missing": ["--target", dirs["no_tokenizer"], "--tokenizer", dirs["root"] / "nope", "--prompt", "x"],
    }[case]
    err = fails(capsys, generate_cli.main, argv)
    assert {
        "target_file": f"target checkpoint directory {config} is a file, expected a directory",
        "drafter_file": f"drafter checkpoint directory {config} is a file, expected a directory",
        "prompt_dir": f"prompt file {dirs['root']} is a directory, expected a file",
        "tokenizer_missing": "--tokenizer " + str(dirs["root"] / "nope") + " does not exist",
    }[case] in err


def test_text_prompt_without_a_tokenizer_names_both_ways_out(dirs, capsys):
    err = fails(capsys, generate_cli.main, ["--target", dirs["no_tokenizer"], "--prompt", "x"])
    assert "has no tokenizer.json" in err and "--tokenizer DIR" in err and "--prompt-ids" in err
    err = fails(capsys, generate_cli.main, ["--target", dirs["no_tokenizer"], "--tokenizer", dirs["drafter"],
                                            "--prompt", "x"])
    assert f"--tokenizer {dirs['drafter']}: no tokenizer.json in this directory" in err


def test_truncated_safetensors_is_one_root_cause(dirs, capsys, tmp_path):
    """Was: the cause on line 1, then a 'missing tensor' line for every parameter."""
    err = fails(capsys, generate_cli.main, ["--target", dirs["truncated"], "--mode", "ar", "--prompt", "x"])
    assert len(err.strip().splitlines()) <= 3, err
    assert "1 problem(s)" in err and "truncated or corrupt" in err and "missing tensor" not in err
    err = fails(capsys, convert_cli.main, [dirs["truncated"], tmp_path / "out", "-q"])
    assert len(err.strip().splitlines()) <= 3 and "truncated or corrupt" in err, err
    assert os.listdir(tmp_path) == []


def test_corrupt_converted_checkpoint_is_one_line(dirs, capsys, tmp_path):
    """Was: Orbax's traceback with pages of TensorStore spec."""
    dst = tmp_path / "converted"
    assert convert_cli.main([dirs["target"], str(dst), "-q"]) == 0
    capsys.readouterr()
    data = max((os.path.join(d, f) for d, _, fs in os.walk(dst / "params") for f in fs), key=os.path.getsize)
    os.truncate(data, 100)
    err = fails(capsys, generate_cli.main, ["--target", dst, "--mode", "ar", "--prompt", "x"])
    assert len(err.strip().splitlines()) == 2 and "cannot read the stored params" in err, err
    assert "truncated or corrupt" in err


@pytest.mark.parametrize("case", ["src_file", "dst_file", "dst_parent_file", "already_converted", "exists"])
def test_convert_input_errors_in_cli_words(dirs, capsys, tmp_path, case):
    config = os.path.join(dirs["target"], "config.json")
    (tmp_path / "file").write_text("x")
    converted = tmp_path / "converted"
    if case in ("already_converted", "exists"):
        assert convert_cli.main([dirs["target"], str(converted), "-q"]) == 0
        capsys.readouterr()
    argv, message = {
        "src_file": ([config, tmp_path / "dst"], f"{config} is a file, expected a directory"),
        "dst_file": ([dirs["target"], tmp_path / "file"], f"{tmp_path / 'file'} is a file, expected a directory"),
        "dst_parent_file": ([dirs["target"], tmp_path / "file" / "dst"],
                            f"{tmp_path / 'file'} is a file, expected a directory"),
        "already_converted": ([converted, tmp_path / "again"],
                              "is already a converted checkpoint: pass it to ddtree-generate"),
        "exists": ([dirs["target"], converted], "already exists; pass --force to replace it"),
    }[case]
    err = fails(capsys, convert_cli.main, argv + ["-q"])
    assert err.startswith("ddtree-convert: error:") and message in err and "overwrite" not in err
    assert len(err.strip().splitlines()) == 1


def test_convert_write_failure_is_a_runtime_error(dirs, capsys, tmp_path, monkeypatch):
    from converters import orbax_io

    def disk_full(path, params):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(orbax_io, "save_params", disk_full)
    err = fails(capsys, convert_cli.main, [dirs["target"], tmp_path / "dst", "-q"], code=1)
    assert "No space left on device" in err and "nothing was written" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("case", ["prompts_dir", "out_file", "bad_json", "bad_ids", "not_utf8", "needs_drafter"])
def test_bench_input_errors_come_before_loading(dirs, capsys, tmp_path, case):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text({"bad_json": '{"prompt": "a"}\n{"prompt": \n', "bad_ids": '{"prompt_ids": [1, -2]}\n'}.get(
        case, "def f(x):\n"))
    if case == "not_utf8":
        prompts.write_bytes(b"ok\n\xfe\n")
    (tmp_path / "file").write_text("x")
    argv = ["--target", dirs["target"], "--drafter", dirs["drafter"], "--prompts", prompts, "--out", tmp_path / "out"]
    if case == "prompts_dir":
        argv[5] = tmp_path
    elif case == "out_file":
        argv[-1] = tmp_path / "file"
    elif case == "needs_drafter":
        argv = argv[:2] + argv[4:] + ["--modes", "ar,ddtree"]
    err = fails(capsys, bench_cli.main, argv)
    assert {
        "prompts_dir": f"prompt file {tmp_path} is a directory, expected a file",
        "out_file": f"--out {tmp_path / 'file'} is a file, expected a directory",
        "bad_json": f"{prompts}:2: invalid JSON",
        "bad_ids": f"{prompts}:1: 'prompt_ids' must be a non-empty list of token ids",
        "not_utf8": "is not valid UTF-8: byte 0xfe at byte offset 3",
        "needs_drafter": "dflash / ddtree modes need a drafter: pass --drafter DIR",
    }[case] in err
    assert "loading" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("main", [generate_cli.main, convert_cli.main, bench_cli.main])
def test_help_documents_the_exit_codes(main, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "exit status:" in out
    for line in ("  0    success", "  1    runtime failure", "  2    usage or input error", "  130  interrupted"):
        assert line in out
    assert "143" in out


def test_usage_errors_exit_2_in_every_command(capsys):
    for main in (generate_cli.main, convert_cli.main, bench_cli.main):
        err = fails(capsys, main, ["--no-such-option"])
        assert "unrecognized arguments" in err or "required" in err


def test_budget_bound_matches_the_tree_builder():
    from ddtree_jax.speculative.build import MAX_BUDGET

    assert common.MAX_BUDGET == MAX_BUDGET


def test_context_error_comes_before_any_output(dirs, capsys):
    """The prompt is echoed with the first generated tokens, so an error found late (here: after the
    model loaded) still finds stdout empty."""
    err = fails(capsys, generate_cli.main, ["--target", dirs["target"], "--mode", "ar", "--prompt", "x" * 500,
                                            "--max-new-tokens", "100"])
    assert "the prompt has 500 tokens; with --max-new-tokens 100 it needs 600 positions" in err
