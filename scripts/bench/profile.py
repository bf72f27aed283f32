"""Where the time of one decode / DDTree step goes, kernel by kernel (run on the H200).

Same target, drafter and filled caches as scripts.bench.e2e (default: the 27B shape at a 4k
context; `--shape demo` the demo pair's shape, whose step is bound by its kernel count). Each phase
("step", plain decoding, and "loop", the whole DDTree step, both as the generation loop runs them,
in its chunks of steps; DDTree draft, tree build, verify, commit) runs `--inner` times inside one
on-device loop under `jax.profiler.trace`;
the trace's GPU plane is read back with `jax.profiler.ProfileData` and every kernel's time is
summed by name and by kind (GEMM, Pallas/Triton, fusion, copy, ...); `--sources` also names what
each kernel computes (shape, op, source lines in our code: read from the phase's optimized HLO,
scripts/bench/hlo_index.py) and sums the time by source line.
A GEMM sweep over the row count M (1 ... 128) at the model's projection shapes shows what a
verify pass of M tree nodes costs per weight byte.

    python -m scripts.bench.profile --out $OUT/profile.json             # on the H200
    python -m scripts.bench.profile --shape demo --budget 16 --gemm-m "" --out $OUT/profile_demo.json
    python -m scripts.bench.profile --smoke                             # any device
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from ddtree_jax import atomic
from ddtree_jax import bench as B
from ddtree_jax.config import TargetConfig
from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.sampling import Sampling
from scripts.bench import hlo_index
from scripts.bench.common import (add_model_options, add_route_options, apply_route_options, model_configs,
                                  model_setup,
                                  start_report, trace_kernels, write_report)
from scripts.bench.e2e import loop_state
from scripts.bench.shapes import filled_caches, normal

KINDS = (  # first match wins; matched against the lower-cased kernel name
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "gemv", "dot")),
    ("pallas/triton", ("pallas", "triton", "tree_attention", "gdn_", "ssd_", "moe_")),
    ("reduce", ("reduce", "argmax", "topk", "top_k", "sort")),
    ("copy/transpose", ("copy", "transpose", "memcpy", "memset", "dynamic_update", "concatenate")),
    ("gather/scatter", ("gather", "scatter", "dynamic_slice")),
    ("fusion", ("fusion", "loop_", "input_")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile(fn, iters: int, label: str, top: int, index=None) -> dict:
    """Wall time per call (median of 5) and the kernel breakdown of `iters` traced calls; with
    `index` (hlo_index, from the same executable's HLO) also where in our code each
    kernel comes from, and the kernel time grouped by that place (`by_source`)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(1e3 * (time.perf_counter() - t0))
    d = tempfile.mkdtemp(prefix=f"trace_{label}_")
    with jax.profiler.trace(d):
        for _ in range(iters):
            jax.block_until_ready(fn())
    events = trace_kernels(d)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    by_kind = collections.defaultdict(float)
    by_source = collections.defaultdict(lambda: [0, 0.0])
    op_time = collections.defaultdict(lambda: collections.defaultdict(float))  # kernel -> hlo_op -> us
    unmatched = []  # (kernel, hlo_op) pairs the index did not name: kept in the report to debug the mapping

    def find(op, name):  # the trace's hlo_op stat first, then the kernel's own name (XLA fusions)
        return (hlo_index.lookup(index, op) if op else None) or hlo_index.lookup(index, name)
    for name, op, us in events:
        key = name[:90]
        by_name[key][0] += 1
        by_name[key][1] += us
        by_kind[kind_of(name)] += us
        if index is not None:
            inst = find(op, name)
            if inst is None and len(unmatched) < 20 and (name, op) not in unmatched:
                unmatched.append((name, op))
            where = hlo_index.describe(inst)
            by_source[where][0] += 1
            by_source[where][1] += us
            op_time[key][op or name] += us
    total = sum(us for _, _, us in events)
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    top_rows = []
    for k, (c, us) in rows:
        row = {"kernel": k, "calls": c / iters, "ms": us / 1e3 / iters}
        if index is not None:  # the instruction that spent most of this kernel name's time
            op = max(op_time[k].items(), key=lambda kv: kv[1])[0]
            row["source"] = hlo_index.describe(find(op, k))
        top_rows.append(row)
    out = {
        "wall_ms": statistics.median(times),
        "gpu_busy_ms": total / 1e3 / iters,
        "kernels_per_call": len(events) / iters,
        "by_kind_ms": {k: v / 1e3 / iters for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": top_rows,
    }
    if index is not None:
        src_rows = sorted(by_source.items(), key=lambda kv: -kv[1][1])[:top]
        out["by_source"] = [{"source": k, "calls": c / iters, "ms": us / 1e3 / iters} for k, (c, us) in src_rows]
        out["unmatched"] = [{"kernel": k, "hlo_op": o} for k, o in unmatched]
    return out


def gemm_sweep(cfg: TargetConfig, ms_list, repeats: int = 20) -> list[dict]:
    """Time x[M, K] @ W[K, N] (bf16) over distinct weights (bigger than L2 in all) for each M."""
    shapes = {
        "mlp_up": (cfg.hidden_size, cfg.intermediate_size),
        "mlp_down": (cfg.intermediate_size, cfg.hidden_size),
        "gdn_qkv": (cfg.hidden_size, cfg.gdn_conv_dim),
        "lm_head": (cfg.hidden_size, cfg.vocab_size),
    }
    out = []
    for name, (k, n) in shapes.items():
        if not k * n:  # an MoE target has no dense MLP (intermediate_size 0)
            continue
        label = f"{name} ({k}x{n})"
        copies = max(1, min(16, int(2e9 // (k * n * 2))))  # up to ~2 GB of weights per call
        ws = [normal(jax.random.PRNGKey(10 + i), (k, n), jnp.bfloat16, k**-0.5) for i in range(copies)]
        f = jax.jit(lambda x, ws: [x @ w for w in ws])
        for m in ms_list:
            x = normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16, 1.0)
            jax.block_until_ready(f(x, ws))
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(f(x, ws))
                ts.append(time.perf_counter() - t0)
            sec = statistics.median(ts) / copies
            out.append({"gemm": label, "M": m, "us": sec * 1e6, "GBps": k * n * 2 / sec / 1e9,
                        "TFLOPs": 2 * m * k * n / sec / 1e12})
            print(f"[gemm] {label:24s} M={m:4d} {sec * 1e6:8.1f} us {k * n * 2 / sec / 1e9:7.0f} GB/s", flush=True)
        del ws
    return out


def write_hlo(path: str, text: str) -> None:
    """Gzipped HLO text, written atomically."""
    atomic.write_bytes(path, gzip.compress(text.encode()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(ap)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--inner", type=int, default=4, help="phase runs per traced call")
    ap.add_argument("--iters", type=int, default=3, help="traced calls per phase")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--gemm-m", default="1,8,16,32,48,64,65,72,80,96,128", help="'' skips the GEMM sweep")
    ap.add_argument("--phases", default="step,draft,build,verify,commit",
                    help="comma list of step (plain decoding), draft, build, verify, commit, and loop: the "
                         "whole DDTree step inside gen._advance with its state carried, as generation runs it "
                         "(it shows the loop's own copies; its per-step figures include 1 / inner of the call's "
                         "entry copies of the caches, which scripts.bench.e2e's marginal step cancels)")
    ap.add_argument("--verify-budgets", default="63,79,127",
                    help="extra budgets whose verify phase is timed (no trace): node count = budget + 1")
    ap.add_argument("--tree-shape", choices=("built", "deep"), default="built",
                    help="tree of the verify / commit phases: the one the build makes from the random "
                         "drafter (random weights: nearly flat draft distributions, so every node sits at "
                         "depth 1), or 'deep': the built tokens on a DDTree-like random tree of depth <= 15 "
                         "(what a trained drafter's confident blocks give; the GDN solve runs one step per "
                         "depth level)")
    ap.add_argument("--sources", action="store_true",
                    help="name each kernel's shape, op and source lines in our code (from the phase's optimized "
                         "HLO: one more compile per phase) and add a table of kernel time by source line")
    ap.add_argument("--hlo-dir", default=None,
                    help="also write each phase's optimized HLO (gzipped text) here: the fusion names in the "
                         "kernel table are instruction names in it, so what each kernel computes can be read "
                         "off the device")
    add_route_options(ap)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile.json"))
    args = ap.parse_args(argv)
    route_fields = apply_route_options(ap, args)  # the autotune cache before the backend starts
    shape, cfg, dcfg, context = model_configs(args)
    report = start_report("scripts.bench.profile", argv, **route_fields, shape=shape, context=context,
                          budget=args.budget, batch=args.batch, phases={})

    def save():
        write_report(args.out, report)

    if args.gemm_m:
        report["gemm_sweep"] = gemm_sweep(cfg, [int(m) for m in args.gemm_m.split(",")], 3 if args.smoke else 20)
        save()

    graphdef, params, proposer, dparams, fields = model_setup(args, cfg, dcfg)
    report.update(fields)
    routes = args.routes
    capacity = context + 64
    cache, dcache = filled_caches(cfg, dcfg, args.batch, context, capacity, seed=args.batch)
    b = args.batch
    key = jax.random.PRNGKey(0)
    s = loop_state(cache, dcache, b, key)
    eos = jnp.zeros((0,), jnp.int32)
    tree_spec = gen.GenSpec("ddtree", args.budget, None, 10**6, Sampling(), capacity, proposer, routes)
    ar_spec = gen.GenSpec("ar", args.budget, None, 10**6, Sampling(), capacity, None, routes)
    logq = B._propose(graphdef, params, dparams, s, tree_spec)
    tree = B._build(logq, s, tree_spec, gen.vocab_ids(tree_spec, dparams))
    if args.tree_shape == "deep":
        tree = B.deep_tree(tree, s.cache.lengths, seed=0)
    report["tree_shape"] = args.tree_shape
    report["tree_max_depth"] = int(jnp.max(tree.depths))
    res = B._verify(graphdef, params, s, tree, tree_spec)
    for phase in args.phases.split(","):
        spec = ar_spec if phase == "step" else tree_spec
        st = s._replace(dstate=None, hist=jnp.zeros((2,), jnp.int32)) if phase == "step" else s
        run = lambda n: (lambda: B._phase_loop(graphdef, params, dparams, st, logq, tree, res, eos, key, spec, phase,
                                               jnp.int32(n)))
        fn = run(args.inner)
        index = None
        if args.hlo_dir or args.sources:  # the executable `fn` runs (same arguments, same compile)
            text = B._phase_loop.lower(graphdef, params, dparams, st, logq, tree, res, eos, key, spec, phase,
                                       jnp.int32(args.inner)).compile().as_text()
            if args.hlo_dir:
                write_hlo(os.path.join(args.hlo_dir, f"{phase}.hlo.txt.gz"), text)
            if args.sources:
                index = hlo_index.index_hlo(text)
        t0 = time.time()
        p = profile(fn, args.iters, phase, args.top, index)
        per_run = lambda rows: [{**r, "calls": r["calls"] / args.inner, "ms": r["ms"] / args.inner} for r in rows]
        p = {**p, "wall_ms": p["wall_ms"] / args.inner, "gpu_busy_ms": p["gpu_busy_ms"] / args.inner,
             "kernels_per_call": p["kernels_per_call"] / args.inner,
             "by_kind_ms": {k: v / args.inner for k, v in p["by_kind_ms"].items()},
             "top": per_run(p["top"]), "seconds": time.time() - t0}
        if "by_source" in p:
            p["by_source"] = per_run(p["by_source"])
        # wall time of one more phase run (n and 2n runs in back-to-back pairs, as scripts.bench.e2e
        # times the loop: the call's dispatch cancels), beside the kernel sum: the gap is time
        # between kernels, or the profiler's own cost if negative
        p["marginal_wall_ms"] = B.paired_marginal_ms(run, args.inner, 7)[0]
        report["phases"][phase] = p
        save()
        print(f"\n== {phase}: {p['wall_ms']:.2f} ms wall per run with the call's dispatch, "
              f"{p['marginal_wall_ms']:.2f} ms per additional run, {p['gpu_busy_ms']:.2f} ms of kernels, "
              f"{p['kernels_per_call']:.0f} kernels ({p['seconds']:.0f} s)", flush=True)
        print("   by kind: " + ", ".join(f"{k} {v:.2f}" for k, v in p["by_kind_ms"].items()))
        for r in p["top"]:
            print(f"   {r['ms']:8.3f} ms {r['calls']:6.1f}x  {r['kernel']}"
                  + (f"  [{r['source']}]" if "source" in r else ""))
        if "by_source" in p:
            print("   by source line:")
            for r in p["by_source"]:
                print(f"   {r['ms']:8.3f} ms {r['calls']:6.1f}x  {r['source']}")
    report["verify_by_budget"] = {}
    for budget in [int(x) for x in args.verify_budgets.split(",") if x]:
        spec = dataclasses.replace(tree_spec, budget=budget)
        lq = B._propose(graphdef, params, dparams, s, spec)
        tr = B._build(lq, s, spec, gen.vocab_ids(spec, dparams))
        rs = B._verify(graphdef, params, s, tr, spec)
        fn = lambda n: (lambda: B._phase_loop(graphdef, params, dparams, s, lq, tr, rs, eos, key, spec, "verify", n))
        jax.block_until_ready(fn(args.inner)())
        # n and 2n iterations in back-to-back pairs: the difference cancels the call's host dispatch
        ms = max(B.paired_marginal_ms(fn, args.inner, 7)[0], 0.0)
        report["verify_by_budget"][budget] = ms
        save()
        print(f"[verify] budget {budget} ({budget + 1} nodes): {ms:.2f} ms", flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
