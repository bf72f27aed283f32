"""Train a DFlash drafter on a frozen target with the published recipe.

Recipe (shared/specs/dflash_ddtree.md, "Training"):
  * the target is frozen; the drafter borrows its embedding and lm_head (frozen too);
  * per sequence, `anchors_per_seq` distinct random anchors a in [1, T - B];
    block = [token at a, MASK x (B-1)] at positions a .. a+B-1;
  * slot k (1..B-1) is supervised with the token at a+k, weight exp(-(k-1)/gamma)
    (gamma 7 for B = 16); slot 0 is not supervised;
  * attention: a block's queries see the context features of positions < a (target features,
    fused by fc + hidden_norm, exactly as `DrafterModel.extend` caches them) and their own
    block, bidirectionally; other blocks are invisible.

`train_hidden` is that forward for all blocks of a batch at once: one masked attention per
layer over [context ; own block] (scores against the T context positions with a per-block
"before the anchor" mask, plus a per-block B x B score tile), no Python loop over blocks.
For a single block it computes exactly what the inference path (`DrafterModel.extend` on the
context, then `DrafterModel.draft`) computes; tests/test_training.py checks it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.cache import init_target_cache
from ddtree_jax.config import TargetConfig
from ddtree_jax.drafter_config import DrafterConfig, default_target_layer_ids
from ddtree_jax.models.attention import NEG_INF
from ddtree_jax.models.drafter import DrafterModel, logits_from_hidden
from pallas_kernels.ref.rope import apply_rope
from ddtree_jax.training.target_trainer import (
    TrainSettings,
    apply_updates,
    cast_tree,
    count_params,
    default_gdn_chunked,
    eval_windows,
    make_optimizer,
    run_budgeted,
    sample_windows,
)

DEMO_DRAFTER_SHAPE = dict(
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768,
)
TOY_DRAFTER_SHAPE = dict(
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
)


def drafter_hf_config(tcfg: TargetConfig, mask_token_id: int, *, block_size: int = 16, rope_theta: float = 10000.0,
                      max_position_embeddings: int = 4096, dtype: str = "bfloat16", **shape) -> dict:
    """A z-lab `DFlashDraftModel` config.json dict for a drafter of the target `tcfg`.

    hidden size = the target's; target_layer_ids = the reference default for the target's layer
    count and the drafter's layer count (K ids spread over [1, L-3]; one layer -> [L // 2]).
    """
    s = dict(DEMO_DRAFTER_SHAPE)
    s.update(shape)
    ids = default_target_layer_ids(tcfg.num_layers, s["num_hidden_layers"])
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": tcfg.hidden_size,
        "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"],
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": float(rope_theta),
        "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "vocab_size": tcfg.vocab_size,
        "num_target_layers": tcfg.num_layers,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": list(ids), "block_size": block_size},
        "dtype": dtype,
    }


@dataclasses.dataclass(frozen=True)
class DrafterSettings(TrainSettings):
    peak_lr: float = 3e-3
    batch_size: int = 32
    anchors_per_seq: int = 128
    gamma: float = 7.0
    seconds: float = 180.0


def loss_weights(block_size: int, gamma: float) -> jax.Array:
    """[B-1] weights of slots 1..B-1: exp(-(k-1)/gamma)."""
    k = jnp.arange(1, block_size, dtype=jnp.float32)
    return jnp.exp(-(k - 1.0) / gamma)


def sample_anchors(key, batch: int, seq_len: int, n: int, block_size: int) -> jax.Array:
    """n distinct anchors per row, uniform over [1, seq_len - block_size] (so a block fits)."""
    span = seq_len - block_size
    if n > span:
        raise ValueError(f"{n} anchors do not fit a sequence of {seq_len} tokens with block size {block_size}")
    noise = jax.random.uniform(key, (batch, span))
    _, idx = jax.lax.top_k(noise, n)
    return jnp.sort(idx, axis=-1).astype(jnp.int32) + 1


def block_positions(anchors: jax.Array, block_size: int) -> jax.Array:
    return anchors[..., None] + jnp.arange(block_size, dtype=jnp.int32)


def train_hidden(dmodel: DrafterModel, target, features: jax.Array, tokens: jax.Array, anchors: jax.Array) -> jax.Array:
    """Drafter outputs [B, N, Bs, H] for N blocks per row, all in one pass.

    features [B, T, K*H]: target features of every position; tokens [B, T]; anchors [B, N]
    (each in [1, T - Bs]). Block n of row b is [tokens[b, a], MASK...] at positions a .. a+Bs-1
    and sees context positions < a plus its own block.
    """
    dcfg = dmodel.cfg
    if any(w is not None for w in dcfg.layer_windows) or any(dcfg.layer_causal):
        raise NotImplementedError("training supports full, non-causal drafter layers only")
    bsz = dcfg.block_size
    b, t, _ = features.shape
    n = anchors.shape[1]
    nh, kvh, hd = dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim
    g = nh // kvh
    dtype = dmodel.fc.kernel.dtype
    ctx = dmodel.hidden_norm(dmodel.fc(features.astype(dtype)))  # [B, T, H]
    ctx_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    blk_pos = block_positions(anchors, bsz)  # [B, N, Bs]
    first = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, N]
    blk_tokens = jnp.concatenate(
        [first[..., None], jnp.full((b, n, bsz - 1), dcfg.mask_token_id, jnp.int32)], axis=-1
    )
    x = target.embed_tokens(blk_tokens.reshape(b, n * bsz))
    if dcfg.input_embedding_scale != 1.0:
        x = x * jnp.asarray(dcfg.input_embedding_scale, x.dtype)
    x = x.astype(dtype)
    cos_c, sin_c = dmodel._rope(ctx_pos)
    cos_b, sin_b = dmodel._rope(blk_pos.reshape(b, n * bsz))
    vis_ctx = ctx_pos[:, None, :] < anchors[:, :, None]  # [B, N, T]
    scale = hd**-0.5
    for layer in dmodel.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(attn.q_norm(attn.q_proj(h).reshape(b, n * bsz, nh, hd)), cos_b, sin_b)
        k_c, v_c = attn.kv(ctx, cos_c, sin_c)  # [B, T, kv, hd]
        k_b, v_b = attn.kv(h, cos_b, sin_b)  # [B, N*Bs, kv, hd]
        qg = q.reshape(b, n, bsz, kvh, g, hd)
        k_b = k_b.reshape(b, n, bsz, kvh, hd)
        v_b = v_b.reshape(b, n, bsz, kvh, hd)
        s_ctx = jnp.einsum("bnqkgd,btkd->bnkgqt", qg, k_c.astype(q.dtype)).astype(jnp.float32) * scale
        s_blk = jnp.einsum("bnqkgd,bnskd->bnkgqs", qg, k_b.astype(q.dtype)).astype(jnp.float32) * scale
        s_ctx = jnp.where(vis_ctx[:, :, None, None, None, :], s_ctx, NEG_INF)
        probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
        p_ctx = probs[..., :t].astype(v_c.dtype)
        p_blk = probs[..., t:].astype(v_b.dtype)
        out = jnp.einsum("bnkgqt,btkd->bnqkgd", p_ctx, v_c) + jnp.einsum("bnkgqs,bnskd->bnqkgd", p_blk, v_b)
        x = x + attn.o_proj(out.reshape(b, n * bsz, nh * hd).astype(x.dtype))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return dmodel.norm(x).reshape(b, n, bsz, -1)


def train_logits(dmodel: DrafterModel, target, features, tokens, anchors) -> jax.Array:
    """Draft logits float32 [B, N, Bs-1, V] of slots 1..Bs-1 of every block."""
    hidden = train_hidden(dmodel, target, features, tokens, anchors)
    return logits_from_hidden(dmodel.cfg, target, hidden[:, :, 1:])


def target_features(target, tcfg: TargetConfig, tokens: jax.Array, hidden_ids: tuple[int, ...], dtype) -> jax.Array:
    """Target features [B, T, K*H] of every position (fresh cache, chunked GDN), no gradient."""
    b, t = tokens.shape
    cache = init_target_cache(tcfg.replace(dtype=jnp.dtype(dtype).name), b, t)
    _, feats, _ = target(tokens, cache, jnp.full((b,), t, jnp.int32), chunked=default_gdn_chunked(),
                         hidden_ids=hidden_ids)
    return jax.lax.stop_gradient(feats)


def drafter_loss(dparams, dgraph, target, features, tokens, anchors, gamma: float, compute_dtype):
    """Decay-weighted cross entropy over slots 1..Bs-1 and metrics (per-slot accuracy, tau proxy)."""
    dmodel = nnx.merge(dgraph, cast_tree(dparams, compute_dtype))
    bsz = dmodel.cfg.block_size
    logits = train_logits(dmodel, target, features, tokens, anchors)  # [B, N, Bs-1, V]
    pos = block_positions(anchors, bsz)[..., 1:]
    b, n = anchors.shape
    labels = jnp.take_along_axis(tokens, pos.reshape(b, -1), axis=1).reshape(b, n, bsz - 1)
    logz = jax.nn.logsumexp(logits, axis=-1)
    ce = logz - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    w = loss_weights(bsz, gamma)
    loss = jnp.sum(ce * w) / (b * n * jnp.sum(w))
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    leading = jnp.sum(jnp.cumprod(correct, axis=-1), axis=-1)  # accepted drafts if the target said `labels`
    metrics = {"loss": loss, "slot_loss": jnp.mean(ce, axis=(0, 1)), "slot_acc": jnp.mean(correct, axis=(0, 1)),
               "tau_proxy": 1.0 + jnp.mean(leading)}
    return loss, metrics


def init_drafter(dcfg: DrafterConfig, seed: int):
    """(graphdef, float32 params): module init with o_proj / down_proj scaled by 1/sqrt(2 L)."""
    model = DrafterModel(dcfg.replace(dtype="float32"), rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    scale = 1.0 / math.sqrt(2 * dcfg.num_layers)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = []
    for path, x in flat:
        name = jax.tree_util.keystr(path)
        if ("o_proj" in name or "down_proj" in name) and "kernel" in name:
            x = x * scale
        leaves.append(x)
    return graphdef, jax.tree_util.tree_unflatten(treedef, leaves)


def train_drafter(dcfg: DrafterConfig, tcfg: TargetConfig, tgraph, tparams, train_tokens: np.ndarray,
                  heldout_tokens: np.ndarray, s: DrafterSettings, *, log: Callable[[str], None] = print):
    """Train the drafter against the frozen target (params as given, cast to compute_dtype).

    Returns (graphdef, float32 drafter params, report).
    """
    t0 = time.time()
    dgraph, dparams = init_drafter(dcfg, s.seed + 100)
    tx = make_optimizer(s)
    opt_state = tx.init(dparams)
    hidden_ids = dcfg.target_hidden_ids
    tparams_c = cast_tree(tparams, s.compute_dtype)
    data = jnp.asarray(train_tokens.astype(np.int32))
    if data.shape[0] <= s.seq_len:
        raise ValueError(f"training set of {data.shape[0]} tokens is shorter than one window of {s.seq_len}")

    def losses(dparams, tparams_c, tokens, key):
        target = nnx.merge(tgraph, tparams_c)
        feats = target_features(target, tcfg, tokens, hidden_ids, s.compute_dtype)
        anchors = sample_anchors(key, tokens.shape[0], s.seq_len, s.anchors_per_seq, dcfg.block_size)
        return drafter_loss(dparams, dgraph, target, feats, tokens, anchors, s.gamma, s.compute_dtype)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(dparams, opt_state, tparams_c, data, key, lr):
        k1, k2 = jax.random.split(key)
        tokens = sample_windows(data, k1, s.batch_size, s.seq_len)
        (loss, metrics), grads = jax.value_and_grad(losses, has_aux=True)(dparams, tparams_c, tokens, k2)
        dparams, opt_state = apply_updates(dparams, grads, opt_state, tx, lr)
        return dparams, opt_state, loss

    @jax.jit
    def eval_step(dparams, tparams_c, tokens, key):
        return losses(dparams, tparams_c, tokens, key)[1]

    windows = eval_windows(heldout_tokens, s.seq_len, s.eval_windows)
    log(f"[drafter] {count_params(dparams):,} params, target_layer_ids {list(dcfg.target_layer_ids)}, "
        f"{s.anchors_per_seq} anchors x block {dcfg.block_size} per sequence of {s.seq_len}")

    def step(state, key, lr):
        p, o = state
        p, o, loss = train_step(p, o, tparams_c, data, key, lr)
        return (p, o), loss

    (dparams, opt_state), hist = run_budgeted(step, (dparams, opt_state), s, log=log, name="drafter", start_time=t0)
    t_eval = time.time()
    ev = evaluate_drafter(eval_step, dparams, tparams_c, windows, min(s.batch_size, len(windows)), s.seed)
    hist.update(params=count_params(dparams), final_train_loss=hist["log"][-1]["loss"],
                first_train_loss=hist["log"][0]["loss"], heldout=ev, eval_s=round(time.time() - t_eval, 2),
                settings=dataclasses.asdict(s))
    log(f"[drafter] held-out loss {ev['loss']:.4f}, tau proxy {ev['tau_proxy']:.3f}, "
        f"slot-1 acc {ev['slot_acc'][0]:.3f}")
    return dgraph, dparams, hist


def evaluate_drafter(eval_step, dparams, tparams_c, windows: np.ndarray, batch: int, seed: int) -> dict:
    """Held-out metrics averaged over full batches of windows (fixed anchors per batch)."""
    key = jax.random.PRNGKey(seed + 12345)
    acc: dict[str, Any] = {}
    count = 0
    for i in range(0, len(windows) - batch + 1, batch):
        key, sub = jax.random.split(key)
        m = eval_step(dparams, tparams_c, jnp.asarray(windows[i:i + batch]), sub)
        for k, v in m.items():
            acc[k] = acc.get(k, 0.0) + np.asarray(v, np.float64)
        count += 1
    out = {k: (v / count).tolist() for k, v in acc.items()}
    out["batches"] = count
    return out
