"""Convert, then generate from text: the converted directory carries the tokenizer, generation
config and chat template, so it generates alone; --tokenizer DIR serves a directory without them;
the progress lines stay on stderr."""

import json
import os
import shutil

import pytest

from converters.load import MANIFEST_FILE
from ddtree_jax.cli import convert as convert_cli
from ddtree_jax.cli import generate as generate_cli
from ddtree_jax.cli.progress import COMPILING
from tests.cli_fixtures import write_target

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    """The tiny HF target with what a real HF directory has besides the weights."""
    target = write_target(str(tmp_path_factory.mktemp("hf") / "target"))
    with open(os.path.join(target, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>", "chat_template": CHAT_TEMPLATE}, f)
    with open(os.path.join(target, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": "<eos>"}, f)
    with open(os.path.join(target, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    return target


def generate(capsys, *argv) -> tuple[dict, str]:
    assert generate_cli.main([str(a) for a in argv] + ["--mode", "ar", "--max-new-tokens", "12", "--json"]) == 0
    captured = capsys.readouterr()
    [line] = captured.out.splitlines()  # --json: one line on stdout, nothing else
    return json.loads(line), captured.err


def test_convert_then_generate_from_text(hf_target, capsys, tmp_path):
    """The converted directory generates from text alone: moved elsewhere, its source gone."""
    src = tmp_path / "src"
    shutil.copytree(hf_target, src)
    assert convert_cli.main([str(src), str(tmp_path / "converted"), "-q"]) == 0
    capsys.readouterr()
    shutil.rmtree(src)
    dst = tmp_path / "moved"
    shutil.move(tmp_path / "converted", dst)
    carried = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
               "chat_template.jinja"]
    for name in carried:
        assert (dst / name).read_bytes() == open(os.path.join(hf_target, name), "rb").read(), name
    assert sorted(json.loads((dst / MANIFEST_FILE).read_text())["copied_files"]) == sorted(carried)
    assert json.loads((dst / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE

    got, err = generate(capsys, "--target", dst, "--prompt", "def f(x):")
    want, _ = generate(capsys, "--target", hf_target, "--prompt", "def f(x):")
    assert got["text"] and got["text"] == want["text"] and got["token_ids"] == want["token_ids"]
    assert f"{COMPILING} ... done in" in err  # the progress line, on stderr only


def test_tokenizer_option_for_a_directory_without_one(hf_target, capsys, tmp_path):
    bare = tmp_path / "bare"
    assert convert_cli.main([hf_target, str(bare), "-q"]) == 0
    os.remove(bare / "tokenizer.json")
    with pytest.raises(SystemExit) as e:
        generate_cli.main(["--target", str(bare), "--prompt", "def f(x):"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--tokenizer DIR" in err and "--prompt-ids" in err
    got, _ = generate(capsys, "--target", bare, "--tokenizer", hf_target, "--prompt", "def f(x):")
    also, _ = generate(capsys, "--target", bare, "--tokenizer", os.path.join(hf_target, "tokenizer.json"),
                       "--prompt", "def f(x):")
    assert got["text"] and got["text"] == also["text"]
    assert got["prompt_ids"][:3] == [70, 71, 72]  # 'd', 'e', 'f' in the fixture's character vocabulary


def test_text_output_and_prompt_echo_on_stdout_only(hf_target, capsys):
    """Streamed text: the prompt and the continuation on stdout, the compile line and the stats on
    stderr (a pipe here, so no progress bars)."""
    assert generate_cli.main(["--target", hf_target, "--mode", "ar", "--max-new-tokens", "12", "--prompt",
                              "x = "]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("x = ") and "compiling" not in captured.out
    assert "tok/s" in captured.err and "\r" not in captured.err
