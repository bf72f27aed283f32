"""What an advance call costs beyond its steps, per program, on the demo pair (decisions 0045, 0046).

For each program (fixed budget 16, plain decoding, budget auto's own programs for 16 and for plain
steps, auto's one program choosing every step with 16 forced, auto's device chunks of 32 with 16
forced) from the same prefilled state: calls of 1 and `--long` steps, each followed by a read of
`done` (as the engine's chunk loop does), `--calls` calls a sample, the median of `--repeats`
interleaved samples; and `--calls` one-step calls queued before one read.
step = (T(long) - T(1)) / (long - 1); call = T(1) - step.

`--profile` adds one jax.profiler trace of six one-step calls of the fixed program, summed by
event name per host / GPU plane (where the call's host time goes), and the dispatch time alone
(until the call returns) of a 0-step call and of a jitted no-op taking the same arguments.

    python -m scripts.bench.call_overhead --out $OUT/call_overhead.json            # on the H200
    python -m scripts.bench.call_overhead --profile --out $OUT/call_overhead.json
    python -m scripts.bench.call_overhead --smoke --out /tmp/call_overhead.json    # any device
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import atomic
from ddtree_jax.engine import bucket
from ddtree_jax.speculative import cost_table as costs
from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.choice import AR, FIRST_TREE
from ddtree_jax.speculative.sampling import Sampling


def programs(engine, prompt_bucket: int, max_new: int, names: list[str]) -> dict:
    """name -> (GenSpec the state is started with, GenSpec the calls run, forced choice or -1)."""
    kw = dict(candidates=None, max_new_tokens=max_new, sampling=Sampling(), prompt_bucket=prompt_bucket)
    auto = engine.spec("ddtree", budget="auto", auto_budgets=(4, 8, 16, 32), decide_every=16, decide_on="host", **kw)
    own = gen.choice_programs(auto)
    per_step = dataclasses.replace(auto, budget=dataclasses.replace(auto.budget, decide_every=0))
    fixed = engine.spec("ddtree", budget=16, **kw)
    plain = engine.spec("ar", budget=1, **kw)
    chunks = dataclasses.replace(auto, budget=dataclasses.replace(auto.budget, decide_every=32, decide_on="device"))
    sixteen = FIRST_TREE + auto.budget.budgets.index(16)
    table = {"fixed16": (fixed, fixed, -1), "plain": (plain, plain, -1), "auto_own_16": (auto, own[sixteen], -1),
             "auto_own_plain": (auto, own[AR], -1), "auto_per_step_forced_16": (per_step, per_step, sixteen),
             "auto_device_chunks_forced_16": (chunks, chunks, sixteen)}
    return {n: table[n] for n in names}


def measure(engine, cases: dict, prompt_len: int, calls: int, repeats: int, long: tuple[int, ...]) -> dict:
    start, advance = gen.bind(engine.graphdef)
    params, dparams = engine.params, engine.drafter_params
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, engine.cfg.vocab_size, (1, prompt_len)), jnp.int32)
    lens = jnp.asarray([prompt_len], jnp.int32)
    never = jnp.asarray([-1], jnp.int32)  # no EOS: rows run for every step asked
    starts = {}
    for name, (first, run, force) in cases.items():
        rows = gen.uniform_rows(Sampling(), 1, first.max_new_tokens, jax.random.PRNGKey(0))
        extra = {} if first.adaptive is None else {"costs": costs.placeholder(first.adaptive)}
        s0 = start(params, dparams, prompt, lens, never, None, spec=first, rows=rows, **extra)
        if force >= 0:
            s0 = s0._replace(adapt=s0.adapt._replace(force=jnp.int32(force)))
        for n in (1, *long):  # compile and first runs
            jax.block_until_ready(advance(params, dparams, jax.tree.map(jnp.copy, s0), never, jnp.int32(n), spec=run))
        starts[name] = (s0, run)
    samples = {name: collections.defaultdict(list) for name in cases}
    for _ in range(repeats):
        for name, (s0, run) in starts.items():  # interleaved: drifts of the machine hit every program alike
            for n in (1, *long):
                st = jax.tree.map(jnp.copy, s0)
                jax.block_until_ready(st)
                t0 = time.perf_counter()
                for _ in range(calls):
                    st = advance(params, dparams, st, never, jnp.int32(n), spec=run)
                    jax.device_get(st.done)
                samples[name][f"seq_{n}"].append(1000 * (time.perf_counter() - t0) / calls)
                if int(st.i) - int(s0.i) < calls * n:  # the rows ran out of tokens: the sample is void
                    raise SystemExit(f"{name}: {calls} calls of {n} steps ran only {int(st.i) - int(s0.i)} steps (rows "
                                     f"stop at {run.max_new_tokens} tokens): use fewer --calls or a shorter --long")
            st = jax.tree.map(jnp.copy, s0)
            jax.block_until_ready(st)
            t0 = time.perf_counter()
            for _ in range(calls):
                st = advance(params, dparams, st, never, jnp.int32(1), spec=run)
            jax.device_get(st.done)
            samples[name]["queued_1"].append(1000 * (time.perf_counter() - t0) / calls)
    out = {}
    for name, r in samples.items():
        m = {k: statistics.median(v) for k, v in r.items()}
        for n in long:
            m[f"step_ms_{n}"] = (m[f"seq_{n}"] - m["seq_1"]) / (n - 1)
        m["step_ms"] = m[f"step_ms_{long[0]}"]
        m["call_ms"] = m["seq_1"] - m["step_ms"]
        out[name] = m
        print(f"[calls] {name:26s} step {m['step_ms']:.3f} ms, call {m['call_ms']:.3f} ms, "
              f"queued one-step call {m['queued_1']:.3f} ms", file=sys.stderr, flush=True)
    return {"results": out, "starts": starts, "never": never}


def profile(engine, start_state, run, never, calls: int) -> dict:
    """Dispatch times and a host / GPU event summary of one-step calls of `run`."""
    _, advance = gen.bind(engine.graphdef)
    params, dparams = engine.params, engine.drafter_params
    noop = jax.jit(lambda p, d, s: s._replace(i=s.i + 1), donate_argnums=(2,))
    fns = {"advance_0_steps": lambda st: advance(params, dparams, st, never, jnp.int32(0), spec=run),
           "noop_same_arguments": lambda st: noop(params, dparams, st)}
    dispatch = {}
    for name, f in fns.items():
        st = jax.tree.map(jnp.copy, start_state)
        st = f(st)
        jax.block_until_ready(st)
        d, total = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            st = f(st)
            t1 = time.perf_counter()
            jax.device_get(st.done)
            d.append(1000 * (t1 - t0))
            total.append(1000 * (time.perf_counter() - t0))
        dispatch[name] = {"dispatch_ms": statistics.median(d), "total_ms": statistics.median(total)}
    trace_dir = tempfile.mkdtemp(prefix="call_overhead_")
    st = jax.tree.map(jnp.copy, start_state)
    jax.block_until_ready(st)
    n = 6
    with jax.profiler.trace(trace_dir):
        for _ in range(n):
            st = advance(params, dparams, st, never, jnp.int32(1), spec=run)
            jax.device_get(st.done)
    events = {"host": collections.defaultdict(lambda: [0, 0.0]), "gpu": collections.defaultdict(lambda: [0, 0.0])}
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in jax.profiler.ProfileData.from_file(path).planes:
            side = "gpu" if plane.name.startswith("/device:GPU") else "host"
            for line in plane.lines:
                for ev in line.events:
                    e = events[side][f"{line.name[:40]} | {ev.name[:100]}"]
                    e[0] += 1
                    e[1] += ev.duration_ns / 1e6 / n
    top = {side: [{"event": k, "count": c, "ms_per_call": ms} for k, (c, ms) in
                  sorted(d.items(), key=lambda kv: -kv[1][1])[:60]] for side, d in events.items()}
    return {"dispatch": dispatch, "calls_traced": n, "events_per_call": top}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON report")
    p.add_argument("--calls", type=int, default=8, help="calls a sample (default 8)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved samples (default 5)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="also trace one-step calls of --profile-program")
    p.add_argument("--profile-program", default="fixed16", help="the program --profile traces (default fixed16)")
    p.add_argument("--programs", default="fixed16,plain,auto_own_16,auto_own_plain,auto_per_step_forced_16,"
                   "auto_device_chunks_forced_16", help="the programs measured, by name")
    p.add_argument("--long", default="16", help="steps of the long calls, comma-separated (default 16; step_ms "
                   "from the first, step_ms_N for each: a chunked program's chunk starts show between them)")
    p.add_argument("--smoke", action="store_true", help="two programs, 2 calls, 1 repeat, 4-step calls")
    args = p.parse_args(argv)
    from ddtree_jax.cli.common import load_engine

    engine = load_engine(None, None)  # the demo pair
    names = ["fixed16", "auto_own_16", "auto_device_chunks_forced_16"] if args.smoke else args.programs.split(",")
    known = ("fixed16", "plain", "auto_own_16", "auto_own_plain", "auto_per_step_forced_16",
             "auto_device_chunks_forced_16")
    if [n for n in names if n not in known] or ((args.profile or args.smoke) and args.profile_program not in names):
        p.error(f"--programs and --profile-program take names among {known} (the profiled one among --programs)")
    if any(int(x) < 2 for x in args.long.split(",")):
        p.error("--long: step counts of at least 2")
    calls, repeats, long = (2, 1, (4,)) if args.smoke else (args.calls, args.repeats,
                                                            tuple(int(x) for x in args.long.split(",")))
    cases = programs(engine, bucket(args.prompt_len), 512, names)
    m = measure(engine, cases, args.prompt_len, calls, repeats, long)
    report = {"device": str(jax.devices()[0].device_kind), "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "args": vars(args), "results": m["results"]}
    if args.profile or args.smoke:
        s0, run = m["starts"][args.profile_program]
        report["profile"] = profile(engine, s0, run, m["never"], calls)
    atomic.write_json(args.out, report)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
