"""The target's own choice at a position: argmax, or a sample with temperature / top-k / top-p.

Acceptance compares draft tokens with these choices, so speculative output follows exactly the
distribution these functions define (losslessness).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        problems = []
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if problems:
            raise ValueError("invalid sampling settings: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_logits(logits: jax.Array, s: Sampling) -> jax.Array:
    """Temperature-scaled logits [..., V] with top-k / top-p filtered entries at -inf."""
    x = logits.astype(jnp.float32) / s.temperature
    vocab = x.shape[-1]
    if s.top_k and s.top_k < vocab:
        # (the barrier: XLA:CPU re-ran a top-k fused into its consumer; see speculative/build.top_k)
        kth = jax.lax.optimization_barrier(jax.lax.top_k(x, s.top_k)[0])[..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if s.top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each entry
        drop_sorted = before >= s.top_p  # keep the smallest prefix whose mass reaches top_p
        # Back to vocabulary order through the inverse permutation: a scatter, not a second sort.
        rows = x.reshape(-1, vocab).shape[0]
        flat_order = order.reshape(rows, vocab)
        drop = jnp.zeros((rows, vocab), bool).at[jnp.arange(rows)[:, None], flat_order].set(
            drop_sorted.reshape(rows, vocab), unique_indices=True)
        x = jnp.where(drop.reshape(x.shape), -jnp.inf, x)
    return x


def choose(logits: jax.Array, s: Sampling, key: jax.Array | None) -> jax.Array:
    """The target's token at every position of logits [..., V] (independent draws per position)."""
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, s), axis=-1).astype(jnp.int32)
