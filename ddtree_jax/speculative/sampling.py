"""The target's own choice at a position: argmax, or a sample with temperature / top-k / top-p.

Acceptance compares draft tokens with these choices, so speculative output follows exactly the
distribution these functions define (losslessness).

Two layers of settings:
- `Sampling`: one request's values (host floats), the user-facing form.
- `SamplingCode` (static, part of the jit key): which sampling code a compiled generation holds.
  The values themselves travel per row as `RowSampling` arrays, so rows with different settings
  share a batch and one compiled program. An all-greedy code compiles the argmax alone; code with
  sampling skips the sampling work at run time (lax.cond) when no row of the batch samples.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np


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


@dataclasses.dataclass(frozen=True)
class SamplingCode:
    """Which sampling code a compiled generation holds (static).

    sample: rows with temperature > 0 draw from the filtered distribution (False: argmax only,
    the all-greedy program). top_k: the largest per-row top-k the program filters by (lax.top_k
    needs a static k; 0: no top-k code). top_p: the top-p filter is compiled.
    """

    sample: bool = False
    top_k: int = 0
    top_p: bool = False

    def __post_init__(self):
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingCode.top_k must be an integer >= 0, got {self.top_k!r}")
        if (self.top_k or self.top_p) and not self.sample:
            raise ValueError("a SamplingCode with a top-k or top-p filter must sample")

    @classmethod
    def covering(cls, settings: Sequence[Sampling]) -> "SamplingCode":
        """The smallest code that serves every one of `settings`."""
        sampled = [s for s in settings if not s.greedy]
        if not sampled:
            return cls()
        return cls(True, max(s.top_k for s in sampled), any(s.top_p < 1 for s in sampled))

    def serves(self, s: Sampling) -> bool:
        """Whether a row with settings s can run in this code."""
        if s.greedy:
            return True
        return self.sample and s.top_k <= self.top_k and (s.top_p == 1 or self.top_p)


def to_code(sampling: "Sampling | SamplingCode") -> SamplingCode:
    """The code a GenSpec's sampling field stands for (a Sampling: the code that serves it)."""
    return sampling if isinstance(sampling, SamplingCode) else SamplingCode.covering([sampling])


def seed_key(seed: int) -> np.ndarray:
    """The raw PRNG key [2] uint32 of an integer seed (jax.random.PRNGKey's for 0 <= seed < 2**32;
    any integer is taken modulo 2**64, high word first)."""
    seed = int(seed) % (1 << 64)
    return np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


class RowSampling(NamedTuple):
    """Per-row sampling values as arrays (traced: new values compile nothing)."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = no top-k filter
    top_p: jax.Array  # [B] float32, 1 = no top-p filter
    key: jax.Array  # [B, 2] uint32: each row's own PRNG key (its seed)

    @classmethod
    def of(cls, settings: Sequence[Sampling], keys) -> "RowSampling":
        """Rows from host settings and per-row raw keys [B, 2] (see seed_key)."""
        return cls(jnp.asarray(np.asarray([s.temperature for s in settings], np.float32)),
                   jnp.asarray(np.asarray([s.top_k for s in settings], np.int32)),
                   jnp.asarray(np.asarray([s.top_p for s in settings], np.float32)),
                   jnp.asarray(np.asarray(keys, np.uint32).reshape(len(settings), 2)))

    @classmethod
    def uniform(cls, s: Sampling, batch: int, key: jax.Array) -> "RowSampling":
        """Every row with settings s; row r's key is fold_in(key, r)."""
        keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(batch, dtype=jnp.uint32))
        return cls(jnp.full((batch,), s.temperature, jnp.float32), jnp.full((batch,), s.top_k, jnp.int32),
                   jnp.full((batch,), s.top_p, jnp.float32), keys)


def filtered_logits(logits: jax.Array, s: Sampling) -> jax.Array:
    """Temperature-scaled logits [..., V] with top-k / top-p filtered entries at -inf (one setting:
    the reference form of `filtered_rows`)."""
    x = logits.astype(jnp.float32) / s.temperature
    vocab = x.shape[-1]
    if s.top_k and s.top_k < vocab:
        # (the barrier: XLA:CPU re-ran a top-k fused into its consumer; see speculative/build.top_k)
        kth = jax.lax.optimization_barrier(jax.lax.top_k(x, s.top_k)[0])[..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if s.top_p < 1.0:
        x = jnp.where(_top_p_drop(x, jnp.asarray(s.top_p, jnp.float32)), -jnp.inf, x)
    return x


def _top_p_drop(x: jax.Array, top_p: jax.Array) -> jax.Array:
    """Entries of x [..., V] outside the smallest most-likely set whose mass reaches top_p
    (top_p broadcasts against x[..., :1])."""
    vocab = x.shape[-1]
    order = jnp.argsort(-x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each entry
    drop_sorted = before >= top_p  # keep the smallest prefix whose mass reaches top_p
    # Back to vocabulary order through the inverse permutation: a scatter, not a second sort.
    rows = x.reshape(-1, vocab).shape[0]
    flat_order = order.reshape(rows, vocab)
    drop = jnp.zeros((rows, vocab), bool).at[jnp.arange(rows)[:, None], flat_order].set(
        drop_sorted.reshape(rows, vocab), unique_indices=True)
    return drop.reshape(x.shape)


def _per_row(v: jax.Array, x: jax.Array) -> jax.Array:
    """v [B] shaped to broadcast against x [B, ..., V]."""
    return v.reshape(v.shape + (1,) * (x.ndim - 1))


def filtered_rows(logits: jax.Array, code: SamplingCode, rows: RowSampling) -> jax.Array:
    """filtered_logits with each row's own settings: logits [B, ..., V]; rows of batch B. Greedy
    rows come out scaled by 1 (their choice is the argmax, made elsewhere). A filter no row uses
    is skipped at run time."""
    x = logits.astype(jnp.float32)
    vocab = x.shape[-1]
    temp = rows.temperature
    x = x / _per_row(jnp.where(temp > 0, temp, 1.0), x)
    k_max = min(code.top_k, vocab)
    if k_max:
        k = rows.top_k
        on = (k > 0) & (k < vocab)

        def top_k_filter(x):
            top = jax.lax.optimization_barrier(jax.lax.top_k(x, k_max)[0])  # [B, ..., k_max]
            kth = jnp.take_along_axis(top, jnp.broadcast_to(_per_row(jnp.clip(k, 1, k_max) - 1, top),
                                                            top.shape[:-1] + (1,)), axis=-1)
            return jnp.where(_per_row(on, x) & (x < kth), -jnp.inf, x)

        x = jax.lax.cond(jnp.any(on), top_k_filter, lambda x: x, x)
    if code.top_p:
        on = rows.top_p < 1

        def top_p_filter(x):
            drop = _top_p_drop(x, _per_row(rows.top_p, x))
            return jnp.where(_per_row(on, x) & drop, -jnp.inf, x)

        x = jax.lax.cond(jnp.any(on), top_p_filter, lambda x: x, x)
    return x


def choose(logits: jax.Array, code: SamplingCode, rows: RowSampling | None, keys: jax.Array | None) -> jax.Array:
    """The target's token at every position of logits [B, ..., V]: each row's argmax or its own
    draw, one PRNG key per position (keys [B, ..., 2], generate.position_keys)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not code.sample:
        return greedy

    def sample(logits):
        x = filtered_rows(logits, code, rows)
        flat_keys, flat_x = keys.reshape(-1, keys.shape[-1]), x.reshape(-1, x.shape[-1])
        drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row))(flat_keys, flat_x)
        drawn = drawn.reshape(x.shape[:-1]).astype(jnp.int32)
        return jnp.where(_per_row(rows.temperature > 0, greedy), drawn, greedy)

    return jax.lax.cond(jnp.any(rows.temperature > 0), sample, lambda _: greedy, logits)
