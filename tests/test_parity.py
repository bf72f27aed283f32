"""Parity of the JAX target with the Hugging Face reference implementations (float32).

For every model type x several tiny configs (tests/hf_models.py SPECS), on a batch of 2 random
prompts of 90 tokens (two GDN chunks of 64, the second partial):
  - prefill logits at every position and the hidden states hs[L-1], hs[0], hs[L], hs[1] (in that
    unsorted order; 0 = embeddings, L = final normed output) match HF's `output_hidden_states`;
  - 32 cached decode steps fed with HF's own greedy tokens match HF's incremental decoding
    (logits and hidden states), and our argmax equals HF's greedy token at every step;
  - the on-device `greedy_decode` reproduces HF's greedy continuation token for token;
  - right-padded batches of different lengths give each row the logits of its single-prompt run.

Tolerance: max |ours - HF| <= 1e-4 * max(1, max |HF|), each array against its own scale.
Measured (jax 0.10.2 CPU, highest matmul precision), max |diff| / scale over all positions / steps:

  spec     logit scale  prefill logits  prefill hidden  step logits  step hidden   greedy == HF
  q35t_a       9.2        6.9e-06         6.2e-06        4.2e-06      3.2e-06       33/33 x 2
  q35t_b      17.2        5.9e-06         7.9e-06        1.2e-06      1.3e-06       yes
  q35t_c       8.3        4.5e-05         3.7e-05        6.6e-06      8.6e-06       yes
  q35_a       15.3        5.3e-06         3.6e-06        8.4e-06      6.8e-06       yes
  q35_b        9.7        6.2e-06         5.7e-06        4.1e-06      4.5e-06       yes
  q35_c        8.9        4.5e-06         7.1e-06        1.8e-05      1.1e-05       yes
  qnext_a      8.3        1.8e-05         1.7e-05        1.0e-05      1.0e-05       yes
  qnext_b     15.2        1.2e-05         1.1e-05        3.0e-06      3.1e-06       yes
  qnext_c      9.6        8.1e-06         8.1e-06        2.6e-06      2.0e-06       yes
  qwen3_a/b/c  8.6-18.4   <= 9.4e-07      <= 1.1e-06     <= 8.4e-07   <= 9.2e-07    yes
  q35moet_a    8.6        5.2e-06         3.9e-06        9.0e-06      8.6e-06       yes
  q35moe_a    15.7        1.7e-05         1.7e-05        4.2e-06      6.5e-06       yes
  qnextmoe_a   7.5        9.8e-06         1.4e-05        6.2e-06      6.8e-06       yes
  qnextmoe_b  19.1        6.4e-06         5.9e-06        4.1e-06      5.7e-06       yes

The mixture-of-experts specs fail by ~1x the logit scale when the router's renormalisation is
flipped, the shared expert's sigmoid gate dropped or gate / up swapped in the experts.

The largest (q35t_c, 4.5e-5) is one prompt position where a GDN head's output has an RMS 35x
below the median, so the gated RMSNorm magnifies float32 rounding of o; it is conditioning, not a
formula difference (the neighbouring positions agree to ~1e-6).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_models import (
    SPECS,
    config_dict,
    hf_model,
    hf_run,
    hidden_ids,
    jax_run,
    max_rel_diff,
    num_layers,
    prompt_tokens,
    reference,
    split_features,
    target_config,
)
from tests.tolerance import assert_scaled_close

TOL = 1e-4


def _params(names):
    return [pytest.param(n, id=n, marks=[pytest.mark.slow] if SPECS[n].slow else []) for n in names]


ALL = _params(SPECS)
# One spec per model type for the (more expensive) ragged-batch test; the rest under -m slow.
RAGGED_DEFAULT = {"q35t_a", "q35_b", "qnext_b", "qwen3_a"}
RAGGED = [
    pytest.param(n, id=n, marks=[] if n in RAGGED_DEFAULT else [pytest.mark.slow]) for n in SPECS
]


def assert_close(ours, ref, what: str, tol: float = TOL):
    diff, scale = max_rel_diff(ours, ref)
    assert diff <= tol * scale, f"{what}: max abs diff {diff:.3e} > {tol:g} * scale {scale:.3f}"


# ---- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_config_matches_hf(name):
    """TargetConfig parsed from the HF config dict describes the HF model we compare against."""
    model = hf_model(name)
    spec = SPECS[name]
    text = model.config.get_text_config()
    cfg = target_config(name)
    assert config_dict(name)["model_type"] == spec.model_type
    assert cfg.model_type == spec.model_type
    assert cfg.num_layers == num_layers(name)
    want_types = ["attention"] * cfg.num_layers if spec.model_type == "qwen3" else [
        {"full_attention": "attention", "linear_attention": "gdn"}[t] for t in text.layer_types
    ]
    assert list(cfg.layer_types) == want_types
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        text.num_attention_heads, text.num_key_value_heads, text.head_dim
    )
    partial = text.rope_parameters.get("partial_rotary_factor", 1.0)
    assert cfg.rotary_dim == int(text.head_dim * partial)
    assert cfg.rope_theta == text.rope_parameters["rope_theta"]
    assert cfg.tie_word_embeddings == spec.tie
    if spec.model_type != "qwen3":
        assert (cfg.gdn_num_k_heads, cfg.gdn_num_v_heads) == (text.linear_num_key_heads, text.linear_num_value_heads)
        assert (cfg.gdn_k_head_dim, cfg.gdn_v_head_dim) == (text.linear_key_head_dim, text.linear_value_head_dim)
        assert cfg.conv_kernel == text.linear_conv_kernel_dim
    # The FFN slot of every layer: sparse exactly where HF built a sparse MoE block, with HF's sizes.
    hf_layers = model.model.language_model.layers if hasattr(model.model, "language_model") else model.model.layers
    sparse = ["experts" in dict(layer.mlp.named_children()) for layer in hf_layers]
    assert [k == "moe" for k in cfg.ffn_kinds] == sparse
    if any(sparse):
        assert (cfg.moe_num_experts, cfg.moe_top_k) == (text.num_experts, text.num_experts_per_tok)
        assert (cfg.moe_intermediate_size, cfg.moe_shared_intermediate_size) == (
            text.moe_intermediate_size, text.shared_expert_intermediate_size)
        assert cfg.moe_norm_topk_prob == getattr(text, "norm_topk_prob", True)  # Qwen3.5-MoE always renormalises


def test_specs_cover_the_variations():
    """The spec table covers what the acceptance asks for (keeps future edits honest)."""
    specs = list(SPECS.values())
    assert {s.model_type for s in specs} == {"qwen3_5_text", "qwen3_5", "qwen3_next", "qwen3", "qwen3_5_moe_text",
                                             "qwen3_5_moe"}
    gdn = [s.kwargs for s in specs if s.model_type != "qwen3"]
    assert {k["linear_num_value_heads"] // k["linear_num_key_heads"] for k in gdn} >= {1, 2, 3}
    assert {k["linear_conv_kernel_dim"] for k in gdn} >= {2, 3, 4}
    assert {s.kwargs["rope_parameters"]["partial_rotary_factor"] for s in specs} >= {0.25, 0.5, 1.0}
    assert {s.tie for s in specs} == {True, False}
    for t in ("qwen3_5_text", "qwen3_5", "qwen3_next", "qwen3"):
        assert {s.tie for s in specs if s.model_type == t and not s.slow} == {True, False}, t
    # Mixtures of experts in the default run: both Qwen3.5-MoE forms and Qwen3-Next with sparse and dense
    # layers mixed (decoder_sparse_step > 1 and an mlp_only_layers entry), top-k > 1, few experts.
    moe = [s.kwargs for s in specs if "num_experts" in s.kwargs and s.kwargs["num_experts"] and not s.slow]
    assert {s.model_type for s in specs if s.kwargs.get("num_experts") and not s.slow} == {
        "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next"}
    assert all(k["num_experts_per_tok"] > 1 and k["num_experts"] <= 8 for k in moe)
    assert {2 * k["num_experts_per_tok"] < k["num_experts"] for k in moe} == {True, False}  # both expert forms
    assert any(k.get("decoder_sparse_step", 1) > 1 and k.get("mlp_only_layers") for k in moe)
    assert {k.get("norm_topk_prob", True) for s in specs for k in [s.kwargs] if s.model_type == "qwen3_next"
            and k.get("num_experts")} == {True, False}


def test_randomised_parameters_are_not_at_init():
    """No parameter keeps HF's constant init (zeros / ones norms, ones dt_bias)."""
    for name in ("q35t_a", "q35_a", "qnext_a", "qwen3_b", "q35moet_a", "qnextmoe_a"):
        for pname, p in hf_model(name).named_parameters():
            flat = p.detach().flatten()
            assert flat.numel() == 1 or float(flat.std()) > 0, f"{name}: {pname} is constant"


# ---- prefill -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_prefill_logits_and_hidden_states(name):
    ref, ours = reference(name), jax_run(name)
    assert ref.prompt.shape == (2, 90)
    assert_close(ours.prefill_logits, ref.prefill_logits, "prefill logits (all positions)")
    ids = hidden_ids(name)
    assert 0 in ids and num_layers(name) in ids
    for i, feat in zip(ids, split_features(ours.features, len(ids))):
        assert_close(feat, ref.hidden[i], f"prefill hidden_states[{i}]")


# ---- decode ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_decode_steps_match_hf_incremental(name):
    ref, ours = reference(name), jax_run(name)
    n = ref.step_inputs.shape[1]
    assert n >= 32
    for j in range(n):
        assert_close(ours.step_logits[:, j], ref.step_logits[:, j], f"decode step {j} logits")
    ids = hidden_ids(name)
    for i, feat in zip(ids, split_features(ours.step_features, len(ids))):
        assert_close(feat, ref.step_hidden[i], f"decode hidden_states[{i}]")
    # Our greedy choice after each teacher-forced step is HF's greedy token.
    np.testing.assert_array_equal(ours.step_logits.argmax(-1), ref.greedy[:, 1:])
    np.testing.assert_array_equal(ours.prefill_logits[:, -1].argmax(-1), ref.greedy[:, 0])


@pytest.mark.parametrize("name", ALL)
def test_greedy_decode_on_device_matches_hf_greedy(name):
    ref, ours = reference(name), jax_run(name)
    np.testing.assert_array_equal(ours.greedy, ref.greedy)


# ---- ragged batch ------------------------------------------------------------------------------
# Second row's length per spec: 70 ends inside the second GDN chunk, 41 inside the first (the whole
# second chunk of that row is padding). The first row has the full 90 tokens.
RAGGED_SECOND = {"q35t_a": 70, "q35_b": 41, "qnext_b": 70, "qwen3_a": 41}
RAGGED_STEPS = 8


@pytest.mark.parametrize("name", RAGGED)
def test_ragged_batch_rows_equal_single_prompt_runs(name):
    """Two prompts of different lengths, right-padded into one batch (n_valid differs): every row's
    prefill logits (real positions), last-token logits and features, and the decode steps that
    follow (each row at its own position) equal that prompt's own batch-1 HF run."""
    import jax.numpy as jnp

    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.decode import decode_step, prefill
    from hf_models import BATCH, CAPACITY, PROMPT_LEN, converted

    cfg, graphdef, params = converted(name)
    lengths = (PROMPT_LEN, RAGGED_SECOND.get(name, 57))
    assert len(lengths) == BATCH  # same shapes as jax_run: the compiled prefill / decode are reused
    # Padding holds real token ids (not a pad id), so any leak of padding into the state shows.
    tokens = prompt_tokens(2000 + SPECS[name].seed, BATCH, PROMPT_LEN)
    singles = [hf_run(hf_model(name), tokens[r : r + 1, :n], RAGGED_STEPS) for r, n in enumerate(lengths)]
    n_valid = jnp.asarray(lengths, jnp.int32)
    ids = hidden_ids(name)
    cache = init_target_cache(cfg, BATCH, CAPACITY)
    out = prefill(graphdef, params, cache, jnp.asarray(tokens), n_valid, hidden_ids=ids, all_logits=True)
    last = prefill(graphdef, params, cache, jnp.asarray(tokens), n_valid, hidden_ids=ids)
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), lengths)
    feats, last_feats = split_features(out.features, len(ids)), split_features(last.features, len(ids))
    for r, (n, ref) in enumerate(zip(lengths, singles)):
        assert_close(np.asarray(out.logits)[r, :n], ref.prefill_logits[0], f"row {r} (n={n}) prefill logits")
        assert_close(np.asarray(last.logits)[r], ref.prefill_logits[0, -1], f"row {r} last-token logits")
        for k, i in enumerate(ids):
            assert_close(feats[k][r, :n], ref.hidden[i][0], f"row {r} hidden_states[{i}]")
            assert_close(last_feats[k][r], ref.hidden[i][0, -1], f"row {r} last-token hidden_states[{i}]")
    # The prefill caches of both entry points are the same: lengths exactly, floats within 1e-5 of
    # their magnitude (two compiled programs, whose float32 sums XLA may round differently). K / V
    # slots at or past a row's length hold its padding's keys, which nothing reads (the next steps
    # overwrite them): only each row's own positions count.
    kv_mask, both = kv_leaf_mask(out.cache), list(zip(jax_leaves(out.cache), jax_leaves(last.cache)))
    assert len(kv_mask) == len(both) and any(kv_mask) == (len(cfg.attention_layers) > 0)
    for (x, y), kv in zip(both, kv_mask):
        if kv:
            for r, n in enumerate(lengths):
                assert_scaled_close(x[r, :, :n], y[r, :, :n], 1e-5, f"the two prefills' K / V caches, row {r}")
        elif np.issubdtype(x.dtype, np.floating):
            assert_scaled_close(x, y, 1e-5, "the two prefills' caches")
        else:
            np.testing.assert_array_equal(x, y)
    cache = out.cache
    for j in range(RAGGED_STEPS):
        feed = np.asarray([ref.step_inputs[0, j] for ref in singles], np.int32)
        o = decode_step(graphdef, params, cache, jnp.asarray(feed), hidden_ids=ids)
        cache = o.cache
        for r, ref in enumerate(singles):
            assert_close(np.asarray(o.logits)[r], ref.step_logits[0, j], f"row {r} decode step {j}")
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(lengths) + RAGGED_STEPS)


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def kv_leaf_mask(cache) -> list[bool]:
    """Per leaf of a target cache (jax_leaves' order): is it an attention layer's K or V
    ([batch, kv heads, capacity, head dim])?"""
    import jax

    from ddtree_jax.cache import KVCache

    def mark(node):
        if isinstance(node, KVCache):
            return jax.tree_util.tree_map(lambda _: False, node)._replace(k=True, v=True)
        return jax.tree_util.tree_map(lambda _: False, node)

    marked = jax.tree_util.tree_map(mark, cache, is_leaf=lambda n: isinstance(n, KVCache))
    return jax.tree_util.tree_leaves(marked)


@pytest.mark.parametrize("name", ["q35t_a", "qwen3_a"])
def test_inactive_rows_keep_their_state(name):
    """decode_step with active=False for a row keeps that row's length, recurrent state, conv window
    and committed KV entries, so its next real step still matches HF. (The inactive row's KV slot
    at position `length` is overwritten with junk; it is not visible and the next step rewrites it.)"""
    import jax.numpy as jnp

    from ddtree_jax.cache import KVCache, init_target_cache
    from ddtree_jax.decode import decode_step, prefill
    from hf_models import CAPACITY, converted

    ref = reference(name)
    cfg, graphdef, params = converted(name)
    b, t = ref.prompt.shape
    ids = hidden_ids(name)
    cache = init_target_cache(cfg, b, CAPACITY)
    n_valid = jnp.full((b,), t, jnp.int32)
    cache = prefill(graphdef, params, cache, jnp.asarray(ref.prompt), n_valid, hidden_ids=ids, all_logits=True).cache
    junk = jnp.asarray([5, 7], jnp.int32)
    skipped = decode_step(graphdef, params, cache, junk, active=jnp.asarray([False, True])).cache
    assert int(skipped.lengths[0]) == t and int(skipped.lengths[1]) == t + 1
    for old, new in zip(cache.layers, skipped.layers):
        for a, c in zip(old, new):
            a, c = np.asarray(a)[0], np.asarray(c)[0]
            if isinstance(old, KVCache):
                a, c = a[:, :t], c[:, :t]
            np.testing.assert_array_equal(a, c)
    o = decode_step(graphdef, params, skipped, jnp.asarray(ref.step_inputs[:, 0]), hidden_ids=ids)
    assert_close(np.asarray(o.logits)[0], ref.step_logits[0, 0], "row 0 after an inactive step")


# ---- checkpoints written by save_pretrained -------------------------------------------------------
@pytest.mark.parametrize("top_tie, text_tie", [(True, None), (False, True)], ids=["top-tied", "text-tied"])
def test_qwen3_5_saved_checkpoint_ties_like_hf(tmp_path, top_tie, text_tie):
    """Qwen3_5ForConditionalGeneration ties lm_head by the TOP-LEVEL `tie_word_embeddings`; its
    text_config carries its own copy (default False; config.json always writes it). A tied model
    saved by save_pretrained has top-level true, text_config false and no lm_head.weight. Our
    config must follow the top level, convert the saved files, and reproduce HF's logits."""
    import jax.numpy as jnp
    from safetensors import safe_open
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from converters.params import target_params_from_tensors
    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.config import TargetConfig
    from ddtree_jax.decode import prefill
    from hf_models import TINY_VISION, randomise_

    text = dict(SPECS["q35_a"].kwargs)
    if text_tie is not None:
        text["tie_word_embeddings"] = text_tie
    config = Qwen3_5Config(text_config=text, vision_config=dict(TINY_VISION), tie_word_embeddings=top_tie)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    randomise_(model, 7)
    model.tie_weights()  # re-tie after randomising (no-op for an untied model)
    hf_tied = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert hf_tied == top_tie
    model.save_pretrained(tmp_path)

    cfg = TargetConfig.from_file(tmp_path)
    assert cfg.tie_word_embeddings == top_tie, "tie_word_embeddings must come from the top-level config"
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        graphdef, params = target_params_from_tensors(cfg, list(f.keys()), f.get_tensor)
    tokens = prompt_tokens(5, 1, 12)
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits[0, -1].float().numpy()
    out = prefill(graphdef, params, init_target_cache(cfg, 1, 16), jnp.asarray(tokens), jnp.asarray([12], jnp.int32))
    assert_close(np.asarray(out.logits)[0], want, "last-token logits of the saved checkpoint")

