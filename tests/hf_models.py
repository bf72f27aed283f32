"""Tiny random Hugging Face reference models and their reference runs, shared by the parity tests.

Every model is built in float32, eval mode, from a fixed seed, with ALL parameters randomised
(HF initialises norm weights to 0 or 1, A_log / dt_bias to fixed ranges; a broken norm or gate
would pass against those). The optional kernel packages (flash-linear-attention, causal-conv1d)
are NOT installed, so transformers runs its pure-PyTorch reference paths
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, `causal_conv1d_fn/update`).

Everything expensive (building a model, converting it, HF reference runs, compiled JAX runs) is
memoised per spec name, so test_parity.py and test_bf16.py share one copy per session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
from typing import Any

import numpy as np
import torch

from converters.params import target_params_from_tensors
from ddtree_jax.config import TargetConfig

V = 128  # vocab of every tiny model
H = 64  # hidden size of every tiny model

# Randomisation ranges (documented here, used by `randomise_`).
NORM_STD = 0.3  # zero-centred norms: w ~ N(0, 0.3); one-centred norms: w ~ 1 + N(0, 0.3)
A_RANGE = (0.05, 2.0)  # A = exp(A_log) ~ U(0.05, 2): decays that keep state across a 64-token chunk
DT_BIAS_STD = 1.0
BIAS_STD = 0.1
EMBED_STD = 0.4  # tied logits = h . e: a scale of ~20-30 rather than ~60
LM_HEAD_GAIN = 2.0  # untied lm_head std = 2 / sqrt(H): logits of a few units, clear argmax gaps


@dataclasses.dataclass(frozen=True)
class Spec:
    """One tiny reference model: HF model type, text-config overrides, tie, seed."""

    name: str
    model_type: str  # qwen3_5_text | qwen3_5 | qwen3_next | qwen3 | qwen3_5_moe_text | qwen3_5_moe
    text: str  # JSON of the text-config overrides (a string keeps the spec hashable)
    tie: bool
    seed: int
    slow: bool = False  # only run under -m slow

    @property
    def kwargs(self) -> dict[str, Any]:
        return json.loads(self.text)

    def describe(self) -> str:
        kw = self.kwargs
        rope = kw.get("rope_parameters", {})
        parts = [self.model_type]
        if self.model_type != "qwen3":
            parts.append(f"Hv/Hk={kw['linear_num_value_heads']}/{kw['linear_num_key_heads']}")
            parts.append(f"K={kw['linear_conv_kernel_dim']}")
        parts.append(f"heads={kw['num_attention_heads']}/{kw['num_key_value_heads']}x{kw['head_dim']}")
        parts.append(f"rot={rope.get('partial_rotary_factor', 1.0)}")
        parts.append("tied" if self.tie else "untied")
        return " ".join(parts)


def _spec(name, model_type, tie, seed, slow=False, **text) -> Spec:
    text = {"vocab_size": V, "hidden_size": H, **text}
    return Spec(name, model_type, json.dumps(text, sort_keys=True), tie, seed, slow)


def _rope(partial: float, theta: float = 10000.0) -> dict:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}


def _moe(experts, top_k, inter, shared) -> dict:
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                shared_expert_intermediate_size=shared)


def _gdn(hk, hv, dk, dv, kernel) -> dict:
    return dict(
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=kernel,
    )


# fmt: off
SPECS: dict[str, Spec] = {s.name: s for s in [
    # ---- Qwen3.5 text-only (Qwen3_5ForCausalLM) --------------------------------------------
    _spec("q35t_a", "qwen3_5_text", tie=False, seed=1,
          intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, rope_parameters=_rope(0.25), full_attention_interval=2, **_gdn(2, 4, 16, 16, 4)),
    _spec("q35t_b", "qwen3_5_text", tie=True, seed=2,
          intermediate_size=96, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
          head_dim=32, rope_parameters=_rope(0.5), full_attention_interval=3, **_gdn(1, 3, 16, 24, 3)),
    _spec("q35t_c", "qwen3_5_text", tie=False, seed=3,
          intermediate_size=128, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=3,
          head_dim=8, rope_parameters=_rope(1.0, 1e6), **_gdn(4, 4, 8, 16, 2),
          layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
    # ---- Qwen3.5 full checkpoint (Qwen3_5ForConditionalGeneration, text weights under language_model)
    _spec("q35_a", "qwen3_5", tie=True, seed=11,
          intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, rope_parameters=_rope(0.25), full_attention_interval=2, **_gdn(2, 4, 16, 16, 4)),
    _spec("q35_b", "qwen3_5", tie=False, seed=12,
          intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
          head_dim=16, rope_parameters=_rope(0.5), full_attention_interval=3, **_gdn(2, 6, 8, 16, 3)),
    _spec("q35_c", "qwen3_5", tie=False, seed=13, slow=True,
          intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
          head_dim=32, rope_parameters=_rope(1.0), full_attention_interval=4, **_gdn(2, 2, 16, 16, 2)),
    # ---- Qwen3-Next dense (fused in_proj_qkvz / in_proj_ba) ---------------------------------
    _spec("qnext_a", "qwen3_next", tie=False, seed=21, num_experts=0,
          intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, rope_parameters=_rope(0.25), full_attention_interval=4, **_gdn(2, 4, 16, 16, 4)),
    _spec("qnext_b", "qwen3_next", tie=True, seed=22, num_experts=0,
          intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
          head_dim=16, rope_parameters=_rope(0.5), full_attention_interval=2, **_gdn(1, 3, 16, 8, 3)),
    _spec("qnext_c", "qwen3_next", tie=False, seed=23, num_experts=0,
          intermediate_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
          head_dim=8, rope_parameters=_rope(1.0), full_attention_interval=2, **_gdn(3, 3, 8, 8, 2)),
    # ---- mixtures of experts: few experts, top-k > 1, odd widths. Decode steps of 2 rows run the
    # gathered expert form where 2 * top_k < num_experts (q35moet_a), the dense form otherwise.
    _spec("q35moet_a", "qwen3_5_moe_text", tie=False, seed=41,
          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          rope_parameters=_rope(0.25), full_attention_interval=2, **_gdn(2, 4, 16, 16, 4), **_moe(8, 3, 22, 36)),
    _spec("q35moe_a", "qwen3_5_moe", tie=True, seed=42,
          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
          rope_parameters=_rope(0.5), full_attention_interval=3, **_gdn(2, 6, 8, 16, 3), **_moe(5, 3, 18, 30)),
    # Qwen3-Next: sparse layers 1 and 5 (decoder_sparse_step 2; layer 3 kept dense by mlp_only_layers)
    _spec("qnextmoe_a", "qwen3_next", tie=False, seed=43, norm_topk_prob=False, decoder_sparse_step=2,
          mlp_only_layers=[3], intermediate_size=72, num_hidden_layers=6, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, rope_parameters=_rope(0.25), full_attention_interval=3,
          **_gdn(2, 4, 16, 16, 4), **_moe(4, 2, 26, 14)),
    _spec("qnextmoe_b", "qwen3_next", tie=True, seed=44, slow=True, norm_topk_prob=True, mlp_only_layers=[0],
          intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
          head_dim=16, rope_parameters=_rope(0.5), full_attention_interval=2, **_gdn(1, 3, 16, 8, 3),
          **_moe(6, 3, 20, 24)),
    # ---- Qwen3 (all attention, plain q/k norms, no output gate) -----------------------------
    _spec("qwen3_a", "qwen3", tie=False, seed=31,
          intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, rope_parameters=_rope(1.0)),
    _spec("qwen3_b", "qwen3", tie=True, seed=32, attention_bias=True,
          intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
          head_dim=16, rope_parameters=_rope(1.0, 1e6)),
    _spec("qwen3_c", "qwen3", tie=False, seed=33, slow=True,
          intermediate_size=128, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
          head_dim=8, rope_parameters=_rope(1.0)),
]}
# fmt: on

TINY_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=H, patch_size=4,
    num_position_embeddings=16,
)


# ---- building ------------------------------------------------------------------------------
def _hf_config(spec: Spec):
    from transformers import (Qwen3_5Config, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config,
                              Qwen3NextConfig)

    kw = spec.kwargs
    if spec.model_type == "qwen3_5_moe_text":
        return Qwen3_5MoeTextConfig(**kw, tie_word_embeddings=spec.tie)
    if spec.model_type == "qwen3_5_moe":
        text = Qwen3_5MoeTextConfig(**kw, tie_word_embeddings=spec.tie).to_dict()
        return Qwen3_5MoeConfig(text_config=text, vision_config=dict(TINY_VISION), tie_word_embeddings=spec.tie)
    if spec.model_type == "qwen3_5_text":
        return Qwen3_5TextConfig(**kw, tie_word_embeddings=spec.tie)
    if spec.model_type == "qwen3_5":
        # text_config carries the same tie flag as the top level here; HF itself only reads the top
        # level (test_qwen3_5_saved_checkpoint_ties_like_hf covers configs where they disagree).
        text = Qwen3_5TextConfig(**kw, tie_word_embeddings=spec.tie).to_dict()
        return Qwen3_5Config(text_config=text, vision_config=dict(TINY_VISION), tie_word_embeddings=spec.tie)
    if spec.model_type == "qwen3_next":
        return Qwen3NextConfig(**kw, tie_word_embeddings=spec.tie)
    if spec.model_type == "qwen3":
        return Qwen3Config(**kw, tie_word_embeddings=spec.tie)
    raise ValueError(spec.model_type)


def _hf_class(model_type: str):
    import transformers as tf

    return {
        "qwen3_5_text": tf.Qwen3_5ForCausalLM,
        "qwen3_5": tf.Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe_text": tf.Qwen3_5MoeForCausalLM,
        "qwen3_5_moe": tf.Qwen3_5MoeForConditionalGeneration,
        "qwen3_next": tf.Qwen3NextForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
    }[model_type]


@torch.no_grad()
def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded random values at sensible scales.

    - A_log: log(U(A_RANGE)); dt_bias: N(0, 1)
    - 1-D weights that HF initialises to all zeros (zero-centred RMSNorms): N(0, NORM_STD);
      all ones (GDN gated norm, Qwen3 RMSNorm, LayerNorm): 1 + N(0, NORM_STD); other 1-D (biases): N(0, 0.1)
    - embeddings: N(0, EMBED_STD); lm_head: N(0, LM_HEAD_GAIN / sqrt(fan_in)); other weights N(0, 1 / sqrt(fan_in))
      (fan_in: the last axis; of a stack of expert matrices [E, out, in] too)
    """
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        normal = lambda std, mean=0.0: torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean
        if name.endswith("A_log"):
            lo, hi = A_RANGE
            value = torch.log(torch.rand(p.shape, generator=gen) * (hi - lo) + lo)
        elif name.endswith("dt_bias"):
            value = normal(DT_BIAS_STD)
        elif p.ndim == 1:
            if bool(torch.all(p == 0)) and "norm" in name:
                value = normal(NORM_STD)
            elif bool(torch.all(p == 1)):
                value = normal(NORM_STD, 1.0)
            else:
                value = normal(BIAS_STD)
        elif "embed_tokens" in name or name.endswith("pos_embed.weight"):
            value = normal(EMBED_STD)
        else:
            fan_in = p.shape[-1] if p.ndim == 3 else math.prod(p.shape[1:])  # [E, out, in] experts; [C, 1, K] conv
            gain = LM_HEAD_GAIN if name.startswith("lm_head") else 1.0
            value = normal(gain / math.sqrt(fan_in))
        p.copy_(value.to(p.dtype))


@functools.lru_cache(maxsize=None)
def hf_model(name: str) -> torch.nn.Module:
    """The randomised float32 HF model of spec `name`, in eval mode (memoised)."""
    spec = SPECS[name]
    config = _hf_config(spec)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the modeling file's per-expert loop (not torch._grouped_mm)
    torch.manual_seed(spec.seed)
    model = _hf_class(spec.model_type)(config).to(torch.float32).eval()
    randomise_(model, spec.seed)
    if spec.tie:
        emb = model.get_input_embeddings().weight
        assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr(), "tied lm_head is not tied"
    assert model.config.model_type == spec.model_type, (model.config.model_type, spec.model_type)
    return model


def config_dict(name: str) -> dict:
    """The dict fed to TargetConfig.from_hf_dict: exactly what save_pretrained writes as config.json."""
    return hf_model(name).config.to_dict()


@functools.lru_cache(maxsize=None)
def target_config(name: str) -> TargetConfig:
    return TargetConfig.from_hf_dict(config_dict(name), source=f"tiny:{name}")


@functools.lru_cache(maxsize=None)
def converted(name: str, dtype: str = "float32"):
    """(cfg, graphdef, params) of our model converted from the HF state dict at `dtype`."""
    import jax.numpy as jnp

    cfg = target_config(name)
    sd = {k: v.detach().float().numpy() for k, v in hf_model(name).state_dict().items()}
    graphdef, params = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__, dtype=jnp.dtype(dtype))
    return cfg, graphdef, params


def num_layers(name: str) -> int:
    return len(hf_model(name).config.get_text_config().layer_types)


# ---- HF reference runs -----------------------------------------------------------------------
def prompt_tokens(seed: int, batch: int, length: int) -> np.ndarray:
    """Random prompt ids [batch, length] int32 (avoiding nothing: V is tiny and has no specials)."""
    return np.random.default_rng(seed).integers(0, V, size=(batch, length), dtype=np.int64).astype(np.int32)


@dataclasses.dataclass
class HFRun:
    prompt: np.ndarray  # [B, T] int32
    prefill_logits: np.ndarray  # [B, T, V] float32
    hidden: list  # HF hidden_states of the prompt: hidden[i] [B, T, H] for i in 0..num_layers
    step_inputs: np.ndarray  # [B, N] int32: token fed at decode step j (HF's own greedy choice)
    step_logits: np.ndarray  # [B, N, V]: logits after feeding step_inputs[:, j]
    step_hidden: list  # step_hidden[i] [B, N, H]: HF hidden_states[i] of every decode step

    @property
    def greedy(self) -> np.ndarray:
        """HF greedy continuation [B, N+1]: argmax of prefill's last logits, then of every step."""
        first = self.prefill_logits[:, -1].argmax(-1)[:, None]
        return np.concatenate([first, self.step_logits.argmax(-1)], axis=1).astype(np.int32)


@contextlib.contextmanager
def torch_threads(n: int):
    """Tiny models run fastest single-threaded (and do not fight JAX / other tests for cores)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@torch.no_grad()
@torch_threads(1)
def hf_run(model: torch.nn.Module, prompt: np.ndarray, steps: int, *, feed: np.ndarray | None = None) -> HFRun:
    """Prefill `prompt` with output_hidden_states and a cache, then `steps` cached one-token steps.

    Each step feeds HF's own greedy token (argmax of the previous logits) unless `feed` [B, steps]
    gives the tokens (teacher forcing). Position ids are passed explicitly on every step (the
    composite Qwen3.5 model would otherwise derive them from its rope_deltas bookkeeping).
    """
    ids = torch.as_tensor(prompt, dtype=torch.long)
    b, t = ids.shape
    out = model(input_ids=ids, use_cache=True, output_hidden_states=True)
    cache = out.cache
    logits = out.logits.float()
    hidden = [h.float().numpy() for h in out.hidden_states]
    nxt = logits[:, -1].argmax(-1)
    inputs, step_logits, step_hidden = [], [], []
    for j in range(steps):
        tok = nxt if feed is None else torch.as_tensor(feed[:, j], dtype=torch.long)
        pos = torch.full((b, 1), t + j, dtype=torch.long)
        out = model(input_ids=tok[:, None], cache=cache, use_cache=True, position_ids=pos, output_hidden_states=True)
        cache = out.cache
        inputs.append(tok.numpy())
        step_logits.append(out.logits[:, -1].float().numpy())
        step_hidden.append([h[:, -1].float().numpy() for h in out.hidden_states])
        nxt = out.logits[:, -1].argmax(-1)
    return HFRun(
        prompt=prompt,
        prefill_logits=logits.numpy(),
        hidden=hidden,
        step_inputs=np.stack(inputs, 1).astype(np.int32),
        step_logits=np.stack(step_logits, 1),
        step_hidden=[np.stack([s[i] for s in step_hidden], 1) for i in range(len(hidden))],
    )


PROMPT_LEN = 90  # > one GDN chunk (64): prefill runs two chunks, the second one partial
STEPS = 32
BATCH = 2
CAPACITY = PROMPT_LEN + STEPS + 8  # one cache shape for every run of a spec: compilations are shared


@functools.lru_cache(maxsize=None)
def reference(name: str, batch: int = BATCH, length: int = PROMPT_LEN, steps: int = STEPS) -> HFRun:
    """Memoised HF reference run of spec `name` on a seeded random prompt [batch, length]."""
    return hf_run(hf_model(name), prompt_tokens(1000 + SPECS[name].seed, batch, length), steps)


def hidden_ids(name: str) -> tuple[int, ...]:
    """Hidden states compared, deliberately unsorted and with gaps: the last layer's raw output
    (DFlash reads hs[id + 1]), the embeddings, the final normed output (num_layers), layer 0's output."""
    n = num_layers(name)
    return tuple(dict.fromkeys((n - 1, 0, n, 1)))


# ---- our model's runs ---------------------------------------------------------------------------
@dataclasses.dataclass
class JaxRun:
    prefill_logits: np.ndarray  # [B, T, V]
    features: np.ndarray  # [B, T, len(ids) * H]
    step_logits: np.ndarray  # [B, N, V] teacher-forced on the HF reference's step inputs
    step_features: np.ndarray  # [B, N, len(ids) * H]
    greedy: np.ndarray | None  # [B, N + 1] from greedy_decode on device after prefill (if asked)
    cache: Any  # TargetCache after prefill and the teacher-forced steps


@functools.lru_cache(maxsize=None)
def jax_run(name: str, dtype: str = "float32", with_greedy: bool = True) -> JaxRun:
    """Our model on the same prompt as `reference(name)`: prefill (all logits + features), the
    teacher-forced decode steps, and on-device greedy decoding (memoised; compiled functions are
    shared by every call with the same graphdef and shapes)."""
    import jax.numpy as jnp

    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.decode import decode_step, greedy_decode, prefill

    ref = reference(name)
    cfg, graphdef, params = converted(name, dtype)
    b, t = ref.prompt.shape
    n = ref.step_inputs.shape[1]
    ids = hidden_ids(name)
    cache = init_target_cache(cfg, b, CAPACITY, dtype=jnp.dtype(dtype))
    n_valid = jnp.full((b,), t, jnp.int32)
    out = prefill(graphdef, params, cache, jnp.asarray(ref.prompt), n_valid, hidden_ids=ids, all_logits=True)
    first_logits, after_prompt = out.logits[:, -1], out.cache
    cache, step_logits, step_feats = out.cache, [], []
    for j in range(n):
        o = decode_step(graphdef, params, cache, jnp.asarray(ref.step_inputs[:, j]), hidden_ids=ids)
        cache = o.cache
        step_logits.append(np.asarray(o.logits))
        step_feats.append(np.asarray(o.features))
    tokens = None
    if with_greedy:
        tokens, counts, _ = greedy_decode(graphdef, params, after_prompt, first_logits, n + 1)
        assert np.all(np.asarray(counts) == n + 1)
        tokens = np.asarray(tokens)
    return JaxRun(
        prefill_logits=np.asarray(out.logits),
        features=np.asarray(out.features.astype(jnp.float32)),
        step_logits=np.stack(step_logits, 1),
        step_features=np.stack(step_feats, 1).astype(np.float32),
        greedy=tokens,
        cache=cache,
    )


def split_features(features: np.ndarray, k: int) -> list[np.ndarray]:
    """Concatenated features [..., k * H] -> k arrays [..., H]."""
    return np.split(np.asarray(features, np.float32), k, axis=-1)


# ---- comparisons -----------------------------------------------------------------------------
def max_rel_diff(ours, ref) -> tuple[float, float]:
    """(max |ours - ref|, max(1, max |ref|)): the tests require diff <= tol * scale."""
    ours = np.asarray(ours, np.float32)
    ref = np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.max(np.abs(ours - ref))), max(1.0, float(np.max(np.abs(ref))))
