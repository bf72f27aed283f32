"""Generation on device: prefill, then a lax.while_loop of steps with no host round trip.

Modes: "ar" (one target token per step), "dflash" (a chain of block_size - 1 drafts verified
causally), "ddtree" (a tree of `budget` drafts; budget a choice.AutoBudget: each step chooses among
plain, DFlash and trees of several budgets, speculative/adaptive.py). Each speculative step is
    propose -> build (chain or tree) -> tree_verify -> emit -> commit (target + drafter)
and emits 1 + accepted tokens per sequence. Output is lossless w.r.t. plain decoding of the
target under the same `Sampling`.

`generate` is the whole thing in one jitted call. `start` + `advance` split it so a caller can
stream: `advance` runs up to `max_steps` steps on device per call (one host sync per chunk of
steps, never per step). The phase functions (`propose`, `build`, `verify`, `commit_and_emit`)
are the loop body's parts, exposed so the benchmark can time them separately.

Per-row settings (`RowControls`: temperature / top-k / top-p / seed, max_new_tokens, stop ids)
are arrays in the loop state, not compile-time constants: rows with different settings share a
batch and one compiled program (GenSpec.sampling says only which sampling code is compiled).
Every field in ROW_FIELDS carries the batch on axis 0, so a server can copy one row's state into
a slot of a running batch (ddtree_jax/serve/slots.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import TargetCache, init_target_cache
from ddtree_jax.compiled import RoutedJit
from ddtree_jax.flat_params import FlatParams
from ddtree_jax.routes import REFERENCE, Routes
from ddtree_jax.speculative import adaptive, choice
from ddtree_jax.speculative.build import build_chain, build_tree, validate_budget
from ddtree_jax.speculative.choice import AutoBudget
from ddtree_jax.speculative.sampling import RowSampling, Sampling, SamplingCode, choose, to_code
from ddtree_jax.speculative.verify import VerifyResult, tree_verify
from ddtree_jax.tree import Tree

MODES = ("ar", "dflash", "ddtree")


@dataclasses.dataclass(frozen=True)
class GenSpec:
    """Static settings of one compiled generation (part of the jit cache key)."""

    mode: str = "ddtree"
    budget: int | AutoBudget = 64  # an AutoBudget: budget "auto" (ddtree only)
    candidates: int | None = None  # per-depth candidate count for DDTree (default min(budget, V))
    max_new_tokens: int = 128  # the output buffer's width: every row's max_new is at most this
    sampling: Sampling | SamplingCode = Sampling()  # the compiled sampling code (a Sampling: the code serving it)
    capacity: int = 0  # KV slots; 0 = prompt + max_new + block + 1
    proposer: Any = None
    routes: Routes = REFERENCE  # kernel routes and forms (ddtree_jax/routes.py; Routes.resolve() per device)
    # Fixed-budget steps between two reads of the loop's predicate, unrolled (on a GPU XLA reads a
    # data-dependent predicate on the host every iteration, and copies back each carried buffer a
    # kernel wrote anew, e.g. a conv window); None: routes.loop_chunk. Budget "auto" takes 1 (`chunk`)
    loop_chunk: int | None = None

    @property
    def block(self) -> int:
        return 1 if self.mode == "ar" else self.proposer.block_size

    @property
    def chunk(self) -> int:
        """Steps a chunk of the generation loop runs (`_advance`): loop_chunk if set, else the
        routes' default; 1 under budget "auto", which chooses between steps."""
        if self.adaptive is not None:
            return 1
        return self.routes.loop_chunk if self.loop_chunk is None else self.loop_chunk

    @property
    def code(self) -> SamplingCode:
        return to_code(self.sampling)

    @property
    def adaptive(self) -> AutoBudget | None:
        return self.budget if isinstance(self.budget, AutoBudget) else None

    def validate(self, vocab: int) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.routes, Routes):
            raise ValueError(f"routes must be a ddtree_jax.routes.Routes, got {self.routes!r}")
        if not isinstance(self.sampling, (Sampling, SamplingCode)):
            raise ValueError(f"sampling must be a Sampling or a SamplingCode, got {self.sampling!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.loop_chunk is not None and (not isinstance(self.loop_chunk, int) or isinstance(self.loop_chunk, bool)
                                            or self.loop_chunk < 1):
            raise ValueError(f"loop_chunk must be a positive integer, got {self.loop_chunk!r}")
        if self.loop_chunk is not None and self.loop_chunk > 1 and self.adaptive is not None:
            raise ValueError(f"loop_chunk = {self.loop_chunk} is for fixed budgets: budget 'auto' chooses between "
                             "steps (use loop_chunk 1)")
        if self.mode != "ar":
            if self.proposer is None:
                raise ValueError(f"mode {self.mode!r} needs a drafter (proposer)")
            if self.proposer.block_size < 2:
                raise ValueError(f"drafter block_size must be >= 2, got {self.proposer.block_size}")
        if self.adaptive is not None:
            problems = self.adaptive.problems() + ([] if self.mode == "ddtree" else
                                                   [f"budget 'auto' is for mode 'ddtree', not {self.mode!r}"])
            if problems:
                raise ValueError("invalid adaptive budget: " + "; ".join(problems))
            for b in self.adaptive.budgets:
                validate_budget(b, self.block - 1, vocab, self.candidates)
        elif self.mode == "ddtree":
            validate_budget(self.budget, self.block - 1, vocab, self.candidates)


class GenerationResult(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens] int32, -1 after a sequence stopped
    num_tokens: jax.Array  # [B] tokens generated (EOS included)
    steps: jax.Array  # [B] target forward passes after prefill (verify steps) while active
    accepted_hist: jax.Array  # [block_size + 1] histogram of tokens emitted per step (all rows)
    cache: TargetCache
    drafter_state: Any  # the proposer's final state (None for "ar")
    adaptive: Any = None  # budget "auto": the final choice.AdaptiveState (choices, calibration, statistics)


class RowControls(NamedTuple):
    """Each row's own settings, as arrays (traced: changing them compiles nothing)."""

    sampling: RowSampling  # temperature / top_k / top_p / PRNG key of each row
    max_new: jax.Array  # [B] int32: tokens to generate at most (capped at GenSpec.max_new_tokens)
    stop: jax.Array  # [B, S] int32: the row's stop token ids besides eos_ids, -1 = none


def uniform_rows(sampling: Sampling, batch: int, max_new: int, key: jax.Array, stop_width: int = 0) -> RowControls:
    """Every row with the same settings; row r's PRNG key is fold_in(key, r)."""
    return RowControls(RowSampling.uniform(sampling, batch, key), jnp.full((batch,), max_new, jnp.int32),
                       jnp.full((batch, stop_width), -1, jnp.int32))


class LoopState(NamedTuple):
    cache: TargetCache
    dstate: Any
    bonus: jax.Array  # [B] next root token (emitted, not yet in the cache)
    out: jax.Array  # [B, max_new_tokens]
    n_out: jax.Array  # [B]
    done: jax.Array  # [B] bool
    steps: jax.Array  # [B] steps taken while active (each row's sampling keys fold it in)
    hist: jax.Array  # [block + 1]
    i: jax.Array  # step counter of the batch (chunks of `advance` count with it)
    rows: RowControls
    adapt: Any = None  # budget "auto": choice.AdaptiveState

    def result(self) -> GenerationResult:
        return GenerationResult(self.out, self.n_out, self.steps, self.hist, self.cache, self.dstate, self.adapt)


# The LoopState fields whose every leaf has the batch on axis 0 (a proposer's state included):
# one row of these and of the adaptive state's per-row fields (choice.ROW_FIELDS) is one sequence's
# whole state. The others (hist, i, the rest of adapt) belong to the batch.
ROW_FIELDS = ("cache", "dstate", "bonus", "out", "n_out", "done", "steps", "rows")


def map_rows(fn, *states: LoopState, base: LoopState | None = None) -> LoopState:
    """base (default states[0]) with every leaf that carries the batch on axis 0 replaced by fn of
    the states' leaves there: the ROW_FIELDS and, under budget "auto", adapt's choice.ROW_FIELDS.
    The batch's own fields are base's."""
    base = states[0] if base is None else base
    new = {f: jax.tree.map(fn, *(getattr(s, f) for s in states)) for f in ROW_FIELDS}
    if base.adapt is not None:
        new["adapt"] = base.adapt._replace(**{f: fn(*(getattr(s.adapt, f) for s in states)) for f in choice.ROW_FIELDS})
    return base._replace(**new)


def position_keys(rows: RowControls, positions: jax.Array) -> jax.Array:
    """The PRNG keys [B, ..., 2] of the tokens at absolute `positions` [B, ...] of each row: the row's
    key folded with the position. The target's draw for a position depends on nothing else, so plain
    decoding and every speculative mode sample the same token there from the same distribution:
    speculative output is then identical to plain decoding's for a seed, sampled as well as greedy
    (up to near-ties of the two passes' logits), and each position's draw stays independent of the
    others (exact sampling)."""
    flat = positions.reshape(positions.shape[0], -1).astype(jnp.uint32)
    keys = jax.vmap(lambda k, p: jax.vmap(lambda q: jax.random.fold_in(k, q))(p))(rows.sampling.key, flat)
    return keys.reshape(*positions.shape, *keys.shape[2:])


def _max_new(s: LoopState, spec: GenSpec) -> jax.Array:
    return jnp.minimum(s.rows.max_new, spec.max_new_tokens)


def required_capacity(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """KV slots a generation needs: a commit writes a full padded path past the prefix."""
    return prompt_len + max_new_tokens + block_size + 1


def _emit(out, n_out, done, new_tokens, n_new, eos_ids, max_new, stop=None):
    """Append new_tokens [B, P] (first n_new[b] real) to out; stop rows at EOS, at one of their
    own stop ids stop [B, S] (-1: none), or at max_new (a scalar or [B])."""
    p = new_tokens.shape[1]
    idx = jnp.arange(p)[None, :]
    real = idx < n_new[:, None]
    eos = jnp.any(new_tokens[..., None] == eos_ids, axis=-1)
    if stop is not None and stop.shape[-1]:
        eos = eos | jnp.any(new_tokens[..., None] == stop[:, None, :], axis=-1)
    eos = eos & real
    first_eos = jnp.where(jnp.any(eos, axis=1), jnp.argmax(eos, axis=1) + 1, n_new)
    n_new = jnp.where(done, 0, jnp.minimum(first_eos, max_new - n_out))
    keep = idx < n_new[:, None]
    pos = jnp.where(keep, n_out[:, None] + idx, out.shape[1])  # out-of-range writes are dropped
    out = jax.vmap(lambda o, p_, t: o.at[p_].set(t, mode="drop"))(out, pos, new_tokens)
    n_out = n_out + n_new
    done = done | jnp.any(eos & keep, axis=1) | (n_out >= max_new)
    return out, n_out, done


# ---- the phases of one speculative step ------------------------------------------------
def propose(model, drafter_params, s: LoopState, spec: GenSpec) -> jax.Array:
    return spec.proposer.propose(drafter_params, s.dstate, model, s.bonus, s.cache.lengths, routes=spec.routes)


def vocab_ids(spec: GenSpec, drafter_params):
    """Token ids of the proposer's draft indices, or None (drafts over the whole vocabulary)."""
    get = getattr(spec.proposer, "vocab_ids", None)
    return None if get is None else get(drafter_params)


def build(logq: jax.Array, s: LoopState, spec: GenSpec, ids: jax.Array | None = None) -> Tree:
    """The chain or tree of this step; ids: `vocab_ids` (logq over a draft vocabulary)."""
    if spec.mode == "dflash":
        return build_chain(logq, s.bonus, s.cache.lengths, ids)
    return build_tree(logq, s.bonus, s.cache.lengths, spec.budget, spec.candidates, routes=spec.routes, vocab_ids=ids)


def verify(model, s: LoopState, tree: Tree, spec: GenSpec) -> VerifyResult:
    """The target's choice at node n is the token at position tree.positions[n] + 1, drawn with that
    position's key (position_keys; unused by greedy code)."""
    keys = position_keys(s.rows, tree.positions + 1)
    shape = None if spec.mode == "dflash" else tree
    return tree_verify(model, s.cache, shape, tree.tokens, spec.code, s.rows.sampling, keys,
                       max_depth=spec.block - 1, hidden_ids=spec.proposer.hidden_ids, routes=spec.routes)


def commit_and_emit(model, drafter_params, s: LoopState, tree: Tree, res: VerifyResult, eos_ids, spec: GenSpec):
    """Emit the accepted draft tokens then the new bonus; commit what was emitted."""
    b = tree.tokens.shape[0]
    path_tokens = jnp.take_along_axis(tree.tokens, res.path, axis=1)
    emitted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jax.vmap(lambda e, c, x: e.at[c - 1].set(x))(emitted, res.count, res.bonus)
    out, n_out, done = _emit(s.out, s.n_out, s.done, emitted, res.count, eos_ids, _max_new(s, spec), s.rows.stop)
    # Commit root + the accepted nodes actually emitted (fewer when EOS / max_new cut the step),
    # so the cache always holds exactly the prompt and every emitted token but the last.
    count = n_out - s.n_out
    cache = model.commit(res.pending, res.path, count, s.cache, spec.routes)
    dstate = spec.proposer.extend(drafter_params, s.dstate, res.features, count, routes=spec.routes)
    return s._replace(cache=cache, dstate=dstate, bonus=res.bonus, out=out, n_out=n_out, done=done), count


def _ar_step(model, s: LoopState, eos_ids, spec: GenSpec, hidden_ids=()):
    """One plain decoding step; also returns the target features hidden_ids of the committed token
    ([B, 1, F], or None without hidden_ids: the adaptive budget's plain steps keep them for the drafter)."""
    keys = position_keys(s.rows, s.cache.lengths + 1)  # the bonus sits at `lengths`; this draws the next
    h, feats, cache = model(s.bonus[:, None], s.cache, (~s.done).astype(jnp.int32), chunked=False,
                            hidden_ids=hidden_ids, routes=spec.routes)
    nxt = choose(model.logits(h[:, 0]), spec.code, s.rows.sampling, keys)
    b = nxt.shape[0]
    out, n_out, done = _emit(s.out, s.n_out, s.done, nxt[:, None], jnp.ones((b,), jnp.int32), eos_ids,
                             _max_new(s, spec), s.rows.stop)
    return s._replace(cache=cache, bonus=nxt, out=out, n_out=n_out, done=done), n_out - s.n_out, feats


def _count_step(s: LoopState, new: LoopState, n_new, spec: GenSpec) -> LoopState:
    """new after one step from s that emitted n_new tokens per row: steps, histogram, step counter."""
    active = ~s.done
    hist = s.hist.at[jnp.where(active, n_new, spec.block + 1)].add(1, mode="drop")
    return new._replace(steps=s.steps + active, hist=hist, i=s.i + 1)


def _step(model, drafter_params, s: LoopState, eos_ids, spec: GenSpec, stop_at=None) -> LoopState:
    """One loop step (budget "auto": a speculative step or a burst of plain steps, ending by
    stop_at, speculative/adaptive.py)."""
    if spec.adaptive is not None:
        return adaptive.step(model, drafter_params, s, eos_ids, spec, _PHASES, stop_at)
    if spec.mode == "ar":
        new, n_new, _ = _ar_step(model, s, eos_ids, spec)
    else:
        logq = propose(model, drafter_params, s, spec)
        tree = build(logq, s, spec, vocab_ids(spec, drafter_params))
        res = verify(model, s, tree, spec)
        new, n_new = commit_and_emit(model, drafter_params, s, tree, res, eos_ids, spec)
    return _count_step(s, new, n_new, spec)


_PHASES = adaptive.Phases(propose, vocab_ids, build, verify, commit_and_emit, _ar_step, _count_step)


# ---- entry points ---------------------------------------------------------------------
def _start(model, drafter_params, prompt, prompt_lens, eos_ids, key, spec: GenSpec, rows: RowControls | None = None,
           capacity: int = 0, costs=None) -> LoopState:
    """rows: each row's settings (None: spec.sampling, a Sampling, for every row, keys from key).
    capacity: the caches' size when it is not the spec's: a caller that prefills rows to copy into
    a larger running batch (ddtree_jax/serve) checks the room itself. costs: budget "auto"'s
    step-time table, arrays (cost_table.CostTable.arrays)."""
    cfg = model.cfg
    spec.validate(cfg.vocab_size)
    b, t = prompt.shape
    if rows is None:
        if not isinstance(spec.sampling, Sampling):
            raise ValueError("a GenSpec whose sampling is a SamplingCode needs per-row settings (rows=RowControls)")
        rows = uniform_rows(spec.sampling, b, spec.max_new_tokens, key)
    if not capacity:
        capacity = spec.capacity or required_capacity(t, spec.max_new_tokens, spec.block)
        if capacity < required_capacity(t, spec.max_new_tokens, spec.block):
            raise ValueError(
                f"cache capacity {capacity} is too small for a prompt of {t} tokens plus {spec.max_new_tokens} new "
                f"tokens (needs {required_capacity(t, spec.max_new_tokens, spec.block)})"
            )
    if spec.mode != "ar" and hasattr(spec.proposer, "check_target"):
        spec.proposer.check_target(cfg)
    hidden_ids = () if spec.mode == "ar" else spec.proposer.hidden_ids
    prompt_lens = prompt_lens.astype(jnp.int32)
    cache = init_target_cache(cfg, b, capacity)
    h, feats, cache = model(prompt, cache, prompt_lens, chunked=True, hidden_ids=hidden_ids)
    last = jnp.take_along_axis(h, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    bonus = choose(model.logits(last), spec.code, rows.sampling, position_keys(rows, prompt_lens))
    dstate = None
    if spec.mode != "ar":
        dstate = spec.proposer.init_state(drafter_params, b, capacity)
        dstate = spec.proposer.extend(drafter_params, dstate, feats, prompt_lens, routes=spec.routes)
    out = jnp.full((b, spec.max_new_tokens), -1, jnp.int32)
    out, n_out, done = _emit(out, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), bonus[:, None],
                             jnp.ones((b,), jnp.int32), eos_ids, jnp.minimum(rows.max_new, spec.max_new_tokens),
                             rows.stop)
    adapt = None if spec.adaptive is None else adaptive.init(spec.adaptive, b, spec, costs)
    s = LoopState(cache, dstate, bonus, out, n_out, done, jnp.zeros((b,), jnp.int32),
                  jnp.zeros((spec.block + 1,), jnp.int32), jnp.int32(0), rows, adapt)
    return adaptive.with_plan(s, spec) if _host_plans(spec) else s


def _host_plans(spec: GenSpec) -> bool:
    """Whether the host reads the adaptive plan after each call (AutoBudget.host_decides);
    otherwise the plan is not computed (the device's programs and the server never read it)."""
    return spec.adaptive is not None and spec.adaptive.host_decides


def _advance(model, drafter_params, s: LoopState, eos_ids, spec: GenSpec, max_steps) -> LoopState:
    """Up to max_steps steps, until every row stopped. With spec.chunk C > 1, first whole chunks
    of C steps (unrolled, so the predicate is read once a chunk, and a buffer one step's kernel
    writes anew is the next step's input instead of a copy back into the loop's carry); a step
    that starts with every row stopped changes no output and is not counted (a stopped row's state
    is stepped as in any batch whose other rows run); then single steps up to the stop."""
    stop_at = s.i + max_steps
    # one jitted step: traced and lowered once however many of its calls the loops below hold
    step = jax.jit(lambda st: _step(model, drafter_params, st, eos_ids, spec, stop_at))
    going = lambda st: ~jnp.all(st.done)
    c = spec.chunk
    if c > 1:
        def counted(_, st):
            nxt = step(st)
            return nxt._replace(i=jnp.where(going(st), nxt.i, st.i))

        s = jax.lax.while_loop(lambda st: going(st) & (st.i + c <= stop_at),
                               lambda st: jax.lax.fori_loop(0, c, counted, st, unroll=True), s)
    s = jax.lax.while_loop(lambda st: going(st) & (st.i < stop_at), step, s)
    return adaptive.with_plan(s, spec) if _host_plans(spec) else s


def _eos(eos_ids):
    return jnp.zeros((0,), jnp.int32) if eos_ids is None else jnp.asarray(eos_ids, jnp.int32)


def _start_from(graphdef, params, drafter_params, prompt, prompt_lens, eos_ids, key, spec: GenSpec,
                rows: RowControls | None = None, capacity: int = 0, costs=None) -> LoopState:
    """Prefill and the first token (the prefill's own choice); rows, capacity and costs as for _start."""
    return _start(nnx.merge(graphdef, params), drafter_params, prompt, prompt_lens, _eos(eos_ids), key, spec, rows,
                  capacity, costs)


def _advance_from(graphdef, params, drafter_params, state: LoopState, eos_ids, max_steps, spec: GenSpec) -> LoopState:
    """Up to max_steps more steps (a traced value: no recompilation when it changes)."""
    return _advance(nnx.merge(graphdef, params), drafter_params, state, _eos(eos_ids), spec, max_steps)


start = RoutedJit(_start_from, static_argnames=("graphdef", "spec", "capacity"))
advance = RoutedJit(_advance_from, static_argnames=("graphdef", "spec"), donate_argnames=("state",))


def choice_programs(spec: GenSpec) -> dict[int, GenSpec]:
    """Budget "auto" chosen by the host every decide_every steps: {choice index: the GenSpec of
    the program that runs that choice every step (AutoBudget.program)}; {} otherwise (one program
    chooses on device, or no adaptive budget)."""
    auto = spec.adaptive
    if auto is None or not auto.host_decides or auto.run >= 0:
        return {}
    return {c: dataclasses.replace(spec, budget=auto.program(c)) for c in auto.choices}


_BOUND: dict[int, tuple] = {}


def bind(graphdef: nnx.GraphDef):
    """(start, advance) as above with the target's graphdef bound once: fn(params, ...).

    As a static argument jit hashes a GraphDef on every call, walking the whole graph (3.9 ms for
    the 27B-shaped target's on this project's CPU machine; a 0-step advance of a 64-layer model
    7.5 ms static, 2.2 ms bound: docs/decisions/0003-bound-graphdef.md), paid per
    chunk of a streamed generation (the engine advances `stream_every` steps a call). Bound, a call
    hashes only its GenSpec; the parameters are flattened once per parameter object
    (flat_params.FlatParams)."""
    hit = _BOUND.get(id(graphdef))
    if hit is None or hit[0] is not graphdef:
        hit = (graphdef,
               FlatParams(functools.partial(_start_from, graphdef), 2, options_arg="spec",
                          static_argnames=("spec", "capacity")),
               FlatParams(functools.partial(_advance_from, graphdef), 2, options_arg="spec",
                          static_argnames=("spec",), donate_argnums=(2,)))
        _BOUND[id(graphdef)] = hit
    return hit[1], hit[2]


@functools.partial(
    RoutedJit,
    options_arg="routes",
    static_argnames=("graphdef", "proposer", "mode", "budget", "candidates", "max_new_tokens", "sampling", "capacity",
                     "routes"),
)
def generate(graphdef, params, prompt, prompt_lens, *, proposer=None, drafter_params=None, mode: str = "ddtree",
             budget: int | AutoBudget = 64, candidates: int | None = None, max_new_tokens: int = 128,
             sampling: Sampling = Sampling(), eos_ids=None, key=None, capacity: int | None = None,
             routes: Routes = REFERENCE, costs=None) -> GenerationResult:
    """Generate for right-padded prompts [B, T] with prompt_lens [B] real tokens: one jitted call,
    prefill plus one on-device while_loop until every sequence stopped. budget an AutoBudget:
    costs = its step-time table as arrays (cost_table.CostTable.arrays)."""
    spec = GenSpec(mode, budget, candidates, max_new_tokens, sampling, capacity or 0, proposer, routes)
    model = nnx.merge(graphdef, params)
    key = jax.random.PRNGKey(0) if key is None else key
    eos_ids = _eos(eos_ids)
    s = _start(model, drafter_params, prompt, prompt_lens, eos_ids, key, spec, costs=costs)
    return _advance(model, drafter_params, s, eos_ids, spec, jnp.int32(2**30)).result()
