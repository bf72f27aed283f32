"""Parity of the JAX Mamba2-family targets (mamba2, bamba, nemotron_h) with transformers (float32).

For every spec of tests/hf_mamba_models.py (n_groups 1/2/4, head shapes, conv kernels 3/4, chunk
sizes 8/16 < the 40-token prompt so prefill runs several chunks with a partial last one, conv
with and without bias, projection biases, tied / untied heads, MoE with group routing and a
latent projection), on a batch of 2 random prompts:
  - prefill logits at every position and the hidden states match HF's `output_hidden_states`;
  - 32 cached decode steps fed with HF's own greedy tokens (explicit position ids) match HF's
    incremental decoding, and our argmax equals HF's greedy token at every step;
  - the on-device `greedy_decode` reproduces HF's greedy continuation token for token;
  - ragged batches: each row of a right-padded batch equals its own batch-1 HF run.
The dt clamp rule (clip to the effective time_step_limit on every path) is checked against HF's
full forward on `nemo_clamp`, where HF's own cached decode disagrees with its full forward.

Tolerance: max |ours - HF| <= 1e-4 * max(1, max |HF|).
"""

from __future__ import annotations

import numpy as np
import pytest

from hf_mamba_models import (
    BATCH,
    CAPACITY,
    PROMPT_LEN,
    SPECS,
    STEPS,
    config_dict,
    converted,
    hf_full_forward,
    hf_hidden_index,
    hf_model,
    hf_run,
    hidden_ids,
    jax_run,
    max_rel_diff,
    prompt_tokens,
    reference,
    target_config,
)

TOL = 1e-4
PARITY = [n for n in SPECS if n != "nemo_clamp"]


def _params(names):
    return [pytest.param(n, id=n, marks=[pytest.mark.slow] if SPECS[n].slow else []) for n in names]


def assert_close(ours, ref, what: str, tol: float = TOL):
    diff, scale = max_rel_diff(ours, ref)
    assert diff <= tol * scale, f"{what}: max abs diff {diff:.3e} > {tol:g} * scale {scale:.3f}"


# ---- config ------------------------------------------------------------------------------------
def test_specs_cover_the_variations():
    specs = [SPECS[n] for n in PARITY]
    by_type = {t: [s for s in specs if s.model_type == t] for t in ("mamba2", "bamba", "nemotron_h")}
    for t, ss in by_type.items():
        assert len(ss) >= 2, t
        if t != "nemotron_h":  # NemotronH never ties (checked in test_config_matches_hf)
            assert {s.tie for s in ss} == {True, False}, t
        assert {target_config(s.name).mamba_n_groups for s in ss} >= {1, 2}, t
        assert {target_config(s.name).mamba_chunk_size for s in ss} >= {8, 16}, t
        assert all(target_config(s.name).mamba_chunk_size < PROMPT_LEN for s in ss), t
    assert any(not target_config(n).mamba_conv_bias for n in PARITY)
    assert any(target_config(n).mamba_proj_bias for n in PARITY)
    assert any(target_config(n).moe_latent_size for n in PARITY)
    assert any(target_config(n).moe_n_group > 1 for n in PARITY)


@pytest.mark.parametrize("name", _params(SPECS))
def test_config_matches_hf(name):
    from ddtree_jax.config import ATTENTION, MAMBA2, MLP, MOE

    hf = hf_model(name).config
    cfg = target_config(name)
    kinds = {"linear_attention": MAMBA2, "full_attention": ATTENTION, "mlp": MLP, "moe": MOE}
    assert list(cfg.layer_types) == [kinds[t] for t in hf.layer_types]
    mixer = next(m for m in hf_model(name).modules() if hasattr(m, "ssm_state_size"))
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size, cfg.mamba_n_groups) == (
        mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups
    )
    assert (cfg.conv_kernel, cfg.mamba_chunk_size, cfg.mamba_conv_bias) == (
        mixer.conv_kernel_size, mixer.chunk_size, mixer.use_conv_bias
    )
    assert cfg.mamba_dt_limit == tuple(float(v) for v in mixer.time_step_limit)
    assert cfg.tie_word_embeddings == SPECS[name].tie
    model = hf_model(name)
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert cfg.tie_word_embeddings == tied
    assert config_dict(name)["model_type"] == SPECS[name].model_type


def test_randomised_parameters_are_not_at_init():
    for name in ("mamba2_a", "bamba_a", "nemo_b"):
        model = hf_model(name)
        named = list(model.named_parameters()) + list(model.named_buffers())
        for pname, p in named:
            if "inv_freq" in pname:
                continue
            flat = p.detach().flatten().float()
            assert flat.numel() == 1 or float(flat.std()) > 0, f"{name}: {pname} is constant"


# ---- prefill, decode, greedy ---------------------------------------------------------------------
@pytest.mark.parametrize("name", _params(PARITY))
def test_prefill_logits_and_hidden_states(name):
    ref, ours = reference(name), jax_run(name)
    assert_close(ours.prefill_logits, ref.prefill_logits, "prefill logits (all positions)")
    ids = hidden_ids(name)
    for i, feat in zip(ids, np.split(ours.features, len(ids), axis=-1)):
        j = hf_hidden_index(name, i)
        if j is not None:
            assert_close(feat, ref.hidden[j], f"prefill hidden_states[{j}] (our id {i})")


@pytest.mark.parametrize("name", _params(PARITY))
def test_decode_steps_match_hf_incremental(name):
    ref, ours = reference(name), jax_run(name)
    assert ref.step_inputs.shape[1] == STEPS >= 32
    for j in range(STEPS):
        assert_close(ours.step_logits[:, j], ref.step_logits[:, j], f"decode step {j} logits")
    np.testing.assert_array_equal(ours.step_logits.argmax(-1), ref.greedy[:, 1:])
    np.testing.assert_array_equal(ours.prefill_logits[:, -1].argmax(-1), ref.greedy[:, 0])


@pytest.mark.parametrize("name", _params(PARITY))
def test_greedy_decode_on_device_matches_hf_greedy(name):
    np.testing.assert_array_equal(jax_run(name).greedy, reference(name).greedy)


# ---- ragged batch ------------------------------------------------------------------------------
RAGGED = {"mamba2_a": 23, "bamba_a": 17, "nemo_a": 29}
RAGGED_STEPS = 6


@pytest.mark.parametrize("name", list(RAGGED))
def test_ragged_batch_rows_equal_single_prompt_runs(name):
    """Right-padded rows of different lengths (padding holds real token ids, so a leak into the
    SSM state or the conv window shows) equal each prompt's own batch-1 HF run, in prefill and
    in the decode steps that follow."""
    import jax.numpy as jnp

    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.decode import decode_step, prefill

    cfg, graphdef, params = converted(name)
    lengths = (PROMPT_LEN, RAGGED[name])
    tokens = prompt_tokens(2000 + SPECS[name].seed, BATCH, PROMPT_LEN)
    singles = [hf_run(hf_model(name), tokens[r : r + 1, :n], RAGGED_STEPS) for r, n in enumerate(lengths)]
    cache = init_target_cache(cfg, BATCH, CAPACITY)
    out = prefill(graphdef, params, cache, jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32), all_logits=True)
    for r, (n, ref) in enumerate(zip(lengths, singles)):
        assert_close(np.asarray(out.logits)[r, :n], ref.prefill_logits[0], f"row {r} (n={n}) prefill logits")
    cache = out.cache
    for j in range(RAGGED_STEPS):
        feed = np.asarray([ref.step_inputs[0, j] for ref in singles], np.int32)
        o = decode_step(graphdef, params, cache, jnp.asarray(feed))
        cache = o.cache
        for r, ref in enumerate(singles):
            assert_close(np.asarray(o.logits)[r], ref.step_logits[0, j], f"row {r} decode step {j}")


# ---- the dt clamp rule ---------------------------------------------------------------------------
def test_dt_clamp_one_rule_on_every_path():
    """nemo_clamp keeps time_step_min = 1e-3 and has heads whose dt falls below it. HF's cached
    decode skips the clamp while its full (chunked) forward applies it, so the two disagree; ours
    applies it on every path, so our prefill AND our cached decode steps equal HF's full forward
    over the whole sequence."""
    import jax.numpy as jnp

    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.decode import decode_step, prefill

    name = "nemo_clamp"
    cfg, graphdef, params = converted(name)
    assert cfg.mamba_dt_limit == (1e-3, float("inf"))
    ref = reference(name)  # HF cached: prefill (clamped) + decode steps (not clamped)
    seq = np.concatenate([ref.prompt, ref.step_inputs], axis=1)
    full = hf_full_forward(hf_model(name), seq)  # clamped at every position
    # The fixture does exercise the clamp: HF's own two paths disagree.
    hf_gap, scale = max_rel_diff(ref.step_logits, full[:, PROMPT_LEN:])
    assert hf_gap > 10 * TOL * scale, f"fixture does not trigger the dt clamp (HF gap {hf_gap:.2e})"
    cache = init_target_cache(cfg, BATCH, CAPACITY)
    out = prefill(graphdef, params, cache, jnp.asarray(ref.prompt), jnp.full((BATCH,), PROMPT_LEN, jnp.int32),
                  all_logits=True)
    assert_close(np.asarray(out.logits), full[:, :PROMPT_LEN], "prefill vs HF full forward")
    cache = out.cache
    for j in range(STEPS):
        o = decode_step(graphdef, params, cache, jnp.asarray(ref.step_inputs[:, j]))
        cache = o.cache
        assert_close(np.asarray(o.logits), full[:, PROMPT_LEN + j], f"decode step {j} vs HF full forward")


# ---- checkpoints on disk and config errors ---------------------------------------------------------
def _flat(params):
    import jax
    from flax import nnx

    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


@pytest.mark.parametrize("name", ["mamba2_a", "bamba_b", "nemo_b"])
def test_save_pretrained_loads_and_converts_exactly(name, tmp_path):
    """save_pretrained writes the on-disk layout (`backbone.` prefix, per-expert NemotronH tensors,
    transformers' {"__float__": "Infinity"} in config.json); load_target and the Orbax conversion
    give exactly the params converted from the in-memory state dict."""
    from converters.load import convert_target, load_target

    src, dst = tmp_path / "hf", tmp_path / "converted"
    hf_model(name).save_pretrained(src)
    _, _, want = converted(name)
    cfg, _, got = load_target(src)
    assert cfg == target_config(name).replace(dtype="float32")
    a, b = _flat(got), _flat(want)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    convert_target(src, dst, progress=False)
    _, _, restored = load_target(dst)
    for k, v in _flat(restored).items():
        np.testing.assert_array_equal(v, b[k], err_msg=k)


def test_missing_expert_is_reported(tmp_path):
    from safetensors.numpy import load_file, save_file

    from converters.keymap import CheckpointError
    from converters.load import load_target

    hf_model("nemo_a").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    gone = "backbone.layers.1.mixer.experts.2.up_proj.weight"
    del tensors[gone]
    del tensors["backbone.layers.0.mixer.D"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_target(tmp_path)
    text = str(err.value)
    assert "mixer.experts.up_proj" in text and "missing [2]" in text
    assert "layers/0/mamba/D" in text


def test_config_problems_are_all_reported():
    from ddtree_jax.config import ConfigError, TargetConfig

    raw = config_dict("nemo_b")
    raw.update(mlp_hidden_act="gelu", mamba_hidden_act="relu", sliding_window=128, n_group=3,
               layers_block_type=raw["layers_block_type"] + ["cross_attention"])
    with pytest.raises(ConfigError) as err:
        TargetConfig.from_hf_dict(raw)
    problems = err.value.problems
    for needle in ("mlp_hidden_act 'gelu'", "mamba_hidden_act 'relu'", "sliding_window", "multiple of n_group",
                   "'cross_attention'"):
        assert any(needle in p for p in problems), (needle, problems)
    raw = config_dict("mamba2_b")
    raw.update(expand=3, n_groups=3, time_step_limit=[1.0, 0.5])
    with pytest.raises(ConfigError) as err:
        TargetConfig.from_hf_dict(raw)
    text = str(err.value)
    assert "hidden_size * expand" in text and "multiple of the mamba n_groups" in text and "time_step_limit" in text
    raw = config_dict("bamba_a")
    raw.update(attn_layer_indices=[1, 7])
    with pytest.raises(ConfigError, match=r"attn_layer_indices \[7\] out of range"):
        TargetConfig.from_hf_dict(raw)
    # Legacy NemotronH names (hybrid_override_pattern, mamba_* aliases) parse like the new ones.
    raw = config_dict("nemo_a")
    legacy = {k: v for k, v in raw.items() if k not in ("layers_block_type", "n_groups", "chunk_size")}
    legacy.update(hybrid_override_pattern="ME*-", mamba_n_groups=raw["n_groups"], mamba_chunk_size=raw["chunk_size"])
    assert TargetConfig.from_hf_dict(legacy) == target_config("nemo_a")
