"""Checkpoint converter: safetensors streaming, Orbax round trip, atomic conversion, error reports, CLI.

Tiny random HF models are built in-process with transformers, saved with save_pretrained
(single file, sharded, bf16), converted, restored, and compared against params built directly
from the torch state dict (exactly) and against HF's own torch forward (closely).
"""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import save_file

from converters import orbax_io
from converters.keymap import CheckpointError, flatten_paths
from converters.load import (
    MANIFEST_FILE,
    MARKER_FILE,
    PARAMS_DIR,
    IncompleteConversionError,
    checkpoint_kind,
    convert_target,
    load_target,
)
from converters.params import target_params_from_tensors
from ddtree_jax import decode
from ddtree_jax.cache import init_target_cache
from ddtree_jax.cli.convert import main as cli_main
from ddtree_jax.config import ConfigError, TargetConfig

SEQ = 11
TOKENS = np.random.default_rng(0).integers(0, 128, size=(1, SEQ)).astype(np.int32)


# ---- tiny HF models ------------------------------------------------------------------------
def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random (norm weights too, or a broken norm would pass)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def tiny_qwen35(seed: int = 0):
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, full_attention_interval=2,
    )
    torch.manual_seed(seed)
    return _randomize(transformers.Qwen3_5ForCausalLM(cfg), seed)


def tiny_qwen3(seed: int = 1, tie: bool = True):
    cfg = transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return _randomize(transformers.Qwen3ForCausalLM(cfg), seed)


def numpy_state_dict(model: torch.nn.Module) -> dict[str, np.ndarray]:
    out = {}
    for k, v in model.state_dict().items():
        a = v.detach().float().numpy()
        out[k] = a.astype(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16 else a
    return out


def hf_logits(model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()


def jax_logits(cfg: TargetConfig, graphdef, params) -> np.ndarray:
    res = decode.prefill(
        graphdef, params, init_target_cache(cfg, 1, 32), jnp.asarray(TOKENS), jnp.array([SEQ], jnp.int32),
        all_logits=True,
    )
    return np.asarray(res.logits)


def flat_params(params) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in flatten_paths(nnx.to_pure_dict(params)).items()}


def assert_params_equal(a, b) -> None:
    fa, fb = flat_params(a), flat_params(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        assert fa[k].dtype == fb[k].dtype, k
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def write_hf_dir(path, config: dict, tensors: dict[str, np.ndarray], shards: int = 1) -> str:
    """A HF-style directory from raw tensors: model.safetensors, or `shards` files + index.json."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return str(path)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, os.path.join(path, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    q35 = tiny_qwen35()
    q35.save_pretrained(root / "q35_sharded", max_shard_size="20KB")
    q35_bf16 = tiny_qwen35().to(torch.bfloat16)
    q35_bf16.save_pretrained(root / "q35_bf16")
    q3 = tiny_qwen3()
    q3.save_pretrained(root / "q3_tied")
    with open(root / "q35_sharded" / "config.json") as f:
        q35_config = json.load(f)
    return dict(
        root=root,
        q35=q35,
        q35_sd=numpy_state_dict(q35),
        q35_config=q35_config,
        q35_bf16=q35_bf16,
        q35_bf16_sd=numpy_state_dict(q35_bf16),
        q3=q3,
        q3_sd=numpy_state_dict(q3),
    )


@pytest.fixture
def q35_raw(models):
    """(config dict, fp32 tensors) of the tiny Qwen3.5, to build broken checkpoints from."""
    return json.loads(json.dumps(models["q35_config"])), dict(models["q35_sd"])


# ---- round trips -----------------------------------------------------------------------------
def test_sharded_fp32_convert_restore_matches_state_dict_and_hf(models, tmp_path):
    src = models["root"] / "q35_sharded"
    assert (src / "model.safetensors.index.json").exists()
    dst = tmp_path / "q35"
    assert convert_target(src, dst, progress=False) == str(dst)
    # generation_config.json (save_pretrained writes one) is carried along; there is no tokenizer here.
    assert sorted(os.listdir(dst)) == sorted(["config.json", MANIFEST_FILE, MARKER_FILE, PARAMS_DIR,
                                              "generation_config.json"])
    manifest = json.loads((dst / MANIFEST_FILE).read_text())
    assert manifest["copied_files"] == ["generation_config.json"]
    assert manifest["format_version"] == 1 and manifest["dtype"] == "float32"
    assert manifest["source"] == os.path.abspath(src) and manifest["model_type"] == "qwen3_5_text"
    assert [p for p in os.listdir(tmp_path) if p != "q35"] == []  # no temp dir left behind
    assert checkpoint_kind(dst) == "converted" and checkpoint_kind(src) == "hf"

    cfg, gd, params = load_target(dst)
    sd = models["q35_sd"]
    gd_direct, direct = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    assert_params_equal(params, direct)
    # Streaming straight from the HF directory gives the same params.
    cfg_hf, _, streamed = load_target(src)
    assert cfg_hf == cfg
    assert_params_equal(streamed, direct)

    got = jax_logits(cfg, gd, params)
    np.testing.assert_array_equal(got, jax_logits(cfg, gd_direct, direct))
    np.testing.assert_allclose(got, hf_logits(models["q35"]), atol=2e-4, rtol=2e-4)


def test_bf16_checkpoint_keeps_bf16_by_default_and_dtype_override(models, tmp_path):
    src = models["root"] / "q35_bf16"
    assert (src / "model.safetensors").exists()
    assert json.loads((src / "config.json").read_text())["dtype"] == "bfloat16"
    dst = tmp_path / "bf16"
    convert_target(src, dst, progress=False)
    assert json.loads((dst / MANIFEST_FILE).read_text())["dtype"] == "bfloat16"
    cfg, gd, params = load_target(dst)
    assert cfg.dtype == "bfloat16"
    assert all(v.dtype == jnp.bfloat16 for v in flat_params(params).values())
    sd = models["q35_bf16_sd"]
    gd_direct, direct = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    assert_params_equal(params, direct)
    np.testing.assert_array_equal(jax_logits(cfg, gd, params), jax_logits(cfg, gd_direct, direct))

    # Override on restore: Orbax casts bf16 -> fp32 exactly.
    cfg32, _, p32 = load_target(dst, dtype="fp32")
    assert cfg32.dtype == "float32"
    up = {k: v.astype(np.float32) for k, v in flat_params(direct).items()}
    for k, v in flat_params(p32).items():
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, up[k], err_msg=k)

    # Override at conversion time (and from the raw HF dir): stored as fp32.
    dst32 = tmp_path / "fp32"
    convert_target(src, dst32, dtype="float32", progress=False)
    assert json.loads((dst32 / MANIFEST_FILE).read_text())["dtype"] == "float32"
    assert_params_equal(load_target(dst32)[2], p32)
    assert_params_equal(load_target(src, dtype=jnp.float32)[2], p32)


def test_qwen3_tied_embeddings_single_file(models, tmp_path):
    src = models["root"] / "q3_tied"
    cfg, gd, params = load_target(src)
    assert cfg.tie_word_embeddings and cfg.model_type == "qwen3"
    sd = models["q3_sd"]
    _, direct = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    assert_params_equal(params, direct)
    np.testing.assert_allclose(jax_logits(cfg, gd, params), hf_logits(models["q3"]), atol=2e-4, rtol=2e-4)
    convert_target(src, tmp_path / "q3", progress=False)
    assert_params_equal(load_target(tmp_path / "q3")[2], direct)


def test_progress_callback_sees_every_tensor(models, tmp_path):
    seen = []
    convert_target(models["root"] / "q3_tied", tmp_path / "out", progress=True, on_tensor=seen.append)
    # save_pretrained drops the tied lm_head copy.
    assert sorted(seen) == sorted(set(models["q3_sd"]) - {"lm_head.weight"})


# ---- bad input ------------------------------------------------------------------------------
def _problems(excinfo) -> list[str]:
    return excinfo.value.problems


def test_unknown_model_type(q35_raw, tmp_path):
    config, tensors = q35_raw
    config["model_type"] = "llama"
    src = write_hf_dir(tmp_path / "src", config, tensors)
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        load_target(src)
    with pytest.raises(ConfigError):
        convert_target(src, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_missing_config_field(q35_raw, tmp_path):
    config, tensors = q35_raw
    del config["hidden_size"]
    src = write_hf_dir(tmp_path / "src", config, tensors)
    with pytest.raises(ConfigError, match="missing required field 'hidden_size'"):
        load_target(src)


def test_missing_directory_and_config(q35_raw, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target(tmp_path / "nope")
    config, tensors = q35_raw
    src = write_hf_dir(tmp_path / "src", config, tensors)
    os.remove(os.path.join(src, "config.json"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target(src)


def test_missing_tensor(q35_raw, tmp_path):
    config, tensors = q35_raw
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(CheckpointError) as e:
        load_target(write_hf_dir(tmp_path / "src", config, tensors))
    assert _problems(e) == ["missing tensor for 'layers/1/self_attn/k_proj/kernel'"]


def test_unexpected_tensor(q35_raw, tmp_path):
    config, tensors = q35_raw
    tensors["model.layers.0.mystery.weight"] = np.zeros((3,), np.float32)
    with pytest.raises(CheckpointError) as e:
        load_target(write_hf_dir(tmp_path / "src", config, tensors))
    assert _problems(e) == ["unexpected tensor 'model.layers.0.mystery.weight'"]


def test_wrong_shape(q35_raw, tmp_path):
    config, tensors = q35_raw
    tensors["model.layers.1.self_attn.v_proj.weight"] = np.zeros((16, 64), np.float32)
    with pytest.raises(CheckpointError) as e:
        load_target(write_hf_dir(tmp_path / "src", config, tensors))
    assert len(_problems(e)) == 1
    assert "'model.layers.1.self_attn.v_proj.weight' has shape (64, 16)" in _problems(e)[0]


def test_unsupported_stored_dtype(q35_raw, tmp_path):
    config, tensors = q35_raw
    tensors["model.layers.0.mlp.up_proj.weight"] = np.ones((128, 64), np.int8)
    with pytest.raises(CheckpointError) as e:
        load_target(write_hf_dir(tmp_path / "src", config, tensors))
    (problem,) = _problems(e)  # reported once, not again as a missing parameter
    assert "'model.layers.0.mlp.up_proj.weight'" in problem and "unsupported dtype I8" in problem


def test_unsupported_target_dtype(models):
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_target(models["root"] / "q3_tied", dtype="int8")


def test_several_problems_reported_together(q35_raw, tmp_path):
    config, tensors = q35_raw
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mystery.weight"] = np.zeros((3,), np.float32)
    tensors["model.layers.1.self_attn.v_proj.weight"] = np.zeros((16, 64), np.float32)
    tensors["model.layers.0.mlp.up_proj.weight"] = np.ones((128, 64), np.int8)
    src = write_hf_dir(tmp_path / "src", config, tensors, shards=3)
    with pytest.raises(CheckpointError) as e:
        convert_target(src, tmp_path / "dst", progress=False)
    text = str(e.value)
    for needle in (
        "missing tensor for 'norm/weight'",
        "unexpected tensor 'model.layers.0.mystery.weight'",
        "'model.layers.1.self_attn.v_proj.weight' has shape",
        "unsupported dtype I8",
    ):
        assert needle in text, text
    assert not (tmp_path / "dst").exists()
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_missing_shard_file_and_absent_index_entry(q35_raw, tmp_path):
    config, tensors = q35_raw
    src = write_hf_dir(tmp_path / "src", config, tensors, shards=3)
    os.remove(os.path.join(src, "model-00002-of-00003.safetensors"))
    index_path = os.path.join(src, "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["weight_map"]["model.layers.0.ghost.weight"] = "model-00001-of-00003.safetensors"
    json.dump(index, open(index_path, "w"))
    with pytest.raises(CheckpointError) as e:
        load_target(src)
    problems = _problems(e)
    assert any("shard file 'model-00002-of-00003.safetensors' is missing" in p for p in problems), problems
    assert any("'model.layers.0.ghost.weight'" in p and "does not contain it" in p for p in problems), problems
    # The parameters the missing shard would have filled are not listed again one by one.
    assert len(problems) == 2, problems


def test_no_safetensors_mentions_expected_files(q35_raw, tmp_path):
    config, _ = q35_raw
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    (src / "pytorch_model.bin").write_bytes(b"not really")
    with pytest.raises(FileNotFoundError) as e:
        load_target(src)
    msg = str(e.value)
    assert "model.safetensors" in msg and "model.safetensors.index.json" in msg and ".bin" in msg


# ---- atomicity ------------------------------------------------------------------------------
@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_conversion_leaves_nothing(models, tmp_path, monkeypatch, exc):
    real_save = orbax_io.save_params

    def failing_save(path, params):
        real_save(path, params)  # params fully on disk, then the conversion dies before the marker
        raise exc

    monkeypatch.setattr(orbax_io, "save_params", failing_save)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(type(exc)):
        convert_target(models["root"] / "q3_tied", out / "dst", progress=False)
    assert os.listdir(out) == []


def test_interrupt_while_reading_tensors_leaves_nothing(models, tmp_path):
    seen = []

    def interrupt(name):
        seen.append(name)
        if len(seen) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_target(models["root"] / "q35_sharded", tmp_path / "dst", progress=False, on_tensor=interrupt)
    assert os.listdir(tmp_path) == []


def test_directory_without_marker_is_refused(models, tmp_path):
    dst = tmp_path / "dst"
    convert_target(models["root"] / "q3_tied", dst, progress=False)
    os.remove(dst / MARKER_FILE)
    with pytest.raises(IncompleteConversionError, match="incomplete conversion"):
        load_target(dst)
    # A leftover temporary directory (manifest written first) is refused the same way.
    shutil.rmtree(dst / PARAMS_DIR)
    with pytest.raises(IncompleteConversionError):
        load_target(dst)


def test_overwrite(models, tmp_path):
    src = models["root"] / "q3_tied"
    dst = tmp_path / "dst"
    convert_target(src, dst, dtype="bf16", progress=False)
    with pytest.raises(FileExistsError, match="already exists; overwrite=True replaces it"):
        convert_target(src, dst, progress=False)
    assert json.loads((dst / MANIFEST_FILE).read_text())["dtype"] == "bfloat16"  # untouched
    convert_target(src, dst, progress=False, overwrite=True)
    assert json.loads((dst / MANIFEST_FILE).read_text())["dtype"] == "float32"
    assert sorted(os.listdir(tmp_path)) == ["dst"]
    # A directory that is not a conversion is never deleted, even with overwrite.
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="refusing"):
        convert_target(src, precious, overwrite=True, progress=False)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_failed_overwrite_keeps_previous_conversion(models, tmp_path, monkeypatch):
    src = models["root"] / "q3_tied"
    dst = tmp_path / "dst"
    convert_target(src, dst, progress=False)

    def failing_save(path, params):
        raise RuntimeError("boom")

    monkeypatch.setattr(orbax_io, "save_params", failing_save)
    with pytest.raises(RuntimeError):
        convert_target(src, dst, overwrite=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["dst"]
    assert checkpoint_kind(dst) == "converted"


# ---- CLI ------------------------------------------------------------------------------------
def test_cli_converts(models, tmp_path, capsys):
    dst = tmp_path / "dst"
    assert cli_main([str(models["root"] / "q3_tied"), str(dst), "--dtype", "bf16"]) == 0
    out = capsys.readouterr()
    assert "converted" in out.out and str(dst) in out.out
    assert "converting" in out.err  # tqdm progress bar
    assert json.loads((dst / MANIFEST_FILE).read_text())["dtype"] == "bfloat16"
    # Second run without --force: one-line error in CLI words, exit 2 (input error), no traceback.
    with pytest.raises(SystemExit) as e:
        cli_main([str(models["root"] / "q3_tied"), str(dst), "-q"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ddtree-convert: error:") and "pass --force to replace it" in err
    assert "overwrite" not in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert cli_main([str(models["root"] / "q3_tied"), str(dst), "-q", "--force"]) == 0


def test_cli_bad_input(q35_raw, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main([str(tmp_path / "missing"), str(tmp_path / "dst")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ddtree-convert: error:") and "does not exist" in err and "Traceback" not in err
    config, tensors = q35_raw
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mystery.weight"] = np.zeros((3,), np.float32)
    src = write_hf_dir(tmp_path / "src", config, tensors)
    with pytest.raises(SystemExit) as e:
        cli_main([src, str(tmp_path / "dst"), "-q"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "2 problem(s)" in err and "norm/weight" in err and "mystery" in err and "Traceback" not in err
    assert not (tmp_path / "dst").exists()


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for needle in ("SRC", "DST", "--dtype", "--force", "safetensors", "bf16"):
        assert needle in out
    with pytest.raises(SystemExit) as e:
        cli_main(["a", "b", "--dtype", "int8"])
    assert e.value.code == 2


def test_null_dtype_does_not_override(q35_raw):
    """A text_config saved with "dtype": null keeps the composite config's dtype, and a null
    `dtype` does not hide `torch_dtype` (both spellings occur in saved HF configs)."""
    from ddtree_jax.config import TargetConfig

    text, _ = q35_raw
    text = {k: v for k, v in text.items() if k not in ("dtype", "torch_dtype")}
    composite = {"model_type": "qwen3_5", "dtype": "bfloat16", "text_config": {**text, "dtype": None}}
    assert TargetConfig.from_hf_dict(composite).dtype == "bfloat16"
    assert TargetConfig.from_hf_dict({**text, "dtype": None, "torch_dtype": "float16"}).dtype == "float16"
    assert TargetConfig.from_hf_dict({**text, "dtype": None}).dtype == "float32"
