"""Generation on device: prefill, then one lax.while_loop of steps with no host round trip.

Modes: "ar" (one target token per step), "dflash" (a chain of block_size - 1 drafts verified
causally), "ddtree" (a tree of `budget` drafts). Each speculative step is
    propose -> build (chain or tree) -> tree_verify -> commit (target + drafter) -> emit,
and emits 1 + accepted tokens per sequence. Output is lossless w.r.t. plain decoding of the
target under the same `Sampling`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import TargetCache, init_target_cache
from ddtree_jax.spec.build import build_chain, build_tree, validate_budget
from ddtree_jax.spec.sampling import Sampling, choose
from ddtree_jax.spec.verify import tree_verify

MODES = ("ar", "dflash", "ddtree")


class GenerationResult(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens] int32, -1 after a sequence stopped
    num_tokens: jax.Array  # [B] tokens generated (EOS included)
    steps: jax.Array  # [B] target forward passes after prefill (verify steps) while active
    accepted_hist: jax.Array  # [block_size + 1] histogram of tokens emitted per step (all rows)
    cache: TargetCache
    drafter_state: Any  # the proposer's final state (None for "ar")


class _Loop(NamedTuple):
    cache: TargetCache
    dstate: Any
    bonus: jax.Array
    out: jax.Array
    n_out: jax.Array
    done: jax.Array
    steps: jax.Array
    hist: jax.Array
    i: jax.Array


def required_capacity(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """KV slots a generation needs: a commit writes a full padded path past the prefix."""
    return prompt_len + max_new_tokens + block_size + 1


def _emit(out, n_out, done, new_tokens, n_new, eos_ids, max_new):
    """Append new_tokens [B, P] (first n_new[b] real) to out; stop rows at EOS or max_new."""
    p = new_tokens.shape[1]
    idx = jnp.arange(p)[None, :]
    real = idx < n_new[:, None]
    eos = jnp.any(new_tokens[..., None] == eos_ids, axis=-1) & real
    first_eos = jnp.where(jnp.any(eos, axis=1), jnp.argmax(eos, axis=1) + 1, n_new)
    n_new = jnp.where(done, 0, jnp.minimum(first_eos, max_new - n_out))
    keep = idx < n_new[:, None]
    pos = jnp.where(keep, n_out[:, None] + idx, out.shape[1])  # out-of-range writes are dropped
    out = jax.vmap(lambda o, p_, t: o.at[p_].set(t, mode="drop"))(out, pos, new_tokens)
    n_out = n_out + n_new
    done = done | jnp.any(eos & keep, axis=1) | (n_out >= max_new)
    return out, n_out, done


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "proposer", "mode", "budget", "max_new_tokens", "sampling", "capacity"),
)
def generate(graphdef, params, prompt, prompt_lens, *, proposer=None, drafter_params=None, mode: str = "ddtree",
             budget: int = 64, max_new_tokens: int = 128, sampling: Sampling = Sampling(), eos_ids=None, key=None,
             capacity: int | None = None) -> GenerationResult:
    """Generate for right-padded prompts [B, T] with prompt_lens [B] real tokens.

    Everything after the arguments runs on device inside this one jitted function.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    b, t = prompt.shape
    block = 1 if mode == "ar" else proposer.block_size
    depth = block - 1
    if mode == "ddtree":
        validate_budget(budget, depth, cfg.vocab_size)
    capacity = capacity or required_capacity(t, max_new_tokens, block)
    eos_ids = jnp.zeros((0,), jnp.int32) if eos_ids is None else jnp.asarray(eos_ids, jnp.int32)
    key = jax.random.PRNGKey(0) if key is None else key
    hidden_ids = () if mode == "ar" else proposer.hidden_ids

    cache = init_target_cache(cfg, b, capacity)
    h, feats, cache = model(prompt, cache, prompt_lens, chunked=True, hidden_ids=hidden_ids)
    last = jnp.take_along_axis(h, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    prefill_key, key = jax.random.split(key)
    bonus = choose(model.logits(last), sampling, prefill_key)
    dstate = None
    if mode != "ar":
        dstate = proposer.init_state(drafter_params, b, capacity)
        dstate = proposer.extend(drafter_params, dstate, feats, prompt_lens)
    out = jnp.full((b, max_new_tokens), -1, jnp.int32)
    out, n_out, done = _emit(out, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), bonus[:, None],
                             jnp.ones((b,), jnp.int32), eos_ids, max_new_tokens)

    def ar_step(s: _Loop, step_key):
        h, _, cache = model(s.bonus[:, None], s.cache, (~s.done).astype(jnp.int32), chunked=False)
        nxt = choose(model.logits(h[:, 0]), sampling, step_key)
        out, n_out, done = _emit(s.out, s.n_out, s.done, nxt[:, None], jnp.ones((b,), jnp.int32), eos_ids, max_new_tokens)
        return cache, s.dstate, nxt, out, n_out, done, (n_out - s.n_out)

    def spec_step(s: _Loop, step_key):
        start = s.cache.lengths
        logq = proposer.propose(drafter_params, s.dstate, model, s.bonus, start)
        if mode == "dflash":
            tree = build_chain(logq, s.bonus, start)
            res = tree_verify(model, s.cache, None, tree.tokens, sampling, step_key, max_depth=depth, hidden_ids=hidden_ids)
        else:
            tree = build_tree(logq, s.bonus, start, budget)
            res = tree_verify(model, s.cache, tree, tree.tokens, sampling, step_key, max_depth=depth, hidden_ids=hidden_ids)
        # Emitted this step: the accepted draft tokens, then the new bonus (res.count tokens).
        path_tokens = jnp.take_along_axis(tree.tokens, res.path, axis=1)
        emitted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
        emitted = jax.vmap(lambda e, c, x: e.at[c - 1].set(x))(emitted, res.count, res.bonus)
        out, n_out, done = _emit(s.out, s.n_out, s.done, emitted, res.count, eos_ids, max_new_tokens)
        # Commit root + the accepted nodes actually emitted (fewer when EOS / max_new cut the step),
        # so the cache always holds exactly the prompt and every emitted token but the last.
        count = n_out - s.n_out
        cache = model.commit(res.pending, res.path, count, s.cache)
        dstate = proposer.extend(drafter_params, s.dstate, res.features, count)
        return cache, dstate, res.bonus, out, n_out, done, count

    step_fn = ar_step if mode == "ar" else spec_step

    def cond(s: _Loop):
        return ~jnp.all(s.done)

    def body(s: _Loop):
        active = ~s.done
        cache, dstate, bonus, out, n_out, done, n_new = step_fn(s, jax.random.fold_in(key, s.i))
        hist = s.hist.at[jnp.where(active, n_new, block + 1)].add(1, mode="drop")
        return _Loop(cache, dstate, bonus, out, n_out, done, s.steps + active, hist, s.i + 1)

    init = _Loop(cache, dstate, bonus, out, n_out, done, jnp.zeros((b,), jnp.int32),
                 jnp.zeros((block + 1,), jnp.int32), jnp.int32(0))
    final = jax.lax.while_loop(cond, body, init)
    return GenerationResult(final.out, final.n_out, final.steps, final.hist, final.cache, final.dstate)
