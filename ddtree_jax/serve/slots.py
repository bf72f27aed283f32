"""The device side of continuous batching: B slots of one running generation state.

One `LoopState` of batch B lives on the device. A request is prefilled alone (batch 1, its prompt
padded to a length bucket, caches the size of the bucket) and its row is copied into a free
slot by a jitted insert that donates the running state (no copy of the other slots). Between
insertions the state advances in chunks of device steps. Requests are kept packed in slots
0 .. n-1 (a freed slot takes the last active row), so a chunk runs only the smallest batch
bucket that holds every active request: idle slots cost no compute.

Nothing here knows HTTP, text or requests: ddtree_jax/serve/scheduler.py drives it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.engine import Engine
from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.sampling import RowSampling, Sampling, SamplingCode, seed_key

MIN_PROMPT_BUCKET = 16


class ChunkReport(NamedTuple):
    """Host copy of what a chunk changed in the first `rows` slots."""

    n_out: np.ndarray  # [rows] tokens generated so far (the prefill's included)
    done: np.ndarray  # [rows] bool
    steps: np.ndarray  # [rows] steps taken while active
    tokens: np.ndarray  # [rows, window] out[r, sent[r] :], -1 past the end


class RowStart(NamedTuple):
    """A prefilled request, not yet in a slot."""

    state: gen.LoopState  # batch 1
    first: int  # the prefill's token
    done: bool  # finished at its first token (a stop id, or max_new 1)


def _rows_of(state: gen.LoopState, fn) -> dict:
    return {f: jax.tree.map(fn, getattr(state, f)) for f in gen.ROW_FIELDS}


def _take(state: gen.LoopState, rows: int) -> gen.LoopState:
    """The first `rows` slots (a copy when rows < B)."""
    if rows == state.done.shape[0]:
        return state
    return state._replace(**_rows_of(state, lambda x: x[:rows]))


def _put(state: gen.LoopState, sub: gen.LoopState, rows: int) -> gen.LoopState:
    """state with its first `rows` slots and its batch fields from sub."""
    if rows == state.done.shape[0]:
        return sub
    fields = {f: jax.tree.map(lambda big, small: big.at[:rows].set(small), getattr(state, f), getattr(sub, f))
              for f in gen.ROW_FIELDS}
    return sub._replace(**fields)


def _chunk(graphdef, params, dparams, state, eos, max_steps, sent, *, spec, rows: int, window: int):
    """Up to max_steps steps of the first `rows` slots, and their new tokens from sent [rows] on."""
    model = nnx.merge(graphdef, params)
    sub = gen._advance(model, dparams, _take(state, rows), eos, spec, max_steps)
    pos = jnp.minimum(sent[:, None] + jnp.arange(window, dtype=jnp.int32)[None], sub.out.shape[1] - 1)
    tokens = jnp.where(sent[:, None] + jnp.arange(window)[None] < sub.n_out[:, None],
                       jnp.take_along_axis(sub.out, pos, axis=1), -1)
    return _put(state, sub, rows), (sub.n_out, sub.done, sub.steps, tokens)


def _insert(state: gen.LoopState, row: gen.LoopState, slot) -> gen.LoopState:
    """state with slot `slot` holding row's sequence (row: batch 1; its caches may be shorter)."""

    def put(big, small):
        return jax.lax.dynamic_update_slice(big, small.astype(big.dtype), (slot,) + (0,) * (big.ndim - 1))

    return state._replace(**{f: jax.tree.map(put, getattr(state, f), getattr(row, f)) for f in gen.ROW_FIELDS})


def _move(state: gen.LoopState, src, dst) -> gen.LoopState:
    """Copy slot src into slot dst, then mark src done (src == dst: just free it)."""

    def mv(x):
        return jax.lax.dynamic_update_slice_in_dim(x, jax.lax.dynamic_slice_in_dim(x, src, 1, axis=0), dst, axis=0)

    state = state._replace(**_rows_of(state, mv))
    return state._replace(done=state.done.at[src].set(True))


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below max_batch, and max_batch."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return tuple(out) + (max_batch,)


def prompt_buckets(max_prompt: int) -> tuple[int, ...]:
    """Prompt lengths that compile a prefill each: powers of two from 16, the last max_prompt."""
    out, t = [], MIN_PROMPT_BUCKET
    while t < max_prompt:
        out.append(t)
        t *= 2
    return tuple(out) + (max_prompt,)


class SlotBatch:
    """B slots of one generation on the device, and the jitted functions that change them.

    spec: the compiled generation (mode, budget, kernel routes; sampling code that samples with
    top-k up to max_top_k and top-p, skipped at run time when no row uses it); every slot has
    room for max_context tokens (prompt + generated). buckets: the batch sizes a chunk may run
    (one compilation each; default powers of two and max_batch; (max_batch,): always every slot).
    """

    def __init__(self, engine: Engine, *, mode: str = "ddtree", budget: int = 64, candidates: int | None = None,
                 max_batch: int = 8, max_context: int = 2048, max_top_k: int = 64, max_stop_ids: int = 8,
                 chunk_steps: int = 4, buckets: Sequence[int] | None = None):
        if mode != "ar" and engine.proposer is None:
            raise ValueError(f"mode {mode!r} needs a drafter (--drafter)")
        if not 2 <= max_context <= engine.max_context:
            raise ValueError(
                f"max_context must be in [2, {engine.max_context}] (the target's limit), got {max_context}")
        if max_batch < 1 or chunk_steps < 1 or max_top_k < 0 or max_stop_ids < 0:
            raise ValueError("max_batch and chunk_steps must be >= 1, max_top_k and max_stop_ids >= 0")
        self.engine = engine
        self.max_batch = max_batch
        self.max_context = max_context
        self.max_stop_ids = max_stop_ids
        self.chunk_steps = chunk_steps
        proposer = None if mode == "ar" else engine.proposer
        block = 1 if mode == "ar" else proposer.block_size
        # Every slot: prompt + generated <= max_context, and a commit's padded path past it
        # (rounded up to a multiple of 64, the kernels' key blocks).
        self.capacity = -(-gen.required_capacity(0, max_context, block) // 64) * 64
        code = SamplingCode(sample=True, top_k=max_top_k, top_p=True)
        self.spec = gen.GenSpec(mode, budget, candidates, max_context, code, self.capacity, proposer, engine.routes)
        self.spec.validate(engine.cfg.vocab_size)
        self.buckets = batch_buckets(max_batch) if buckets is None else tuple(sorted(set(buckets) | {max_batch}))
        if not 1 <= self.buckets[0] or self.buckets[-1] != max_batch:
            raise ValueError(f"batch buckets must be in [1, max_batch={max_batch}], got {tuple(buckets)}")
        self.prompt_buckets = prompt_buckets(max_context)
        self.window = chunk_steps * block + 1  # a chunk's tokens per row, plus the prefill's
        self.eos = jnp.asarray(sorted(set(engine.stop_ids)), jnp.int32)
        g = engine.graphdef
        self._start, _ = gen.bind(g)
        self._chunk = jax.jit(functools.partial(_chunk, g), static_argnames=("spec", "rows", "window"),
                              donate_argnames=("state",))
        self._insert = jax.jit(_insert, donate_argnames=("state",))
        self._move = jax.jit(_move, donate_argnames=("state",))
        self.state = self._empty()

    # ---- host-side helpers -----------------------------------------------------------------
    def rows_for(self, n_active: int) -> int:
        """The batch bucket a chunk runs for n_active packed requests."""
        return next(b for b in self.buckets if b >= n_active)

    def prompt_bucket(self, n: int) -> int:
        return next(t for t in self.prompt_buckets if t >= n)

    def controls(self, settings: Sequence[Sampling], seeds: Sequence[int], max_new: Sequence[int],
                 stop_ids: Sequence[Sequence[int]]) -> gen.RowControls:
        stop = np.full((len(settings), self.max_stop_ids), -1, np.int32)
        for r, ids in enumerate(stop_ids):
            if len(ids) > self.max_stop_ids:
                raise ValueError(f"at most {self.max_stop_ids} stop token ids, got {len(ids)}")
            stop[r, : len(ids)] = ids
        return gen.RowControls(RowSampling.of(settings, [seed_key(s) for s in seeds]),
                               jnp.asarray(np.asarray(max_new, np.int32)), jnp.asarray(stop))

    def _empty(self) -> gen.LoopState:
        """B idle slots (zero caches, every row done): the shapes of a prefill of B rows."""
        b, e = self.max_batch, self.engine
        rows = self.controls([Sampling()] * b, [0] * b, [1] * b, [()] * b)
        prompt = jax.ShapeDtypeStruct((b, 1), jnp.int32)
        lens = jax.ShapeDtypeStruct((b,), jnp.int32)
        fn = lambda p, d, pr, ln, eos, r: gen._start_from(e.graphdef, p, d, pr, ln, eos, None, self.spec, r,
                                                           self.capacity)
        shapes = jax.eval_shape(fn, e.params, e.drafter_params, prompt, lens, self.eos, rows)
        state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        return state._replace(done=jnp.ones((b,), bool))

    # ---- device work ---------------------------------------------------------------------
    def prefill(self, prompt_ids: Sequence[int], sampling: Sampling, seed: int, max_new: int,
                stop_ids: Sequence[int] = ()) -> RowStart:
        """Prefill one request alone (its prompt padded to a length bucket) and choose its first token."""
        n = len(prompt_ids)
        if not 1 <= n or n + max_new > self.max_context:
            raise ValueError(f"prompt of {n} tokens + {max_new} new exceeds the context {self.max_context}")
        t = self.prompt_bucket(n)
        prompt = np.zeros((1, t), np.int32)
        prompt[0, :n] = prompt_ids
        rows = self.controls([sampling], [seed], [max_new], [stop_ids])
        e = self.engine
        state = self._start(e.params, e.drafter_params, jnp.asarray(prompt), jnp.asarray([n], jnp.int32), self.eos,
                            None, spec=self.spec, rows=rows, capacity=t)
        first, done = jax.device_get((state.out[0, 0], state.done[0]))
        return RowStart(state, int(first), bool(done))

    def insert(self, row: RowStart, slot: int) -> None:
        self.state = self._insert(self.state, row.state, jnp.int32(slot))

    def move(self, src: int, dst: int) -> None:
        """Slot src's request continues in slot dst; src is freed (src == dst: free it)."""
        self.state = self._move(self.state, jnp.int32(src), jnp.int32(dst))

    def advance(self, n_active: int, sent: Sequence[int], steps: int | None = None) -> ChunkReport:
        """One chunk of up to `steps` (default chunk_steps) device steps of the slots 0 .. n_active-1
        (in their batch bucket); one host sync."""
        rows = self.rows_for(n_active)
        sent_arr = np.zeros((rows,), np.int32)
        sent_arr[: len(sent)] = sent
        e = self.engine
        self.state, report = self._chunk(e.params, e.drafter_params, self.state, self.eos,
                                         jnp.int32(steps or self.chunk_steps), jnp.asarray(sent_arr),
                                         spec=self.spec, rows=rows, window=self.window)
        return ChunkReport(*jax.device_get(report))

    def warm_up(self, max_prompt: int | None = None) -> None:
        """Compile and run once: the prefill of each prompt bucket (up to max_prompt tokens; default
        all), the insert, the move, and a chunk of each batch bucket; the slots end idle."""
        limit = max_prompt or self.max_context
        for t in self.prompt_buckets[: 1 + sum(t < limit for t in self.prompt_buckets)]:
            row = self.prefill([1] * min(t, self.max_context - 1), Sampling(), 0, 1)
        for rows in self.buckets:
            for slot in range(rows):
                self.insert(row, slot)
            self.advance(rows, [0] * rows, steps=1)
            for slot in reversed(range(rows)):
                self.move(slot, slot)
        jax.block_until_ready(self.state)
