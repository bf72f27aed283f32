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


# ---- merged projection layouts (converters/layout.py) ----------------------------------------
def _merged_layout(monkeypatch, on: bool):
    from converters.layout import SWITCHES

    for path in SWITCHES:
        monkeypatch.setattr(path, on)


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
    assert parts["layers/0/self_attn/q_proj/kernel"][0] == (8, 12) and parts["layers/0/self_attn/v_proj/bias"][0] == (4,)
    assert parts["layers/0/mlp/up_proj/kernel"][0] == (8, 6) and parts["layers/1/linear_attn/in_proj_a/kernel"][0] == (8, 3)
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


def test_hf_checkpoint_loads_into_merged_layouts(models, monkeypatch):
    """A model built with merged gate | up, q | k | v and qkv | z | b | a weights (the defaults), or
    with qkv | z and b | a, loads the same HF tensors (joined by the converter) and computes the
    separate layout's logits."""
    from ddtree_jax.models import gdn

    cfg = TargetConfig.from_hf_dict(models["q35_config"])
    sd = dict(models["q35_sd"])  # a copy: one tensor is dropped below
    _merged_layout(monkeypatch, False)
    gd_sep, sep = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    assert any(k.endswith("linear_attn/in_proj_a/kernel") for k in flat_params(sep))
    want = jax_logits(cfg, gd_sep, sep)
    _merged_layout(monkeypatch, True)
    gd_m, merged = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    flat = flat_params(merged)
    assert any(k.endswith("mlp/gate_up_proj/kernel") for k in flat)
    assert any(k.endswith("self_attn/qkv_proj/kernel") for k in flat)
    assert any(k.endswith("linear_attn/in_proj_qkvzba/kernel") for k in flat)
    np.testing.assert_allclose(jax_logits(cfg, gd_m, merged), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(gdn, "MERGED_QKVZ_BA", False)  # the two-weight GDN layout
    gd_m, merged = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    flat = flat_params(merged)
    assert any(k.endswith("linear_attn/in_proj_ba/kernel") for k in flat)
    assert any(k.endswith("linear_attn/in_proj_qkv_z/kernel") for k in flat)
    np.testing.assert_allclose(jax_logits(cfg, gd_m, merged), want, rtol=1e-5, atol=1e-5)
    del sd[next(k for k in sd if k.endswith("mlp.up_proj.weight"))]
    with pytest.raises(CheckpointError, match=r"missing tensor for 'layers/\d+/mlp/up_proj/kernel'"):
        target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)


@pytest.mark.parametrize("saved_merged", [False, True])
def test_converted_checkpoint_restores_across_layouts(models, tmp_path, monkeypatch, saved_merged):
    """A converted checkpoint written in one layout restores into a model built in the other
    (or partly merged), with the same logits."""
    from ddtree_jax.models import layers

    src = models["root"] / "q35_sharded"
    _merged_layout(monkeypatch, saved_merged)
    convert_target(src, tmp_path / "c", progress=False)
    cfg, gd_saved, saved = load_target(tmp_path / "c")
    want = jax_logits(cfg, gd_saved, saved)
    _merged_layout(monkeypatch, not saved_merged)
    _, gd, params = load_target(tmp_path / "c")
    assert any(k.endswith("gate_up_proj/kernel") for k in flat_params(params)) != saved_merged
    np.testing.assert_allclose(jax_logits(cfg, gd, params), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(layers, "MERGED_GATE_UP", saved_merged)  # mixed: only gate | up as stored
    _, gd, params = load_target(tmp_path / "c")
    np.testing.assert_allclose(jax_logits(cfg, gd, params), want, rtol=1e-5, atol=1e-5)


def test_qkvzba_layout_loads_hf_and_converted_checkpoints(models, tmp_path, monkeypatch):
    """gdn.MERGED_QKVZ_BA (the default) against the two-weight GDN layout (qkv | z and b | a): a
    checkpoint converted in either restores into the other with the same logits, both load the HF
    tensors; a qkv | z | b | a weight without its layer's A_log cannot be cut and says so."""
    from converters import layout
    from ddtree_jax.models import gdn

    cfg = TargetConfig.from_hf_dict(models["q35_config"])
    sd = models["q35_sd"]
    gd0, p0 = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    flat = flat_params(p0)
    assert any(k.endswith("linear_attn/in_proj_qkvzba/kernel") for k in flat)
    assert not any(k.endswith("in_proj_ba/kernel") or k.endswith("in_proj_qkv_z/kernel") for k in flat)
    want = jax_logits(cfg, gd0, p0)
    src = models["root"] / "q35_sharded"
    convert_target(src, tmp_path / "qkvzba", progress=False)
    monkeypatch.setattr(gdn, "MERGED_QKVZ_BA", False)
    gd1, p1 = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    assert any(k.endswith("linear_attn/in_proj_qkv_z/kernel") for k in flat_params(p1))
    np.testing.assert_allclose(jax_logits(cfg, gd1, p1), want, rtol=1e-5, atol=1e-5)
    _, gd, params = load_target(tmp_path / "qkvzba")
    assert any(k.endswith("linear_attn/in_proj_ba/kernel") for k in flat_params(params))
    np.testing.assert_allclose(jax_logits(cfg, gd, params), want, rtol=1e-5, atol=1e-5)
    convert_target(src, tmp_path / "pair", progress=False)
    monkeypatch.setattr(gdn, "MERGED_QKVZ_BA", True)
    _, gd, params = load_target(tmp_path / "pair")
    assert any(k.endswith("linear_attn/in_proj_qkvzba/kernel") for k in flat_params(params))
    np.testing.assert_allclose(jax_logits(cfg, gd, params), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="qkv \\| z \\| b \\| a"):
        layout.to_parts({"layers/1/linear_attn/in_proj_qkvzba/kernel": ((8, 20), np.float32),
                         "layers/1/linear_attn/out_proj/kernel": ((5, 8), np.float32)}, kv_width=4)


def test_export_cuts_merged_weights_into_hf_tensors(models, monkeypatch):
    """params_to_hf (the demo pair's HF export) writes the same tensors from a merged-layout model
    as from the separate one."""
    from converters import qwen3
    from converters.params import kv_width
    from ddtree_jax.training.export import params_to_hf

    cfg = TargetConfig.from_hf_dict(models["q35_config"])
    sd = models["q35_sd"]
    _merged_layout(monkeypatch, False)
    _, sep = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    _merged_layout(monkeypatch, True)
    _, merged = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    from ddtree_jax.models import gdn

    monkeypatch.setattr(gdn, "MERGED_QKVZ_BA", False)  # the two-weight GDN layout too
    _, whole = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    rules = qwen3.rules_for(cfg)
    want = params_to_hf(sep, rules, prefix="model.", no_prefix=("lm_head.",), dtype="float32")
    for params in (merged, whole):
        got = params_to_hf(params, rules, prefix="model.", no_prefix=("lm_head.",), dtype="float32",
                           kv_width=kv_width(cfg))
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
