"""The model shapes the benchmarks run and their random weights, made here and nowhere else.

Model shapes (`SHAPES`, chosen with `--shape`):
  27b   the Qwen3.6-27B-shaped hybrid target (hidden 5120, 64 layers, full attention every 4th,
        24 q / 4 kv heads of 256, GDN 16 k / 48 v heads of 128, conv 4, FFN 17408, vocab 248320,
        bf16) and a 5-layer DFlash drafter of its width (32 q / 8 kv heads of 128, block 16);
  35b-a3b  the Qwen3.6-35B-A3B-shaped MoE hybrid target (qwen3_5_moe_text: hidden 2048, 40 layers,
        full attention every 4th with 16 q / 2 kv heads of 256 and partial rotary 0.25, GDN 16 k /
        32 v heads of 128, conv 4; every layer's FFN a sparse MoE: 256 experts, top-8, expert
        intermediate 512, shared expert 512 with its sigmoid gate; vocab 248320; bf16; ~35 B
        parameters, 70 GB) and a 5-layer DFlash drafter of hidden 2048, block 16 (z-lab's 35B-A3B
        drafters use block 16; their layer sizes are not in our sources: 16 q / 8 kv heads of 128
        and intermediate 6144 here, a Qwen3-1.7B-like layer); its smoke size is `moe-smoke`;
  nemotron-h-8b  the Nemotron-H-8B-shaped Mamba2 hybrid (nemotron_h: hidden 4096, 52 blocks of one
        mixer each: 24 Mamba2 (128 heads of 64, 8 groups, state 128, conv 4), 24 relu^2 MLPs of
        21504, 4 attention (32 q / 8 kv heads of 128, no RoPE); vocab 131072; bf16; ~8 B parameters)
        and a 5-layer DFlash drafter of its width (32 q / 8 kv heads of 128, block 16); its smoke
        size is `nemotron-h-smoke`;
  demo  the embedded demo pair's configs (ddtree_jax/assets/demo: 8 layers of 256, vocab 8192) with
        random weights: a small model, whose step is bound by its kernel count;
  smoke tiny widths of the 27B's layer pattern, to check a tool on any machine in seconds
        (`--smoke` picks a shape's own smoke size: `moe-smoke` for 35b-a3b, tiny widths of its
        pattern with 16 experts, top-4; `nemotron-h-smoke` for nemotron-h-8b).

Random weights: normal with std fan_in^-1/2 (stacked experts [E, in, out]: in^-1/2), norm weights
1 + N(0, 0.1), the GDN gate parameters (A_log, dt_bias) uniform in [-1, 1]; never zeros (a kernel
fed zeros can look right and fast while reading the wrong rows). Made on the device leaf by leaf,
so a 27B target needs no host copy.

Caches: `filled_caches` holds `context` committed tokens of random K / V and recurrent state per row,
what a prefill of that length leaves (no long prefill to compile).

Kernel layer shapes (`GDN_27B`, `ATTENTION_27B`, `SSD_NEMOTRON_H_8B`): one layer of the models above,
what scripts.bench.kernels and the native GPU tests run the kernels at.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.cache import KVCache, RecurrentCache, TargetCache
from ddtree_jax.config import ATTENTION, FFN_KINDS, MAMBA2, TargetConfig
from ddtree_jax.demo import DEMO_DIR
from ddtree_jax.drafter_config import DrafterConfig
from ddtree_jax.models.drafter import DrafterCache, DrafterModel
from ddtree_jax.models.target import TargetModel

QWEN36_27B = dict(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
    num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="bfloat16", max_position_embeddings=262144,
)
QWEN36_35B_A3B = dict(
    model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="bfloat16", max_position_embeddings=262144,
)
DRAFTER_35B_A3B = dict(layers=5, heads=16, kv=8, head_dim=128, block=16, inter=6144)
# Nemotron-H 8B's shape: transformers' NemotronHConfig defaults (NVIDIA's 8B: hidden 4096, MLP
# relu^2 21504, 32 q / 8 kv heads of 128 without RoPE, Mamba2 128 heads of 64 in 8 groups, state
# 128, conv 4, vocab 131072) and the 52-layer pattern of 24 Mamba2, 24 MLP and 4 attention blocks
# (Megatron-Bridge's Nemotron-H docs give this string for the 52-layer models).
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_H_8B = dict(
    model_type="nemotron_h", vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_hidden_layers=52,
    hybrid_override_pattern=NEMOTRON_H_8B_PATTERN, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, expand=2,
    chunk_size=128, mlp_hidden_act="relu2", use_bias=False, mlp_bias=False, use_conv_bias=True,
    layer_norm_epsilon=1e-5, tie_word_embeddings=False, dtype="bfloat16", max_position_embeddings=8192,
)
SMOKE_NEMOTRON_H = dict(NEMOTRON_H_8B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                        hybrid_override_pattern="M-M*M-M-", num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=2)
SMOKE_MOE = dict(QWEN36_35B_A3B, vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=32, linear_value_head_dim=32, num_experts=16, num_experts_per_tok=4,
                 moe_intermediate_size=64, shared_expert_intermediate_size=64)
SMOKE = dict(QWEN36_27B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)

# Plain decoding against HF transformers (scripts.bench.hf): a Qwen3.5-shaped config small enough for
# both frameworks' generate at bf16, and its smoke size.
HF_COMPARE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=128, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=8192)
HF_COMPARE_SMOKE = dict(HF_COMPARE, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)

# One layer of the 27B target (GDN and attention) and of Nemotron-H 8B's Mamba2 mixer.
GDN_27B = dict(hk=QWEN36_27B["linear_num_key_heads"], hv=QWEN36_27B["linear_num_value_heads"],
               dk=QWEN36_27B["linear_key_head_dim"], dv=QWEN36_27B["linear_value_head_dim"],
               taps=QWEN36_27B["linear_conv_kernel_dim"], hidden=QWEN36_27B["hidden_size"])
ATTENTION_27B = dict(heads=QWEN36_27B["num_attention_heads"], kv_heads=QWEN36_27B["num_key_value_heads"],
                     head_dim=QWEN36_27B["head_dim"])
# ... and of the 35B-A3B target (its GDN and attention layers)
GDN_35B_A3B = dict(hk=QWEN36_35B_A3B["linear_num_key_heads"], hv=QWEN36_35B_A3B["linear_num_value_heads"],
                   dk=QWEN36_35B_A3B["linear_key_head_dim"], dv=QWEN36_35B_A3B["linear_value_head_dim"],
                   taps=QWEN36_35B_A3B["linear_conv_kernel_dim"], hidden=QWEN36_35B_A3B["hidden_size"])
ATTENTION_35B_A3B = dict(heads=QWEN36_35B_A3B["num_attention_heads"], kv_heads=QWEN36_35B_A3B["num_key_value_heads"],
                         head_dim=QWEN36_35B_A3B["head_dim"])
LAYERS = {"27b": (GDN_27B, ATTENTION_27B), "35b-a3b": (GDN_35B_A3B, ATTENTION_35B_A3B)}  # --layer
SSD_NEMOTRON_H_8B = dict(heads=128, head_dim=64, groups=8, state=128)
DRAFT_DEPTHS = 15  # a DFlash block of 16: 15 drafted depths below the root


def dflash_drafter(cfg: TargetConfig, layers: int, heads: int, kv: int, head_dim: int, block: int,
                   inter: int | None = None) -> DrafterConfig:
    """A DFlash drafter config of the target's width and vocabulary (mask token: the last id); its
    MLP of the target's intermediate size unless `inter` is given (a MoE target has none)."""
    return DrafterConfig.from_hf_dict({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": inter or cfg.intermediate_size, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "rope_theta": 1e7, "rms_norm_eps": 1e-6,
        "vocab_size": cfg.vocab_size, "num_target_layers": cfg.num_layers, "block_size": block, "dtype": "bfloat16",
        "dflash_config": {"mask_token_id": cfg.vocab_size - 1},
    })


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A target + drafter pair to benchmark: configs, and the context its caches hold by default."""

    name: str
    target: Callable[[], TargetConfig]
    drafter: Callable[[TargetConfig], DrafterConfig]
    context: int
    smoke: str = "smoke"  # the shape --smoke runs instead


SHAPES = {
    "27b": ModelShape("27b", lambda: TargetConfig.from_hf_dict(QWEN36_27B),
                      lambda cfg: dflash_drafter(cfg, 5, 32, 8, 128, 16), 4096),
    "demo": ModelShape("demo", lambda: TargetConfig.from_file(os.path.join(DEMO_DIR, "target")),
                       lambda cfg: DrafterConfig.from_file(os.path.join(DEMO_DIR, "drafter")), 512),
    "35b-a3b": ModelShape("35b-a3b", lambda: TargetConfig.from_hf_dict(QWEN36_35B_A3B),
                          lambda cfg: dflash_drafter(cfg, **DRAFTER_35B_A3B), 4096, smoke="moe-smoke"),
    "nemotron-h-8b": ModelShape("nemotron-h-8b", lambda: TargetConfig.from_hf_dict(NEMOTRON_H_8B),
                                lambda cfg: dflash_drafter(cfg, 5, 32, 8, 128, 16), 4096, smoke="nemotron-h-smoke"),
    "nemotron-h-smoke": ModelShape("nemotron-h-smoke", lambda: TargetConfig.from_hf_dict(SMOKE_NEMOTRON_H),
                                   lambda cfg: dflash_drafter(cfg, 5, 4, 2, 32, 16), 64, smoke="nemotron-h-smoke"),
    "smoke": ModelShape("smoke", lambda: TargetConfig.from_hf_dict(SMOKE),
                        lambda cfg: dflash_drafter(cfg, 5, 4, 2, 32, 16), 64),
    "moe-smoke": ModelShape("moe-smoke", lambda: TargetConfig.from_hf_dict(SMOKE_MOE),
                            lambda cfg: dflash_drafter(cfg, 5, 4, 2, 32, 16, inter=256), 64, smoke="moe-smoke"),
}


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def normal(key, shape, dtype, std):
    """Normal random values of `std`, drawn in float32 on the device and cast to dtype."""
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def random_params(abstract, seed: int):
    """Random weights for an abstract params pytree (nnx.eval_shape), made on device leaf by leaf."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaves = []
    for i, (path, leaf) in enumerate(flat):
        name = jax.tree_util.keystr(path)
        key = jax.random.PRNGKey(seed * 100003 + i)
        shape, dtype = leaf.shape, leaf.dtype
        if "A_log" in name or "dt_bias" in name:
            leaves.append(jax.random.uniform(key, shape, jnp.float32, -1, 1).astype(dtype))
        elif "norm" in name:
            leaves.append((1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
        else:
            fan_in = shape[0] if len(shape) == 2 and "embedding" not in name else 1
            if len(shape) == 3 and "experts" in name:  # stacked experts [E, in, out]
                fan_in = shape[1]
            leaves.append(normal(key, shape, dtype, fan_in**-0.5))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def random_models(cfg: TargetConfig, dcfg: DrafterConfig):
    """(graphdef, params, drafter graphdef, drafter params) with random weights on the device."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: TargetModel(cfg, rngs=nnx.Rngs(0))))
    dgraph, dabstract = nnx.split(nnx.eval_shape(lambda: DrafterModel(dcfg, rngs=nnx.Rngs(0))))
    params, dparams = random_params(abstract, 0), random_params(dabstract, 1)
    return graphdef, params, dgraph, dparams


def filled_caches(cfg: TargetConfig, dcfg: DrafterConfig, batch: int, context: int, capacity: int, seed: int):
    """Target and drafter caches holding `context` committed tokens of random state per row
    (batch > 1: lengths spread over [context / 2, context])."""
    key = jax.random.PRNGKey(seed)
    lengths = (jnp.asarray(np.linspace(context, context // 2, batch).astype(np.int32)) if batch > 1
               else jnp.asarray([context], jnp.int32))
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        if kind == ATTENTION:
            shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
            layers.append(KVCache(normal(k1, shape, jnp.bfloat16, 1.0), normal(k2, shape, jnp.bfloat16, 1.0)))
        elif kind in FFN_KINDS:
            layers.append(None)
        elif kind == MAMBA2:
            layers.append(RecurrentCache(
                normal(k1, (batch, cfg.conv_kernel - 1, cfg.mamba_conv_dim), jnp.bfloat16, 1.0),
                normal(k2, (batch, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size), jnp.float32, 0.05)))
        else:
            layers.append(RecurrentCache(
                normal(k1, (batch, cfg.conv_kernel - 1, cfg.gdn_conv_dim), jnp.bfloat16, 1.0),
                normal(k2, (batch, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim), jnp.float32, 0.05)))
    dlayers = []
    for i in range(dcfg.num_layers):
        k1, k2 = jax.random.split(jax.random.fold_in(key, 1000 + i))
        shape = (batch, dcfg.num_kv_heads, capacity, dcfg.head_dim)
        dlayers.append(KVCache(normal(k1, shape, jnp.bfloat16, 1.0), normal(k2, shape, jnp.bfloat16, 1.0)))
    return TargetCache(tuple(layers), lengths), DrafterCache(tuple(dlayers), lengths)


def nbytes(tree) -> int:
    """Bytes of every array in a pytree."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
