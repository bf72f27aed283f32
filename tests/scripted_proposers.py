"""Scripted drafters for end-to-end tests, behind the same Proposer interface as DFlash.

- oracle: proposes the target's own greedy continuation (a table of absolute positions) with
  errors injected at random (position, depth, step) - long accepts and rejects at every depth;
  the correct token stays the runner-up so trees can recover from an error.
- random: error_rate 1 and no runner-up: almost nothing is accepted.
- recording: wraps another proposer and stores the target features it is given, by position,
  so a test can check they are the features of the committed tokens.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from ddtree_jax.routes import REFERENCE


class ScriptState(NamedTuple):
    table: jax.Array  # [B, T_total] target greedy tokens at absolute positions (or zeros)
    lengths: jax.Array  # [B] committed tokens


@dataclasses.dataclass(frozen=True)
class ScriptedProposer:
    block_size: int
    vocab: int
    error_rate: float
    seed: int = 0
    runner_up: bool = True
    hidden_ids: tuple = ()

    def init_state(self, params, batch, capacity):
        table = params if params is not None else jnp.zeros((batch, capacity), jnp.int32)
        return ScriptState(table, jnp.zeros((batch,), jnp.int32))

    def extend(self, params, state, features, n_valid, routes=REFERENCE):
        return state._replace(lengths=state.lengths + n_valid)

    def propose(self, params, state, target, bonus, start, routes=REFERENCE):
        depth = self.block_size - 1
        b = bonus.shape[0]
        pos = start[:, None] + 1 + jnp.arange(depth)[None, :]
        correct = jnp.take_along_axis(state.table, jnp.minimum(pos, state.table.shape[1] - 1), axis=1)
        key = jax.random.fold_in(jax.random.PRNGKey(self.seed), 0)
        keys = jax.vmap(lambda p: jax.random.fold_in(key, p))(pos.reshape(-1) * 7919 + jnp.repeat(start, depth))
        u = jax.vmap(lambda k: jax.random.uniform(k))(keys).reshape(b, depth)
        shift = jax.vmap(lambda k: jax.random.randint(k, (), 1, self.vocab))(keys).reshape(b, depth)
        wrong = u < self.error_rate
        # Half of the errors hide the correct token entirely, so trees reject at that depth too.
        hidden = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys).reshape(b, depth) < 0.5
        proposal = jnp.where(wrong, (correct + shift) % self.vocab, correct)
        logits = jnp.full((b, depth, self.vocab), -4.0)
        logits = logits + 0.01 * jax.vmap(lambda k: jax.random.normal(k, (self.vocab,)))(keys).reshape(b, depth, -1)
        if self.runner_up:
            show = jax.nn.one_hot(correct, self.vocab, dtype=bool) & ~(wrong & hidden)[..., None]
            logits = jnp.where(show, 6.0, logits)
        logits = jnp.where(jax.nn.one_hot(proposal, self.vocab, dtype=bool), 8.0, logits)
        return jax.nn.log_softmax(logits, axis=-1)


class RecordState(NamedTuple):
    inner: ScriptState
    features: jax.Array  # [B, capacity, F]


@dataclasses.dataclass(frozen=True)
class RecordingProposer:
    inner: ScriptedProposer
    feature_dim: int
    hidden_ids: tuple = (1, 2)

    @property
    def block_size(self):
        return self.inner.block_size

    def init_state(self, params, batch, capacity):
        return RecordState(self.inner.init_state(params, batch, capacity),
                           jnp.zeros((batch, capacity, self.feature_dim)))

    def extend(self, params, state, features, n_valid, routes=REFERENCE):
        start = state.inner.lengths
        t = features.shape[1]
        pos = jnp.where(jnp.arange(t)[None, :] < n_valid[:, None], start[:, None] + jnp.arange(t)[None, :],
                        state.features.shape[1])
        feats = jax.vmap(lambda buf, p, f: buf.at[p].set(f.astype(buf.dtype), mode="drop"))(state.features, pos,
                                                                                            features)
        return RecordState(self.inner.extend(params, state.inner, features, n_valid, routes=routes), feats)

    def propose(self, params, state, target, bonus, start, routes=REFERENCE):
        return self.inner.propose(params, state.inner, target, bonus, start, routes=routes)
