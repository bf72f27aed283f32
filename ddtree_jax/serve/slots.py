"""The device side of continuous batching: B slots of one running generation state.

One `LoopState` of batch B lives on the device. The requests waiting at a scheduling point are
prefilled together, in calls of similar prompt lengths within a budget of padded tokens
(`prefill_groups`; each call's count padded to a prefill batch bucket, its prompts to the longest
one's length bucket, caches the size of that bucket: one prefill program per pair of buckets),
and each call's rows are scattered into free slots by one jitted insert that donates the running
state (no copy of the other slots): a burst of arrivals costs a prefill, a host read of the first
tokens and an insert per call, not per request. Between insertions the state advances in
chunks of device steps, each dispatched without waiting (`launch`): the host streams one chunk's
tokens while the next one runs, and each chunk reports the tokens it generated per row. Requests
are kept packed in slots 0 .. n-1 (a freed slot takes the last active row), so a chunk runs only
the smallest batch bucket that holds every active request: idle slots cost no compute.

Budget "auto" (choice.AutoBudget, objective "tokens"): each chunk runs with its batch bucket's
step-time table (data in the loop state: one compilation per bucket still), from a file or
measured at start-up in the chunk program itself. The policy's per-row state moves with its
request and starts afresh in a slot that gets a new one (choice.joining); its calibration belongs
to the model and persists. The step counter and statistics restart with every chunk.

Nothing here knows HTTP, text or requests: ddtree_jax/serve/scheduler.py drives it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time
from typing import Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.engine import Engine, resolve_budget
from ddtree_jax.flat_params import FlatParams
from ddtree_jax.speculative import choice
from ddtree_jax.speculative import cost_table as costs
from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.choice import AutoBudget
from ddtree_jax.speculative.sampling import RowSampling, Sampling, SamplingCode, seed_key

MIN_PROMPT_BUCKET = 16
SERVE_AR_MARGIN = 0.3  # budget "auto" served: plain steps must be predicted 30 % better than the best draft
MEASURE_PROMPT = 64  # tokens of the start-up table's synthetic prompt (at most a quarter of the context)
# padded prompt tokens one prefill call may take, by default (decision 0044): on a CPU prefill is
# compute-bound, and a call of 32 prompts made every first token wait for all of them
PREFILL_TOKENS = {"cpu": 512, "accelerator": 2048}


def measure_steps() -> int:
    """Steps of a start-up table's shorter timing call (twice as many in the longer): by device
    (cost_table.timing_defaults)."""
    return costs.timing_defaults()[0]


class ChunkReport(NamedTuple):
    """Host copy of what a chunk changed in the first `rows` slots (as they were when it ran)."""

    n_out: np.ndarray  # [rows] tokens generated so far (the prefill's included)
    n_new: np.ndarray  # [rows] tokens the chunk generated
    done: np.ndarray  # [rows] bool
    steps: np.ndarray  # [rows] steps taken while active
    tokens: np.ndarray  # [rows, window] the chunk's tokens (tokens[r, :n_new[r]]), -1 past them
    # budget "auto", per choice (AutoBudget.names order), in this chunk: steps, row-steps (active rows
    # summed over those steps), predicted (calibrated) and realised accepted draft tokens, and the
    # row-steps the prediction covers (all speculative ones but device chunks' lean steps); else None
    choice_steps: np.ndarray | None = None
    choice_rows: np.ndarray | None = None
    choice_predicted: np.ndarray | None = None
    choice_accepted: np.ndarray | None = None
    choice_scored: np.ndarray | None = None


class PrefillRequest(NamedTuple):
    """What a prefill needs of one request."""

    prompt_ids: Sequence[int]
    sampling: Sampling
    seed: int
    max_new: int
    stop_ids: Sequence[int] = ()


class Prefilled(NamedTuple):
    """Requests prefilled together, not yet in slots: rows 0 .. n-1 of `state` (its batch is the
    prefill's bucket; the rows past n are padding that is never inserted)."""

    state: gen.LoopState
    first: tuple[int, ...]  # [n] each request's first token (the prefill's)
    done: tuple[bool, ...]  # [n] finished at its first token (a stop id, or max_new 1)


def _take(state: gen.LoopState, rows: int) -> gen.LoopState:
    """The first `rows` slots (a copy when rows < B)."""
    if rows == state.done.shape[0]:
        return state
    return gen.map_rows(lambda x: x[:rows], state)


def _put(state: gen.LoopState, sub: gen.LoopState, rows: int) -> gen.LoopState:
    """state with its first `rows` slots and its batch fields from sub."""
    if rows == state.done.shape[0]:
        return sub
    return gen.map_rows(lambda big, small: big.at[:rows].set(small), state, sub, base=sub)


class PendingChunk:
    """A chunk dispatched to the device; result() waits for it and copies its report to the host."""

    def __init__(self, report):
        self._report = report

    def result(self) -> ChunkReport:
        return ChunkReport(*jax.device_get(self._report))


def _chunk(graphdef, params, dparams, state, eos, max_steps, table, *, spec, rows: int, window: int):
    """Up to max_steps steps of the first `rows` slots, and the tokens each generated.

    The batch's step counter, histogram and (budget "auto") statistics restart from zero in every
    chunk, so none of them grows with the server's lifetime (the step counter stays below
    max_steps: every index by step is in range). table: budget "auto"'s step times for this bucket
    (cost_ms [C, K], cost_ctx [K]: data, so every table shares the bucket's compilation); None
    otherwise."""
    model = nnx.merge(graphdef, params)
    sub = _take(state, rows)
    sub = sub._replace(i=jnp.zeros_like(sub.i), hist=jnp.zeros_like(sub.hist))
    if spec.adaptive is not None:
        ms, ctx = table
        sub = sub._replace(adapt=choice.clear_statistics(sub.adapt)._replace(cost_ms=ms, cost_ctx=ctx))
    start = sub.n_out
    sub = gen._advance(model, dparams, sub, eos, spec, max_steps)
    offsets = start[:, None] + jnp.arange(window, dtype=jnp.int32)[None]
    tokens = jnp.where(offsets < sub.n_out[:, None],
                       jnp.take_along_axis(sub.out, jnp.minimum(offsets, sub.out.shape[1] - 1), axis=1), -1)
    stats = (None,) * 5
    if spec.adaptive is not None:
        a = sub.adapt
        stats = (a.n_steps, a.n_rows, a.sum_cal, a.sum_real, a.n_scored)
    return _put(state, sub, rows), (sub.n_out, sub.n_out - start, sub.done, sub.steps, tokens) + stats


def _insert(state: gen.LoopState, rows: gen.LoopState, slots) -> gen.LoopState:
    """state with slot slots[j] holding rows' row j, for every j with slots[j] < B (B or more: row j is
    not inserted); rows' caches may be shorter than the slots' (a prefill's prompt bucket: the
    slot's positions past them keep what they held, which no mask reads). One scatter per field.
    Budget "auto": an inserted row's per-row policy state is a joining row's (choice.joining), never
    the previous occupant's; the batch's calibration is state's own, and its probe wait restarts
    from the shortest (a new request is new evidence: after a long run of plain steps, whose
    probes kept choosing plain steps and doubled the wait up to probe_wait's most, the policy
    would otherwise not try a draft on it for up to that many steps)."""
    if state.adapt is not None:
        rows = rows._replace(adapt=choice.joining(state.adapt, rows.adapt))
        state = state._replace(adapt=state.adapt._replace(gap=jnp.ones_like(state.adapt.gap)))

    def put(big, small):
        window = tuple(slice(0, n) for n in small.shape[1:])
        return big.at[(slots,) + window].set(small.astype(big.dtype), mode="drop")

    return gen.map_rows(put, state, rows)


def _move(state: gen.LoopState, src, dst) -> gen.LoopState:
    """Copy slot src into slot dst (its per-row policy state too), then mark src done (src == dst:
    just free it)."""

    def mv(x):
        return jax.lax.dynamic_update_slice_in_dim(x, jax.lax.dynamic_slice_in_dim(x, src, 1, axis=0), dst, axis=0)

    state = gen.map_rows(mv, state)
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

    budget "auto" (mode ddtree): an AutoBudget over auto_budgets with the objective "tokens" (a
    server replaces finished rows, so the batch's tokens per second is what counts; an AutoBudget
    passed in keeps its objective), chosen on device: every step (decide_every 0, the default), or
    once per device chunk of decide_every steps, which goes on across the server's chunks of
    chunk_steps (AutoBudget.device_chunks; rows that join meanwhile take the running choice). The
    host never chooses: its chunks are a few steps and, with overlap, read a chunk late. Its step
    times per batch bucket come from cost_table (the path of a file `ddtree-bench --cost-table` wrote, with a table for
    every bucket, or {bucket: CostTable}) or from measure_costs() (warm_up calls it); `tables`
    holds them.
    """

    def __init__(self, engine: Engine, *, mode: str = "ddtree", budget: int | str | AutoBudget = 64,
                 candidates: int | None = None, max_batch: int = 8, max_context: int = 2048, max_top_k: int = 64,
                 max_stop_ids: int = 8, chunk_steps: int = 4, buckets: Sequence[int] | None = None,
                 max_prefill: int | None = None, prefill_tokens: int | None = None,
                 auto_budgets: Sequence[int] | None = None,
                 cost_table: str | os.PathLike | Mapping[int, costs.CostTable] | None = None,
                 decide_every: int = 0):
        if mode != "ar" and engine.proposer is None:
            raise ValueError(f"mode {mode!r} needs a drafter (--drafter)")
        if not 2 <= max_context <= engine.max_context:
            raise ValueError(
                f"max_context must be in [2, {engine.max_context}] (the target's limit), got {max_context}")
        if max_batch < 1 or chunk_steps < 1 or max_top_k < 0 or max_stop_ids < 0:
            raise ValueError("max_batch and chunk_steps must be >= 1, max_top_k and max_stop_ids >= 0")
        max_prefill = max_batch if max_prefill is None else max_prefill
        if not 1 <= max_prefill <= max_batch:
            raise ValueError(f"max_prefill must be in [1, max_batch={max_batch}], got {max_prefill}")
        if prefill_tokens is None:
            prefill_tokens = PREFILL_TOKENS["cpu" if jax.default_backend() == "cpu" else "accelerator"]
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
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
        resolved = resolve_budget(mode, budget, auto_budgets)
        if isinstance(budget, str) and isinstance(resolved, AutoBudget):
            # rows are replaced as they finish; the margin toward drafting the serving runs were measured
            # with (decisions 0044, 0047) stays: the engine's makespan replaced it by its spread term
            resolved = dataclasses.replace(resolved, objective="tokens", ar_margin=SERVE_AR_MARGIN)
        if isinstance(resolved, AutoBudget):  # chunks of a few steps, read a chunk late: choose on device
            if not isinstance(decide_every, int) or decide_every < 0:
                raise ValueError(f"decide_every must be an integer >= 0, got {decide_every!r}")
            resolved = dataclasses.replace(resolved, decide_every=decide_every, decide_on="device", run=-1)
        self.spec = gen.GenSpec(mode, resolved, candidates, max_context, code, self.capacity, proposer, engine.routes)
        self.spec.validate(engine.cfg.vocab_size)
        self.auto: AutoBudget | None = self.spec.adaptive
        self.buckets = batch_buckets(max_batch) if buckets is None else tuple(sorted(set(buckets) | {max_batch}))
        if not 1 <= self.buckets[0] or self.buckets[-1] != max_batch:
            raise ValueError(f"batch buckets must be in [1, max_batch={max_batch}], got {tuple(buckets)}")
        # budget "auto": the step-time table of each batch bucket, and its arrays on the device
        self.tables: dict[int, costs.CostTable] = {}
        self._table_arrays: dict[int, tuple] = {}
        # the trace of choices holds one chunk's steps (or a start-up measurement's longest call)
        self.trace_len = max(chunk_steps, 2 * measure_steps())
        if cost_table is not None:
            if self.auto is None:
                raise ValueError("a step-time table is for mode ddtree with budget 'auto' only")
            self.tables = self._load_tables(cost_table)
        self.prompt_buckets = prompt_buckets(max_context)
        # requests prefilled at once: powers of two up to max_prefill (a prefill program per pair of
        # a prefill bucket and a prompt bucket)
        self.prefill_buckets = batch_buckets(max_prefill)
        self.max_prefill = max_prefill
        self.prefill_tokens = prefill_tokens
        self.window = chunk_steps * block + 1  # a chunk's tokens per row, plus the prefill's
        self.eos = jnp.asarray(sorted(set(engine.stop_ids)), jnp.int32)
        g = engine.graphdef
        self._start, _ = gen.bind(g)
        self._chunk = FlatParams(functools.partial(_chunk, g), 2, static_argnames=("spec", "rows", "window"),
                                 donate_argnums=(2,))
        self._insert = jax.jit(_insert, donate_argnames=("state",))
        self._move = jax.jit(_move, donate_argnames=("state",))
        self.state = self._empty()
        if self.auto is not None:
            self._install_tables()

    # ---- budget "auto": step-time tables ---------------------------------------------------------
    @property
    def choice_names(self) -> tuple[str, ...]:
        """The adaptive budget's choices (ChunkReport.choice_* order); () without one."""
        return () if self.auto is None else self.auto.names

    def _load_tables(self, source) -> dict[int, costs.CostTable]:
        """A table for every batch bucket, each checked against the compiled choices; every problem
        of every bucket in one ValueError."""
        tables, problems = {}, []
        for rows in self.buckets:
            try:
                if isinstance(source, Mapping):
                    if rows not in source:
                        raise ValueError(f"no step-time table for batch {rows} (tables for {sorted(source)})")
                    table = source[rows]
                else:
                    table = self.engine.load_cost_table(source, rows, self.auto.form)
                table.arrays(self.auto)  # every compiled choice has a time
                tables[rows] = table
            except ValueError as e:
                if str(e) not in problems:
                    problems.append(str(e))
        if problems:
            raise ValueError("; ".join(problems))
        return tables

    def _install_tables(self) -> None:
        """The tables' arrays for the chunks, and the policy's state from scratch: calibration and
        population expectation from the largest bucket's table where it measured them (a file from
        ddtree-bench), else nothing learned yet (the first speculative step teaches them)."""
        self._table_arrays = {}
        for rows, table in self.tables.items():
            arrays = table.arrays(self.auto)
            self._table_arrays[rows] = (jnp.asarray(arrays.ms, jnp.float32), jnp.asarray(arrays.contexts, jnp.float32))
        prior = self.tables.get(self.buckets[-1])
        arrays = prior.arrays(self.auto) if prior is not None else costs.placeholder(self.auto)
        fresh = choice.init_state(self.auto, self.max_batch, self.trace_len, arrays)
        # one buffer per field (init_state shares some; the chunk donates the state) and exact types
        # (no weak types: a new state must not compile another program)
        self.state = self.state._replace(adapt=jax.tree.map(lambda x: jnp.array(x, x.dtype, copy=True), fresh))

    def _table(self, rows: int, placeholder: bool = False):
        """The (cost_ms, cost_ctx) a chunk of batch `rows` runs with; None without budget "auto"."""
        if self.auto is None:
            return None
        if rows in self._table_arrays:
            return self._table_arrays[rows]
        if not placeholder:
            raise RuntimeError(f"no step-time table for batch {rows}: call measure_costs() (warm_up does) or "
                               "give cost_table")
        arrays = costs.placeholder(self.auto)  # warm-up and measurement runs: their choices do not matter
        return jnp.asarray(arrays.ms), jnp.asarray(arrays.contexts)

    def measure_costs(self, steps: int | None = None, repeats: int | None = None) -> dict[int, float]:
        """Budget "auto": measure the step-time table of every batch bucket that has none, in the
        serving program itself (the bucket's chunk; the forced choice and the table are data, so
        nothing more compiles): the bucket's slots hold copies of one synthetic request, run without
        stop tokens, each choice forced (cost_table.measure). The acceptance such runs see says
        nothing of real requests and is not kept: the policy learns it from the traffic. Needs idle
        slots (before serving) and room for a copy of their state. The slots end idle. Returns the
        seconds each bucket took. steps / repeats: None, by device (cost_table.timing_defaults)."""
        if self.auto is None:
            return {}
        steps, repeats = costs.timing_defaults(steps, repeats)
        if not bool(np.asarray(self.state.done).all()):
            raise RuntimeError("measure_costs needs idle slots: call it before serving")
        if 2 * steps > self.trace_len:
            raise ValueError(f"steps must be at most {self.trace_len // 2}, got {steps}")
        todo = [rows for rows in self.buckets if rows not in self.tables]
        seconds = {}
        if todo:
            n = max(1, min(MEASURE_PROMPT, self.max_context // 4))
            if self.max_context - n < 2:
                raise ValueError(f"max_context {self.max_context} leaves no room to measure step times")
            prompt = np.random.default_rng(0).integers(0, self.engine.cfg.vocab_size, n).tolist()
            never = jnp.full(self.eos.shape, -1, jnp.int32)  # the real EOS set's shape: the same program
            row = self._prefill([PrefillRequest(prompt, Sampling(), 0, self.max_context - n)], never)
            e = self.engine
            for rows in todo:
                t0 = time.perf_counter()
                for slot in range(rows):
                    self.insert(row, [slot])
                start = self.state._replace(i=jnp.zeros_like(self.state.i))
                hold = self._table(rows, placeholder=True)

                def advance(st, c, k, rows=rows, hold=hold):  # c: forced in st (adapt.force)
                    return self._chunk(e.params, e.drafter_params, st, never, np.int32(k), hold, spec=self.spec,
                                       rows=rows, window=self.window)[0]

                table = costs.measure(advance, start, self.auto, steps=steps, repeats=repeats, batch=rows,
                                      context=float(n), calibrate=False)
                self.tables[rows] = dataclasses.replace(
                    table, ratios={}, accepted={},
                    source=f"measured at start-up in the serving program (batch {rows}, a synthetic {n}-token prompt; "
                    f"each choice forced for {steps} and {2 * steps} steps, median of {repeats} interleaved pairs)")
                self.state = start
                seconds[rows] = time.perf_counter() - t0
            self.state = self.state._replace(done=jnp.ones_like(self.state.done))
        self._install_tables()
        jax.block_until_ready(self.state)
        return seconds

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
                                                           self.capacity, self._row_costs())
        shapes = jax.eval_shape(fn, e.params, e.drafter_params, prompt, lens, self.eos, rows)
        # (budget "auto": the adaptive state is replaced by _install_tables)
        state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        return state._replace(done=jnp.ones((b,), bool))

    def _row_costs(self):
        """The table arrays a prefill's own adaptive state starts from: only its per-row fields are
        used, and insert replaces them (choice.joining)."""
        return None if self.auto is None else costs.placeholder(self.auto)

    # ---- device work ---------------------------------------------------------------------
    def problem(self, prompt_len: int, max_new: int) -> str | None:
        """Why a request of this size cannot be prefilled, or None."""
        if not 1 <= prompt_len or prompt_len + max_new > self.max_context:
            return f"prompt of {prompt_len} tokens + {max_new} new exceeds the context {self.max_context}"
        return None

    def prefill_shape(self, n: int, longest: int) -> tuple[int, int]:
        """(rows, tokens per row) of the prefill of n requests whose longest prompt has `longest`
        tokens: n padded to a prefill bucket, `longest` to a prompt bucket."""
        return next(b for b in self.prefill_buckets if b >= n), self.prompt_bucket(longest)

    def prefill_groups(self, lengths: Sequence[int]) -> list[list[int]]:
        """The waiting requests (their prompt lengths) in prefill calls: indices by prompt length
        (similar lengths share a call, so little padding; the short ones first), each call as many
        as fit max_prefill and prefill_tokens padded tokens (rows x prompt bucket; a request longer
        than that alone). Where prefill is compute-bound (a large model, a CPU) a small budget
        keeps the first requests from waiting for everyone's prefill; where it is launch-bound (a
        small model on a GPU) one call for a whole burst costs about what one request's does."""
        groups: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
            if groups and len(groups[-1]) < self.max_prefill:
                trial = groups[-1] + [i]
                rows, t = self.prefill_shape(len(trial), max(lengths[j] for j in trial))
                if rows * t <= self.prefill_tokens:
                    groups[-1] = trial
                    continue
            groups.append([i])
        return groups

    def prefill(self, prompt_ids: Sequence[int], sampling: Sampling, seed: int, max_new: int,
                stop_ids: Sequence[int] = ()) -> Prefilled:
        """Prefill one request (its prompt padded to a length bucket) and choose its first token."""
        return self.prefill_many([PrefillRequest(prompt_ids, sampling, seed, max_new, stop_ids)])

    def prefill_many(self, requests: Sequence[PrefillRequest]) -> Prefilled:
        """Prefill up to max_prefill requests in one call (their count padded to a prefill bucket,
        their prompts to the longest one's length bucket) and choose each one's first token; one host
        read of all of them."""
        return self._prefill(requests, self.eos)

    def _prefill(self, requests: Sequence[PrefillRequest], eos) -> Prefilled:
        n = len(requests)
        if not 1 <= n <= self.max_prefill:
            raise ValueError(f"a prefill takes 1 to max_prefill={self.max_prefill} requests, got {n}")
        problems = [p for r in requests if (p := self.problem(len(r.prompt_ids), r.max_new))]
        if problems:
            raise ValueError("; ".join(problems))
        rows, t = self.prefill_shape(n, max(len(r.prompt_ids) for r in requests))
        prompt = np.zeros((rows, t), np.int32)
        lens = np.ones((rows,), np.int32)  # padding rows: a 1-token prompt, never inserted
        for j, r in enumerate(requests):
            prompt[j, : len(r.prompt_ids)] = r.prompt_ids
            lens[j] = len(r.prompt_ids)
        pad = rows - n
        controls = self.controls([r.sampling for r in requests] + [Sampling()] * pad,
                                 [r.seed for r in requests] + [0] * pad, [r.max_new for r in requests] + [1] * pad,
                                 [r.stop_ids for r in requests] + [()] * pad)
        e = self.engine
        state = self._start(e.params, e.drafter_params, jnp.asarray(prompt), jnp.asarray(lens), eos,
                            None, spec=self.spec, rows=controls, capacity=t, costs=self._row_costs())
        first, done = jax.device_get((state.out[:n, 0], state.done[:n]))
        return Prefilled(state, tuple(int(x) for x in first), tuple(bool(x) for x in done))

    def insert(self, pre: Prefilled, slots: Sequence[int | None]) -> None:
        """Put pre's request j into slot slots[j] (None: not inserted, e.g. it finished at its first
        token); one jitted scatter for all of them."""
        if len(slots) != len(pre.first):
            raise ValueError(f"{len(pre.first)} prefilled requests, {len(slots)} slots given")
        if not any(s is not None for s in slots):
            return
        dst = np.full((pre.state.done.shape[0],), self.max_batch, np.int32)  # max_batch: dropped
        for j, slot in enumerate(slots):
            if slot is not None:
                if not 0 <= slot < self.max_batch:
                    raise ValueError(f"slot {slot} is not in [0, {self.max_batch})")
                dst[j] = slot
        self.state = self._insert(self.state, pre.state, jnp.asarray(dst))

    def move(self, src: int, dst: int) -> None:
        """Slot src's request continues in slot dst; src is freed (src == dst: free it)."""
        self.state = self._move(self.state, np.int32(src), np.int32(dst))

    def launch(self, n_active: int, steps: int | None = None) -> PendingChunk:
        """Dispatch one chunk of up to `steps` (default and at most chunk_steps) device steps of the
        slots 0 .. n_active-1 (in their batch bucket) without waiting for it: the host may stream the
        previous chunk's tokens and dispatch moves, inserts and the next chunk meanwhile (they run
        after it, in order)."""
        steps = steps or self.chunk_steps
        if not 1 <= steps <= self.chunk_steps:
            raise ValueError(f"a chunk runs 1 to chunk_steps={self.chunk_steps} steps, got {steps}")
        rows = self.rows_for(n_active)
        return self._launch(rows, steps, self._table(rows))

    def advance(self, n_active: int, steps: int | None = None) -> ChunkReport:
        """launch() and wait for its report."""
        return self.launch(n_active, steps).result()

    def _compile_ahead(self, prefills: list, workers: int) -> None:
        """Run the given prefill calls and a 0-step chunk of every batch bucket (on copies of the
        idle state), `workers` at a time: their compilations overlap. Nothing is kept."""
        e = self.engine
        self.prefill_many([PrefillRequest([1], Sampling(), 0, 1)])  # the shared wrappers, on this thread first

        def chunk(rows):
            state = jax.tree.map(jnp.copy, self.state)
            return self._chunk(e.params, e.drafter_params, state, self.eos, np.int32(0),
                               self._table(rows, placeholder=True), spec=self.spec, rows=rows, window=self.window)

        jobs = [functools.partial(chunk, rows) for rows in self.buckets] + prefills
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            jax.block_until_ready([f.result() for f in [pool.submit(job) for job in jobs]])

    def _launch(self, rows: int, steps: int, table) -> PendingChunk:
        e = self.engine
        self.state, report = self._chunk(e.params, e.drafter_params, self.state, self.eos, np.int32(steps), table,
                                         spec=self.spec, rows=rows, window=self.window)
        return PendingChunk(report)

    def warm_up(self, max_prompt: int | None = None, workers: int | None = None) -> dict[int, float]:
        """Compile and run once: the prefill and the insert of each pair of a prefill bucket and a
        prompt bucket that prefill_groups may call (prompts up to max_prompt tokens; default all), the
        move, and a chunk of each batch bucket; budget "auto": the step-time tables the buckets lack
        (measure_costs; its seconds per bucket are returned). The slots end idle, the adaptive
        policy with nothing learned from the warm-up's requests (they finish at their first token).

        workers > 1 (default: half the host's cores, at most 8): the prefill and chunk programs are
        first compiled `workers` at a time (each traced on its thread, compiled by XLA without the
        GIL) on throwaway states, so the steps below find them compiled."""
        limit = max_prompt or self.max_context
        pairs = [(t, k) for t in self.prompt_buckets[: 1 + sum(t < limit for t in self.prompt_buckets)]
                 for k in self.prefill_buckets if k == 1 or k * t <= self.prefill_tokens]  # what prefill_groups calls
        dummy = [PrefillRequest([1] * min(t, self.max_context - 1), Sampling(), 0, 1) for t, _ in pairs]
        if workers is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            workers = min(8, cores // 2)
        if workers > 1:
            self._compile_ahead([functools.partial(self.prefill_many, [r] * k) for r, (_, k) in zip(dummy, pairs)],
                                workers)
        for r, (_, k) in zip(dummy, pairs):
            pre = self.prefill_many([r] * k)
            self.insert(pre, list(range(k)))
        row = self.prefill([1], Sampling(), 0, 1)
        for rows in self.buckets:
            for slot in range(rows):
                self.insert(row, [slot])
            self._launch(rows, 1, self._table(rows, placeholder=True)).result()
            for slot in reversed(range(rows)):
                self.move(slot, slot)
        seconds = self.measure_costs()  # budget "auto" (else nothing); resets the policy's state
        jax.block_until_ready(self.state)
        return seconds
