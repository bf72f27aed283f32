"""The adaptive budget's simulation (scripts/adaptive_bench.py `simulate`, and the groups and
tables `ceiling` reads): any policy - plain, DFlash, every fixed budget, or auto with the loop's
own choice.py code - replayed on a trace with a step-time table, tokens/s per batch size."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.speculative import choice
from ddtree_jax.speculative.choice import AR, AutoBudget
from ddtree_jax.speculative.cost_table import POINTS, CostTable
from ddtree_jax.speculative.generation_choice import GenerationPolicy


def truncated(tr: dict, max_new: int) -> dict:
    """The trace as generations of max_new tokens would visit it: each row's first max_new - 1
    positions (fewer where its generation ended sooner). A makespan is the slowest row's steps, and
    its spread over rows shrinks with length, so a simulation compares with a run of the same length."""
    if not 2 <= max_new <= tr["max_new_tokens"]:
        raise ValueError(f"--max-new-tokens must be in [2, {tr['max_new_tokens']}] (the trace's length), got {max_new}")
    rows = []
    for r in tr["rows"]:
        n = min(r["positions"], max_new - 1)
        rows.append(r | {"positions": n, "e": r["e"][:n], "accepted": r["accepted"][:n]})
    return tr | {"max_new_tokens": max_new, "rows": rows}


@functools.partial(jax.jit, static_argnums=0)
def _decide(auto, a, left, ctx):
    costs = choice.step_costs(auto, a, ctx)
    return choice.draft_next(auto, a, left, costs), costs


_choose = jax.jit(choice.choose, static_argnums=0)
_after_spec = jax.jit(choice.after_spec, static_argnums=0)
_after_ar = jax.jit(choice.after_ar)
_after_lean = jax.jit(choice.after_lean, static_argnums=1)
_learning = jax.jit(choice.learning_draft, static_argnums=0)


def simulate(tr: dict, rows: list[dict], ms: dict, contexts: list[float], policy: str, auto: AutoBudget,
             context: float | None = None, measured: dict | None = None, decision_ms: float = 0.0):
    """One generation of a batch of the trace's rows under `policy`: a choice name run at every
    step, or "auto" (the loop's policy over auto's choices, every one of which must be in the trace
    and in ms). Returns (tokens, ms, steps per choice). A step costs the table's time of its choice
    at the batch's mean committed length over active rows (context + position when `context` is
    given, else each row's prompt length + position). decision_ms: what auto pays beyond the chosen
    step's own time at each scored draft (the Bmax selection, E, the choice, the conditionals)."""
    names = list(auto.names)
    cols = [tr["choices"].index(n) for n in names]
    batch = len(rows)
    e = [np.asarray(r["e"], np.float32)[:, cols] for r in rows]
    acc = [np.asarray(r["accepted"], np.int32)[:, cols] for r in rows]
    end = np.asarray([r["positions"] for r in rows])
    base = np.asarray([context if context is not None else r["prompt_len"] for r in rows], np.float32)
    table = np.asarray([ms[n] if on else [np.inf] * len(contexts) for n, on in zip(names, auto.enabled)], np.float32)
    pad = POINTS - len(contexts)
    measured = measured or {}
    a = choice.init_state(auto, batch, int(end.max()) + 2, choice.TableArrays(
        np.pad(table, ((0, 0), (0, pad)), mode="edge"), np.pad(np.asarray(contexts, np.float32), (0, pad), mode="edge"),
        np.asarray([measured.get("ratios", {}).get(n, -1.0) for n in names], np.float32),
        np.asarray([measured.get("accepted", {}).get(n, -1.0) for n in names], np.float32)))
    pos = np.zeros(batch, np.int64)
    total_ms, steps, i = 0.0, {}, 0

    def at(p):
        take = lambda xs: np.stack([x[min(q, len(x) - 1)] for x, q in zip(xs, p)])
        return take(e), take(acc)

    def cost(c, active):
        return float(np.interp(np.mean((base + pos)[active]), contexts, table[c]))

    row_steps = 0
    while np.any(pos < end):
        active = pos < end
        row_steps += int(np.sum(active))
        left = jnp.asarray(np.maximum(end - pos, 0))  # tokens each row still generates
        if policy == "auto":
            draft, costs = _decide(auto, a, left, jnp.float32(np.mean((base + pos)[active])))
            if not bool(draft):  # a burst of plain steps, as the loop runs it
                for _ in range(auto.burst):
                    active = pos < end
                    if not active.any():
                        break
                    a = _after_ar(a, jnp.asarray(np.maximum(end - pos, 0)), i)
                    total_ms += cost(AR, active)
                    steps["ar"] = steps.get("ar", 0) + 1
                    pos = pos + active
                    i += 1
                continue
            e_raw, acc_all = at(pos)
            c, e_cal = _choose(auto, a, jnp.asarray(e_raw), left, costs)
            c = int(c)
            total_ms += decision_ms
            # device chunks: a learning draft (choice.learning_draft) is a one-step chunk, any other
            # runs decide_every steps of its choice; the policy learns from the chunk's first step
            chunk = (1 if bool(_learning(auto, a, left, costs)) else auto.decide_every) if auto.device_chunks else 1
            a = _after_spec(auto, a, c, jnp.asarray(e_raw), e_cal, jnp.asarray(acc_all[:, c]), left, i, costs)
            if auto.device_chunks:  # the chunk's first step, then the rest of its fixed-budget steps
                total_ms += cost(c, active)
                steps[names[c]] = steps.get(names[c], 0) + 1
                pos = pos + np.where(active, 1 + acc_all[:, c], 0)
                i += 1
                for _ in range(chunk - 1):
                    active = pos < end
                    if not active.any():
                        break
                    acc_all = at(pos)[1]
                    a = _after_lean(a, c, i, jnp.asarray(acc_all[:, c]), jnp.asarray(np.maximum(end - pos, 0)))
                    total_ms += cost(c, active)
                    steps[names[c]] = steps.get(names[c], 0) + 1
                    pos = pos + np.where(active, 1 + acc_all[:, c], 0)
                    i += 1
                continue
        else:
            c = names.index(policy)
            acc_all = at(pos)[1]
        total_ms += cost(c, active)
        steps[names[c]] = steps.get(names[c], 0) + 1
        pos = pos + np.where(active, 1 + acc_all[:, c], 0)
        i += 1
    tokens = int(np.sum(end + 1))  # each row: the prefill's token and one per position walked
    if policy == "auto":
        return tokens, total_ms, steps
    return tokens, total_ms, steps, row_steps


def simulate_per_generation(tr: dict, groups: list[list[dict]], ms: dict, contexts: list[float], auto: AutoBudget,
                            context: float | None, measured: dict) -> tuple[int, float, dict]:
    """Auto chosen once a generation (AutoBudget.per_generation): each group of rows is one
    generation of the choice generation_choice.GenerationPolicy picks from the table (its
    `accepted` is the policy's starting value) and what the earlier groups realised; each
    generation is the fixed choice's simulation. Returns (tokens, ms, steps per choice)."""
    table = CostTable(len(groups[0]), tuple(contexts), {n: tuple(v) for n, v in ms.items()}, "simulation",
                      accepted=dict(measured.get("accepted") or {}))
    policy = GenerationPolicy.start(auto, table)
    tokens, total, steps = 0, 0.0, {}
    for group in groups:
        left = np.asarray([r["positions"] for r in group])
        ctx = context if context is not None else float(np.mean([r["prompt_len"] for r in group]))
        c, _ = policy.choose(left, ctx)
        n, t, st, row_steps = simulate(tr, group, ms, contexts, auto.names[c], auto, context, measured)
        policy.learn(c, float(n - len(group) - row_steps), float(row_steps))
        tokens, total = tokens + n, total + t
        for k, v in st.items():
            steps[k] = steps.get(k, 0) + v
    return tokens, total, steps


def tables_from_files(cost_table_path: str | None, e2e_paths: list[str], ratios_from: str | None = None) -> dict:
    """{batch: (contexts, {choice: [ms per context]}, {"ratios": ..., "accepted": ...})} from a
    ddtree-bench table file, or from scripts.bench.e2e reports (their runs' step_ms_by_choice, each
    report one context) with the measured acceptance of a ddtree-bench table file (ratios_from:
    random weights accept nothing, so it goes with the trace's pair)."""
    out: dict = {}
    if cost_table_path:
        with open(cost_table_path) as f:
            doc = json.load(f)
        for b, t in doc["tables"].items():
            out[int(b)] = (list(t["contexts"]), {k: list(v) for k, v in t["ms"].items()},
                           {"ratios": t.get("ratios") or {}, "accepted": t.get("accepted") or {}})
        return out
    ratios = {}
    if ratios_from:
        with open(ratios_from) as f:
            tables = json.load(f)["tables"]
        ratios = {int(b): {"ratios": t.get("ratios") or {}, "accepted": t.get("accepted") or {}}
                  for b, t in tables.items()}
    points: dict = {}
    for path in e2e_paths:
        with open(path) as f:
            doc = json.load(f)
        for run in doc["runs"]:
            if run.get("step_ms_by_choice"):
                points.setdefault(run["batch"], {})[float(run["context"])] = run["step_ms_by_choice"]
    for b, by_ctx in points.items():
        ctxs = sorted(by_ctx)
        names = set.intersection(*(set(by_ctx[c]) for c in ctxs))
        out[b] = (ctxs, {n: [by_ctx[c][n] for c in ctxs] for n in names}, ratios.get(b, ratios.get(1, {})))
    return out


def _setting(text: str) -> tuple[str, float]:
    """FIELD=VALUE of --policy: a numeric AutoBudget field."""
    field, _, value = text.partition("=")
    known = {f.name for f in dataclasses.fields(AutoBudget)}
    if field not in known or not value:
        raise SystemExit(f"--policy {text!r}: expected FIELD=VALUE with FIELD one of {sorted(known)}")
    try:
        return field, float(value)
    except ValueError:
        raise SystemExit(f"--policy {text!r}: {value!r} is not a number") from None


def batches_of(rows: list[dict], b: int) -> list[list[dict]]:
    """The trace's rows as the benchmark runs its prompts: in batches of b, the rows cycled to fill
    the last batch (and a batch larger than the prompt set)."""
    n = -(-max(len(rows), b) // b) * b
    cycled = [rows[i % len(rows)] for i in range(n)]
    return [cycled[i: i + b] for i in range(0, n, b)]


def run_simulation(tr: dict, tables: dict, batches: list[int], context: float | None,
                   objective: str = AutoBudget.objective, decide_every: int = 0,
                   decide_on: str = AutoBudget.decide_on, decision_ms: float = 0.0,
                   policy: dict | None = None, passes: int = 1) -> dict:
    """Every fixed choice and auto over the trace's rows in batches of each size. passes: auto
    chosen once a generation runs the batches this many times in a row (the benchmark's repeated
    passes: what the policy learns carries over), its time the mean pass's."""
    results = {}
    for b in batches:
        if b not in tables:
            raise SystemExit(f"no step-time table for batch {b} (have {sorted(tables)})")
        contexts, ms, measured = tables[b]
        missing = [n for n in tr["choices"] if n not in ms]
        auto = AutoBudget(tuple(int(n) for n in tr["choices"][2:] if n in ms), ar="ar" in ms, dflash="dflash" in ms,
                          ar_burst=tr["ar_burst"], objective=objective, decide_every=decide_every,
                          decide_on=decide_on, **(policy or {}))
        policies = [n for n, on in zip(auto.names, auto.enabled) if on] + ["auto"]
        row = {"contexts": contexts, "ms": ms, "measured": measured, "missing_choices": missing, "policies": {}}
        for p in policies:
            tokens, total, steps = 0, 0.0, {}
            if p == "auto" and auto.per_generation:
                tokens, total, steps = simulate_per_generation(tr, batches_of(tr["rows"], b) * passes, ms, contexts,
                                                               auto, context, measured)
                tokens, total = tokens / passes, total / passes
            for group in batches_of(tr["rows"], b) if not (p == "auto" and auto.per_generation) else ():
                n, t, st = simulate(tr, group, ms, contexts, p, auto, context, measured, decision_ms)[:3]
                tokens, total = tokens + n, total + t
                for k, v in st.items():
                    steps[k] = steps.get(k, 0) + v
            row["policies"][p] = {"tokens_per_s": 1000 * tokens / total, "steps": steps}
        fixed = {p: v["tokens_per_s"] for p, v in row["policies"].items() if p != "auto"}
        best = max(fixed, key=fixed.get)
        row["best_fixed"] = best
        row["auto_over_best"] = row["policies"]["auto"]["tokens_per_s"] / fixed[best]
        results[str(b)] = row
        print(f"batch {b:3d}: auto {row['policies']['auto']['tokens_per_s']:10.1f} tok/s = "
              f"{row['auto_over_best']:.3f}x the best fixed choice ({best}: {fixed[best]:.1f}); auto's steps "
              f"{row['policies']['auto']['steps']}", flush=True)
    return results
