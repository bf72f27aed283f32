"""Pure, jitted entry points of the target: prefill, one decode step, and greedy decoding.

The model object is split once (`nnx.split`) into a hashable graphdef and a params pytree;
every function here merges them inside jit, so calls are pure functions of
(params, cache, tokens) and compile once per shape.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import TargetCache


class StepOutput(NamedTuple):
    logits: jax.Array  # float32, [B, V] (or [B, T, V] for prefill with all_logits)
    features: jax.Array | None  # chosen hidden states, concatenated on the last axis
    cache: TargetCache


def check_fits(cache: TargetCache, lengths, new_tokens: int) -> None:
    """Host-side guard: refuse to write past the KV capacity (XLA would clamp silently)."""
    need = int(jnp.max(jnp.asarray(lengths))) + int(new_tokens)
    if need > cache.capacity:
        raise ValueError(
            f"sequence of {need} tokens does not fit the cache capacity {cache.capacity}; "
            "create the cache with a larger capacity or shorten the prompt / max_new_tokens"
        )


@functools.partial(jax.jit, static_argnames=("graphdef", "hidden_ids", "all_logits"))
def prefill(graphdef, params, cache: TargetCache, tokens, n_valid, hidden_ids=(), all_logits=False) -> StepOutput:
    """Run prompts tokens [B, T] (right-padded, n_valid[b] real tokens) with the chunked GDN form.

    Logits are those of the last real token of each row, or of every position with all_logits.
    """
    model = nnx.merge(graphdef, params)
    h, feats, cache = model(tokens, cache, n_valid, chunked=True, hidden_ids=hidden_ids)
    if not all_logits:
        last = jnp.maximum(n_valid - 1, 0)
        h = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
        if feats is not None:
            feats = jnp.take_along_axis(feats, last[:, None, None], axis=1)[:, 0]
    return StepOutput(model.logits(h), feats, cache)


def _step(model, cache, tokens, active, hidden_ids):
    h, feats, cache = model(tokens[:, None], cache, active.astype(jnp.int32), chunked=False, hidden_ids=hidden_ids)
    return model.logits(h[:, 0]), None if feats is None else feats[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "hidden_ids"))
def decode_step(graphdef, params, cache: TargetCache, tokens, active=None, hidden_ids=()) -> StepOutput:
    """One token per sequence (tokens [B]); rows with active=False leave their cache untouched."""
    model = nnx.merge(graphdef, params)
    if active is None:
        active = jnp.ones(tokens.shape, bool)
    return StepOutput(*_step(model, cache, tokens, active, hidden_ids))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def greedy_decode(graphdef, params, cache: TargetCache, first_logits, max_new_tokens: int, eos_ids=None):
    """Plain greedy decoding on device: one lax.while_loop, no host round trip per token.

    first_logits [B, V] are the prefill logits. Returns (tokens [B, max_new_tokens] padded with -1
    after a sequence stops, number generated [B], final cache). eos_ids [E] int32 (may be empty).
    """
    model = nnx.merge(graphdef, params)
    b = first_logits.shape[0]
    eos_ids = jnp.zeros((0,), jnp.int32) if eos_ids is None else jnp.asarray(eos_ids, jnp.int32)
    out = jnp.full((b, max_new_tokens), -1, jnp.int32)

    def is_eos(tok):
        return jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)

    def cond(carry):
        i, _, _, _, done = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, logits, cache, out, done = carry
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out = out.at[:, i].set(jnp.where(done, -1, tok))
        done = done | is_eos(tok)
        logits, _, cache = _step(model, cache, tok, ~done, ())
        return i + 1, logits, cache, out, done

    init = (jnp.int32(0), first_logits, cache, out, jnp.zeros((b,), bool))
    _, _, cache, out, _ = jax.lax.while_loop(cond, body, init)
    return out, jnp.sum(out >= 0, axis=1), cache
