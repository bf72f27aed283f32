"""The adaptive budget's (budget="auto", issue #27) measurements.

    demo      ddtree-bench on the demo pair for each batch size: auto against plain decoding, DFlash
              and every fixed budget, interleaved repeats, one step-time table file for all batches
              (its entries measured by ddtree-bench), and a summary: auto / the best other run
              (calls into the same --out add their batches to it).
    trace     Per prompt and position of its greedy continuation: every choice's raw expected
              acceptance E (what the policy sees) and the draft tokens it would accept (the target's
              greedy continuation is known, so acceptance is counterfactual for every choice at once).
              The drafter's context is the committed tokens', whatever was chosen before, so greedy
              generation under any policy walks these positions. Also the target's top-1
              probability and entropy of the distribution that chose each position's root (what a
              policy knows of the target before choosing).
    simulate  Any policy (plain, DFlash, every fixed budget, auto with the loop's own choice.py code)
              replayed on a trace with a step-time table: tokens/s per batch size. With the demo
              pair's trace and a 27B-shaped table (python -m scripts.bench.e2e --budgets ... step_ms_by_choice,
              one file per context) this is the 27B simulation: random weights accept nothing, so the
              acceptance comes from the demo pair; with the demo's own table (ddtree-bench
              --cost-table) it checks the simulation against measured auto runs (scripts/adaptive_simulate.py).
    ceiling   What any per-step choice could gain on a trace over the best fixed choice: the oracle
              (realised acceptance known), the choice from E with a calibration fitted in-sample and
              on the other prompts, and with --knn K the K nearest positions of the other prompts by
              every choice's E and the target's confidence (scripts/adaptive_ceiling.py).
    latency   Compile time of auto and its effect on the first token: a fresh engine's first call of
              a shape (compilation, warm-up, auto's start-up table) and a second call, per mode.

    python -m scripts.adaptive_bench demo --batches 1,4 --out $OUT/auto_demo
    python -m scripts.adaptive_bench demo --batches 8,16 --out $OUT/auto_demo
    python -m scripts.adaptive_bench trace --prompts docs/demo_heldout_prompts.jsonl --out $OUT/trace.json
    python -m scripts.adaptive_bench simulate --trace $OUT/trace.json --e2e $OUT/e2e_4k.json \\
        $OUT/e2e_32k.json --ratios-from $OUT/demo_costs.json --batches 1,8 --context 4096 --out $OUT/sim_27b.json
    python -m scripts.adaptive_bench simulate --trace $OUT/trace.json --cost-table $OUT/demo_costs.json \\
        --batches 1,4,8,16 --out $OUT/sim_demo.json
    python -m scripts.adaptive_bench ceiling --trace $OUT/trace.json --e2e $OUT/e2e_4k.json --batches 1,8 \\
        --context 4096 --out $OUT/ceiling_27b.json
    python -m scripts.adaptive_bench latency --out $OUT/latency.json
    python -m scripts.adaptive_bench smoke          # all three at tiny sizes on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax import atomic
from ddtree_jax.cli import bench as bench_cli
from ddtree_jax.cli.common import load_engine
from ddtree_jax.compiled import routed_jit
from ddtree_jax.engine import bucket
from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.accept import accept
from ddtree_jax.speculative.build import build_chain, tree_candidates, tree_from_candidates
from ddtree_jax.speculative.choice import AutoBudget
from ddtree_jax.speculative.expected import chain_expectation, tree_expectations
from ddtree_jax.speculative.sampling import Sampling
from scripts import adaptive_ceiling
from scripts.adaptive_simulate import _setting, batches_of, run_simulation, tables_from_files, truncated

DEFAULT_PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "demo_heldout_prompts.jsonl")


# ---- trace --------------------------------------------------------------------------------------
@routed_jit(static_argnames=("graphdef", "spec", "auto", "n"))
def _trace(graphdef, params, dparams, s, table, spec, auto: AutoBudget, n: int):
    """n positions from state s: (E [n, B, C], accepted [n, B, C], the target's top-1 probability
    and entropy (nats) [n, B] of the token after each position's root); one plain step between them.
    The target's figures take one more target forward a position (a trace-only cost)."""
    model = nnx.merge(graphdef, params)
    depth = spec.block - 1
    eos = jnp.zeros((0,), jnp.int32)

    def body(st, _):
        logq = gen.propose(model, dparams, st, spec)
        ids = gen.vocab_ids(spec, dparams)
        cands = tree_candidates(logq, auto.budgets[-1], spec.candidates, spec.routes)
        b = logq.shape[0]
        e = jnp.concatenate([jnp.zeros((b, 1)), chain_expectation(cands.best)[:, None],
                             tree_expectations(cands, auto.budgets)], axis=1)
        trees = [build_chain(logq, st.bonus, st.cache.lengths, ids)]
        trees += [tree_from_candidates(cands, bb, st.bonus, st.cache.lengths, spec.routes, ids) for bb in auto.budgets]
        # the target's greedy choice after a node = the continuation's token one position on
        post = [jnp.take_along_axis(table, jnp.minimum(t.positions + 1, table.shape[1] - 1), axis=1) for t in trees]
        acc = [accept(t, p, depth).count - 1 for t, p in zip(trees, post)]
        acc = jnp.stack([jnp.zeros((b,), jnp.int32)] + acc, axis=1)
        h, _, _ = model(st.bonus[:, None], st.cache, (~st.done).astype(jnp.int32), chunked=False, routes=spec.routes)
        logp = jax.nn.log_softmax(model.logits(h[:, 0]).astype(jnp.float32), axis=-1)
        top1, entropy = jnp.exp(jnp.max(logp, axis=-1)), -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        new, _, feats = gen._ar_step(model, st, eos, spec, spec.proposer.hidden_ids)
        dstate = spec.proposer.extend(dparams, new.dstate, feats, (~st.done).astype(jnp.int32), routes=spec.routes)
        return new._replace(dstate=dstate), (e, acc, top1, entropy)

    _, out = jax.lax.scan(body, s, None, length=n)
    return out


def trace(engine, prompts: list[list[int]], max_new: int, auto: AutoBudget) -> dict:
    """Greedy continuations of the prompts (one batch) and, at each of their first max_new - 1
    positions, every choice's E and accepted count."""
    block = engine.proposer.block_size
    ref = engine.generate(prompts, mode="ar", max_new_tokens=max_new + block + 1)
    lens = [len(p) for p in prompts]
    b, t = bucket(len(prompts), 1), bucket(max(lens))
    table = np.full((b, t + max_new + 2 * block + 2), -1, np.int32)
    prompt = np.zeros((b, t), np.int32)
    lengths = np.ones((b,), np.int32)
    for i, (p, c) in enumerate(zip(prompts, ref)):
        prompt[i, : len(p)] = p
        lengths[i] = len(p)
        row = list(p) + c.token_ids
        table[i, : len(row)] = row
    spec = engine.spec("ddtree", budget=auto.budgets[-1], candidates=None, max_new_tokens=max_new + block + 1,
                       sampling=Sampling(), prompt_bucket=t)
    eos = jnp.zeros((0,), jnp.int32)
    s = gen.start(engine.graphdef, engine.params, engine.drafter_params, jnp.asarray(prompt), jnp.asarray(lengths),
                  eos, jax.random.PRNGKey(0), spec)
    e, acc, top1, entropy = (np.asarray(x) for x in _trace(
        engine.graphdef, engine.params, engine.drafter_params, s, jnp.asarray(table), spec, auto, max_new - 1))
    rows = []
    for i, c in enumerate(ref):
        n = min(len(c.token_ids), max_new) - 1  # positions a generation of max_new tokens (or to EOS) visits
        # what a policy knows at position p before choosing: the target's distribution that chose
        # p's root, computed at p - 1 (none at the first position)
        rows.append({"prompt_len": lens[i], "positions": n, "e": e[:n, i].round(5).tolist(),
                     "accepted": acc[:n, i].tolist(),
                     "root_top1": [None] + top1[: n - 1, i].round(5).tolist(),
                     "root_entropy": [None] + entropy[: n - 1, i].round(5).tolist()})
    return {"choices": list(auto.names), "budgets": list(auto.budgets), "ar_burst": auto.ar_burst,
            "max_new_tokens": max_new, "rows": rows}


# ---- latency ------------------------------------------------------------------------------------
def latency(engine, prompt: list[int], max_new: int, auto_budgets, fixed_budget: int) -> dict:
    """Per mode, a fresh shape's first call and a second one: wall time, time to the first streamed
    token, auto's start-up table time. Modes run in this process one after the other, each with
    a program of its own (nothing compiled for one serves another); auto in its four forms (per
    step on device: one program; per chunk of 32 on device: one program; per chunk of 16 on the
    host: one program per choice; once a generation: each choice's fixed program)."""
    out = {}
    auto = dict(mode="ddtree", budget="auto", auto_budgets=auto_budgets)
    for name, kw in (("ar", dict(mode="ar")), (f"ddtree-{fixed_budget}", dict(mode="ddtree", budget=fixed_budget)),
                     ("auto-per-step", auto | dict(decide_every=0)),
                     ("auto-chunks-on-device", auto | dict(decide_every=32, decide_on="device")),
                     ("auto-chunks-on-host", auto | dict(decide_every=16, decide_on="host")),
                     ("auto-per-generation", auto | dict(decide_on="generation"))):
        row = {}
        for call in ("first", "second"):
            first_token = []
            t0 = time.perf_counter()

            def on_tokens(r, ids, t0=t0, first_token=first_token):
                if not first_token:
                    first_token.append(time.perf_counter() - t0)

            [c] = engine.generate([prompt], max_new_tokens=max_new, stream=on_tokens, **kw)
            row[f"{call}_call_s"] = time.perf_counter() - t0
            row[f"{call}_first_token_s"] = first_token[0]
            if c.stats.adaptive is not None:
                row[f"{call}_table_s"] = c.stats.adaptive["calibration_seconds"]
        row["compile_and_warm_s"] = row["first_call_s"] - row["second_call_s"] - row.get("first_table_s", 0.0)
        out[name] = row
        table = f", step-time table {row['first_table_s']:.2f} s" if "first_table_s" in row else ""
        print(f"{name:10s} first call {row['first_call_s']:7.2f} s "
              f"(first token after {row['first_first_token_s']:.2f} s{table}), "
              f"second call {row['second_call_s']:.3f} s (first token after "
              f"{row['second_first_token_s'] * 1000:.1f} ms)", flush=True)
    return out


# ---- demo ---------------------------------------------------------------------------------------
PROMPTS_16 = os.path.join(os.path.dirname(DEFAULT_PROMPTS), "demo_heldout_prompts_16.jsonl")


def demo(out: str, batches: list[int], budgets: str, auto_budgets: str, repeats: int, max_new: int, prompts: str,
         extra=()) -> dict:
    """ddtree-bench per batch size into out/b{B}/, the step-time tables into out/costs.json; the
    summary: per batch each run's median tokens/s, the best run other than auto, auto / best."""
    table = os.path.join(out, "costs.json")
    summary = {}
    for b in batches:
        run_dir = os.path.join(out, f"b{b}")
        argv = ["--prompts", prompts, "--modes", "ar,dflash,ddtree", "--budgets", f"auto,{budgets}",
                "--auto-budgets", auto_budgets, "--batch", str(b), "--repeats", str(repeats), "--phase-repeats", "0",
                "--max-new-tokens", str(max_new), "--cost-table", table, "--out", run_dir, *extra]
        print(f"[demo] batch {b}: ddtree-bench {' '.join(argv)}", flush=True)
        code = bench_cli.main(argv)
        with open(os.path.join(run_dir, "bench.json")) as f:
            report = json.load(f)
        tps = {("plain" if r["mode"] == "ar" else r["mode"] if r["budget"] is None else str(r["budget"])):
               r["tokens_per_second"] for r in report["results"]}
        others = {k: v for k, v in tps.items() if k != "auto"}
        best = max(others, key=others.get)
        summary[str(b)] = {"tokens_per_second": tps, "best_other": best, "auto_over_best": tps["auto"] / others[best],
                           "outputs_match_plain": all(r["outputs_match_ar"] is not False for r in report["results"]),
                           "auto": next(r["adaptive"] for r in report["results"] if r["budget"] == "auto"),
                           "exit_code": code}
        print(f"[demo] batch {b}: auto {tps['auto']:.0f} tok/s = {summary[str(b)]['auto_over_best']:.3f}x the best "
              f"other run ({best}: {others[best]:.0f})", flush=True)
    return summary


# ---- CLI ----------------------------------------------------------------------------------------
def read_prompts(path: str, limit: int | None) -> list[list[int]]:
    with open(path) as f:
        rows = [json.loads(line)["prompt_ids"] for line in f if line.strip()]
    return rows[:limit] if limit else rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="ddtree-bench on the demo pair per batch size: auto against every other run")
    d.add_argument("--batches", default="1,4,8,16")
    d.add_argument("--budgets", default="4,8,16,32,64", help="the fixed budgets run")
    d.add_argument("--auto-budgets", default="4,8,16,32", help="auto's set")
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--prompts", default=PROMPTS_16,
                   help="JSON lines with prompt_ids (default: the 16 held-out prompts)")
    d.add_argument("--decide-every", type=int, default=None,
                   help="auto's decide_every (default AutoBudget's; 0: one program choosing every step on device)")
    d.add_argument("--decide-on", choices=["device", "host", "generation"], default=None,
                   help="where auto chooses (default: the engine's, Engine.default_decide_on)")
    d.add_argument("--smoke", action="store_true",
                   help="tiny: batches 1,2, budgets 4,8, 2 prompts, 16 tokens (--decide-every / --decide-on apply)")
    d.add_argument("--out", required=True)
    t = sub.add_parser("trace", help="per-position E and acceptance of every choice (the demo pair by default)")
    t.add_argument("--target", default=None)
    t.add_argument("--drafter", default=None)
    t.add_argument("--prompts", default=DEFAULT_PROMPTS, help="JSONL with prompt_ids per line")
    t.add_argument("--limit", type=int, default=None)
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--auto-budgets", default="4,8,16,32,64", help="the budgets traced (a simulation takes any subset)")
    t.add_argument("--out", required=True)
    s = sub.add_parser("simulate", help="tokens/s of every policy on a trace with a step-time table")
    s.add_argument("--trace", required=True)
    s.add_argument("--cost-table", default=None, help="a table file from ddtree-bench --cost-table")
    s.add_argument("--e2e", nargs="*", default=[],
                   help="scripts.bench.e2e reports with step_ms_by_choice (one per context)")
    s.add_argument("--ratios-from", default=None,
                   help="with --e2e: the first calibration from this ddtree-bench table file (of the trace's pair)")
    s.add_argument("--batches", default="1,8")
    s.add_argument("--context", type=float, default=None,
                   help="committed length at the first position (default: each prompt's own length)")
    s.add_argument("--objective", choices=["tokens", "makespan"], default=AutoBudget.objective,
                   help="auto's objective (choice.AutoBudget.objective)")
    s.add_argument("--decide-every", type=int, default=0,
                   help="auto's decide_every (default 0: the per-step policy; N > 1: device chunks, a scored step "
                   "then the choice's fixed-budget steps)")
    s.add_argument("--decide-on", choices=["device", "generation"], default="device",
                   help="device (default): the loop's policy at every step or chunk; generation: one choice a "
                   "generation, by generation_choice.GenerationPolicy (--decide-every unused)")
    s.add_argument("--passes", type=int, default=1,
                   help="with --decide-on generation: the batches run this many times in a row, as the benchmark's "
                   "repeated passes (what the policy learned carries over); the mean pass is reported")
    s.add_argument("--decision-ms", type=float, default=0.0,
                   help="ms auto pays at each scored draft beyond the chosen step's time (default 0: left out; the "
                   "H200 demo pair's per-step program paid 0.26 ms a step over a fixed budget's, decision 0045)")
    s.add_argument("--max-new-tokens", type=int, default=None,
                   help="simulate generations of this many tokens: each row's first positions only (default: the "
                   "trace's own length; the demo command generates 128)")
    s.add_argument("--policy", action="append", default=[], metavar="FIELD=VALUE",
                   help="an AutoBudget setting for auto (e.g. chunk_weight=0.5, ar_margin=0.1); repeatable")
    s.add_argument("--out", required=True)
    c = sub.add_parser("ceiling", help="what any per-step choice could gain on a trace over the best fixed choice")
    c.add_argument("--trace", required=True)
    c.add_argument("--cost-table", default=None, help="a table file from ddtree-bench --cost-table")
    c.add_argument("--e2e", nargs="*", default=[], help="scripts.bench.e2e reports with step_ms_by_choice")
    c.add_argument("--batches", default="1,8")
    c.add_argument("--context", type=float, default=None,
                   help="committed length at the first position (default: each prompt's own length)")
    c.add_argument("--max-new-tokens", type=int, default=None, help="as simulate's")
    c.add_argument("--bins", type=int, default=12, help="quantile bins of E in the calibrated choice")
    c.add_argument("--knn", type=int, default=0,
                   help="also choose from the K nearest positions of other prompts: by every choice's E, and by "
                   "E with the target's confidence in the root where the trace has it (0: off)")
    c.add_argument("--out", required=True)
    la = sub.add_parser("latency", help="compile time of auto and the first token's latency")
    la.add_argument("--target", default=None)
    la.add_argument("--drafter", default=None)
    la.add_argument("--prompts", default=DEFAULT_PROMPTS)
    la.add_argument("--max-new-tokens", type=int, default=64)
    la.add_argument("--budget", type=int, default=16, help="the fixed budget to compare with")
    la.add_argument("--auto-budgets", default="4,8,16,32")
    la.add_argument("--out", required=True)
    sm = sub.add_parser("smoke", help="trace, simulate and latency at tiny sizes (CPU)")
    sm.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "adaptive_smoke"))
    args = ap.parse_args(argv)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python -m scripts.adaptive_bench"] + (argv if argv is not None else sys.argv[1:])),
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}

    if args.cmd == "simulate":
        with open(args.trace) as f:
            tr = json.load(f)
        if args.max_new_tokens is not None:
            tr = truncated(tr, args.max_new_tokens)
        tables = tables_from_files(args.cost_table, args.e2e, args.ratios_from)
        report |= {"trace": args.trace, "cost_table": args.cost_table, "e2e": args.e2e, "context": args.context,
                   "objective": args.objective, "decide_every": args.decide_every, "decision_ms": args.decision_ms,
                   "decide_on": args.decide_on, "passes": args.passes,
                   "simulation": run_simulation(tr, tables, [int(b) for b in args.batches.split(",")], args.context,
                                                args.objective, args.decide_every, args.decide_on, args.decision_ms,
                                                dict(_setting(x) for x in args.policy), args.passes)}
        atomic.write_json(args.out, report)
        return 0

    if args.cmd == "ceiling":
        with open(args.trace) as f:
            tr = json.load(f)
        if args.max_new_tokens is not None:
            tr = truncated(tr, args.max_new_tokens)
        tables = tables_from_files(args.cost_table, args.e2e)
        batches = [int(b) for b in args.batches.split(",")]
        missing = [b for b in batches if b not in tables]
        if missing:
            raise SystemExit(f"no step-time table for batch(es) {missing} (have {sorted(tables)})")
        if args.knn < 0:
            raise SystemExit(f"--knn must be >= 0, got {args.knn}")
        result = adaptive_ceiling.ceiling(tr, tables, batches, args.context, batches_of, args.bins, args.knn)
        if args.knn and not all("root_top1" in r for r in tr["rows"]):
            print("note: the trace has no target figures (root_top1 / root_entropy: adaptive_bench trace since "
                  "2026-12-04), so --knn runs the view by every choice's E only", file=sys.stderr)
        for b, r in result.items():
            print(f"batch {int(b):3d}: best fixed {r['best_fixed']}; per-step choice over it: "
                  + ", ".join(f"{k} {v:.3f}x" for k, v in r["over_best"].items()), flush=True)
            if "calibrated_outside" not in r["over_best"]:
                print(f"note: batch {int(b)} holds every prompt of the trace: no choice fitted outside it",
                      file=sys.stderr)
        report |= {"trace": args.trace, "cost_table": args.cost_table, "e2e": args.e2e, "context": args.context,
                   "bins": args.bins, "knn": args.knn, "ceiling": result}
        atomic.write_json(args.out, report)
        return 0

    if args.cmd == "demo":
        # where auto chooses, as given (the smoke run too: it checks the form a GPU run will use)
        extra = tuple(x for flag, v in (("--decide-every", args.decide_every), ("--decide-on", args.decide_on))
                      if v is not None for x in (flag, str(v)))
        if args.smoke:
            short = os.path.join(args.out, "prompts.jsonl")
            os.makedirs(args.out, exist_ok=True)
            with open(short, "w") as f:
                for p in read_prompts(DEFAULT_PROMPTS, 2):
                    f.write(json.dumps({"prompt_ids": p[:24]}) + "\n")
            report["demo"] = demo(args.out, [1, 2], "4,8", "4,8", 1, 16, short, ("--cost-repeats", "1", *extra))
        else:
            report["demo"] = demo(args.out, [int(b) for b in args.batches.split(",")], args.budgets,
                                  args.auto_budgets, args.repeats, args.max_new_tokens, args.prompts, extra)
        path = os.path.join(args.out, "summary.json")
        if os.path.isfile(path):  # batches run by earlier calls into the same --out stay
            with open(path) as f:
                report["demo"] = json.load(f).get("demo", {}) | report["demo"]
        atomic.write_json(path, report)
        return 0

    if args.cmd == "smoke":
        os.makedirs(args.out, exist_ok=True)
        engine = load_engine(None, None)
        auto = AutoBudget((4, 8), ar_burst=4)
        tr = trace(engine, read_prompts(DEFAULT_PROMPTS, 2), 24, auto)
        atomic.write_json(os.path.join(args.out, "trace.json"), tr)
        ms = {"ar": [1.0], "dflash": [1.6], "4": [1.7], "8": [2.0]}
        measured = {"ratios": {"dflash": 2.0}, "accepted": {n: 1.0 for n in ms if n != "ar"}}
        report["simulation"] = run_simulation(tr, {1: ([0.0], ms, {}), 2: ([0.0], ms, measured)}, [1, 2], None)
        report["latency"] = latency(engine, read_prompts(DEFAULT_PROMPTS, 1)[0][:16], 8, (4,), 4)
        atomic.write_json(os.path.join(args.out, "report.json"), report)
        return 0

    engine = load_engine(args.target, args.drafter)
    budgets = tuple(int(x) for x in args.auto_budgets.split(","))
    if args.cmd == "trace":
        report |= trace(engine, read_prompts(args.prompts, args.limit), args.max_new_tokens, AutoBudget(budgets))
    else:
        report["latency"] = latency(engine, read_prompts(args.prompts, 1)[0], args.max_new_tokens, budgets,
                                    args.budget)
    atomic.write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
