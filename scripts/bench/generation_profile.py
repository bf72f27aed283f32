"""Where a whole generation's time goes, per program, on the demo pair (issue #27, decision 0048).

For each program (plain, DFlash, fixed budgets, budget auto in its forms) the same prompts are
generated through `Engine.generate` (one advance call a generation, as ddtree-bench runs them),
programs interleaved, `--repeats` passes: the median seconds of a generation and its steps. Then
one jax.profiler trace of one generation of each program, summed per event kind (digits stripped:
`while.711` and `while.610` are both `while.`):
  - host: the executable's thunks (while loops, conditionals, command buffers: their executions,
    updates and graph launches, device-to-host copies of predicates), counts and ms;
  - GPU: kernel count, kernel ms, and the span from the first kernel's start to the last one's
    end, so (span - kernel ms) is the time the GPU sat idle inside the generation.
Auto's extra time over a fixed budget at the same acceptance is then split into GPU work, GPU idle
and what the host did before the first kernel and after the last.

    python -m scripts.bench.generation_profile --programs fixed16,auto --batch 1 --out $OUT/gen_profile.json
    python -m scripts.bench.generation_profile --smoke --out /tmp/gen_profile.json     # any device
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax

from ddtree_jax import atomic

PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                       "demo_heldout_prompts_16.jsonl")


def program_kwargs(name: str) -> dict:
    """Engine.generate's arguments of a program name: plain, dflash, fixedN, auto (the default form),
    auto_stepN (one choice per chunk of N steps on device; 0: every step), auto_hostN (on the host)."""
    if name == "plain":
        return {"mode": "ar"}
    if name == "dflash":
        return {"mode": "dflash"}
    if m := re.fullmatch(r"fixed(\d+)", name):
        return {"mode": "ddtree", "budget": int(m.group(1))}
    if name == "auto":
        return {"mode": "ddtree", "budget": "auto"}
    if m := re.fullmatch(r"auto_(step|host)(\d+)", name):
        return {"mode": "ddtree", "budget": "auto", "decide_every": int(m.group(2)),
                "decide_on": "device" if m.group(1) == "step" else "host"}
    raise ValueError(f"unknown program {name!r}: plain, dflash, fixedN, auto, auto_stepN or auto_hostN")


def _kind(name: str) -> str:
    """An event's kind: digits and anything after a space or parenthesis dropped."""
    return re.sub(r"\d+", "", re.split(r"[ (]", name, maxsplit=1)[0])


def trace_summary(trace_dir: str) -> dict:
    """Host thunk kinds (count, ms), GPU kernels (count, ms) and the GPU span of a trace."""
    host = collections.defaultdict(lambda: [0, 0.0])
    by_kernel = collections.defaultdict(lambda: [0, 0.0])
    kernels, kernel_ms, first, last = 0, 0.0, None, None
    gpu_events, host_events = [], []  # (start, end, name): the GPU's kernels; the host's events
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in jax.profiler.ProfileData.from_file(path).planes:
            gpu = plane.name.startswith("/device:GPU")
            for line in plane.lines:
                for ev in line.events:
                    if gpu:
                        if not line.name.startswith("Stream"):  # not the "XLA Ops" / "XLA Modules" lines
                            continue
                        kernels += 1
                        kernel_ms += ev.duration_ns / 1e6
                        k = by_kernel[ev.name[:80]]
                        k[0] += 1
                        k[1] += ev.duration_ns / 1e6
                        first = ev.start_ns if first is None else min(first, ev.start_ns)
                        last = ev.end_ns if last is None else max(last, ev.end_ns)
                        gpu_events.append((ev.start_ns, ev.end_ns, ev.name[:60]))
                    else:
                        k = host[_kind(ev.name)]
                        k[0] += 1
                        k[1] += ev.duration_ns / 1e6
                        host_events.append((ev.start_ns, ev.end_ns, _kind(ev.name)[:60]))
    span = (last - first) / 1e6 if first is not None else 0.0
    keep = ("while.", "cond.", "command_buffer", "cuGraph", "MemcpyDH", "Thunks::", "jit_", "PjitFunction",
            "CommonPjRtLoadedExecutable::Execute", "conditional", "switch")
    thunks = {k: {"count": c, "ms": ms} for k, (c, ms) in sorted(host.items(), key=lambda kv: -kv[1][1])
              if any(s in k for s in keep)}
    return {"gpu_kernels": kernels, "gpu_kernel_ms": kernel_ms, "gpu_span_ms": span,
            "gpu_idle_in_span_ms": max(span - kernel_ms, 0.0), "host": thunks,
            "kernels": {k: {"count": c, "ms": ms} for k, (c, ms) in by_kernel.items()},
            "gaps": gap_causes(gpu_events, host_events)}


def gap_causes(gpu_events: list, host_events: list, min_us: float = 5.0, top: int = 12) -> dict:
    """Where the GPU idles between kernels: every gap of at least `min_us` between one kernel's end
    and the next start, attributed to the innermost host event overlapping the gap's middle (the
    shortest one: e.g. a while loop's predicate read, a conditional's branch read, a graph launch)
    and to the kernel after it. Returns the gaps' count and total ms and the top causes by total ms."""
    gpu_events = sorted(gpu_events)
    host_events = sorted(host_events)
    starts = [h[0] for h in host_events]
    by_host = collections.defaultdict(lambda: [0, 0.0])
    by_next = collections.defaultdict(lambda: [0, 0.0])
    n, total, end = 0, 0.0, None
    for start, stop, name in gpu_events:
        if end is not None and start - end >= min_us * 1e3:
            gap_ms, mid = (start - end) / 1e6, (start + end) // 2
            inner = None
            k = bisect.bisect_right(starts, mid)
            for h in host_events[max(k - 2000, 0):k]:  # the host events started last before the gap's middle
                if h[0] <= mid <= h[1] and (inner is None or h[1] - h[0] < inner[1] - inner[0]):
                    inner = h
            for table, key in ((by_host, inner[2] if inner else "(no host event)"), (by_next, name)):
                table[key][0] += 1
                table[key][1] += gap_ms
            n, total = n + 1, total + gap_ms
        end = stop if end is None else max(end, stop)

    def rank(table):
        rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
        return [{"name": k, "count": c, "ms": ms} for k, (c, ms) in rows]

    return {"min_us": min_us, "count": n, "ms": total, "by_host_event": rank(by_host), "by_next_kernel": rank(by_next)}


def kernel_difference(a: dict, b: dict, top: int = 40) -> list[dict]:
    """Kernels by name whose total time differs most between two profiles' `kernels` (b - a)."""
    names = set(a) | set(b)
    rows = [{"kernel": n, "count": b.get(n, {}).get("count", 0) - a.get(n, {}).get("count", 0),
             "ms": b.get(n, {}).get("ms", 0.0) - a.get(n, {}).get("ms", 0.0)} for n in names]
    return sorted(rows, key=lambda r: -abs(r["ms"]))[:top]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON report")
    p.add_argument("--programs", default="fixed16,auto", help="comma-separated: plain, dflash, fixedN, auto, "
                   "auto_stepN (device chunks of N; 0: every step), auto_hostN")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompts", default=PROMPTS, help="JSON lines with prompt_ids (default: the 16 held-out prompts)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="interleaved passes over the prompts (default 3)")
    p.add_argument("--no-profile", action="store_true", help="timings only")
    p.add_argument("--smoke", action="store_true", help="2 prompts, 16 tokens, 1 pass")
    args = p.parse_args(argv)
    names = [n for n in args.programs.split(",") if n]
    try:
        kwargs = {n: program_kwargs(n) for n in names}
    except ValueError as e:
        p.error(str(e))
    with open(args.prompts) as f:
        prompts = [json.loads(line)["prompt_ids"] for line in f if line.strip()]
    max_new, repeats = args.max_new_tokens, args.repeats
    if args.smoke:
        prompts, max_new, repeats = prompts[:2], 16, 1
    batches = [prompts[i: i + args.batch] for i in range(0, len(prompts), args.batch)]
    from ddtree_jax.cli.common import load_engine

    engine = load_engine(None, None)  # the demo pair
    for n in names:  # compile, warm up and (auto) measure the start-up table of every batch shape
        for chunk in batches:
            engine.generate(chunk, max_new_tokens=max_new, **kwargs[n])
    runs = {n: collections.defaultdict(list) for n in names}
    for _ in range(repeats):
        for n in names:  # interleaved: drifts of the machine hit every program alike
            for chunk in batches:
                res = engine.generate(chunk, max_new_tokens=max_new, **kwargs[n])
                runs[n]["seconds"].append(res[0].stats.seconds)
                runs[n]["tokens"].append(sum(len(c.token_ids) for c in res))
                runs[n]["steps"].append(res[0].stats.steps)
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "args": vars(args),
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "programs": {}}
    for n in names:
        r = runs[n]
        tps = [sum(r["tokens"][k: k + len(batches)]) / sum(r["seconds"][k: k + len(batches)])
               for k in range(0, len(r["seconds"]), len(batches))]
        report["programs"][n] = {
            "tokens_per_second": statistics.median(tps), "generation_ms": 1000 * statistics.median(r["seconds"]),
            "steps_per_generation": statistics.mean(r["steps"]),
            "ms_per_step": 1000 * sum(r["seconds"]) / max(sum(r["steps"]), 1)}
        print(f"[gen] {n:12s} {report['programs'][n]['tokens_per_second']:8.0f} tok/s, generation "
              f"{report['programs'][n]['generation_ms']:.2f} ms, {report['programs'][n]['steps_per_generation']:.1f} "
              f"steps, {report['programs'][n]['ms_per_step']:.3f} ms a step", file=sys.stderr, flush=True)
    if not args.no_profile:
        chunk = batches[0]
        for n in names:
            trace_dir = tempfile.mkdtemp(prefix="gen_profile_")
            with jax.profiler.trace(trace_dir):
                t0 = time.perf_counter()
                res = engine.generate(chunk, max_new_tokens=max_new, **kwargs[n])
                wall = 1000 * (time.perf_counter() - t0)
            s = trace_summary(trace_dir)
            if not s["gpu_kernels"]:
                print(f"[profile] {n}: the trace has no GPU kernels (a {jax.default_backend()} run): its GPU figures "
                      "are 0, only the host's events count", file=sys.stderr, flush=True)
            s.update(wall_ms=wall, generation_ms=1000 * res[0].stats.seconds, steps=res[0].stats.steps,
                     choices=(res[0].stats.adaptive or {}).get("choices"))
            report["programs"][n]["profile_first_batch"] = s
            print(f"[profile] {n:12s} generation {s['generation_ms']:.2f} ms ({s['steps']} steps): GPU kernels "
                  f"{s['gpu_kernel_ms']:.2f} ms in {s['gpu_kernels']}, span {s['gpu_span_ms']:.2f} ms, idle "
                  f"{s['gpu_idle_in_span_ms']:.2f} ms; choices {s['choices']}; host: " + ", ".join(
                      f"{k} {v['count']}x {v['ms']:.2f}" for k, v in list(s["host"].items())[:10]),
                  file=sys.stderr, flush=True)
            g = s["gaps"]
            print(f"[gaps] {n:12s} {g['count']} gaps >= {g['min_us']:.0f} us, {g['ms']:.2f} ms; during: " + ", ".join(
                f"{r['name']} {r['count']}x {r['ms']:.2f}" for r in g["by_host_event"][:6]) + "; before: " + ", ".join(
                f"{r['name'][:30]} {r['count']}x {r['ms']:.2f}" for r in g["by_next_kernel"][:6]),
                file=sys.stderr, flush=True)
        if len(names) > 1:  # per kernel, each program against the first (its profiled generation)
            base = report["programs"][names[0]]["profile_first_batch"]
            for n in names[1:]:
                prof = report["programs"][n]["profile_first_batch"]
                diff = kernel_difference(base["kernels"], prof["kernels"])
                prof[f"kernels_minus_{names[0]}"] = diff
                print(f"[kernels] {n} - {names[0]}: " + ", ".join(
                    f"{r['kernel'][:40]} {r['count']:+d}x {r['ms']:+.3f}" for r in diff[:14]),
                    file=sys.stderr, flush=True)
            for n in names:
                prof = report["programs"][n]["profile_first_batch"]
                prof["kernels"] = dict(sorted(prof["kernels"].items(), key=lambda kv: -kv[1]["ms"])[:80])
    atomic.write_json(args.out, report)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
