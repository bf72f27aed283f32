"""Train a small Qwen3.5-style hybrid target (Gated DeltaNet + gated attention) from scratch.

The training forward is the project's own `TargetModel.__call__` on a fresh cache per batch
(chunked GDN form, causal attention over the batch's own tokens), so the trained weights run
unchanged in every decoding path. (On jaxlib < 0.11 CPU the token-by-token GDN form is used
instead: see `default_gdn_chunked`.) Mixed precision: float32 master params and AdamW state,
the forward/backward in `compute_dtype` (bfloat16 by default; the GDN recurrence itself always
runs in float32). One jitted step (compiled once) samples a batch of random windows from the
token array held on the device, so the host only dispatches steps.

Training is time-budgeted: after a few steps the measured step time fixes the total step count
(and with it the warmup + cosine learning-rate schedule); `max_steps` makes a run fully
deterministic instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable

import jax
import jaxlib
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ddtree_jax.cache import init_target_cache
from ddtree_jax.config import TargetConfig
from ddtree_jax.models.target import TargetModel

# The demo target: 8 layers (GDN x3 + attention) x 2, hidden 256, tied embeddings.
DEMO_TARGET_SHAPE = dict(
    hidden_size=256,
    intermediate_size=576,
    num_hidden_layers=8,
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    partial_rotary_factor=0.25,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
)
# A tiny target for CPU tests (still hybrid: GDN at layers 0 and 2, attention at 1 and 3).
TOY_TARGET_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    full_attention_interval=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    partial_rotary_factor=0.25,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
)


def target_hf_config(vocab_size: int, eos_token_id: int, *, rope_theta: float = 10000.0,
                     max_position_embeddings: int = 4096, dtype: str = "bfloat16", **shape) -> dict:
    """A complete HF `Qwen3_5ForCausalLM` config.json dict (model_type qwen3_5_text)."""
    s = dict(DEMO_TARGET_SHAPE)
    s.update(shape)
    n, interval = s["num_hidden_layers"], s["full_attention_interval"]
    layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": int(vocab_size),
        "hidden_size": s["hidden_size"],
        "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": n,
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"],
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(rope_theta),
            "partial_rotary_factor": s["partial_rotary_factor"],
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "full_attention_interval": interval,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": s["linear_conv_kernel_dim"],
        "linear_key_head_dim": s["linear_key_head_dim"],
        "linear_value_head_dim": s["linear_value_head_dim"],
        "linear_num_key_heads": s["linear_num_key_heads"],
        "linear_num_value_heads": s["linear_num_value_heads"],
        "bos_token_id": None,
        "eos_token_id": int(eos_token_id),
        "pad_token_id": int(eos_token_id),
        "dtype": dtype,
    }


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Optimisation settings shared by the target and drafter trainers."""

    seq_len: int = 512
    batch_size: int = 64
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    compute_dtype: str = "bfloat16"
    seed: int = 0
    seconds: float = 240.0  # wall-clock budget of the whole phase (compile + steps + final eval)
    max_steps: int | None = None  # fixed step count (deterministic); None: fill the time budget
    reserve_seconds: float = 15.0  # kept for the final held-out evaluation
    probe_steps: int = 5  # steps timed (after the compiling one) to size the schedule
    log_every: int = 50
    eval_windows: int = 128  # held-out windows of seq_len + 1 tokens for the final loss


def count_params(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


def cast_tree(tree, dtype):
    dtype = jnp.dtype(dtype)
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def lr_at(step: int, total: int, s: TrainSettings) -> float:
    """Linear warmup to peak_lr, then cosine decay to min_lr_ratio * peak_lr at `total`."""
    warm = max(1, min(s.warmup_steps, max(1, total // 10)))
    if step < warm:
        return s.peak_lr * (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, total - warm))
    return s.peak_lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(s: TrainSettings) -> optax.GradientTransformation:
    """Clip + AdamW with a unit learning rate; the step multiplies updates by the current lr.
    Weight decay applies to matrices only (not norms, biases, A_log, dt_bias)."""
    mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(s.grad_clip),
        optax.adamw(1.0, b1=s.b1, b2=s.b2, eps=1e-8, weight_decay=s.weight_decay, mask=mask),
    )


def apply_updates(params, grads, opt_state, tx, lr):
    updates, opt_state = tx.update(grads, opt_state, params)
    updates = jax.tree_util.tree_map(lambda u: (u * lr).astype(u.dtype), updates)
    return optax.apply_updates(params, updates), opt_state


def sample_windows(data: jax.Array, key, batch: int, length: int) -> jax.Array:
    """`batch` random windows of `length` tokens from the 1-D token array on the device."""
    starts = jax.random.randint(key, (batch,), 0, data.shape[0] - length + 1)
    return jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(data, s, length))(starts)


def eval_windows(tokens: np.ndarray, length: int, max_windows: int) -> np.ndarray:
    """Non-overlapping windows [n, length] spread evenly over a token array (deterministic)."""
    n_avail = len(tokens) // length
    if n_avail < 1:
        raise ValueError(f"held-out set has {len(tokens)} tokens, fewer than one window of {length}")
    n = min(n_avail, max_windows)
    idx = np.linspace(0, n_avail - 1, n).round().astype(np.int64)
    return np.stack([tokens[i * length:(i + 1) * length] for i in idx])


# ---- model -------------------------------------------------------------------------------
def init_target(cfg: TargetConfig, seed: int):
    """(graphdef, float32 params) of a freshly initialised target.

    Linear kernels ~ N(0, 1/fan_in) (the module default) with the residual output projections
    (o_proj, out_proj, down_proj) scaled by 1/sqrt(2 L); the tied embedding ~ N(0, 0.02^2) so
    the initial logits are small; zero-centred norms start at 0 (scale 1); GDN A_log, dt_bias
    and conv weights keep the module's initialisation.
    """
    model = TargetModel(cfg.replace(dtype="float32"), rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    residual_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
    key = jax.random.PRNGKey(seed + 1)
    leaves = []
    for path, x in flat:
        name = jax.tree_util.keystr(path)
        if "embedding" in name:
            key, sub = jax.random.split(key)
            x = jax.random.normal(sub, x.shape, jnp.float32) * 0.02
        elif any(p in name for p in ("o_proj", "out_proj", "down_proj")) and "kernel" in name:
            x = x * residual_scale
        leaves.append(x)
    return graphdef, jax.tree_util.tree_unflatten(treedef, leaves)


def default_gdn_chunked() -> bool:
    """Chunked GDN form for training, except on jaxlib < 0.11 CPU.

    jaxlib 0.10.x CPU LAPACK kernels (the chunked form's triangular solves) fan their batch out
    to XLA:CPU's intra-op pool and block on it; when the backward pass runs as many solves
    concurrently as the pool has threads, the process deadlocks (seen here on 2 cores; jaxlib
    0.11.1+ builds compile that path out). There the token-by-token form (the same function,
    no LAPACK) is used instead. GPUs always use the chunked form.
    """
    if jax.default_backend() != "cpu":
        return True
    try:
        major, minor = (int(x) for x in jaxlib.__version__.split(".")[:2])
    except Exception:  # noqa: BLE001 - unknown version: be safe
        return False
    return (major, minor) >= (0, 11)


def lm_row_losses(params, graphdef, cfg: TargetConfig, tokens: jax.Array, compute_dtype,
                  chunked: bool | None = None) -> jax.Array:
    """Per-row mean next-token cross entropy [B] over tokens [B, T+1], with TargetModel's
    cached forward on a fresh cache (chunked GDN unless `default_gdn_chunked` says otherwise)."""
    chunked = default_gdn_chunked() if chunked is None else chunked
    model = nnx.merge(graphdef, cast_tree(params, compute_dtype))
    x, y = tokens[:, :-1], tokens[:, 1:]
    b, t = x.shape
    cache = init_target_cache(cfg.replace(dtype=jnp.dtype(compute_dtype).name), b, t)
    h, _, _ = model(x, cache, jnp.full((b,), t, jnp.int32), chunked=chunked)
    logits = model.logits(h)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(axis=-1)


def lm_loss(params, graphdef, cfg: TargetConfig, tokens: jax.Array, compute_dtype,
            chunked: bool | None = None) -> jax.Array:
    return lm_row_losses(params, graphdef, cfg, tokens, compute_dtype, chunked).mean()


def make_target_steps(graphdef, cfg: TargetConfig, s: TrainSettings, tx):
    """(train_step, eval_row_losses), each jitted once."""

    @jax.jit
    def eval_row_losses(params, tokens):
        return lm_row_losses(params, graphdef, cfg, tokens, s.compute_dtype)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, data, key, lr):
        tokens = sample_windows(data, key, s.batch_size, s.seq_len + 1)
        loss, grads = jax.value_and_grad(lm_loss)(params, graphdef, cfg, tokens, s.compute_dtype)
        params, opt_state = apply_updates(params, grads, opt_state, tx, lr)
        return params, opt_state, loss

    return train_step, eval_row_losses


def mean_eval_loss(eval_fn, params, windows: np.ndarray, batch: int) -> float:
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i:i + batch]
        n = len(chunk)
        if n < batch:  # pad to a fixed shape (one compile), weight only the real rows
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - n, axis=0)])
        losses = eval_fn(params, jnp.asarray(chunk))
        total += float(jnp.sum(losses[:n]))
        count += n
    return total / max(1, count)


# ---- the budgeted loop, shared with the drafter trainer -------------------------------------
def run_budgeted(step: Callable, state: Any, s: TrainSettings, *, log: Callable[[str], None] = print,
                 name: str = "train", start_time: float | None = None) -> tuple[Any, dict]:
    """Run `state, loss = step(state, key, lr)` until the budget or max_steps is reached.

    Returns (state, history) with history = {steps, total_steps, compile_s, step_s, train_s, log: [...]}.
    """
    t0 = time.time() if start_time is None else start_time
    deadline = t0 + s.seconds - s.reserve_seconds
    key = jax.random.PRNGKey(s.seed)
    total = s.max_steps
    provisional = total or 10**9
    records, i = [], 0
    compile_s = step_s = None
    t_first = None
    while True:
        lr = lr_at(i, total or provisional, s)
        key, sub = jax.random.split(key)
        state, loss = step(state, sub, jnp.float32(lr))
        i += 1
        if i == 1:
            loss0 = float(loss)  # waits for the compile and the first step
            t_first = time.time()
            compile_s = t_first - t0
            records.append({"step": 1, "time_s": round(compile_s, 2), "loss": loss0, "lr": lr})
            log(f"[{name}] step 1 loss {loss0:.4f} (compile + first step {compile_s:.1f} s)")
        elif i == 1 + s.probe_steps:
            float(loss)
            step_s = (time.time() - t_first) / s.probe_steps
            if total is None:
                total = max(i, i + int((deadline - time.time()) / step_s))
                log(f"[{name}] {step_s * 1e3:.1f} ms/step -> {total} steps in the budget")
        if i % s.log_every == 0 or (total is not None and i >= total):
            value = float(loss)
            now = time.time()
            records.append({"step": i, "time_s": round(now - t0, 2), "loss": value, "lr": lr})
            log(f"[{name}] step {i}/{total} loss {value:.4f} lr {lr:.2e} ({now - t0:.0f} s)")
            if s.max_steps is None and now > deadline:
                log(f"[{name}] time budget reached at step {i}")
                break
        if total is not None and i >= total:
            break
    jax.block_until_ready(state)
    train_s = time.time() - t0
    if step_s is None:
        step_s = (time.time() - t_first) / max(1, i - 1) if i > 1 else compile_s
    return state, {"steps": i, "total_steps": total, "compile_s": round(compile_s, 2),
                   "step_ms": round(step_s * 1e3, 2), "train_s": round(train_s, 2), "log": records}


def train_target(cfg: TargetConfig, train_tokens: np.ndarray, heldout_tokens: np.ndarray, s: TrainSettings,
                 *, log: Callable[[str], None] = print) -> tuple[Any, Any, dict]:
    """Train from scratch; returns (graphdef, float32 params, report)."""
    t0 = time.time()
    graphdef, params = init_target(cfg, s.seed)
    tx = make_optimizer(s)
    opt_state = tx.init(params)
    train_step, eval_fn = make_target_steps(graphdef, cfg, s, tx)
    data = jnp.asarray(train_tokens.astype(np.int32))
    if data.shape[0] <= s.seq_len + 1:
        raise ValueError(f"training set of {data.shape[0]} tokens is shorter than one window of {s.seq_len + 1}")
    windows = eval_windows(heldout_tokens, s.seq_len + 1, s.eval_windows)
    log(f"[target] {count_params(params):,} params, {len(train_tokens):,} train tokens, "
        f"{len(windows)} held-out windows of {s.seq_len + 1}, "
        f"GDN {'chunked' if default_gdn_chunked() else 'recurrent'} form")

    def step(state, key, lr):
        p, o = state
        p, o, loss = train_step(p, o, data, key, lr)
        return (p, o), loss

    (params, opt_state), hist = run_budgeted(step, (params, opt_state), s, log=log, name="target", start_time=t0)
    t_eval = time.time()
    heldout = mean_eval_loss(eval_fn, params, windows, min(s.batch_size, len(windows)))
    hist.update(
        params=count_params(params),
        tokens_seen=hist["steps"] * s.batch_size * s.seq_len,
        final_train_loss=hist["log"][-1]["loss"],
        first_train_loss=hist["log"][0]["loss"],
        heldout_loss=heldout,
        heldout_ppl=math.exp(min(heldout, 50.0)),
        heldout_windows=int(len(windows)),
        gdn_form="chunked" if default_gdn_chunked() else "recurrent",
        eval_s=round(time.time() - t_eval, 2),
        settings=dataclasses.asdict(s),
    )
    log(f"[target] held-out loss {heldout:.4f} (ppl {hist['heldout_ppl']:.2f}) after {hist['steps']} steps")
    return graphdef, params, hist
