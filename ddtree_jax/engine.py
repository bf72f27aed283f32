"""User-facing API: load a target (+ DFlash drafter, + tokenizer) and generate.

    engine = Engine.load("ckpt/target", drafter="ckpt/drafter")
    [out] = engine.generate(["def fib(n):"], mode="ddtree", budget=64, max_new_tokens=128)
    print(out.text, out.stats.acceptance_length, out.stats.tokens_per_second)
    [out] = engine.generate(["def fib(n):"])  # budget "auto": each step's draft chosen on device
    print(out.stats.adaptive["choices"])

Prompts of one call run as one batch, right-padded into a shape bucket (powers of two), so each
bucket compiles once; the decode loop runs on device, and streaming syncs with the host once per
chunk of steps, never per step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from converters.load import load_drafter, load_target
from ddtree_jax.config import TargetConfig
from ddtree_jax.models import int8
from ddtree_jax.routes import Routes
from ddtree_jax.speculative import choice
from ddtree_jax.speculative import cost_table as costs
from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative import generation_choice
from ddtree_jax.speculative.choice import AutoBudget, summary
from ddtree_jax.speculative.dflash import DFlashProposer
from ddtree_jax.speculative.draft_vocab import check_ids, load_ids
from ddtree_jax.speculative.sampling import RowSampling, Sampling, SamplingCode, seed_key

MIN_BUCKET = 16
# budget "auto" chooses once a generation on the host below this many bytes of target weights (4 GiB
# read in ~1 ms on an H200): there the device program's ~0.06 ms a step (the demo pair, decision 0051)
# costs more than choosing within a generation gained in simulation (2.5 % at the 27B shape's 17 ms steps)
GENERATION_FORM_MAX_BYTES = 4 << 30


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum): the padded size that shares one compilation."""
    size = minimum
    while size < n:
        size *= 2
    return size


@dataclasses.dataclass
class Stats:
    num_tokens: int  # generated tokens (including the one chosen at prefill)
    steps: int  # target verify/decode passes after prefill
    acceptance_length: float  # tokens emitted per step after prefill: (num_tokens - 1) / steps
    seconds: float  # wall time of the generation after compilation (prefill included)
    tokens_per_second: float
    step_ms: float  # mean wall time per step (all rows of the batch share steps)
    accepted_hist: list[int]  # steps by number of tokens emitted (batch total)
    # budget "auto" (the batch's, shared by its rows): steps per choice, predicted vs realised
    # accepted tokens per choice, the choice of each step, the step-time table and where it came from
    adaptive: dict | None = None


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    stats: Stats

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class Engine:
    """A loaded target, optionally a DFlash drafter and a tokenizer; `generate` is the one API."""

    # Set on an instance: called with no arguments around the first run of a (spec, shape) bucket,
    # where JAX compiles; returns a context manager (the CLIs print a "compiling ..." line with its
    # time). None: nothing.
    on_first_run: Callable[[], contextlib.AbstractContextManager] | None = None

    def __init__(self, cfg: TargetConfig, graphdef, params, *, proposer=None, drafter_params=None, tokenizer=None,
                 max_context: int | None = None, impl: str | None = None, routes: Routes | None = None,
                 draft_vocab=None, int8_drafter: bool | str | int8.Int8Scheme = False, kernels: str | None = None):
        """impl: the kernel route ("xla", "pallas", "pallas_interpret"; default: Pallas on a GPU, the
        XLA forms elsewhere); routes: every route explicitly (ddtree_jax/routes.py; default
        Routes.resolve(impl=impl)). draft_vocab: draft from these token ids only (a size N for ids
        0 .. N-1, a JSON file of ids, or a sequence of ids; ddtree_jax/speculative/draft_vocab.py).
        int8_drafter: the drafter's weights and its draft head as int8 (True or "w8a8": the wide
        products W8A8; "weight-only"; or an int8.Int8Scheme; ddtree_jax/models/int8.py). Output is
        unchanged by all of these. kernels: the former name of impl (deprecated)."""
        self.cfg = cfg
        self.graphdef = graphdef
        self.params = params
        self.proposer = proposer
        self.drafter_params = drafter_params
        self.tokenizer = tokenizer
        self.max_context = max_context or cfg.max_position_embeddings
        if kernels is not None:
            warnings.warn("Engine(kernels=...) is now Engine(impl=...)", DeprecationWarning, stacklevel=2)
            impl = impl or kernels
        if routes is not None and impl is not None and routes.impl != impl:
            raise ValueError(f"impl={impl!r} disagrees with routes.impl={routes.impl!r}: pass one of them")
        self.routes = routes if routes is not None else Routes.resolve(impl=impl)
        if proposer is not None:
            proposer.check_target(cfg)
        if draft_vocab is not None:
            if proposer is None or not hasattr(proposer, "with_draft_vocab"):
                raise ValueError("a draft vocabulary needs a DFlash drafter (--drafter)")
            ids = (load_ids(draft_vocab, cfg.vocab_size) if isinstance(draft_vocab, (str, int))
                   else check_ids(draft_vocab, cfg.vocab_size))
            self.proposer, self.drafter_params = proposer.with_draft_vocab(
                drafter_params, nnx.merge(graphdef, params), ids)
        if int8_drafter:
            if self.proposer is None or not hasattr(self.proposer, "with_int8"):
                raise ValueError("an int8 drafter needs a DFlash drafter (--drafter)")
            self.proposer, self.drafter_params = self.proposer.with_int8(
                self.drafter_params, nnx.merge(graphdef, params), int8_scheme(int8_drafter))
        self._warm: set = set()  # (spec, prompt shape) whose prefill and step loop ran once
        self._cost_tables: dict = {}  # budget "auto": (spec, prompt shape) or (file, batch) -> CostTable
        # budget "auto": (spec, prompt shape) -> (real, pred, pop_e) the last generation ended with, the next
        # one's start (choice.carried_over)
        self._learned: dict = {}
        # budget "auto" chosen once a generation: (spec, prompt shape, table source) -> GenerationPolicy
        self._policies: dict = {}
        self._generation_stats: dict | None = None

    # ---- loading -------------------------------------------------------------------------
    @property
    def impl(self) -> str:
        return self.routes.impl

    @classmethod
    def load(cls, target: str | os.PathLike, drafter: str | os.PathLike | None = None, *, dtype=None,
             max_context: int | None = None, progress: bool = False, impl: str | None = None,
             routes: Routes | None = None, draft_vocab=None, int8_drafter: bool | str | int8.Int8Scheme = False,
             kernels: str | None = None) -> "Engine":
        cfg, graphdef, params = load_target(target, dtype, progress=progress)
        proposer = dparams = None
        if drafter is not None:
            dcfg, dgraph, dparams = load_drafter(drafter, dtype=cfg.dtype)
            proposer = DFlashProposer(dgraph, dcfg)
        return cls(cfg, graphdef, params, proposer=proposer, drafter_params=dparams,
                   tokenizer=load_tokenizer(target), max_context=max_context, impl=impl, routes=routes,
                   draft_vocab=draft_vocab, int8_drafter=int8_drafter, kernels=kernels)

    # ---- text <-> ids ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this target directory has no tokenizer.json: give the engine one "
                             "(engine.tokenizer = load_tokenizer(DIR)) or pass token ids instead of text")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids))

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.cfg.eos_token_ids)

    # ---- generation ----------------------------------------------------------------------
    def spec(self, mode: str, *, budget: int | str | AutoBudget, candidates: int | None, max_new_tokens: int,
             sampling: Sampling, prompt_bucket: int, auto_budgets: Sequence[int] | None = None,
             decide_every: int | None = None, decide_on: str | None = None) -> gen.GenSpec:
        """The GenSpec of a generation; budget "auto" (mode ddtree): an AutoBudget over auto_budgets,
        decide_every and decide_on (defaults AutoBudget's); other modes ignore the budget."""
        if mode != "ar" and self.proposer is None:
            raise ValueError(f"mode {mode!r} needs a drafter: load one with --drafter / Engine.load(drafter=...)")
        block = 1 if mode == "ar" else self.proposer.block_size
        need = gen.required_capacity(prompt_bucket, max_new_tokens, block)
        if mode == "ddtree" and budget == "auto":
            budget = self.auto_budget(auto_budgets, decide_every, decide_on)
        spec = gen.GenSpec(mode, resolve_budget(mode, budget, auto_budgets, decide_every, decide_on), candidates,
                           max_new_tokens, sampling, bucket(need, 64), None if mode == "ar" else self.proposer,
                           self.routes)
        spec.validate(self.cfg.vocab_size)
        return spec

    @functools.cached_property
    def weight_bytes(self) -> int:
        """Bytes of the target's parameters (read once: generate asks at every call)."""
        return int(sum(x.nbytes for x in jax.tree.leaves(self.params)))

    @property
    def default_decide_on(self) -> str | None:
        """Where budget "auto" chooses when not told (decide_on None): on a GPU, once a generation on
        the host for a target whose weights read in well under the device program's cost a step
        (below GENERATION_FORM_MAX_BYTES: launch-bound steps, decision 0051); else AutoBudget's
        default (device chunks). A CPU has no launches to save, and compiling every choice's program
        (~4x the one auto program's time on this project's CPU) would slow the first run."""
        small = self.weight_bytes < GENERATION_FORM_MAX_BYTES
        return "generation" if small and jax.default_backend() == "gpu" else None

    def auto_budget(self, auto_budgets: Sequence[int] | None = None, decide_every: int | None = None,
                    decide_on: str | None = None) -> AutoBudget:
        """budget "auto"'s AutoBudget for this engine (decide_on None: default_decide_on)."""
        return resolve_budget("ddtree", "auto", auto_budgets, decide_every, decide_on or self.default_decide_on)

    @property
    def device_kind(self) -> str:
        return str(jax.devices()[0].device_kind)

    def fingerprint(self) -> dict:
        """What a step-time table depends on besides device and batch (cost_table.fingerprint)."""
        return costs.fingerprint(self.cfg, self.proposer, self.routes)

    def load_cost_table(self, path, batch: int, program: str | None = None) -> costs.CostTable:
        """The step-time table for `batch` from a file `ddtree-bench --cost-table` wrote; program:
        the auto form it must be for (AutoBudget.form; None: any)."""
        key = (os.path.abspath(os.fspath(path)), batch, program)
        if key not in self._cost_tables:
            self._cost_tables[key] = costs.load(path, batch, device=self.device_kind, model=self.fingerprint(),
                                                program=program)
        return self._cost_tables[key]

    def measure_cost_table(self, spec: gen.GenSpec, prompt, lens, eos, rows, *, steps: int | None = None,
                           repeats: int | None = None) -> costs.CostTable:
        """Time every choice of an auto spec on these prompts (cost_table.measure), in the programs
        the generation runs (each choice's own, or the auto program with the choice forced): rows
        run without EOS from their prefill. steps / repeats (None: by device, costs.timing_defaults):
        calls of `steps` and 2 x `steps` steps, `repeats` interleaved pairs."""
        steps, repeats = costs.timing_defaults(steps, repeats)
        start, advance = gen.bind(self.graphdef)
        dparams = self.drafter_params
        never = jnp.full(eos.shape, -1, jnp.int32)  # the same shape as the real EOS set: no other program
        if spec.adaptive.per_generation:
            return self._measure_programs(spec, prompt, lens, never, rows, steps, repeats)
        s0 = start(self.params, dparams, prompt, lens, never, None, spec=spec, rows=rows,
                   costs=costs.placeholder(spec.adaptive))
        programs = gen.choice_programs(spec)
        return costs.measure(lambda st, c, n: advance(self.params, dparams, st, never, np.int32(n),
                                                      spec=programs.get(c, spec)), s0,
                             spec.adaptive, steps=steps, repeats=repeats, batch=int(prompt.shape[0]))

    def _measure_programs(self, spec, prompt, lens, never, rows, steps, repeats) -> costs.CostTable:
        """The table of choosing once a generation: each choice's own fixed program timed from its
        prefill, its acceptance counted (cost_table.measure_programs)."""
        start, advance = gen.bind(self.graphdef)
        dparams = self.drafter_params
        programs = generation_choice.fixed_specs(spec)
        s0 = {c: start(self.params, dparams, prompt, lens, never, None, spec=p, rows=rows) for c, p in programs.items()}

        def run(c: int, n: int):
            st = jax.tree.map(jnp.copy, s0[c])
            jax.block_until_ready(st)
            t0 = time.perf_counter()
            out = advance(self.params, dparams, st, never, np.int32(n), spec=programs[c])
            ran = int(out.i)  # blocks until the call is done
            seconds = time.perf_counter() - t0
            row_steps = np.asarray(out.steps) - np.asarray(s0[c].steps)
            tokens = np.asarray(out.n_out) - np.asarray(s0[c].n_out)
            return seconds, ran - int(s0[c].i), float(np.sum(tokens - row_steps)), float(np.sum(row_steps))

        return costs.measure_programs(run, spec.adaptive, steps=steps, repeats=repeats, batch=int(prompt.shape[0]),
                                      context=float(np.mean(np.asarray(lens))))

    def generate(self, prompts: Sequence[str | Sequence[int]], *, mode: str = "ddtree",
                 budget: int | str | AutoBudget = "auto", candidates: int | None = None,
                 max_new_tokens: int | Sequence[int] = 128, sampling: Sampling | Sequence[Sampling] = Sampling(),
                 seed: int = 0, stop_token_ids: Sequence[int] = (),
                 stream: Callable[[int, list[int]], None] | None = None, stream_every: int = 4,
                 auto_budgets: Sequence[int] | None = None, decide_every: int | None = None,
                 decide_on: str | None = None,
                 cost_table: costs.CostTable | str | os.PathLike | None = None) -> list[Completion]:
        """Generate for a batch of prompts (text or token ids); one Completion per prompt.

        budget: DDTree nodes per step, or "auto" (the default): each step chooses among plain
        decoding, DFlash and the trees of auto_budgets (default 4, 8, 16, 32) for the most
        tokens per second, by a step-time table: cost_table (a CostTable or the path of a file
        `ddtree-bench --cost-table` wrote), else measured at start-up for each new batch and prompt
        bucket (seconds; reported in stats.adaptive with the choices made). decide_every: n > 1 (default
        32) one choice per chunk of n steps, made on device in one program (decide_on "device", the
        default; a chunk goes on across streamed calls) or by the host, which runs that choice's own
        program (decide_on "host"); 0 one program chooses on device at every step
        (AutoBudget.decide_every and decide_on).

        max_new_tokens and sampling: one for every prompt, or one each (per-row settings share one
        compiled program). Prompt r samples with the seed `seed + r`. stream(row, new_token_ids) is
        called after every `stream_every` device steps with the tokens committed since the last call.
        """
        if not prompts:
            raise ValueError("no prompts given")
        ids = [self.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        max_news = per_prompt(max_new_tokens, len(ids), "max_new_tokens")
        settings = per_prompt(sampling, len(ids), "sampling")
        for i, x in enumerate(settings):
            if not isinstance(x, Sampling):
                raise ValueError(f"sampling must be a Sampling, got {x!r} (prompt {i})")
        for i, m in enumerate(max_news):
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                raise ValueError(f"max_new_tokens must be a positive integer, got {m!r} (prompt {i})")
        for i, (p, max_new_tokens) in enumerate(zip(ids, max_news)):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i} has token ids outside the vocabulary [0, {self.cfg.vocab_size}): {bad[:5]}")
            if len(p) + max_new_tokens > self.max_context:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                    f"{len(p) + max_new_tokens} positions but the context limit is {self.max_context}"
                )
        b = bucket(len(ids), 1)
        t = bucket(max(len(p) for p in ids))
        prompt = np.zeros((b, t), np.int32)
        lens = np.ones((b,), np.int32)  # padding rows: a 1-token dummy prompt, discarded
        for i, p in enumerate(ids):
            prompt[i, : len(p)] = p
            lens[i] = len(p)
        # The output buffer's width in buckets too (rows stop at their own max_new), and the spec
        # holds the sampling code, not the values: fewer compilations.
        spec = self.spec(mode, budget=budget, candidates=candidates, max_new_tokens=bucket(max(max_news)),
                         sampling=settings[0], prompt_bucket=t, auto_budgets=auto_budgets,
                         decide_every=decide_every, decide_on=decide_on)
        pad = b - len(ids)  # padding rows: greedy, done after their first token
        spec = dataclasses.replace(spec, sampling=SamplingCode.covering(settings))
        rows = gen.RowControls(
            RowSampling.of(settings + [Sampling()] * pad, [seed_key(seed + r) for r in range(b)]),
            jnp.asarray(np.asarray(max_news + [1] * pad, np.int32)), jnp.zeros((b, 0), jnp.int32))
        eos = jnp.asarray(sorted(set(self.stop_ids) | set(int(x) for x in stop_token_ids)), jnp.int32)
        args = (jnp.asarray(prompt), jnp.asarray(lens), eos, rows)
        if spec.adaptive is not None and cost_table is not None:
            if not isinstance(cost_table, costs.CostTable):
                # bad files fail before any compilation
                cost_table = self.load_cost_table(cost_table, b, spec.adaptive.form)
            elif cost_table.batch != b:
                raise ValueError(f"the step-time table is for batch {cost_table.batch}; these {len(ids)} prompts run "
                                 f"as batch {b}")
        state = self._run(spec, args, stream, stream_every, len(ids), cost_table)
        return self._completions(ids, state, spec, eos)

    def _run(self, spec, args, stream, stream_every, n_rows, cost_table=None):
        if spec.adaptive is not None and spec.adaptive.per_generation:
            return self._run_per_generation(spec, args, stream, stream_every, n_rows, cost_table)
        prompt, lens, eos, rows = args
        key = None
        dparams = self.drafter_params
        # The first call of a bucket runs prefill and one step untimed on a throwaway state
        # (compilation, tracing, and XLA:CPU's kernels built on their first run: ~4.7 s for the demo
        # on a CPU), so the reported speed is generation only.
        # step counts go in as numpy scalars: a jnp scalar is a device op of its own (~0.1 ms a call
        # on this project's CPU, decision 0045)
        steps = np.int32(stream_every if stream else 2**30)
        start, advance = gen.bind(self.graphdef)  # no GraphDef hash per call
        warm_key = (spec, prompt.shape, eos.shape)
        table = None
        if spec.adaptive is not None:
            table = cost_table or self._cost_tables.get(warm_key)
        step_costs = None if spec.adaptive is None else costs.placeholder(spec.adaptive)
        # budget "auto" chosen by the host (decide_on "host"): one program per choice, the host picks
        # each chunk's from the plan the last call ended with
        programs = gen.choice_programs(spec)
        if warm_key not in self._warm:
            with self.on_first_run() if self.on_first_run else contextlib.nullcontext():
                state = start(self.params, dparams, prompt, lens, eos, key, spec=spec, rows=rows, costs=step_costs)
                for program in programs.values() or [spec]:
                    state = advance(self.params, dparams, state, eos, np.int32(1), spec=program)
                jax.block_until_ready(state)
            self._warm.add(warm_key)
        self._calibration_s = 0.0
        self._carried = False
        if spec.adaptive is not None:
            if table is None:  # measured once per compiled program (batch, prompt bucket), at the prompts' length
                t_cal = time.perf_counter()
                table = self._cost_tables[warm_key] = self.measure_cost_table(spec, prompt, lens, eos, rows)
                self._calibration_s = time.perf_counter() - t_cal
            step_costs = table.arrays(spec.adaptive)
            self._carried = warm_key in self._learned
            if self._carried:
                step_costs = choice.carried_over(step_costs, *self._learned[warm_key])
        self._table = table
        t0 = time.perf_counter()
        state = start(self.params, dparams, prompt, lens, eos, key, spec=spec, rows=rows, costs=step_costs)
        if stream:
            sent = [0] * n_rows
            self._stream(state, stream, sent, n_rows)
        program = spec
        if programs:
            choice_, n = (int(x) for x in np.asarray(state.adapt.plan))
        while True:
            if programs:  # the policy's choice for this chunk, read with the last chunk's results
                program = programs[choice_]
                steps = np.int32(min(n, stream_every) if stream else n)
            state = advance(self.params, dparams, state, eos, steps, spec=program)
            # one host sync per chunk (device_get: no op to compile, the copies started at once); with
            # auto, the calibration the next generation starts from comes with it
            a = state.adapt
            done, plan, learned = jax.device_get((state.done, a.plan if programs else None,
                                                  None if a is None else (a.real, a.pred, a.pop_e)))
            done = bool(done.all())
            if programs:
                choice_, n = (int(x) for x in plan)
            if stream:
                self._stream(state, stream, sent, n_rows)
            if done:
                break
        jax.block_until_ready(state.out)
        self._seconds = time.perf_counter() - t0
        if learned is not None:
            self._learned[warm_key] = learned
        return state

    def _run_per_generation(self, spec, args, stream, stream_every, n_rows, cost_table=None):
        """Budget "auto" chosen once a generation (AutoBudget.per_generation): the policy picks a
        choice from the table and what earlier generations realised, the choice's own fixed
        program runs the whole generation, and the policy learns what it accepted."""
        prompt, lens, eos, rows = args
        dparams = self.drafter_params
        start, advance = gen.bind(self.graphdef)
        programs = generation_choice.fixed_specs(spec)
        warm_key = (spec, prompt.shape, eos.shape)
        if warm_key not in self._warm:  # every choice's program compiled and run once
            def warm(program):
                state = start(self.params, dparams, prompt, lens, eos, None, spec=program, rows=rows)
                return advance(self.params, dparams, state, eos, np.int32(1), spec=program)

            # several at once (each traced on its thread, compiled by XLA without the GIL), as the
            # server's warm-up does; on a GPU, compiles run together autotune side by side
            workers = min(len(programs), max(1, (os.cpu_count() or 2) // 2), 8)
            with self.on_first_run() if self.on_first_run else contextlib.nullcontext():
                with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                    jax.block_until_ready([f.result() for f in [pool.submit(warm, p) for p in programs.values()]])
            self._warm.add(warm_key)
        self._calibration_s = 0.0
        table = cost_table or self._cost_tables.get(warm_key)
        if table is None:  # measured once per (spec, prompt bucket), at the prompts' length
            t_cal = time.perf_counter()
            table = self._cost_tables[warm_key] = self.measure_cost_table(spec, prompt, lens, eos, rows)
            self._calibration_s = time.perf_counter() - t_cal
        self._table = table
        key = (warm_key, table.source)
        self._carried = key in self._policies
        if not self._carried:
            self._policies[key] = generation_choice.GenerationPolicy.start(spec.adaptive, table)
        policy = self._policies[key]
        max_new = np.minimum(np.asarray(rows.max_new), spec.max_new_tokens)
        left = np.where(np.arange(max_new.shape[0]) < n_rows, max_new - 1, 0)  # after the prefill's token
        expected = policy.expected()
        c, probe = policy.choose(left, float(np.mean(np.asarray(lens)[:n_rows])))
        program = programs[c]
        steps = np.int32(stream_every if stream else 2**30)
        t0 = time.perf_counter()
        state = start(self.params, dparams, prompt, lens, eos, None, spec=program, rows=rows)
        sent = [0] * n_rows
        while True:
            if stream:
                self._stream(state, stream, sent, n_rows)
            state = advance(self.params, dparams, state, eos, steps, spec=program)
            if bool(jax.device_get(state.done).all()):
                break
        if stream:
            self._stream(state, stream, sent, n_rows)
        jax.block_until_ready(state.out)
        self._seconds = time.perf_counter() - t0
        row_steps = np.asarray(state.steps)[:n_rows]
        tokens = np.asarray(state.n_out)[:n_rows] - 1  # after the prefill's token
        accepted = float(np.sum(tokens - row_steps))
        policy.learn(c, accepted, float(np.sum(row_steps)))
        self._generation_stats = policy.summary(c, int(row_steps.max(initial=0)), int(np.sum(row_steps)), accepted,
                                                expected, probe)
        return state

    @staticmethod
    def _stream(state, stream, sent, n_rows):
        out = np.asarray(state.out)
        n_out = np.asarray(state.n_out)
        for r in range(n_rows):
            if n_out[r] > sent[r]:
                stream(r, out[r, sent[r] : n_out[r]].tolist())
                sent[r] = int(n_out[r])

    def _completions(self, ids, state, spec, eos) -> list[Completion]:
        out = np.asarray(state.out)
        n_out = np.asarray(state.n_out)
        steps = np.asarray(state.steps)
        hist = np.asarray(state.hist).tolist()
        eos_set = set(np.asarray(eos).tolist())
        seconds = self._seconds
        total_steps = int(steps[: len(ids)].max()) if len(ids) else 0
        adaptive = None
        if spec.adaptive is not None:
            own = self._generation_stats if spec.adaptive.per_generation else summary(spec.adaptive, state.adapt)
            adaptive = own | {
                "budgets": list(spec.adaptive.budgets), "cost_table": self._table.as_dict(),
                "calibration_seconds": self._calibration_s,
                "calibration_from": ("the earlier generations of this program" if spec.adaptive.per_generation
                                     else "the last generation of this program") if self._carried else "the table"}
        res = []
        for r, p in enumerate(ids):
            toks = out[r, : n_out[r]].tolist()
            finish = "stop" if toks and toks[-1] in eos_set else "length"
            n, s = len(toks), int(steps[r])
            stats = Stats(
                num_tokens=n,
                steps=s,
                acceptance_length=(n - 1) / s if s else float(n),
                seconds=seconds,
                tokens_per_second=n / seconds if seconds > 0 else float("nan"),
                step_ms=1000 * seconds / max(total_steps, 1),
                accepted_hist=hist,
                adaptive=adaptive,
            )
            res.append(Completion(p, toks, self.decode(toks), finish, stats))
        return res


def per_prompt(value, n: int, name: str) -> list:
    """value for each of n prompts: one value for all, or a sequence of n."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def resolve_budget(mode: str, budget, auto_budgets: Sequence[int] | None = None, decide_every: int | None = None,
                   decide_on: str | None = None):
    """GenSpec's budget: an int, or an AutoBudget for "auto" in mode ddtree (over auto_budgets and
    with decide_every and decide_on when given); other modes ignore the budget (1)."""
    if isinstance(budget, str) and budget != "auto":
        raise ValueError(f"budget must be a positive integer or 'auto', got {budget!r}")
    if mode != "ddtree":
        return budget if isinstance(budget, int) else 1
    if isinstance(budget, AutoBudget):
        return budget
    if budget == "auto":
        settings = {k: v for k, v in (("decide_every", decide_every), ("decide_on", decide_on)) if v is not None}
        if auto_budgets:
            settings["budgets"] = tuple(int(b) for b in auto_budgets)
        return AutoBudget(**settings)
    return budget

def int8_scheme(choice) -> int8.Int8Scheme:
    """The int8 scheme an `int8_drafter` argument asks for: True / "w8a8", "weight-only", or a scheme."""
    if isinstance(choice, int8.Int8Scheme):
        return choice
    if choice is True:
        return int8.Int8Scheme()
    if isinstance(choice, str) and choice in int8.SCHEMES:
        return int8.SCHEMES[choice]
    raise ValueError(f"int8_drafter must be True, one of {sorted(int8.SCHEMES)} or an Int8Scheme, got {choice!r}")


TOKENIZER_FILE = "tokenizer.json"


def tokenizer_file(path: str | os.PathLike) -> str | None:
    """The tokenizer.json of a model directory (or `path` itself, a tokenizer.json file), or None
    when there is none. ddtree-convert copies it next to the converted parameters."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path
    candidate = os.path.join(path, TOKENIZER_FILE)
    return candidate if os.path.isfile(candidate) else None


def load_tokenizer(target_dir: str | os.PathLike):
    """tokenizers.Tokenizer from target_dir/tokenizer.json (or from a tokenizer.json path), or None
    when there is none. An unreadable file is a ValueError naming it."""
    path = tokenizer_file(target_dir)
    if path is None:
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises its own exception type
        raise ValueError(f"{path} is not a readable tokenizer file ({e})") from None


def completion_json(c: Completion, mode: str) -> str:
    d = c.to_json()
    d["mode"] = mode
    return json.dumps(d)
