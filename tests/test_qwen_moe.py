"""The sparse MoE FFN of Qwen3.5-MoE / Qwen3-Next (ddtree_jax/models/moe.py), its config and its
checkpoints.

- The expert products: the gathered form (decode) and the form the block picks equal the dense
  masked reference (every expert on every token), with experts shared across tokens, tree nodes
  and batch rows, for both activations (silu_glu: Qwen; relu2: NemotronH) in float32 and bf16.
- Router ties: equal scores go to the lower expert index (jax.lax.top_k) on every path. torch.topk
  has no tie rule (its CPU order depends on k and on the other values), so HF has none to copy.
- One block equals HF's Qwen3_5MoeSparseMoeBlock / Qwen3NextSparseMoeBlock (float32 and bf16).
- Config: sparse layers as HF places them; every problem of a bad MoE config reported at once.
- Checkpoints: fused and per-expert on-disk experts give the same params; a bad checkpoint (missing
  experts, an expert beyond num_experts, wrong per-expert or stacked shapes, a router of the wrong
  size) gets one error naming every problem; the export writes fused experts that HF loads.
(Whole-model parity with HF: tests/test_parity.py; lossless speculation: test_generate.py,
test_dflash_generate.py, test_sampling.py.)
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

from converters.keymap import CheckpointError, flatten_paths
from converters.load import load_target
from ddtree_jax.config import MLP, MOE, ConfigError, TargetConfig
from ddtree_jax.models import moe
from ddtree_jax.models.moe import SILU_GLU, SparseMoeBlock, route_softmax_top_k
from ddtree_jax.routes import REFERENCE
from pallas_kernels.moe_experts import ACTS, dense_reference, reference
from tests.tree_harness import INTERPRET
from hf_models import converted, hf_model
from tests.tiny_models import HYBRID_MOE, random_params

H = 32


# ---- expert products ------------------------------------------------------------------------------
def _shared_choices(rng, tokens: int, experts: int, top_k: int) -> np.ndarray:
    """[tokens, top_k] distinct experts per row, drawn so rows repeat one another's choices (tree
    nodes and batch rows sharing experts): half the rows copy row 0, the rest draw from top_k + 1."""
    pool = rng.permutation(experts)[: min(experts, top_k + 1)]
    rows = [rng.permutation(pool)[:top_k] if t % 2 else rng.permutation(experts)[:top_k] for t in range(tokens)]
    rows = [rows[0] if t % 3 == 0 else r for t, r in enumerate(rows)]
    return np.asarray(rows, np.int32)


@settings(max_examples=8, deadline=None)
@given(tokens=st.sampled_from([1, 2, 5, 33]), experts=st.sampled_from([4, 5, 8]), top_k=st.integers(1, 3),
       act=st.sampled_from(ACTS), bf16=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_sparse_forms_equal_the_dense_reference(tokens, experts, top_k, act, bf16, seed):
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    rng = np.random.default_rng(seed)
    inter = 12
    w_in = jnp.asarray(rng.normal(size=(experts, H, 2 * inter if act == SILU_GLU else inter)) * H**-0.5, dtype)
    w_out = jnp.asarray(rng.normal(size=(experts, inter, H)) * inter**-0.5, dtype)
    x = jnp.asarray(rng.normal(size=(tokens, H)), dtype)
    ids = jnp.asarray(_shared_choices(rng, tokens, experts, top_k))
    weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(tokens, top_k)), jnp.float32)
    want = np.asarray(dense_reference(x, ids, weights, w_in, w_out, act=act), np.float32)
    scale = float(np.abs(want).max())
    tol = 2e-2 if bf16 else 1e-5
    for got in (reference(x, ids, weights, w_in, w_out, act=act),
                moe.experts(x, ids, weights, w_in, w_out, act=act, routes=REFERENCE)):
        assert got.shape == x.shape and got.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("tokens,gathered", [(1, True), (3, False), (9, False)])
def test_expert_products_read_only_the_chosen_experts(tokens, gathered):
    """8 experts, top 3, XLA forms: one token (3 < 8 choices) gathers its experts' weights ([T, k, H,
    2I] slices); three or more group the choices by expert; no form computes every expert on every
    token ([T, E, 2I] activations). With kernels on, the expert kernels run instead: their decode
    path (no grouping) up to routes.moe_decode_max_pairs pairs, the grouped kernel above."""
    e, k, inter = 8, 3, 16
    args = (jnp.zeros((tokens, H)), jnp.zeros((tokens, k), jnp.int32), jnp.ones((tokens, k)),
            jnp.zeros((e, H, 2 * inter)), jnp.zeros((e, inter, H)))
    jaxpr = str(jax.make_jaxpr(lambda *a: moe.experts(*a, act=SILU_GLU, routes=REFERENCE))(*args))
    assert (f"[{tokens},{k},{H},{2 * inter}]" in jaxpr) == gathered
    assert f"[{tokens},{e},{2 * inter}]" not in jaxpr and "pallas_call" not in jaxpr
    decode = INTERPRET.replace(moe_decode_max_pairs=tokens * k)
    jaxpr = str(jax.make_jaxpr(lambda *a: moe.experts(*a, act=SILU_GLU, routes=decode))(*args))
    assert "pallas_call" in jaxpr and "moe_decode_up" in jaxpr and "moe_experts_up" not in jaxpr
    grouped = INTERPRET.replace(moe_decode_max_pairs=tokens * k - 1)
    jaxpr = str(jax.make_jaxpr(lambda *a: moe.experts(*a, act=SILU_GLU, routes=grouped))(*args))
    assert "moe_experts_up" in jaxpr and "moe_decode_up" not in jaxpr


def _block(raw_overrides=None, seed=0, dtype=jnp.float32):
    cfg = TargetConfig.from_hf_dict(dict(HYBRID_MOE, **(raw_overrides or {})))
    gd, params = nnx.split(SparseMoeBlock(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))
    return cfg, gd, random_params(params, seed, zero_centered_norms=True)


def test_tree_nodes_and_rows_sharing_experts_equal_their_single_token_runs():
    """A verify-shaped input [B, N, H] (2 rows x 9 nodes, 4 experts, top 2: every expert is chosen by
    several nodes; row 1 repeats row 0's nodes) runs the dense form; each node alone (one token:
    the gathered form) gives the same output, so neither the flattening nor the form mixes tokens."""
    cfg, gd, params = _block()
    x = np.random.default_rng(1).normal(size=(2, 9, cfg.hidden_size)).astype(np.float32)
    x[1, :5] = x[0, :5]
    run = jax.jit(lambda p, x: nnx.merge(gd, p)(x))
    route = jax.jit(lambda p, x: nnx.merge(gd, p).route(x))
    idx = np.asarray(route(params, jnp.asarray(x))[0]).reshape(-1, cfg.moe_top_k)
    assert len({tuple(sorted(r)) for r in idx}) < len(idx) and np.bincount(idx.ravel()).min() >= 2
    together = np.asarray(run(params, jnp.asarray(x)))
    for b in range(2):
        for n in range(9):
            alone = np.asarray(run(params, jnp.asarray(x[b, n][None, None])))[0, 0]
            np.testing.assert_allclose(together[b, n], alone, rtol=1e-5, atol=1e-5 * np.abs(together).max())
    np.testing.assert_array_equal(together[1, :5], together[0, :5])


# ---- router ties ----------------------------------------------------------------------------------
def test_router_ties_go_to_the_lower_expert_index():
    logits = jnp.asarray([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0] * 5, [0.5, 2.0, 0.5, 2.0, 2.0]], jnp.float32)
    idx, weights = route_softmax_top_k(logits, top_k=2, norm=True)
    np.testing.assert_array_equal(np.asarray(idx), [[1, 2], [0, 1], [1, 3]])
    np.testing.assert_allclose(np.asarray(weights), 0.5)


def test_block_router_ties_pick_the_same_lower_expert_on_every_path():
    """Router rows of experts 1 and 2 equal: their scores tie for every token. Where the tie straddles
    the top-k boundary, expert 1 is chosen and 2 is not, in a decode-sized call (1 token) and a
    verify-sized one (all tokens) alike."""
    cfg, gd, params = _block({"num_experts": 4, "num_experts_per_tok": 2})
    kernel = np.array(params["router"]["kernel"][...])
    kernel[:, 2] = kernel[:, 1]
    params["router"]["kernel"][...] = jnp.asarray(kernel)
    route = jax.jit(lambda p, x: nnx.merge(gd, p).route(x))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(64, cfg.hidden_size)), jnp.float32)
    together = np.asarray(route(params, x)[0])
    alone = np.stack([np.asarray(route(params, x[t : t + 1])[0])[0] for t in range(x.shape[0])])
    np.testing.assert_array_equal(together, alone)
    boundary = [t for t, r in enumerate(together) if (1 in r) != (2 in r)]
    assert boundary, "no token with the tie at the top-k boundary"
    assert all(1 in together[t] and 2 not in together[t] for t in boundary)


def test_torch_topk_has_no_tie_rule_to_match():
    """HF routes with torch.topk, whose order among equal values is unspecified: on CPU it is what
    std::partial_sort / std::nth_element leave (here neither the lower nor the higher indices).
    Whatever it picks, it picks equal values: ours are a valid top-k with the ties broken by index."""
    rows = ([[0.1, 0.3, 0.3, 0.3, 0.0]], [[0.2, 0.5, 0.1, 0.5, 0.5, 0.2]], [[0.3] * 18])
    for row in (np.asarray(r, np.float32) for r in rows):
        for k in (1, 2, 3):
            t_val, _ = torch.topk(torch.as_tensor(row), k)
            j_val, j_idx = jax.lax.top_k(jnp.asarray(row), k)
            np.testing.assert_array_equal(t_val.numpy(), np.asarray(j_val))
            ties = np.asarray(j_idx)[0][np.asarray(j_val)[0] == np.asarray(j_val)[0][-1]]
            assert list(ties) == sorted(ties)


# ---- one block against HF's ---------------------------------------------------------------------
def _hf_block(family: str, seed: int):
    import transformers as tf
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m35
    from transformers.models.qwen3_next import modeling_qwen3_next as mnext

    kw = dict(hidden_size=H, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=14,
              shared_expert_intermediate_size=22)
    if family == "qwen3_5_moe_text":
        config, block_class = tf.Qwen3_5MoeTextConfig(**kw), m35.Qwen3_5MoeSparseMoeBlock
    else:
        config, block_class = tf.Qwen3NextConfig(**kw, norm_topk_prob=False), mnext.Qwen3NextSparseMoeBlock
    config._experts_implementation = "eager"
    block = block_class(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(block.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return config.to_dict(), block


def _our_block(raw: dict, hf_block, dtype):
    """Our block holding HF's weights (each torch Linear [out, in] -> [in, out])."""
    cfg = TargetConfig.from_hf_dict(dict(raw, vocab_size=16, num_hidden_layers=1, layer_types=["full_attention"]))
    gd, params = nnx.split(SparseMoeBlock(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    sd = {k: v.detach().float().numpy() for k, v in hf_block.state_dict().items()}
    t = lambda w: w.T
    values = {
        "router/kernel": t(sd["gate.weight"]),
        "experts/gate_up_proj": sd["experts.gate_up_proj"].transpose(0, 2, 1),
        "experts/down_proj": sd["experts.down_proj"].transpose(0, 2, 1),
        "shared_expert/gate_up_proj/kernel": np.concatenate(
            [t(sd["shared_expert.gate_proj.weight"]), t(sd["shared_expert.up_proj.weight"])], axis=1),
        "shared_expert/down_proj/kernel": t(sd["shared_expert.down_proj.weight"]),
        "shared_expert_gate/kernel": t(sd["shared_expert_gate.weight"]),
    }
    assert set(values) == set(flatten_paths(nnx.to_pure_dict(params)))
    for path, value in values.items():
        node = params
        for part in path.split("/"):
            node = node[part]
        node[...] = jnp.asarray(value, dtype)
    return gd, params


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_matches_hf_sparse_moe_block(family, dtype):
    """Router, experts and gated shared expert equal HF's block on 2 x 7 tokens (float32: to 1e-5
    of the output scale; bf16, where HF also rounds every expert's partial sum to bf16: to 2e-2)."""
    raw, hf_block = _hf_block(family, seed=5)
    tdtype = torch.float32 if dtype == "float32" else torch.bfloat16
    x = np.random.default_rng(3).normal(size=(2, 7, H)).astype(np.float32)
    with torch.no_grad():
        want = hf_block.to(tdtype)(torch.as_tensor(x).to(tdtype)).float().numpy()
    gd, params = _our_block(raw, hf_block.float(), jnp.dtype(dtype))
    got = np.asarray(jax.jit(lambda p, x: nnx.merge(gd, p)(x))(params, jnp.asarray(x, dtype)), np.float32)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next"])
def test_block_bf16_error_is_no_more_than_hf_bf16s(family):
    """Precision of one block in bf16, against float32 over 2000 tokens: ours within 1.25x of HF's
    own bf16 block (+1e-3). End to end the MoE models' bf16 figures spread with router flips
    (tests/test_bf16.py); this is the bound on the block's own rounding."""
    raw, hf_block = _hf_block(family, seed=7)
    x = np.random.default_rng(4).normal(size=(1, 2000, H)).astype(np.float32)
    with torch.no_grad():
        ref = hf_block.float()(torch.as_tensor(x)).numpy()
        theirs = hf_block.to(torch.bfloat16)(torch.as_tensor(x).bfloat16()).float().numpy()
    gd, params = _our_block(raw, hf_block.float(), jnp.bfloat16)  # the same (bf16-representable) weights
    ours = np.asarray(jax.jit(lambda p, x: nnx.merge(gd, p)(x))(params, jnp.asarray(x, jnp.bfloat16)), np.float32)
    rel = lambda a: float(np.mean(np.abs(a - ref)) / np.mean(np.abs(ref)))
    assert rel(ours) <= 1.25 * rel(theirs) + 1e-3, (rel(ours), rel(theirs))


# ---- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("step,mlp_only", [(1, []), (2, [3]), (3, [0, 2]), (1, [0, 1, 2, 3, 4, 5])])
def test_qwen3_next_sparse_layers_are_where_hf_puts_them(step, mlp_only):
    from transformers import Qwen3NextConfig

    raw = Qwen3NextConfig(vocab_size=16, hidden_size=H, num_hidden_layers=6, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                          decoder_sparse_step=step, mlp_only_layers=mlp_only).to_dict()
    want = tuple(MOE if i not in mlp_only and (i + 1) % step == 0 else MLP for i in range(6))
    cfg = TargetConfig.from_hf_dict(raw)
    assert cfg.ffn_types == want
    assert cfg.intermediate_size == (raw["intermediate_size"] if MLP in want else 0)
    assert TargetConfig.from_hf_dict(dict(raw, num_experts=0)).ffn_types == (MLP,) * 6


def test_qwen3_5_moe_configs():
    """The text config has no intermediate_size (every layer sparse) and always renormalises; the
    wrapper reads text_config, its dtype and tie flag from the top level."""
    text = {k: v for k, v in HYBRID_MOE.items()}
    cfg = TargetConfig.from_hf_dict(dict(text, norm_topk_prob=False))
    assert cfg.ffn_types == (MOE,) * 4 and cfg.intermediate_size == 0 and cfg.moe_norm_topk_prob
    assert (cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_intermediate_size, cfg.moe_shared_intermediate_size) == (
        4, 2, 20, 28)
    wrapped = TargetConfig.from_hf_dict({"model_type": "qwen3_5_moe", "dtype": "bfloat16", "tie_word_embeddings": True,
                                         "text_config": dict(text, model_type="qwen3_5_moe_text")})
    assert wrapped.replace(model_type=cfg.model_type, dtype=cfg.dtype, tie_word_embeddings=False) == cfg
    assert wrapped.dtype == "bfloat16" and wrapped.tie_word_embeddings
    with pytest.raises(ConfigError, match="needs a 'text_config'"):
        TargetConfig.from_hf_dict({"model_type": "qwen3_5_moe"})


def test_bad_moe_config_reports_every_problem():
    raw = dict(HYBRID_MOE, model_type="qwen3_next", num_experts=4, num_experts_per_tok=6,
               decoder_sparse_step=0, mlp_only_layers="3", norm_topk_prob="yes", moe_intermediate_size=-2)
    with pytest.raises(ConfigError) as e:
        TargetConfig.from_hf_dict(raw)
    text = str(e.value)
    for needle in ("num_experts_per_tok (6) exceeds num_experts (4)", "'decoder_sparse_step' must be a positive",
                   "'mlp_only_layers' has type str", "'norm_topk_prob' has type str",
                   "'moe_intermediate_size' must be a positive"):
        assert needle in text, (needle, text)


# ---- checkpoints ----------------------------------------------------------------------------------
SPEC = "qnextmoe_a"  # sparse layers 1 and 5, dense 0, 2, 3, 4


def _flat_params(params) -> dict:
    return {k: np.asarray(v) for k, v in flatten_paths(nnx.to_pure_dict(params)).items()}


def test_fused_and_per_expert_checkpoints_give_the_same_params(tmp_path):
    """save_pretrained writes one tensor per expert; the state dict (and Qwen3.5-MoE checkpoints) hold
    them fused. Both, read from safetensors, give exactly the params built from the state dict."""
    model = hf_model(SPEC)
    model.save_pretrained(tmp_path / "per_expert")
    with safe_open(str(tmp_path / "per_expert" / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names and not any("gate_up_proj" in n for n in names)
    (tmp_path / "fused").mkdir()
    save_file({k: v.detach().contiguous().numpy() for k, v in model.state_dict().items()},
              str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    want = _flat_params(converted(SPEC)[2])
    assert want["layers/1/mlp/experts/gate_up_proj"].shape == (4, 64, 52)
    for form in ("per_expert", "fused"):
        cfg, _, params = load_target(tmp_path / form)
        got = _flat_params(params)
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{form}: {k}")


def _tensors(tmp_path) -> tuple[dict, str]:
    model = hf_model(SPEC)
    model.save_pretrained(tmp_path / "src")
    with safe_open(str(tmp_path / "src" / "model.safetensors"), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, (tmp_path / "src" / "config.json").read_text()


def _write(directory, tensors: dict, config: str) -> None:
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(config)


def test_bad_moe_checkpoint_names_every_problem(tmp_path):
    tensors, config = _tensors(tmp_path)
    p1, p5 = "model.layers.1.mlp.", "model.layers.5.mlp."
    del tensors[p1 + "experts.2.up_proj.weight"]  # a missing expert tensor
    del tensors[p1 + "experts.0.gate_proj.weight"]
    tensors[p1 + "experts.4.gate_proj.weight"] = tensors[p1 + "experts.1.gate_proj.weight"]  # beyond num_experts
    tensors[p1 + "experts.3.down_proj.weight"] = np.ascontiguousarray(tensors[p1 + "experts.3.down_proj.weight"].T)
    # layer 5: fused experts of 3 experts (the config says 4), a router of 5 rows
    for part in ("gate_up_proj", "down_proj"):
        stack = [tensors.pop(f"{p5}experts.{e}.{n}.weight") for e in range(4)
                 for n in (("gate_proj", "up_proj") if part == "gate_up_proj" else ("down_proj",))]
        per = 2 if part == "gate_up_proj" else 1
        tensors[p5 + "experts." + part] = np.stack([np.concatenate(stack[e * per:(e + 1) * per]) for e in range(3)])
    tensors[p5 + "gate.weight"] = np.concatenate([tensors[p5 + "gate.weight"], tensors[p5 + "gate.weight"][:1]])
    _write(tmp_path / "bad", tensors, config)
    with pytest.raises(CheckpointError) as e:
        load_target(tmp_path / "bad")
    text = str(e.value)
    expected = [
        "'model.layers.1.mlp.experts.gate_up_proj': per-expert tensors: gate_proj missing for experts [0] (1)",
        "up_proj missing for experts [2] (1)", "gate_proj of experts [4] (1) beyond num_experts 4",
        "'model.layers.1.mlp.experts.down_proj': per-expert tensors: expert 3 down_proj has shape (26, 64), "
        "the config needs (64, 26)",
        "'model.layers.5.mlp.experts.gate_up_proj': has shape (3, 52, 64), the config needs (4, 52, 64)",
        "'model.layers.5.mlp.experts.down_proj': has shape (3, 64, 26), the config needs (4, 64, 26)",
        "'model.layers.5.mlp.gate.weight': has shape (5, 64), the config needs (4, 64)",
    ]
    for needle in expected:
        assert needle in text, (needle, text)
    assert len(e.value.problems) == 5 and "missing tensor" not in text  # each problem once


def test_experts_in_a_missing_shard_are_reported_once(tmp_path):
    """A shard that holds some of a layer's experts is missing: the shard is the problem (reported by
    the reader); its layer's stacked experts are not reported again as missing or incomplete."""
    tensors, config = _tensors(tmp_path)
    lost = [k for k in tensors if k.startswith("model.layers.1.mlp.experts.") and ".down_proj" not in k]
    d = tmp_path / "sharded"
    d.mkdir()
    kept = {k: v for k, v in tensors.items() if k not in lost}
    save_file(kept, str(d / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    index = {k: shards[0] for k in kept} | {k: shards[1] for k in lost}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    (d / "config.json").write_text(config)
    with pytest.raises(CheckpointError) as e:
        load_target(d)
    assert len(e.value.problems) == 1 and "model-00002-of-00002.safetensors' is missing" in e.value.problems[0]


def test_export_writes_fused_experts_that_hf_loads(tmp_path):
    """export_target (qwen3_5_moe_text) writes experts fused; HF's Qwen3_5MoeForCausalLM loads the
    directory and gives our logits; converting it back gives the same params."""
    import transformers as tf

    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.decode import prefill
    from ddtree_jax.training.export import export_target

    name = "q35moet_a"
    cfg, gd, params = converted(name)
    raw = hf_model(name).config.to_dict()
    export_target(str(tmp_path / "out"), raw, params, dtype="float32")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj").shape == (8, 44, 64)
    reloaded = _flat_params(load_target(tmp_path / "out")[2])
    for k, v in _flat_params(params).items():
        np.testing.assert_array_equal(reloaded[k], v, err_msg=k)
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, size=(1, 12)).astype(np.int32)
    model = tf.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "out", experts_implementation="eager").eval()
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits[0, -1].numpy()
    out = prefill(gd, params, init_target_cache(cfg, 1, 16), jnp.asarray(tokens), jnp.asarray([12], jnp.int32))
    np.testing.assert_allclose(np.asarray(out.logits)[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ---- in the model, through the kernels ----------------------------------------------------------------
@pytest.mark.slow  # ~15 s of interpret-mode kernel compilation
def test_moe_ffn_in_the_fused_residual_stream_matches_xla():
    """With kernels on, each residual add runs inside the next RMSNorm's kernel and the FFN output
    travels as the stream's pending delta: a sparse FFN there gives the XLA path's hidden states
    (a chain verify of 5 nodes after a prompt), also with the shared expert in the grouped kernel
    and with the pairs grouped by one launch."""
    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.decode import prefill
    from tests.tiny_models import make_target

    cfg, gd, params = make_target(dict(num_hidden_layers=2, layer_types=["full_attention"] * 2, head_dim=16), seed=5,
                                  base=HYBRID_MOE)
    rng = np.random.default_rng(0)
    cache = prefill(gd, params, init_target_cache(cfg, 2, 32), jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 8))),
                    jnp.asarray([8, 6], jnp.int32)).cache
    nodes = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)

    verify = jax.jit(lambda p, c, t, routes: nnx.merge(gd, p).verify(t, c, None, routes=routes)[0], static_argnums=3)
    ref = np.asarray(verify(params, cache, nodes, REFERENCE))
    got = np.asarray(verify(params, cache, nodes, INTERPRET))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
    # the shared expert inside the grouped kernel (moe_shared_in_grouped_kernel): the same logits
    grouped = np.asarray(verify(params, cache, nodes, INTERPRET.replace(moe_shared_in_grouped_kernel=True)))
    np.testing.assert_allclose(grouped, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
    # the pairs grouped by XLA's fusions instead of one kernel launch (moe_grouping_kernel): the same logits
    by_xla = np.asarray(verify(params, cache, nodes, INTERPRET.replace(moe_grouping_kernel=False)))
    np.testing.assert_array_equal(by_xla, got)


def test_shared_expert_runs_in_the_decode_kernels_at_one_token():
    """With kernels on, a one-token call (a batch-1 decode step) runs the shared expert as one more
    pair of the experts' decode launches (no product of its own); its output is the separate
    shared expert's within bf16 rounding; more tokens (the grouped kernel) keep it separate unless
    moe_shared_in_grouped_kernel puts it into the grouped launches."""
    from ddtree_jax.routes import Routes

    cfg, gd, params = _block({"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                              "shared_expert_intermediate_size": 32}, dtype=jnp.bfloat16)  # the kernel's sizes
    fused, apart = Routes(impl="pallas_interpret"), Routes(impl="pallas_interpret", moe_shared_in_decode_kernel=False)
    run = jax.jit(lambda p, x, routes: nnx.merge(gd, p)(x, routes), static_argnums=2)
    closed = lambda x, routes: jax.make_jaxpr(lambda p, x: nnx.merge(gd, p)(x, routes))(params, x)
    jaxpr = lambda x, routes: str(closed(x, routes))

    def xla_dots(jaxpr) -> int:  # dot_general equations outside the kernels
        n = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                continue
            n += eqn.primitive.name == "dot_general"
            for v in eqn.params.values():
                n += xla_dots(v.jaxpr) if hasattr(v, "consts") else xla_dots(v) if hasattr(v, "eqns") else 0
        return n

    rng = np.random.default_rng(5)
    one = jnp.asarray(rng.normal(size=(1, cfg.hidden_size)), jnp.bfloat16)
    # the shared expert's two products and its gate's are gone (the router's remains)
    assert xla_dots(closed(one, fused).jaxpr) == xla_dots(closed(one, apart).jaxpr) - 3
    gate_apart = Routes(impl="pallas_interpret", moe_gate_in_decode_kernel=False)
    assert xla_dots(closed(one, gate_apart).jaxpr) == xla_dots(closed(one, apart).jaxpr) - 2
    want = np.asarray(run(params, one, apart), np.float32)
    for routes in (fused, gate_apart):
        got = np.asarray(run(params, one, routes), np.float32)
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    many = jnp.asarray(rng.normal(size=(5, cfg.hidden_size)), jnp.bfloat16)
    assert jaxpr(many, fused) == jaxpr(many, apart)
    # moe_shared_in_grouped_kernel: at 5 tokens (the grouped kernel) the shared expert is one more
    # expert of its grouping; its two products are gone (its gate's product stays an XLA dot)
    grouped = Routes(impl="pallas_interpret", moe_shared_in_grouped_kernel=True)
    assert xla_dots(closed(many, grouped).jaxpr) == xla_dots(closed(many, apart).jaxpr) - 2
    want = np.asarray(run(params, many, apart), np.float32)
    got = np.asarray(run(params, many, grouped), np.float32)
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    assert jaxpr(one, grouped) == jaxpr(one, fused)  # one token: the decode path, as before


def test_one_token_block_hands_the_norm_its_weighted_parts():
    """parts_out (set where an add + RMSNorm kernel takes the block's output) with the shared expert
    in the decode kernels: the block returns SplitKParts, one weighted partial per routed choice
    and the shared expert's last, written by the experts' second launch; summed they are the
    combined output. moe_parts_into_norm off, several tokens, or kernels off: a plain array."""
    from ddtree_jax.models.layers import SplitKParts, dense
    from ddtree_jax.routes import Routes

    cfg, gd, params = _block({"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                              "shared_expert_intermediate_size": 32})
    gd = nnx.split(_with_parts_out(nnx.merge(gd, params)))[0]
    run = jax.jit(lambda p, x, routes: nnx.merge(gd, p)(x, routes), static_argnums=2)
    rng = np.random.default_rng(9)
    one = jnp.asarray(rng.normal(size=(1, cfg.hidden_size)), jnp.float32)
    off = Routes(impl="pallas_interpret", moe_parts_into_norm=False)
    parts = run(params, one, INTERPRET)
    assert isinstance(parts, SplitKParts) and parts.parts.shape == (cfg.moe_top_k + 1, 1, cfg.hidden_size)
    want = run(params, one, off)
    assert not isinstance(want, SplitKParts)
    np.testing.assert_allclose(np.asarray(dense(parts, jnp.float32)), np.asarray(want), rtol=1e-5,
                               atol=1e-5 * float(np.abs(want).max()))
    many = jnp.asarray(rng.normal(size=(3, cfg.hidden_size)), jnp.float32)
    assert not isinstance(run(params, many, INTERPRET), SplitKParts)
    assert not isinstance(run(params, one, REFERENCE), SplitKParts)
    # the decode path in one launch (moe_decode_fused) writes the same parts
    fused = run(params, one, Routes(impl="pallas_interpret", moe_decode_fused=True))
    assert isinstance(fused, SplitKParts) and fused.parts.shape == parts.parts.shape
    np.testing.assert_allclose(np.asarray(fused.parts), np.asarray(parts.parts), rtol=1e-5,
                               atol=1e-5 * float(np.abs(parts.parts).max()))


def test_one_token_block_chooses_its_experts_in_the_experts_launch():
    """Kernels on, one token (the decode path): the router's softmax top-k runs inside the experts'
    first launch (routes.moe_choice_in_experts), so the block has one kernel launch fewer and no
    softmax_top_k; bf16, with and without the weighted parts: the block's output within one bf16
    rounding of the choice's own launch (the softmax's float32 sum in another order; on these inputs
    bit-equal). Several tokens (the grouped kernel) keep the choice's own launch."""
    from ddtree_jax.models.layers import SplitKParts, dense
    from ddtree_jax.routes import Routes

    from tests.jaxpr_eqns import equations, kernel_name

    cfg, gd, params = _block({"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                              "shared_expert_intermediate_size": 32}, dtype=jnp.bfloat16)
    on, off = Routes(impl="pallas_interpret"), Routes(impl="pallas_interpret", moe_choice_in_experts=False)
    rng = np.random.default_rng(11)
    one = jnp.asarray(rng.normal(size=(1, cfg.hidden_size)), jnp.bfloat16)
    many = jnp.asarray(rng.normal(size=(3, cfg.hidden_size)), jnp.bfloat16)

    def kernels(gd, x, routes):
        jaxpr = jax.make_jaxpr(lambda p, x: nnx.merge(gd, p)(x, routes))(params, x).jaxpr
        return [kernel_name(e) for e in equations(jaxpr) if e.primitive.name == "pallas_call"]

    for graph in (gd, nnx.split(_with_parts_out(nnx.merge(gd, params)))[0]):
        run = jax.jit(lambda p, x, routes, graph=graph: dense(nnx.merge(graph, p)(x, routes), jnp.float32),
                      static_argnums=2)
        k_on, k_off = kernels(graph, one, on), kernels(graph, one, off)
        assert len(k_on) == len(k_off) - 1 and not any("softmax_top_k" in k for k in k_on), (k_on, k_off)
        assert any("softmax_top_k" in k for k in k_off)
        got, want = np.asarray(run(params, one, on)), np.asarray(run(params, one, off))
        assert np.abs(got - want).max() <= 2**-7 * np.abs(want).max()
        assert kernels(graph, many, on) == kernels(graph, many, off)
    assert isinstance(nnx.merge(nnx.split(_with_parts_out(nnx.merge(gd, params)))[0], params)(one, on), SplitKParts)


def _with_parts_out(block):
    block.parts_out = True
    return block


@pytest.mark.slow  # ~20 s of interpret-mode kernel compilation
def test_decode_step_with_moe_parts_into_the_norm_matches_the_combine():
    """A batch-1 decode step of a hybrid MoE target with kernels on: the layers hand their MoE parts
    to the next add + RMSNorm kernel (one launch fewer a layer); logits equal the step with XLA's
    combine within float32 rounding, and the program has fewer XLA equations."""
    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.decode import prefill
    from ddtree_jax.routes import Routes
    from tests.tiny_models import make_target

    cfg, gd, params = make_target(dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                       head_dim=16, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=32), seed=6, base=HYBRID_MOE)
    model = nnx.merge(gd, params)
    assert all(layer.mlp.parts_out for layer in model.layers)
    rng = np.random.default_rng(1)
    cache = prefill(gd, params, init_target_cache(cfg, 1, 32), jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 8))),
                    jnp.asarray([8], jnp.int32)).cache
    token = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 1)), jnp.int32)
    step = lambda p, c, t, routes: nnx.merge(gd, p).verify(t, c, None, routes=routes)[0]
    off = Routes(impl="pallas_interpret", moe_parts_into_norm=False)
    got = np.asarray(jax.jit(step, static_argnums=3)(params, cache, token, INTERPRET))
    want = np.asarray(jax.jit(step, static_argnums=3)(params, cache, token, off))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    count = lambda routes: len(jax.make_jaxpr(lambda p, c, t: step(p, c, t, routes))(params, cache, token).eqns)
    assert count(INTERPRET) < count(off)
    # the experts' decode path in one launch (moe_decode_fused): the same logits
    fused = Routes(impl="pallas_interpret", moe_decode_fused=True)
    one = np.asarray(jax.jit(step, static_argnums=3)(params, cache, token, fused))
    np.testing.assert_allclose(one, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    # the first launch's row loaded and padded (moe_decode_masked_row=false) instead of the default's
    # masked load: the same logits, bit for bit (the router's choice made by its own launch in both, so
    # that no reduction order differs between the two programs)
    apart = Routes(impl="pallas_interpret", moe_choice_in_experts=False)
    padded = apart.replace(moe_decode_masked_row=False)
    np.testing.assert_array_equal(np.asarray(jax.jit(step, static_argnums=3)(params, cache, token, padded)),
                                  np.asarray(jax.jit(step, static_argnums=3)(params, cache, token, apart)))
    # the choice inside the experts' first launch (the default) against its own launch: the same
    # logits within float32 rounding (the softmax's sum in another program's order)
    np.testing.assert_allclose(np.asarray(jax.jit(step, static_argnums=3)(params, cache, token, apart)), got,
                               rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    # both launches in the "cols" MMA form (moe_decode_rows=false): the same logits
    cols = np.asarray(jax.jit(step, static_argnums=3)(params, cache, token,
                                                      Routes(impl="pallas_interpret", moe_decode_rows=False)))
    np.testing.assert_allclose(cols, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
