"""Merged projection layouts (converters/layout.py): the plans that cut and join merged weights,
HF and converted checkpoints loading into any layout with the same logits, and the HF export of
merged weights. Shares the tiny HF models of tests/test_converter.py."""

from __future__ import annotations

import numpy as np
import pytest

from converters.keymap import CheckpointError
from converters.load import convert_target, load_target
from converters.params import target_params_from_tensors
from ddtree_jax.config import TargetConfig
from tests import test_converter as base
from tests.test_converter import flat_params, jax_logits

models = base.models  # the tiny HF models fixture (module scope: built once for this file too)


def test_layout_plans_round_trip():
    from converters import layout

    expected = {"layers/0/mlp/gate_up_proj/kernel": ((8, 12), np.float32),
                "layers/0/self_attn/qkv_proj/kernel": ((8, 20), np.float32),
                "layers/0/self_attn/qkv_proj/bias": ((20,), np.float32),
                "layers/1/linear_attn/in_proj_ba/kernel": ((8, 6), np.float32),
                "layers/1/linear_attn/in_proj_qkv_z/kernel": ((8, 14), np.float32),
                "layers/1/linear_attn/out_proj/kernel": ((5, 8), np.float32),
                "norm/weight": ((8,), np.float32)}
    parts, plan = layout.to_parts(expected, kv_width=4)
    assert parts["layers/0/self_attn/q_proj/kernel"][0] == (8, 12)
    assert parts["layers/0/self_attn/v_proj/bias"][0] == (4,)
    assert parts["layers/0/mlp/up_proj/kernel"][0] == (8, 6)
    assert parts["layers/1/linear_attn/in_proj_a/kernel"][0] == (8, 3)
    assert parts["layers/1/linear_attn/in_proj_qkv/kernel"][0] == (8, 9)  # z as wide as out_proj's input
    assert parts["layers/1/linear_attn/in_proj_z/kernel"][0] == (8, 5)
    assert layout.to_merged(parts)[0] == expected
    rng = np.random.default_rng(0)
    flat = {k: rng.normal(size=s) for k, (s, _) in expected.items()}
    back = layout.join(layout.split(dict(flat), layout.to_merged(parts)[1]), plan)
    assert set(back) == set(flat) and all(np.array_equal(back[k], flat[k]) for k in flat)
    # the other layouts a checkpoint of this merged model may be stored in: 2^4 - 1 with the GDN
    # projections as qkv | z and b | a (merged or not), + 2^2 with them as one qkv | z | b | a
    assert len(layout.alternatives(expected, kv_width=4)) == 19
    with pytest.raises(ValueError, match="qkv | z"):
        layout.to_parts({k: v for k, v in expected.items() if "out_proj" not in k}, kv_width=4)


def test_hf_checkpoint_loads_into_the_merged_weights(models):
    """The models hold merged gate | up, q | k | v and qkv | z | b | a weights: the converter joins
    the HF tensors into them (logits against HF: tests/test_parity.py), and a missing part is named
    as HF names it."""
    cfg = TargetConfig.from_hf_dict(models["q35_config"])
    sd = dict(models["q35_sd"])  # a copy: one tensor is dropped below
    _, params = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    flat = flat_params(params)
    for merged in ("mlp/gate_up_proj/kernel", "self_attn/qkv_proj/kernel", "linear_attn/in_proj_qkvzba/kernel"):
        assert any(k.endswith(merged) for k in flat), merged
    assert not any(k.endswith("linear_attn/in_proj_a/kernel") or k.endswith("mlp/up_proj/kernel") for k in flat)
    del sd[next(k for k in sd if k.endswith("mlp.up_proj.weight"))]
    with pytest.raises(CheckpointError, match=r"missing tensor for 'layers/\d+/mlp/up_proj/kernel'"):
        target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)


@pytest.mark.parametrize("older", ["separate", "qkv_z_and_ba", "gate_up_only"])
def test_converted_checkpoints_in_older_layouts_restore(models, tmp_path, older):
    """A converted checkpoint written in an older projection layout (every weight separate; the GDN
    projections as qkv | z and b | a; only gate | up merged) restores into today's model with the
    same logits."""
    from converters import layout, orbax_io
    from converters.load import PARAMS_DIR
    from converters.params import kv_width

    src = models["root"] / "q35_sharded"
    convert_target(src, tmp_path / "c", progress=False)
    cfg, gd, params = load_target(tmp_path / "c")
    want = jax_logits(cfg, gd, params)
    flat = {k: np.asarray(v) for k, v in flat_params(params).items()}
    shapes = {k: (v.shape, v.dtype) for k, v in flat.items()}
    parts, plan = layout.to_parts(shapes, kv_width(cfg))
    flat = layout.split(flat, plan)
    kinds = {"separate": set(), "qkv_z_and_ba": {"linear_attn/in_proj_qkv_z", "linear_attn/in_proj_ba"},
             "gate_up_only": {"mlp/gate_up_proj"}}[older]
    _, merge_plan = layout.to_merged(parts, kinds)
    flat = layout.join(flat, merge_plan)
    assert any(k.endswith("in_proj_qkv_z/kernel") for k in flat) == (older == "qkv_z_and_ba")
    params_dir = tmp_path / "c" / PARAMS_DIR
    import shutil

    shutil.rmtree(params_dir)
    orbax_io.save_params(params_dir, flat)
    _, gd2, restored = load_target(tmp_path / "c")
    np.testing.assert_allclose(jax_logits(cfg, gd2, restored), want, rtol=1e-5, atol=1e-5)


def test_a_qkvzba_weight_without_its_a_log_cannot_be_cut():
    from converters import layout

    with pytest.raises(ValueError, match="qkv \\| z \\| b \\| a"):
        layout.to_parts({"layers/1/linear_attn/in_proj_qkvzba/kernel": ((8, 20), np.float32),
                         "layers/1/linear_attn/out_proj/kernel": ((5, 8), np.float32)}, kv_width=4)


def test_export_cuts_merged_weights_into_hf_tensors(models):
    """params_to_hf (the demo pair's HF export) writes back exactly the HF tensors the merged model
    was loaded from."""
    from converters import qwen3
    from converters.params import kv_width
    from ddtree_jax.training.export import params_to_hf

    cfg = TargetConfig.from_hf_dict(models["q35_config"])
    sd = models["q35_sd"]
    _, merged = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    got = params_to_hf(merged, qwen3.rules_for(cfg), prefix="model.", no_prefix=("lm_head.",), dtype="float32",
                       kv_width=kv_width(cfg))
    for name, arr in got.items():
        np.testing.assert_array_equal(arr, np.asarray(sd[name], np.float32), err_msg=name)
