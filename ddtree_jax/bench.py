"""Side-by-side measurement of AR, DFlash linear and DDTree on one engine and prompt set.

For every (mode, budget): end-to-end tokens/s and acceptance length over the prompts (after
compilation), the histogram of tokens per step, and the time of one step split into its
phases (draft / tree build / verify / commit), each phase jitted on its own and timed by the
median of repeats on a real mid-generation state. Peak device memory where the backend
reports it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax import decode
from ddtree_jax.cache import init_target_cache
from ddtree_jax.compiled import routed_jit
from ddtree_jax.engine import Engine, bucket
from ddtree_jax.speculative import cost_table as costs
from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.sampling import Sampling
from ddtree_jax.tree import Tree, make_tree


@dataclasses.dataclass
class RunResult:
    mode: str
    budget: int | str | None  # "auto": the adaptive budget
    prompts: int
    tokens: int
    seconds: float
    tokens_per_second: float
    acceptance_length: float  # mean over prompts of tokens per step after prefill
    accepted_hist: list[int]
    step_ms: float  # end-to-end wall time per step
    phases_ms: dict[str, float]  # one step, phase by phase (median of repeats)
    peak_memory_bytes: int | None
    outputs_match_ar: bool | None = None
    speedup_vs_ar: float | None = None
    # For rows that differ from AR: (row, first differing token, AR top-2 logit gap there / logit scale).
    divergences: list | None = None
    divergences_are_ties: bool | None = None
    # tokens/s of every timed pass when the prompt set ran more than once (tokens_per_second = median)
    tokens_per_second_runs: list[float] | None = None
    # budget "auto": steps per choice and accepted tokens per row-step of each choice (predicted raw /
    # calibrated, realised) over all batches, the choice of every step of the first batch, the table
    adaptive: dict | None = None


def peak_memory() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall ms of fn() (blocked until ready) over `repeats` calls after one warm-up call."""
    jax.block_until_ready(fn())  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def marginal_ms(call_ms: Callable[[int], float], n: int) -> tuple[float, float]:
    """(ms per iteration, fixed ms per call) of a loop call from its times at n and 2n iterations
    (call_ms(k): the call's time with k iterations): the difference cancels the per-call cost
    (host dispatch of a params pytree, loop entry), which T(k) / k would spread over the k."""
    once, twice = call_ms(n), call_ms(2 * n)
    per = (twice - once) / n
    return per, once - n * per


def paired_marginal_ms(call: Callable[[int], Callable[[], object]], n: int, repeats: int
                       ) -> tuple[float, float, list[float]]:
    """marginal_ms with the n and 2n calls timed in pairs, one pair per repeat: (median of the
    pairs' ms per iteration, median fixed ms per call, every pair's ms per iteration). The
    difference of two medians taken minutes apart moves with the GPU's clock between them
    (docs/decisions/0001-paired-marginal-step-estimator.md); a pair shares the conditions it ran under.
    call(k)() runs k iterations; both are warmed up first."""
    once, twice = call(n), call(2 * n)
    jax.block_until_ready(once())
    jax.block_until_ready(twice())
    pers, fixed = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(once())
        t1 = time.perf_counter()
        jax.block_until_ready(twice())
        t2 = time.perf_counter()
        a, b = 1000 * (t1 - t0), 1000 * (t2 - t1)
        pers.append((b - a) / n)
        fixed.append(a - n * pers[-1])
    return statistics.median(pers), statistics.median(fixed), pers


@routed_jit(static_argnames=("graphdef", "spec"))
def _propose(graphdef, params, dparams, s, spec):
    return gen.propose(nnx.merge(graphdef, params), dparams, s, spec)


@routed_jit(static_argnames=("spec",))
def _build(logq, s, spec, ids=None):
    """The build phase; ids: the proposer's draft vocabulary (gen.vocab_ids), or None."""
    return gen.build(logq, s, spec, ids)


@routed_jit(static_argnames=("graphdef", "spec"))
def _verify(graphdef, params, s, tree, spec):
    return gen.verify(nnx.merge(graphdef, params), s, tree, spec)


def deep_parents(n: int, seed, max_depth: int = 15) -> np.ndarray:
    """A DDTree-like parent array in topological order: node i extends node i - 1 half the time
    (while it is shallower than max_depth), else branches from a random shallower node. What a
    trained drafter's confident blocks give (a long main path with side branches), where a random
    drafter's flat distributions put every node at depth 1. seed: an int or a numpy Generator
    (drawn from in place: scripts/gpu_gdn.py draws several trees and then the inputs from one)."""
    rng = np.random.default_rng(seed)
    parents, depth = [-1], [0]
    for i in range(1, n):
        if depth[i - 1] < max_depth and rng.random() < 0.5:
            p = i - 1
        else:
            p = int(rng.choice([j for j in range(i) if depth[j] < max_depth]))
        parents.append(p)
        depth.append(depth[p] + 1)
    return np.asarray(parents, np.int32)


def deep_tree(tree: Tree, start: jax.Array, seed: int = 0, max_depth: int = 15) -> Tree:
    """`tree`'s tokens on a `deep_parents` shape (same size, every node valid; batch rows share
    it): to time the verify / commit of a deep tree with random weights."""
    b, n = tree.tokens.shape
    parents = jnp.broadcast_to(jnp.asarray(deep_parents(n, seed, max_depth)), (b, n))
    return make_tree(tree.tokens, parents, jnp.ones((b, n), bool), start, max_depth)


def _checksum(tree) -> jax.Array:
    """A scalar that depends on every floating / integer leaf (keeps work alive inside loops)."""
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")]
    return sum(jnp.sum(x.reshape(-1)[:1].astype(jnp.float32)) for x in leaves)


@routed_jit(static_argnames=("graphdef", "spec", "phase"))
def _phase_loop(graphdef, params, dparams, s, logq, tree, res, eos, key, spec, phase: str, n):
    """Run one phase n times on device (n traced: one compilation for every n); each iteration
    perturbs an input by the loop index so nothing is hoisted out of the loop, and a checksum of
    the output keeps it from being dropped. The plain decoding step ("step") and the whole
    speculative step ("loop": draft, build, verify, commit and the loop's bookkeeping) instead run
    n steps of gen._advance, the generation loop itself (spec's mode): its state carried from step
    to step (with only a checksum of each output, XLA dropped the recurrent-state and cache
    writebacks and copied the K cache per layer instead of updating it in place, seen in the
    profile's HLO), its predicate reads and its chunks of steps (Routes.loop_chunk: on a GPU pairs,
    between whose steps no carried buffer is copied back; docs/decisions/0075-generation-loop-in-pairs-of-steps.md).
    The inputs are not donated: each call first copies the caches it will update (per call, not per
    iteration)."""
    model = nnx.merge(graphdef, params)
    vocab = model.cfg.vocab_size
    if phase in ("step", "loop"):  # n steps as generation runs them
        if (phase == "step") != (spec.mode == "ar"):
            raise ValueError(f"phase {phase!r} with a {spec.mode!r} spec ('step' is plain decoding's)")
        return _checksum(gen._advance(model, dparams, s, eos, spec, n))

    def body(i, acc):
        bumped = s._replace(bonus=(s.bonus + i) % vocab)
        if phase == "draft":
            out = gen.propose(model, dparams, bumped, spec)
        elif phase == "build":
            out = gen.build(logq.at[:, 0, 0].add(i.astype(jnp.float32) * 1e-6), s, spec, gen.vocab_ids(spec, dparams))
        elif phase == "verify":
            out = gen.verify(model, s, tree._replace(tokens=tree.tokens.at[:, 0].set((tree.tokens[:, 0] + i) % vocab)),
                             spec)
        elif phase == "commit":
            out = gen.commit_and_emit(model, dparams, s, tree, res._replace(bonus=(res.bonus + i) % vocab), eos,
                                      spec)[0]
        else:
            raise ValueError(f"unknown phase {phase!r}")
        return acc + _checksum(out)

    return jax.lax.fori_loop(0, n, body, jnp.float32(0))


def phase_times(engine: Engine, prompt_ids: Sequence[int], spec: gen.GenSpec, repeats: int = 10,
                warm_steps: int = 4) -> dict[str, float]:
    """Median ms of each phase of one step, on the state reached after a few real steps."""
    t = bucket(len(prompt_ids))
    prompt = np.zeros((1, t), np.int32)
    prompt[0, : len(prompt_ids)] = prompt_ids
    eos = jnp.zeros((0,), jnp.int32)
    key = jax.random.PRNGKey(0)
    g, p, dp = engine.graphdef, engine.params, engine.drafter_params
    s = gen.start(g, p, dp, jnp.asarray(prompt), jnp.asarray([len(prompt_ids)], jnp.int32), eos, key, spec)
    s = gen.advance(g, p, dp, s, eos, jnp.int32(warm_steps), spec)
    s = s._replace(done=jnp.zeros_like(s.done), out=jnp.full_like(s.out, -1), n_out=jnp.zeros_like(s.n_out))
    return phase_times_at(g, p, dp, s, spec, key, repeats)


def phase_times_at(graphdef, params, dparams, s: gen.LoopState, spec: gen.GenSpec, key, repeats: int = 10,
                   inner: int = 8) -> dict[str, float]:
    """Per-phase ms of one step from state s: each phase runs inside one on-device loop of `inner`
    and of 2 x `inner` iterations, timed back to back `repeats` times (paired_marginal_ms); the
    median difference / inner is the phase's time without the host dispatch of a call. A phase
    shorter than the calls' dispatch jitter / inner reads 0 (the difference is clamped at zero):
    raise `inner` for large models (scripts/bench_e2e.py uses 32)."""
    eos = jnp.zeros((0,), jnp.int32)
    logq = tree = res = None
    phases = ("step",) if spec.mode == "ar" else ("draft", "build", "verify", "commit")
    if spec.mode != "ar":
        logq = _propose(graphdef, params, dparams, s, spec)
        tree = _build(logq, s, spec, gen.vocab_ids(spec, dparams))
        res = _verify(graphdef, params, s, tree, spec)
    out = {}
    for phase in phases:
        run = lambda n: (lambda: _phase_loop(graphdef, params, dparams, s, logq, tree, res, eos, key, spec, phase,
                                             jnp.int32(n)))
        per, _, _ = paired_marginal_ms(run, inner, repeats)
        out[phase] = max(per, 0.0)
    return out


def run_mode(engine: Engine, prompts: Sequence[Sequence[int]], mode: str, budget: int | str | None, *,
             max_new_tokens: int, batch: int, sampling: Sampling = Sampling(), phase_repeats: int = 10,
             auto_budgets: Sequence[int] | None = None, cost_table: costs.CostTable | None = None,
             decide_every: int | None = None, decide_on: str | None = None) -> tuple[RunResult, list[list[int]]]:
    """Generate for every prompt (in batches; the engine runs each new shape once untimed, so the
    reported time is generation only). phase_repeats 0 skips the per-phase timing (its
    compilations dominate short runs; budget "auto" has none: its steps differ). budget "auto":
    the adaptive budget over auto_budgets, decide_every and decide_on with cost_table (None: measured by the
    engine)."""
    outputs, seconds, step_ms, accept, hist, adaptive = [], 0.0, [], [], None, []
    kwargs = dict(mode=mode, budget=budget or 1, max_new_tokens=max_new_tokens, sampling=sampling,
                  auto_budgets=auto_budgets, decide_every=decide_every, decide_on=decide_on,
                  cost_table=cost_table)
    for i in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[i : i + batch]]
        res = engine.generate(chunk, **kwargs)
        seconds += res[0].stats.seconds
        step_ms.append(res[0].stats.step_ms)
        for c in res:
            outputs.append(c.token_ids)
            accept.append(c.stats.acceptance_length)
        h = np.asarray(res[0].stats.accepted_hist)
        hist = h if hist is None else hist + h
        if res[0].stats.adaptive is not None:
            adaptive.append(res[0].stats.adaptive)
    tokens = sum(len(o) for o in outputs)
    phases = {}
    if phase_repeats > 0 and budget != "auto":
        spec = engine.spec(mode, budget=budget or 1, candidates=None, max_new_tokens=max_new_tokens,
                           sampling=sampling, prompt_bucket=bucket(len(prompts[0])))
        phases = phase_times(engine, list(prompts[0]), spec, repeats=phase_repeats)
    result = RunResult(
        mode=mode, budget=budget if mode == "ddtree" else None, prompts=len(prompts), tokens=tokens, seconds=seconds,
        tokens_per_second=tokens / seconds if seconds else float("nan"),
        acceptance_length=float(np.mean(accept)), accepted_hist=hist.tolist(),
        step_ms=float(np.mean(step_ms)),
        phases_ms=phases, peak_memory_bytes=peak_memory(), adaptive=merge_adaptive(adaptive) if adaptive else None,
    )
    return result, outputs


def merge_adaptive(parts: list[dict]) -> dict:
    """One budget "auto" summary from the batches of a run: steps per choice and row-step weighted
    acceptance summed over batches; the first batch's step-by-step choices and the table."""
    choices, acc = {}, {}
    for part in parts:
        for name, n in part["choices"].items():
            choices[name] = choices.get(name, 0) + n
        for name, a in part["acceptance"].items():
            into = acc.setdefault(name, {"steps": 0, "row_steps": 0, "predicted": 0.0, "calibrated": 0.0,
                                         "realised": 0.0})
            into["steps"] += a["steps"]
            into["row_steps"] += a["row_steps"]
            for k in ("predicted", "calibrated", "realised"):
                into[k] += a[k] * a["row_steps"]
    for a in acc.values():
        for k in ("predicted", "calibrated", "realised"):
            a[k] /= max(a["row_steps"], 1)
    first = parts[0]
    return {"choices": choices, "acceptance": acc, "budgets": first["budgets"], "cost_table": first["cost_table"],
            "trace_first_batch": first["trace"]}


def auto_cost_table(engine: Engine, prompts: Sequence[Sequence[int]], args) -> costs.CostTable:
    """ddtree-bench's step-time table for --budgets auto: read from --cost-table-in, or measured on
    the first batch of prompts (and written into --cost-table when given)."""
    first = [list(p) for p in prompts[: args.batch]]
    b = bucket(len(first), 1)
    if args.cost_table_in:
        form = engine.auto_budget(args.auto_budgets, args.decide_every, args.decide_on).form
        return engine.load_cost_table(args.cost_table_in, b, form)
    t = bucket(max(len(p) for p in first))
    spec = engine.spec("ddtree", budget="auto", candidates=None, max_new_tokens=args.max_new_tokens,
                       sampling=Sampling(), prompt_bucket=t, auto_budgets=args.auto_budgets,
                       decide_every=args.decide_every, decide_on=args.decide_on)
    prompt = np.zeros((b, t), np.int32)
    lens = np.ones((b,), np.int32)
    for i, p in enumerate(first):
        prompt[i, : len(p)] = p
        lens[i] = len(p)
    eos = jnp.asarray(sorted(set(engine.stop_ids)), jnp.int32)
    rows = gen.uniform_rows(Sampling(), b, args.max_new_tokens, jax.random.PRNGKey(0))  # as Engine.generate's
    table = engine.measure_cost_table(spec, jnp.asarray(prompt), jnp.asarray(lens), eos, rows,
                                      repeats=args.cost_repeats)
    table = dataclasses.replace(table, source=table.source.replace("at start-up", "by ddtree-bench"))
    if args.cost_table:
        costs.save(args.cost_table, table, device=engine.device_kind, model=engine.fingerprint(),
                   extra={"command": "ddtree-bench", "max_new_tokens": args.max_new_tokens})
        table = dataclasses.replace(table, source=f"{table.source}; written to {args.cost_table}")
    return table


def merge_repeats(passes: list[RunResult]) -> RunResult:
    """One result from repeated passes of a (mode, budget) over the prompt set: median tokens/s,
    seconds and step time, every pass's tokens/s kept; counts and phases from the first pass.
    A launch-bound small model varies ~10 % from pass to pass on a GPU, more than the
    difference between close modes, so single passes cannot rank them."""
    if len(passes) == 1:
        return passes[0]
    first = passes[0]
    return dataclasses.replace(
        first,
        seconds=statistics.median(r.seconds for r in passes),
        tokens_per_second=statistics.median(r.tokens_per_second for r in passes),
        step_ms=statistics.median(r.step_ms for r in passes),
        tokens_per_second_runs=[r.tokens_per_second for r in passes],
    )


TIE_TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 3e-2}


def top2_gap(engine: Engine, tokens: Sequence[int]) -> float:
    """(top-1 - top-2) logit after `tokens`, relative to max(1, max |logit|): a near tie is a point
    where batch-size-dependent rounding may legitimately flip a greedy choice."""

    n = len(tokens)
    out = decode.prefill(engine.graphdef, engine.params, init_target_cache(engine.cfg, 1, bucket(n, 64)),
                         jnp.asarray([tokens], jnp.int32), jnp.asarray([n], jnp.int32))
    logits = np.sort(np.asarray(out.logits[0]))[::-1]
    return float((logits[0] - logits[1]) / max(1.0, np.abs(logits).max()))


def compare(results: list[RunResult], outputs: dict, ar_key=("ar", None), engine: Engine | None = None,
            prompts: Sequence[Sequence[int]] | None = None) -> None:
    """Fill speedup_vs_ar and outputs_match_ar against the AR run (greedy runs must match). With the
    engine and prompts, explain every divergence: where it starts and how close AR's top two
    logits are there (ties within the dtype's rounding are numerics, anything else is a bug)."""
    base = next((r for r in results if r.mode == "ar"), None)
    for r in results:
        if base is None:
            continue
        r.speedup_vs_ar = r.tokens_per_second / base.tokens_per_second
        ours, ref = outputs[(r.mode, r.budget)], outputs[ar_key]
        r.outputs_match_ar = ours == ref
        if r.outputs_match_ar or engine is None or prompts is None:
            continue
        r.divergences = []
        for row, (a, b) in enumerate(zip(ref, ours)):
            k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if k is None and len(a) == len(b):
                continue
            k = min(len(a), len(b)) if k is None else k
            r.divergences.append((row, k, top2_gap(engine, list(prompts[row]) + list(a[:k]))))
        tol = TIE_TOLERANCE.get(engine.cfg.dtype, 1e-3)
        r.divergences_are_ties = all(gap < tol for _, _, gap in r.divergences)


def table(results: list[RunResult]) -> str:
    """One row per run; with repeated passes tok/s is their median and a range column shows the spread."""
    spread = any(r.tokens_per_second_runs for r in results)
    head = f"{'mode':7} {'budget':>6} {'tok/s':>9} " + (f"{'tok/s range':>15} " if spread else "") + \
           f"{'speedup':>7} {'accept':>6} {'ms/step':>8} {'draft':>7} {'build':>7} {'verify':>7} {'commit':>7} " \
           f"{'same':>5}"
    lines = [head, "-" * len(head)]
    for r in results:
        ph = r.phases_ms
        cols = [ph.get(k, ph.get("step") if k == "verify" else None) for k in ("draft", "build", "verify", "commit")]
        fmt = lambda x: f"{x:7.2f}" if x is not None else f"{'-':>7}"
        runs = r.tokens_per_second_runs
        rng = f"{min(runs):7.0f}-{max(runs):<7.0f} " if runs else f"{'-':>15} "
        lines.append(
            f"{r.mode:7} {r.budget if r.budget is not None else '-':>6} {r.tokens_per_second:9.1f} "
            + (rng if spread else "")
            + f"{(r.speedup_vs_ar or float('nan')):7.2f} {r.acceptance_length:6.2f} {r.step_ms:8.2f} "
            + " ".join(fmt(c) for c in cols)
            + f" {_same(r):>5}"
        )
    return "\n".join(lines)


def _same(r: RunResult) -> str:
    if r.outputs_match_ar is None:
        return "-"
    if r.outputs_match_ar:
        return "yes"
    return "tie" if r.divergences_are_ties else "NO"


def plot(results: list[RunResult], path: str) -> None:
    """Speedup over AR and acceptance length vs budget (DDTree line; DFlash and AR as references)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tree = sorted((r for r in results if r.mode == "ddtree" and r.budget != "auto"), key=lambda r: r.budget)
    lin = next((r for r in results if r.mode == "dflash"), None)
    auto = next((r for r in results if r.budget == "auto"), None)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    if tree:
        budgets = [r.budget for r in tree]
        a1.plot(budgets, [r.speedup_vs_ar or float("nan") for r in tree], "o-", label="DDTree")
        a2.plot(budgets, [r.acceptance_length for r in tree], "o-", label="DDTree")
        a1.set_xscale("log", base=2)
        a2.set_xscale("log", base=2)
    if lin is not None:
        a1.axhline(lin.speedup_vs_ar or float("nan"), color="C1", ls="--", label="DFlash linear")
        a2.axhline(lin.acceptance_length, color="C1", ls="--", label="DFlash linear")
    if auto is not None:
        a1.axhline(auto.speedup_vs_ar or float("nan"), color="C2", ls="-.", label="auto budget")
        a2.axhline(auto.acceptance_length, color="C2", ls="-.", label="auto budget")
    a1.axhline(1.0, color="gray", ls=":", label="plain decoding")
    a2.axhline(1.0, color="gray", ls=":", label="plain decoding")
    a1.set(xlabel="budget (tree nodes)", ylabel="speedup vs plain decoding (tok/s)")
    a2.set(xlabel="budget (tree nodes)", ylabel="acceptance length (tokens / step)")
    a1.legend()
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_choices(result: RunResult, path: str) -> None:
    """The adaptive budget's choice at every step of its first generation (first batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = result.adaptive
    names = ["ar", "dflash"] + [str(b) for b in a["budgets"]]
    labels = ["plain", "DFlash"] + [f"tree {b}" for b in a["budgets"]]
    trace = [names.index(n) for n in a["trace_first_batch"]]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.plot(range(len(trace)), trace, ".", ms=4)
    ax.set_yticks(range(len(names)), labels)
    ax.set(xlabel="step", ylabel="choice", title=f"budget auto, first batch: {len(trace)} steps "
           f"({', '.join(f'{k} {v}' for k, v in a['choices'].items())} over all batches)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
