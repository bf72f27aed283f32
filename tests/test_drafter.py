"""DFlash drafter: config parsing / validation, checkpoint round trip, JAX vs PyTorch parity."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from converters.dflash import drafter_params_from_tensors, load_drafter
from converters.keymap import CheckpointError
from ddtree_jax.config import ConfigError, TargetConfig
from ddtree_jax.drafter_config import (
    DrafterConfig,
    default_target_layer_ids,
    target_mismatches,
    validate_against_target,
)
from ddtree_jax.models.drafter import (
    draft_hidden,
    draft_logits,
    extend_context,
    init_drafter_cache,
    make_block,
)
from ddtree_jax.models.target import TargetModel
import torch_dflash_reference as ref

H, V, TARGET_LAYERS = 32, 97, 6


def target_config(**overrides) -> TargetConfig:
    raw = {
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": 48,
        "num_hidden_layers": TARGET_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": V,
        "rope_theta": 10000.0,
    }
    raw.update(overrides)
    return TargetConfig.from_hf_dict(raw)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# ---------------------------------------------------------------------------------------
# config parsing
# ---------------------------------------------------------------------------------------


def test_parse_basic_and_hashable():
    d = DrafterConfig.from_hf_dict(ref.make_config())
    assert d.target_layer_ids == (0, 2, 5)
    assert d.target_hidden_ids == (1, 3, 6)
    assert d.block_size == 4 and d.mask_token_id == 96
    assert d.fc_in_dim == 3 * H and d.num_features == 3
    assert d.layer_windows == (None, None) and d.layer_causal == (False, False)
    assert d.rotary_dim == 16 and d.rope_theta == 10000.0
    hash(d)
    assert d == DrafterConfig.from_hf_dict(ref.make_config())


def test_block_size_top_level_or_in_dflash_config():
    top = ref.make_config(block_size=8)
    assert DrafterConfig.from_hf_dict(top).block_size == 8
    inner = ref.make_config(dflash_config={"mask_token_id": 5, "target_layer_ids": [1], "block_size": 6})
    del inner["block_size"]
    assert DrafterConfig.from_hf_dict(inner).block_size == 6
    both = ref.make_config(block_size=8, dflash_config={"mask_token_id": 5, "target_layer_ids": [1], "block_size": 6})
    assert DrafterConfig.from_hf_dict(both).block_size == 6  # dflash_config wins, as the reference
    neither = ref.make_config()
    del neither["block_size"]
    assert DrafterConfig.from_hf_dict(neither).block_size == 16  # reference default


def test_rope_parameters_and_top_level_mask_token():
    raw = ref.make_config(dflash_config={"target_layer_ids": [1, 2]}, mask_token_id=7)
    del raw["rope_theta"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    d = DrafterConfig.from_hf_dict(raw)
    assert d.rope_theta == 1e6 and d.mask_token_id == 7


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B, 5-layer drafter
    assert default_target_layer_ids(36, 1) == (18,)
    raw = ref.make_config(num_target_layers=36, num_hidden_layers=5, hidden_size=32)
    raw["dflash_config"] = {"mask_token_id": 3}
    d = DrafterConfig.from_hf_dict(raw)
    assert d.target_layer_ids == (1, 9, 17, 25, 33)
    assert d.fc_in_dim == 5 * 32


def _problems(raw) -> list[str]:
    with pytest.raises(ConfigError) as e:
        DrafterConfig.from_hf_dict(raw)
    return e.value.problems


def test_missing_mask_token_id():
    raw = ref.make_config(dflash_config={"target_layer_ids": [0, 1]})
    (p,) = _problems(raw)
    assert "mask_token_id" in p


def test_block_size_below_two():
    (p,) = _problems(ref.make_config(block_size=1))
    assert "block_size" in p and ">= 2" in p


def test_missing_fields_and_several_problems_at_once():
    raw = ref.make_config(block_size=1, dflash_config={"target_layer_ids": [0]})
    del raw["hidden_size"]
    del raw["head_dim"]
    probs = _problems(raw)
    text = "\n".join(probs)
    for needle in ("hidden_size", "head_dim", "mask_token_id", "block_size"):
        assert needle in text, (needle, probs)
    assert len(probs) == 4


def test_no_ids_and_no_num_target_layers():
    raw = ref.make_config(dflash_config={"mask_token_id": 1})
    del raw["num_target_layers"]
    (p,) = _problems(raw)
    assert "target_layer_ids" in p and "num_target_layers" in p


def test_unsupported_drafters_are_named():
    probs = _problems(ref.make_config(architectures=["DFlash2DraftModel"], model_type="llama"))
    assert any("DFlash2DraftModel" in p for p in probs) and any("llama" in p for p in probs)
    probs = _problems(ref.make_config(layer_types=["full_attention", "chunked_attention"]))
    assert any("chunked_attention" in p for p in probs)


def test_sliding_window_layers_follow_hf_rules():
    d = DrafterConfig.from_hf_dict(
        ref.make_config(use_sliding_window=True, sliding_window=64, layer_types=["full_attention", "sliding_attention"])
    )
    assert d.layer_windows == (None, 64) and d.layer_causal == (False, True)
    d = DrafterConfig.from_hf_dict(
        ref.make_config(
            use_sliding_window=True, sliding_window=64, is_causal=False, layer_types=["sliding_attention"] * 2
        )
    )
    assert d.layer_windows == (64, 64) and d.layer_causal == (False, False)
    # without use_sliding_window HF drops the window
    d = DrafterConfig.from_hf_dict(ref.make_config(sliding_window=64))
    assert d.layer_windows == (None, None)


def test_validate_against_target_ok():
    d = DrafterConfig.from_hf_dict(ref.make_config())
    t = target_config()
    assert target_mismatches(d, t) == []
    validate_against_target(d, t)


def test_validate_target_layer_ids_out_of_range():
    d = DrafterConfig.from_hf_dict(ref.make_config())
    t = target_config(num_hidden_layers=4)
    probs = target_mismatches(d, t)
    assert any("target_layer_ids [5]" in p for p in probs), probs
    assert any("num_target_layers" in p for p in probs)


def test_validate_hidden_and_vocab_mismatch_listed_together():
    d = DrafterConfig.from_hf_dict(ref.make_config())
    t = target_config(hidden_size=48, vocab_size=64)
    with pytest.raises(ConfigError) as e:
        validate_against_target(d, t)
    text = "\n".join(e.value.problems)
    assert "hidden_size 32 != target hidden_size 48" in text
    assert "fc input dim 96" in text
    assert "vocab_size 97 != target vocab_size 64" in text
    assert "mask_token_id 96 >= target vocab_size 64" in text
    assert len(e.value.problems) == 4


# ---------------------------------------------------------------------------------------
# checkpoint round trip
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    cfg = ref.make_config()
    model = ref.randomize_(ref.DFlashDrafter(cfg), seed=0)
    path = str(tmp_path_factory.mktemp("dflash_plain"))
    ref.save_pretrained(model, path)
    return model, path


def test_checkpoint_round_trip(plain_dir):
    model, path = plain_dir
    dcfg, graphdef, params = load_drafter(path)
    assert dcfg == DrafterConfig.from_hf_dict(ref.make_config())
    flat = nnx.to_pure_dict(params)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(np.asarray(flat["fc"]["kernel"]), sd["fc.weight"].T)
    np.testing.assert_array_equal(np.asarray(flat["hidden_norm"]["weight"]), sd["hidden_norm.weight"])
    np.testing.assert_array_equal(np.asarray(flat["norm"]["weight"]), sd["norm.weight"])
    lay = flat["layers"][1]
    np.testing.assert_array_equal(np.asarray(lay["self_attn"]["k_proj"]["kernel"]),
                                  sd["layers.1.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(lay["self_attn"]["q_norm"]["weight"]),
                                  sd["layers.1.self_attn.q_norm.weight"])
    np.testing.assert_array_equal(np.asarray(lay["mlp"]["down_proj"]["kernel"]), sd["layers.1.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(
        np.asarray(lay["post_attention_layernorm"]["weight"]), sd["layers.1.post_attention_layernorm.weight"]
    )
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert n_params == sum(v.size for v in sd.values())
    # bf16 load
    dcfg16, _, params16 = load_drafter(path, dtype="bf16")
    assert dcfg16.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params16))


def test_checkpoint_problems_listed_together(plain_dir):
    model, _ = plain_dir
    dcfg = DrafterConfig.from_hf_dict(ref.make_config())
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    del sd["layers.0.mlp.up_proj.weight"]
    sd["layers.1.self_attn.o_proj.weight"] = sd["layers.1.self_attn.o_proj.weight"][:, :-1]
    sd["layers.0.extra.weight"] = np.zeros(3, np.float32)
    sd["model.embed_tokens.weight"] = np.zeros((V, H), np.float32)  # ignored, as the reference does
    with pytest.raises(CheckpointError) as e:
        drafter_params_from_tensors(dcfg, list(sd), sd.__getitem__)
    text = "\n".join(e.value.problems)
    assert len(e.value.problems) == 3, e.value.problems
    assert "layers/0/mlp/up_proj/kernel" in text and "o_proj" in text and "layers.0.extra.weight" in text


# ---------------------------------------------------------------------------------------
# JAX vs PyTorch parity (batch 2, different context lengths, context grown over two calls)
# ---------------------------------------------------------------------------------------

VARIANT = dict(
    use_sliding_window=True,
    sliding_window=5,
    layer_types=["full_attention", "sliding_attention"],  # layer 1: window 5, causal
    attention_bias=True,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    dflash_config={
        "mask_token_id": 3,
        "target_layer_ids": [1, 4],
        "block_size": 5,
        "input_embedding_scale": 1.5,
        "output_multiplier": 0.7,
        "final_logit_softcapping": 4.0,
    },
)


@pytest.fixture(scope="module")
def target():
    tcfg = target_config()
    model = TargetModel(tcfg, rngs=nnx.Rngs(7))
    tgraph, tparams = nnx.split(model)
    emb = torch.from_numpy(np.array(model.embed_tokens.embedding[...]))
    head = torch.from_numpy(np.asarray(model.lm_head.kernel[...]).T.copy())
    return tcfg, tgraph, tparams, emb, head


@pytest.mark.parametrize("variant", ["plain", "variant"])
def test_jax_matches_torch(variant, target, tmp_path):
    tcfg, tgraph, tparams, emb, head = target
    cfg = ref.make_config()
    if variant == "variant":
        cfg.update(copy.deepcopy(VARIANT))
        del cfg["rope_theta"], cfg["block_size"]
    tmodel = ref.randomize_(ref.DFlashDrafter(cfg), seed=3)
    ref.save_pretrained(tmodel, str(tmp_path))
    dcfg, graphdef, params = load_drafter(str(tmp_path))
    validate_against_target(dcfg, tcfg)
    bs, kh = dcfg.block_size, dcfg.fc_in_dim
    scale = float(cfg.get("dflash_config", {}).get("input_embedding_scale", 1.0))

    rng = np.random.default_rng(0)
    n_calls = [np.array([5, 3]), np.array([2, 4]), np.array([1, 6])]
    widths = [5, 4, 6]
    feats = [rng.normal(size=(2, w, kh)).astype(np.float32) for w in widths]
    for f, n in zip(feats, n_calls):  # padding rows are garbage and must be ignored
        for b in range(2):
            f[b, n[b] :] = 1e3
    bonuses = [rng.integers(0, V, size=2) for _ in widths]

    dcache = init_drafter_cache(dcfg, 2, capacity=24)
    tcache = [None, None]
    tlen = [0, 0]
    for step, (f, n, bonus) in enumerate(zip(feats, n_calls, bonuses)):
        dcache = extend_context(graphdef, params, dcache, jnp.asarray(f), jnp.asarray(n, jnp.int32))
        np.testing.assert_array_equal(np.asarray(dcache.lengths), np.array(tlen) + n)
        logits = np.asarray(draft_logits(graphdef, params, dcache, tgraph, tparams, jnp.asarray(bonus, jnp.int32)))
        blk = make_block(dcfg, jnp.asarray(bonus, jnp.int32))
        embeds = nnx.merge(tgraph, tparams).embed_tokens(blk) * scale
        hidden = np.asarray(draft_hidden(graphdef, params, dcache, embeds))
        assert logits.shape == (2, bs - 1, V) and hidden.shape == (2, bs, H)
        for b in range(2):
            blk_t = torch.tensor([[int(bonus[b])] + [dcfg.mask_token_id] * (bs - 1)])
            with torch.no_grad():
                pos = torch.arange(tlen[b], tlen[b] + int(n[b]) + bs)
                h_ref, cache_b = tmodel(emb[blk_t] * scale, torch.from_numpy(f[b : b + 1, : n[b]]), pos, tcache[b])
                l_ref = tmodel.logits(h_ref[:, 1:], head)
            tlen[b] += int(n[b])
            tcache[b] = tmodel.crop(cache_b, tlen[b])
            assert rel_err(hidden[b], h_ref[0].numpy()) < 1e-4, (step, b)
            assert rel_err(logits[b], l_ref[0].numpy()) < 1e-4, (step, b)

    # One extend with the whole context gives the same drafts as the three incremental ones.
    full = np.zeros((2, sum(widths), kh), np.float32)
    for b in range(2):
        full[b, : tlen[b]] = np.concatenate([f[b, : n[b]] for f, n in zip(feats, n_calls)])
    one = extend_context(graphdef, params, init_drafter_cache(dcfg, 2, 24), jnp.asarray(full),
                         jnp.asarray(tlen, jnp.int32))
    logits_one = draft_logits(graphdef, params, one, tgraph, tparams, jnp.asarray(bonuses[-1], jnp.int32))
    assert rel_err(logits_one, logits) < 1e-5
    # the cache beyond the committed lengths stays zero (padding rows were dropped, not written)
    k0 = np.asarray(dcache.layers[0].k)
    for b in range(2):
        assert not np.any(k0[b, :, tlen[b] :])
