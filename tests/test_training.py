"""The demo-pair pipeline at toy size on CPU: corpus, tokenizer, target + drafter training,
HF export round trip, the drafter's batched training forward vs its inference path, and
lossless generation with the exported pair."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from converters.dflash import load_drafter
from converters.load import load_target
from ddtree_jax.config import TargetConfig
from ddtree_jax.drafter_config import DrafterConfig
from ddtree_jax.models.drafter import init_drafter_cache
from ddtree_jax.training import corpus as corpus_mod
from ddtree_jax.training import tokenizer as tok_mod
from ddtree_jax.training.drafter_trainer import (
    TOY_DRAFTER_SHAPE,
    drafter_hf_config,
    init_drafter,
    loss_weights,
    sample_anchors,
    target_features,
    train_logits,
)
from ddtree_jax.training.export import export_drafter, export_target, hf_name_for
from ddtree_jax.training.target_trainer import TOY_TARGET_SHAPE, init_target, lm_loss, target_hf_config
from scripts import build_demo_pair
from tests.tiny_models import random_params
from tests.tolerance import assert_scaled_close

@pytest.mark.slow  # ~35 s: trains and converts the toy pair end to end
def test_toy_pipeline_end_to_end(tmp_path):
    """scripts/build_demo_pair.py --toy: outputs, decreasing losses, lossless generation with the
    exported pair. One test (not a shared fixture), so pytest-xdist never runs the pipeline twice."""
    out = tmp_path / "toy_pair"
    assert build_demo_pair.main(["--toy", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    _check_outputs(out, report)
    _check_losses(report)
    _check_lossless_generation(out, report)


def _check_outputs(out, report):
    files = [os.path.relpath(os.path.join(dp, f), out) for dp, _, fs in os.walk(out) for f in fs]
    assert sorted(files) == sorted([
        "corpus_manifest.json", "report.json", "target/config.json", "target/model.safetensors",
        "target/tokenizer.json", "drafter/config.json", "drafter/model.safetensors",
    ])
    assert all(os.path.getsize(out / f) <= 16 << 20 for f in files)
    manifest = json.loads((out / "corpus_manifest.json").read_text())
    assert manifest["corpus_sha256"] == report["corpus"]["sha256"]
    assert manifest["totals"]["heldout"]["files"] >= 1 and manifest["totals"]["train"]["files"] >= 1
    assert all(len(e["sha256"]) == 64 and e["split"] in ("train", "heldout") for e in manifest["files"])
    dconf = json.loads((out / "drafter" / "config.json").read_text())
    assert dconf["dflash_config"]["mask_token_id"] == report["tokenizer"]["special_ids"]["mask"] == 1
    assert dconf["block_size"] == 16


def _check_losses(report):
    t, d = report["target"]["training"], report["drafter"]["training"]
    assert t["steps"] == t["total_steps"] == 20
    assert t["final_train_loss"] < t["first_train_loss"] - 0.5
    assert t["heldout_loss"] < np.log(report["tokenizer"]["vocab_size"]) - 0.5
    assert d["final_train_loss"] < d["first_train_loss"] - 0.5
    assert d["heldout"]["loss"] < d["first_train_loss"]


def _check_lossless_generation(out, report):
    """generate(mode='ddtree') with the exported pair equals greedy AR (in the script's eval and here)."""
    assert report["eval"]["results"]["ddtree_16"]["matches_ar"] == 1.0
    from ddtree_jax.speculative.dflash import DFlashProposer
    from ddtree_jax.speculative.generate import generate

    cfg, gd, params = load_target(out / "target", dtype="float32")
    dcfg, dgd, dparams = load_drafter(out / "drafter", dtype="float32")
    tok = tok_mod.load_tokenizer(str(out / "target" / "tokenizer.json"))
    text = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    ids = tok.encode(text).ids[:32]
    assert len(ids) == 32
    prompt = jnp.asarray([ids, ids[::-1]], jnp.int32)
    lens = jnp.asarray([32, 27], jnp.int32)
    ar = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=24)
    tree = generate(gd, params, prompt, lens, proposer=DFlashProposer(dgd, dcfg), drafter_params=dparams,
                    mode="ddtree", budget=16, max_new_tokens=24)
    np.testing.assert_array_equal(np.asarray(tree.tokens), np.asarray(ar.tokens))


# ---- export -------------------------------------------------------------------------------------
def test_export_names_invert_the_converter_rules():
    from converters import dflash as dflash_rules
    from converters import qwen3 as qwen3_rules

    rules = qwen3_rules.rules_for(TargetConfig.from_hf_dict(target_hf_config(96, 0, **TOY_TARGET_SHAPE)))
    cases = {
        "layers/3/linear_attn/in_proj_qkv/kernel": "layers.3.linear_attn.in_proj_qkv.weight",
        "layers/0/linear_attn/conv_weight": "layers.0.linear_attn.conv1d.weight",
        "layers/1/self_attn/q_norm/weight": "layers.1.self_attn.q_norm.weight",
        "layers/2/input_layernorm/weight": "layers.2.input_layernorm.weight",
        "layers/2/linear_attn/A_log": "layers.2.linear_attn.A_log",
        "embed_tokens/embedding": "embed_tokens.weight",
        "norm/weight": "norm.weight",
    }
    for path, name in cases.items():
        assert hf_name_for(path, rules)[0] == name
    conv = np.arange(12, dtype=np.float32).reshape(4, 3)  # [K, C]
    assert hf_name_for("layers/0/linear_attn/conv_weight", rules)[1](conv).shape == (3, 1, 4)
    assert hf_name_for("fc/kernel", dflash_rules.RULES)[0] == "fc.weight"
    assert hf_name_for("layers/0/mlp/down_proj/kernel", dflash_rules.RULES)[0] == "layers.0.mlp.down_proj.weight"
    with pytest.raises(KeyError):
        hf_name_for("layers/0/unknown/kernel", rules)


def test_export_round_trip_gives_identical_logits(tmp_path):
    """float32 and bf16 exports load back to exactly the (rounded) params; bf16 gives identical logits."""
    thf = target_hf_config(96, 0, **dict(TOY_TARGET_SHAPE, num_hidden_layers=6, full_attention_interval=3))
    tcfg = TargetConfig.from_hf_dict(thf)
    dhf = drafter_hf_config(tcfg, 1, **dict(TOY_DRAFTER_SHAPE, num_hidden_layers=2))
    dcfg = DrafterConfig.from_hf_dict(dhf)
    assert dcfg.target_layer_ids == (1, 3)  # the reference default for L=6, 2 drafter layers
    tg, tp = init_target(tcfg, 0)
    tp = random_params(tp, 1, zero_centered_norms=True)
    dg, dp = init_drafter(dcfg, 2)
    dp = random_params(dp, 3, zero_centered_norms=False)
    for dtype in ("float32", "bfloat16"):
        export_target(str(tmp_path / dtype / "t"), thf, tp, dtype=dtype)
        export_drafter(str(tmp_path / dtype / "d"), dhf, dp, dtype=dtype)
        cfg2, tg2, tp2 = load_target(str(tmp_path / dtype / "t"), dtype="float32")
        dcfg2, dg2, dp2 = load_drafter(str(tmp_path / dtype / "d"), dtype="float32")
        assert cfg2 == tcfg.replace(dtype="float32")
        assert dcfg2 == dcfg.replace(dtype="float32")
        rounded = lambda p: jax.tree_util.tree_map(lambda x: x.astype(dtype).astype(jnp.float32), p)
        tp_ref, dp_ref = rounded(tp), rounded(dp)
        for a, b in zip(jax.tree_util.tree_leaves(tp_ref), jax.tree_util.tree_leaves(tp2)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree_util.tree_leaves(dp_ref), jax.tree_util.tree_leaves(dp2)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bf = tmp_path / "bfloat16"  # cfg2, tg2, tp2, ... below are its loaded copies

    from safetensors import safe_open

    with safe_open(str(bf / "t" / "model.safetensors"), "numpy") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.linear_attn.conv1d.weight").shape == (tcfg.gdn_conv_dim, 1, 4)
        assert f.get_tensor("model.layers.2.self_attn.q_proj.weight").shape == (2 * 2 * 32, 64)
    assert "model.embed_tokens.weight" in names and not any(n.startswith("lm_head") for n in names)
    with safe_open(str(bf / "d" / "model.safetensors"), "numpy") as f:
        assert f.get_tensor("fc.weight").shape == (64, 2 * 64)
        assert not any(n.startswith("model.") for n in f.keys())
    # Identical logits: target forward and drafter draft logits, reference vs loaded.
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(2, 96, (2, 24)), jnp.int32)

    from ddtree_jax.cache import init_target_cache

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def run(tgd, dgd, tpar, dpar):
        target, drafter = nnx.merge(tgd, tpar), nnx.merge(dgd, dpar)
        h, feats, _ = target(tokens, init_target_cache(cfg2, 2, 24), jnp.full((2,), 24, jnp.int32), chunked=True,
                             hidden_ids=dcfg.target_hidden_ids)
        dc = drafter.extend(init_drafter_cache(dcfg2, 2, 32), feats, jnp.full((2,), 24, jnp.int32))
        return target.logits(h), drafter.draft(target, tokens[:, -1], dc)

    # One compile: the loaded graphdefs differ from ours only in the config's dtype field.
    ref_t, ref_d = run(tg, dg, tp_ref, dp_ref)
    got_t, got_d = run(tg, dg, tp2, dp2)
    np.testing.assert_array_equal(np.asarray(ref_t), np.asarray(got_t))
    np.testing.assert_array_equal(np.asarray(ref_d), np.asarray(got_d))


def test_exported_target_runs_in_transformers(tmp_path):
    """The exported directory is a real HF Qwen3_5ForCausalLM checkpoint: same logits in PyTorch."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    thf = target_hf_config(96, 0, **TOY_TARGET_SHAPE)
    tcfg = TargetConfig.from_hf_dict(thf)
    tg, tp = init_target(tcfg, 0)
    tp = random_params(tp, 6, zero_centered_norms=True)
    export_target(str(tmp_path), thf, tp, dtype="float32")
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = np.random.default_rng(2).integers(2, 96, (1, 20))
    with torch.no_grad():
        ref = hf(torch.as_tensor(tokens)).logits.numpy()
    from ddtree_jax.cache import init_target_cache

    model = nnx.merge(tg, tp)
    h, _, _ = jax.jit(lambda x: model(x, init_target_cache(tcfg.replace(dtype="float32"), 1, 20),
                                      jnp.full((1,), 20, jnp.int32), chunked=True))(jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(np.asarray(model.logits(h)), ref, rtol=1e-4, atol=1e-4)


def test_chunked_training_gradient_matches_recurrent_form():
    """The GPU training path (chunked GDN) is differentiable and has the recurrent form's gradient.
    One GDN layer and a tiny batch: CPU training elsewhere uses the recurrent form because of a
    jaxlib 0.10 CPU LAPACK deadlock (`default_gdn_chunked`)."""
    shape = dict(TOY_TARGET_SHAPE, num_hidden_layers=2, full_attention_interval=2)
    tcfg = TargetConfig.from_hf_dict(target_hf_config(96, 0, **shape))
    tg, tp = init_target(tcfg, 0)
    tp = random_params(tp, 7, zero_centered_norms=True)
    tokens = jnp.asarray(np.random.default_rng(3).integers(2, 96, (2, 65)), jnp.int32)
    grad = lambda chunked: jax.jit(jax.value_and_grad(
        lambda p: lm_loss(p, tg, tcfg, tokens, "float32", chunked)))(tp)
    (l_c, g_c), (l_r, g_r) = grad(True), grad(False)
    np.testing.assert_allclose(float(l_c), float(l_r), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g_c), jax.tree_util.tree_leaves(g_r)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)


# ---- the drafter's training forward ------------------------------------------------------------
def test_training_forward_equals_inference_path():
    """Every block of the batched masked training forward equals DrafterModel.extend + draft on
    the same context (positions < anchor), row by row, including rows with different anchors."""
    thf = target_hf_config(96, 0, **dict(TOY_TARGET_SHAPE, num_hidden_layers=6, full_attention_interval=3))
    tcfg = TargetConfig.from_hf_dict(thf)
    dcfg = DrafterConfig.from_hf_dict(drafter_hf_config(tcfg, 1, **dict(TOY_DRAFTER_SHAPE, num_hidden_layers=2)))
    dcfg = dcfg.replace(dtype="float32")
    tg, tp = init_target(tcfg, 0)
    dg, dp = init_drafter(dcfg, 1)
    tp = random_params(tp, 4, zero_centered_norms=True)
    dp = random_params(dp, 5, zero_centered_norms=False)
    rng = np.random.default_rng(1)
    t = 48
    tokens = jnp.asarray(rng.integers(2, 96, (2, t)), jnp.int32)

    feats = jax.jit(lambda tp: target_features(nnx.merge(tg, tp), tcfg, tokens, dcfg.target_hidden_ids,
                                               jnp.float32))(tp)

    @jax.jit
    def batched_fn(tp, dp, anchors):
        target, drafter = nnx.merge(tg, tp), nnx.merge(dg, dp)
        return train_logits(drafter, target, feats, tokens, anchors)

    @jax.jit
    def inference_fn(tp, dp, a):
        target, drafter = nnx.merge(tg, tp), nnx.merge(dg, dp)
        cache = drafter.extend(init_drafter_cache(dcfg, 2, 64), feats, a)  # row b keeps positions < a[b]
        return drafter.draft(target, jnp.take_along_axis(tokens, a[:, None], axis=1)[:, 0], cache)

    anchors = jnp.asarray([[1, 9, 30, 32], [5, 17, 18, t - 16]], jnp.int32)
    batched = batched_fn(tp, dp, anchors)  # [B, N, 15, V]
    assert batched.shape == (2, 4, 15, 96)
    # logits reach ~60: within 1e-6 of their magnitude (a fixed 2e-5 failed by 2.3e-5 on an AVX2-only
    # CPU, float32 rounding; the blocks differ there by ~2.5e-7 of it)
    for n in range(anchors.shape[1]):
        single = inference_fn(tp, dp, anchors[:, n])
        assert_scaled_close(batched[:, n], single, 1e-6, f"block {n}")
    # One block alone gives the same as inside the batch (other blocks are invisible).
    alone = batched_fn(tp, dp, anchors[:, 2:3])
    assert_scaled_close(alone[:, 0], batched[:, 2], 1e-6, "the block alone")


def test_anchors_and_weights():
    a = np.asarray(sample_anchors(jax.random.PRNGKey(0), 3, 64, 20, 16))
    assert a.shape == (3, 20) and a.min() >= 1 and a.max() <= 64 - 16
    assert all(len(set(row)) == 20 for row in a)
    w = np.asarray(loss_weights(16, 7.0))
    np.testing.assert_allclose(w, np.exp(-np.arange(15) / 7.0), rtol=1e-6)


# ---- corpus and tokenizer -------------------------------------------------------------------
class _Meta(dict):
    def get_all(self, key):
        v = self.get(key)
        return v if isinstance(v, list) or v is None else [v]


@pytest.mark.parametrize("meta, ok", [
    ({"License-Expression": "MIT"}, True),
    ({"License-Expression": "Apache-2.0 OR BSD-2-Clause"}, True),
    ({"License-Expression": "Apache-2.0 AND Apache-2.0 WITH LLVM-exception"}, True),
    ({"License-Expression": "GPL-3.0-only OR MIT"}, True),
    ({"License-Expression": "BSD-3-Clause AND Zlib"}, False),
    ({"License-Expression": "MPL-2.0"}, False),
    ({"License": "Apache 2.0"}, True),
    ({"License": "MPL-2.0 AND MIT"}, False),
    ({"License": "Copyright (c) 2020 Someone\nPermission is hereby granted..."}, False),
    ({"Classifier": ["License :: OSI Approved :: BSD License"]}, True),
    ({"Classifier": ["License :: OSI Approved :: MIT License",
                     "License :: OSI Approved :: GNU General Public License v3 (GPLv3)"]}, False),
    ({}, False),
])
def test_license_decisions(meta, ok):
    assert corpus_mod.license_decision(_Meta(meta))[0] is ok


def test_corpus_is_deterministic_and_split_by_path():
    a = corpus_mod.gather_corpus(96 << 10, include_packages=False, heldout_fraction=0.2)
    b = corpus_mod.gather_corpus(96 << 10, include_packages=False, heldout_fraction=0.2)
    assert a.sha256 == b.sha256 and [f.path for f in a.files] == [f.path for f in b.files]
    assert sum(f.size for f in a.files) <= 96 << 10
    assert [f.path for f in a.files] == sorted(f.path for f in a.files)
    bigger = corpus_mod.gather_corpus(192 << 10, include_packages=False, heldout_fraction=0.2)
    split = {f.path: f.split for f in bigger.files}
    assert all(split[f.path] == f.split for f in a.files if f.path in split)  # split depends on the path only
    m = a.manifest()
    assert m["sources"][0]["name"] == "stdlib" and m["totals"]["all"]["files"] == len(a.files)


def test_tokenizer_round_trip_and_special_tokens():
    texts = [f.text for f in corpus_mod.gather_corpus(64 << 10, include_packages=False).files]
    tok = tok_mod.train_tokenizer(texts, 400)
    assert tok.get_vocab_size() == 400
    assert tok_mod.special_ids(tok) == {"eos": 0, "mask": 1}
    sample = "def f(x):\n    return x ** 2  # ünïcödé\n"
    assert tok.decode(tok.encode(sample).ids) == sample
    ids = tok_mod.encode_documents(tok, texts[:3])
    assert int(np.sum(ids == 0)) == 3 and ids[-1] == 0 and not np.any(ids == 1)
