"""Tiny Mamba2-family targets for the tests: HF reference models (mamba2, bamba, nemotron_h) and
random JAX-only targets for the tree / generation property tests.

HF models are float32, eval mode, ALL parameters randomised (norm weights, D, dt_bias, A_log,
conv bias, MoE router and its e_score_correction_bias buffer included), and run with transformers'
pure-PyTorch paths (`mamba2_chunk_scan`, `mamba2_selective_state_update`, `causal_conv1d_fn/update`:
mamba-ssm and causal-conv1d are NOT installed). torch is imported lazily, so the JAX-only
helpers do not pay for it.

The dt clamp (ddtree_jax/models/mamba2.py): we clip dt to the effective time_step_limit on every
path. HF clips only in its chunked forward, so NemotronH parity fixtures set time_step_min = 1e-12
(clamp inactive: HF's cached decode and full forward agree); `nemo_clamp` keeps the default 1e-3
with very negative dt_bias on some heads, where only HF's full (chunked) forward is our reference.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import numpy as np

V = 128
H = 64

# ---- JAX-only tiny targets (tree / generation property tests) ------------------------------------
TINY = {
    "nemotron_h": dict(
        model_type="nemotron_h", vocab_size=64, hidden_size=32, intermediate_size=48,
        layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=4, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, routed_scaling_factor=1.5,
        time_step_min=0.05,  # the clamp is ACTIVE for some tokens: every path must apply it alike
    ),
    "bamba": dict(
        model_type="bamba", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=3, mamba_chunk_size=4, mamba_expand=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "mamba2": dict(
        model_type="mamba2", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
        expand=2, state_size=8, n_groups=2, conv_kernel=4, chunk_size=4, tie_word_embeddings=True,
    ),
}


def random_jax_params(params, seed: int, scale: float = 0.4):
    """Every parameter random at a sane scale (norm weights around 1, A = exp(A_log) in (0.05, 2),
    dt_bias ~ N(0, 1) with one very negative entry per layer so the dt clamp triggers)."""
    import jax
    import jax.numpy as jnp

    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(seed)
    leaves = []
    for path, leaf in flat:
        name = jax.tree_util.keystr(path)
        shape = leaf.shape
        if "A_log" in name:
            value = np.log(rng.uniform(0.05, 2.0, shape))
        elif "dt_bias" in name:
            value = rng.normal(0.0, 1.0, shape)
            value[0] = -7.0  # softplus(-7 + x) ~ 1e-3: below time_step_min for most tokens
        elif "norm" in name:
            value = rng.normal(1.0, 0.3, shape)
        elif "embedding" in name:
            value = rng.normal(0.0, 1.0, shape)
        elif name.endswith("'D']") or "correction_bias" in name or "bias" in name:
            value = rng.normal(0.0, 0.3, shape) + (1.0 if name.endswith("'D']") else 0.0)
        else:
            fan_in = shape[-2] if len(shape) >= 2 else 1
            value = rng.normal(0.0, scale * 2.0 / np.sqrt(max(fan_in, 1)), shape)
        leaves.append(jnp.asarray(value, leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def make_jax_target(name: str, seed: int = 0, overrides: dict | None = None):
    """(cfg, graphdef, params) of a tiny random JAX target of family `name`."""
    from flax import nnx

    from ddtree_jax.config import TargetConfig
    from ddtree_jax.models.target import TargetModel

    raw = dict(TINY[name])
    raw.update(overrides or {})
    cfg = TargetConfig.from_hf_dict(raw)
    graphdef, params = nnx.split(TargetModel(cfg, rngs=nnx.Rngs(seed)))
    return cfg, graphdef, random_jax_params(params, seed)


# ---- HF reference models ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    model_type: str  # mamba2 | bamba | nemotron_h
    text: str  # JSON of the config kwargs
    seed: int
    slow: bool = False
    neg_dt_heads: int = 0  # heads per mamba layer whose dt_bias is set very negative (dt clamp fixtures)

    @property
    def kwargs(self) -> dict[str, Any]:
        return json.loads(self.text)

    @property
    def tie(self) -> bool:
        """Whether HF ties lm_head to the embedding (NemotronH never does, whatever the config says)."""
        return self.model_type != "nemotron_h" and bool(self.kwargs.get("tie_word_embeddings", False))

    def describe(self) -> str:
        kw = self.kwargs
        if self.model_type == "mamba2":
            heads, g, n, k, c = kw["num_heads"], kw["n_groups"], kw["state_size"], kw["conv_kernel"], kw["chunk_size"]
            hd, conv_bias = kw["head_dim"], kw.get("use_conv_bias", True)
        elif self.model_type == "bamba":
            heads, g, n = kw["mamba_n_heads"], kw["mamba_n_groups"], kw["mamba_d_state"]
            k, c = kw["mamba_d_conv"], kw["mamba_chunk_size"]
            hd, conv_bias = kw["mamba_d_head"], kw.get("mamba_conv_bias", True)
        else:
            heads, g, n = kw["mamba_num_heads"], kw["n_groups"], kw["ssm_state_size"]
            k, c = kw["conv_kernel"], kw["chunk_size"]
            hd, conv_bias = kw["mamba_head_dim"], kw.get("use_conv_bias", True)
        return (f"{self.model_type} heads={heads}x{hd} G={g} N={n} K={k} chunk={c} "
                f"conv_bias={conv_bias} {'tied' if self.tie else 'untied'}")


def _spec(name, model_type, seed, slow=False, neg_dt_heads=0, **kw) -> Spec:
    kw = {"vocab_size": V, "hidden_size": H, **kw}
    return Spec(name, model_type, json.dumps(kw, sort_keys=True), seed, slow, neg_dt_heads)


_NEMO_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)

# fmt: off
SPECS: dict[str, Spec] = {s.name: s for s in [
    # ---- Mamba2ForCausalLM (pure SSM, residual in fp32) ----------------------------------------
    _spec("mamba2_a", "mamba2", seed=1, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, state_size=16,
          n_groups=2, conv_kernel=4, chunk_size=8, tie_word_embeddings=True),
    _spec("mamba2_b", "mamba2", seed=2, num_hidden_layers=3, num_heads=4, head_dim=32, expand=2, state_size=8,
          n_groups=1, conv_kernel=3, chunk_size=16, use_bias=True, use_conv_bias=False, tie_word_embeddings=False),
    # ---- Bamba (attention at attn_layer_indices, partial rotary 0.5, SwiGLU feed_forward) --------
    _spec("bamba_a", "bamba", seed=11, num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
          num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
          mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8, tie_word_embeddings=False),
    _spec("bamba_b", "bamba", seed=12, num_hidden_layers=4, intermediate_size=96, num_attention_heads=4,
          num_key_value_heads=4, attn_layer_indices=[0, 3], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
          mamba_d_state=8, mamba_d_conv=3, mamba_chunk_size=16, mamba_proj_bias=True, attention_bias=True,
          tie_word_embeddings=True),
    # ---- NemotronH (one mixer per block; time_step_min tiny: HF's clamp inactive) ---------------
    _spec("nemo_a", "nemotron_h", seed=21, intermediate_size=128,
          layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], **_NEMO_ATTN,
          mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
          time_step_min=1e-12, tie_word_embeddings=False),
    _spec("nemo_b", "nemotron_h", seed=22, intermediate_size=96,
          layers_block_type=["linear_attention", "full_attention", "linear_attention", "moe", "linear_attention",
                             "mlp"],
          **_NEMO_ATTN, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=8, n_groups=1, conv_kernel=3,
          chunk_size=16, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=3, norm_topk_prob=False,
          routed_scaling_factor=2.5, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
          moe_latent_size=32, use_bias=True, time_step_min=1e-12, tie_word_embeddings=True),
    # clamp fixture: default time_step_min and heads whose dt falls below it (see module docstring)
    _spec("nemo_clamp", "nemotron_h", seed=23, intermediate_size=128,
          layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention"], **_NEMO_ATTN,
          mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=4, conv_kernel=4, chunk_size=8,
          time_step_min=0.001, tie_word_embeddings=False, neg_dt_heads=3),
]}
# fmt: on


def spec_names(include_slow: bool = True, model_type: str | None = None) -> list[str]:
    return [n for n, s in SPECS.items()
            if (include_slow or not s.slow) and (model_type is None or s.model_type == model_type)]


def _hf_class(model_type: str):
    import transformers as tf

    return {
        "mamba2": (tf.Mamba2Config, tf.Mamba2ForCausalLM),
        "bamba": (tf.BambaConfig, tf.BambaForCausalLM),
        "nemotron_h": (tf.NemotronHConfig, tf.NemotronHForCausalLM),
    }[model_type]


def randomise_(model, seed: int, neg_dt_heads: int = 0) -> None:
    """Every parameter AND the router's correction-bias buffer at seeded random values:
    A_log = log U(0.05, 2); dt_bias ~ N(0, 1) (the first `neg_dt_heads` of each layer -9 + N(0, 1),
    so softplus(dt + dt_bias) < 1e-3 often); 1-D weights HF sets to ones (norms, D): 1 + N(0, 0.3);
    other 1-D (biases, correction bias): N(0, 0.1); embeddings N(0, 0.4); lm_head N(0, 2 / sqrt(H));
    matrices and fused experts [E, out, in]: N(0, 1 / sqrt(in))."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    named = list(model.named_parameters(remove_duplicate=True)) + [
        (n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    ]
    with torch.no_grad():
        for name, p in named:
            if id(p) in seen:
                continue
            seen.add(id(p))
            normal = lambda std, mean=0.0: torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean
            if name.endswith("A_log"):
                value = torch.log(torch.rand(p.shape, generator=gen) * 1.95 + 0.05)
            elif name.endswith("dt_bias"):
                value = normal(1.0)
                value[:neg_dt_heads] -= 9.0
            elif p.ndim == 1:
                value = normal(0.3, 1.0) if bool(torch.all(p == 1)) else normal(0.1)
            elif "embed" in name:
                value = normal(0.4)
            else:
                fan_in = p.shape[-1] if p.ndim == 3 else math.prod(p.shape[1:])
                gain = 2.0 if name.startswith("lm_head") else 1.0
                value = normal(gain / math.sqrt(fan_in))
            p.copy_(value.to(p.dtype))


@functools.lru_cache(maxsize=None)
def hf_model(name: str):
    import torch

    spec = SPECS[name]
    config_cls, model_cls = _hf_class(spec.model_type)
    config = config_cls(**spec.kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(spec.seed)
    model = model_cls(config).to(torch.float32).eval()
    randomise_(model, spec.seed, spec.neg_dt_heads)
    if spec.tie:
        emb = model.get_input_embeddings().weight
        assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr(), "tied lm_head is not tied"
    return model


def config_dict(name: str) -> dict:
    """Exactly what save_pretrained writes as config.json (JSON round trip: Infinity and all)."""
    return json.loads(hf_model(name).config.to_json_string())


@functools.lru_cache(maxsize=None)
def target_config(name: str):
    from ddtree_jax.config import TargetConfig

    return TargetConfig.from_hf_dict(config_dict(name), source=f"tiny:{name}")


@functools.lru_cache(maxsize=None)
def converted(name: str):
    """(cfg, graphdef, params) converted from the HF state dict (in-memory names: `model.` /
    `backbone.` prefixes, fused NemotronH experts)."""
    from converters.params import target_params_from_tensors

    cfg = target_config(name)
    sd = {k: v.detach().float().numpy() for k, v in hf_model(name).state_dict().items()}
    graphdef, params = target_params_from_tensors(cfg, sd.keys(), sd.__getitem__)
    return cfg, graphdef, params


def num_layers(name: str) -> int:
    return target_config(name).num_layers


# ---- HF reference runs -----------------------------------------------------------------------------
PROMPT_LEN = 40  # 5 chunks of 8 / 2.5 chunks of 16: multi-chunk prefill with a partial last chunk
STEPS = 32
BATCH = 2
CAPACITY = PROMPT_LEN + STEPS + 8


def prompt_tokens(seed: int, batch: int, length: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, size=(batch, length)).astype(np.int32)


@dataclasses.dataclass
class HFRun:
    prompt: np.ndarray  # [B, T]
    prefill_logits: np.ndarray  # [B, T, V]
    hidden: list  # HF hidden_states of the prompt
    step_inputs: np.ndarray  # [B, N] token fed at decode step j (HF's own greedy choice)
    step_logits: np.ndarray  # [B, N, V]

    @property
    def greedy(self) -> np.ndarray:
        first = self.prefill_logits[:, -1].argmax(-1)[:, None]
        return np.concatenate([first, self.step_logits.argmax(-1)], axis=1).astype(np.int32)


def hf_run(model, prompt: np.ndarray, steps: int) -> HFRun:
    """Prefill with a cache, then `steps` cached greedy steps with explicit position ids (Bamba
    restarts positions at 0 in cached steps otherwise)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            ids = torch.as_tensor(prompt, dtype=torch.long)
            b, t = ids.shape
            out = model(input_ids=ids, use_cache=True, output_hidden_states=True)
            cache, logits = out.cache, out.logits.float()
            hidden = [h.float().numpy() for h in out.hidden_states]
            nxt = logits[:, -1].argmax(-1)
            inputs, step_logits = [], []
            for j in range(steps):
                pos = torch.full((b, 1), t + j, dtype=torch.long)
                o = model(input_ids=nxt[:, None], cache=cache, use_cache=True, position_ids=pos)
                cache = o.cache
                inputs.append(nxt.numpy())
                step_logits.append(o.logits[:, -1].float().numpy())
                nxt = o.logits[:, -1].argmax(-1)
    finally:
        torch.set_num_threads(old)
    return HFRun(prompt, logits.numpy(), hidden, np.stack(inputs, 1).astype(np.int32), np.stack(step_logits, 1))


def hf_full_forward(model, tokens: np.ndarray) -> np.ndarray:
    """Logits [B, T, V] of one uncached forward over tokens (HF's chunked path at every position)."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


@functools.lru_cache(maxsize=None)
def reference(name: str) -> HFRun:
    return hf_run(hf_model(name), prompt_tokens(1000 + SPECS[name].seed, BATCH, PROMPT_LEN), STEPS)


def hidden_ids(name: str) -> tuple[int, ...]:
    n = num_layers(name)
    return tuple(sorted({0, 1, n // 2, n - 1, n}))


def hf_hidden_index(name: str, i: int) -> int | None:
    """Index into HF's `hidden_states` of our hidden id i (None: HF has no such entry).
    Mamba2Model records no embeddings entry: its tuple is (layer 0 out, ..., layer L-1 out, norm_f out)."""
    if SPECS[name].model_type != "mamba2":
        return i
    n = num_layers(name)
    return None if i == 0 else (n if i == n else i - 1)


@dataclasses.dataclass
class JaxRun:
    prefill_logits: np.ndarray
    features: np.ndarray
    step_logits: np.ndarray  # teacher-forced on the HF reference's step inputs
    greedy: np.ndarray
    cache: Any


@functools.lru_cache(maxsize=None)
def jax_run(name: str) -> JaxRun:
    import jax.numpy as jnp

    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.decode import decode_step, greedy_decode, prefill

    ref = reference(name)
    cfg, graphdef, params = converted(name)
    b, t = ref.prompt.shape
    ids = hidden_ids(name)
    cache = init_target_cache(cfg, b, CAPACITY)
    out = prefill(graphdef, params, cache, jnp.asarray(ref.prompt), jnp.full((b,), t, jnp.int32),
                  hidden_ids=ids, all_logits=True)
    cache, step_logits = out.cache, []
    for j in range(ref.step_inputs.shape[1]):
        o = decode_step(graphdef, params, cache, jnp.asarray(ref.step_inputs[:, j]))
        cache = o.cache
        step_logits.append(np.asarray(o.logits))
    tokens, counts, _ = greedy_decode(graphdef, params, out.cache, out.logits[:, -1], STEPS + 1)
    assert np.all(np.asarray(counts) == STEPS + 1)
    return JaxRun(np.asarray(out.logits), np.asarray(out.features, np.float32), np.stack(step_logits, 1),
                  np.asarray(tokens), cache)


def max_rel_diff(ours, ref) -> tuple[float, float]:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.max(np.abs(ours - ref))), max(1.0, float(np.max(np.abs(ref))))
