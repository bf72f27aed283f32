"""End-to-end step benchmark at real model size (random weights, on device; scripts/bench/shapes.py).

Default shape: the Qwen3.6-27B-shaped hybrid target and its 5-layer DFlash drafter, caches filled
with random K / V and recurrent state at a 4k context. Times, by the median of repeats:
  - the plain decode step (one token per sequence), against the HBM roofline: bytes a step must
    read (weights, KV, recurrent + conv state) / the best read rate measured in the same run (a
    large bf16 reduction and a large bf16 GEMV);
  - one DDTree step (draft + tree build + verify + commit) at budget 64, whole and by phase;
  - N and 2N steps inside one on-device while_loop (no host sync per step): the step is the
    marginal cost (T(2N) - T(N)) / N, the median over back-to-back (N, 2N) pairs, net of the
    per-call host dispatch (a ~1000-leaf params pytree: several ms a call on the H200, paid once
    per generation chunk, not per step), which is reported beside it, as is T(N) / N (the step
    with 1/N of the dispatch);
  - batch 1 and 8; peak device memory;
  - with --budgets B1,B2,... (and dflash in --modes) the loop step of every budget (and of DFlash)
    too: each run's `step_ms_by_choice` ({"ar", "dflash", "B"...: ms}) is the step-time table that
    --acceptance (scripts/bench/budget_table.py) turns into tokens per second per choice and the
    adaptive budget's simulation reads (python -m scripts.adaptive_bench simulate);
  - on an MoE target (--shape 35b-a3b) the MoE figures of scripts/bench/moe_step.py: distinct
    experts a layer reads in the decode step and at every budget (from a routing probe), the
    decode roofline over the bytes it must read (dense weights + the chosen experts + K / V +
    state), the expert products' time against their bytes, and the correlated-routing bracket.
Writes JSON (--out) and prints a table last.

    python -m scripts.bench.e2e --out $OUT/e2e.json                 # on the H200 (27B shape)
    python -m scripts.bench.e2e --shape demo --out $OUT/e2e_demo.json
    python -m scripts.bench.e2e --shape 35b-a3b --batches 1,8 --budgets 8,16,32,64 --no-phases \
        --acceptance demo --out $OUT/e2e_35b.json                  # the MoE shape (~70 GB of weights)
    python -m scripts.bench.e2e --smoke                             # tiny shapes, any device
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax import bench as B
from ddtree_jax import budget_table
from ddtree_jax.cache import KVCache, RecurrentCache, TargetCache
from ddtree_jax.compiled import routed_jit
from ddtree_jax.config import TargetConfig
from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.sampling import Sampling
from scripts.bench import moe_step
from scripts.bench.compile_pool import CompilePool
from scripts.bench.common import (add_model_options, add_route_options, apply_route_options, jax_rates, model_configs,
                                  model_setup,
                                  start_report, write_report)
from scripts.bench.shapes import filled_caches, nbytes


def measure_bandwidth(smoke: bool) -> dict:
    """The device's best read rate (common.jax_rates: a bf16 reduction and a bf16 GEMV over 2 GiB,
    tiny with --smoke), under this report's keys."""
    rates = jax_rates(not smoke, False, matmul=False)
    return {"reduce_GBps": rates["reduction_GBps"], "gemv_GBps": rates["gemv_GBps"], "best_GBps": rates["hbm_GBps"]}


def decode_bytes(cfg: TargetConfig, params, cache: TargetCache) -> int:
    """Bytes a decode step must read: every weight but the embedding table (one row), the K/V up to
    each row's length, and the recurrent + conv state (read and written)."""
    weights = nbytes(params) - cfg.vocab_size * cfg.hidden_size * 2 * (0 if cfg.tie_word_embeddings else 1)
    lengths = np.asarray(cache.lengths)
    kv = sum(2 * int(lengths.sum()) * layer.k.shape[1] * layer.k.shape[3] * layer.k.dtype.itemsize
             for layer in cache.layers if isinstance(layer, KVCache))
    rec = sum(2 * (nbytes(layer.state) + nbytes(layer.conv))
              for layer in cache.layers if isinstance(layer, RecurrentCache))
    return int(weights + kv + rec)


def loop_state(cache, dcache, batch: int, key) -> gen.LoopState:
    """Generation loop state over filled caches (bonus token 7, nothing emitted yet)."""
    return gen.LoopState(cache, dcache, jnp.zeros((batch,), jnp.int32) + 7, jnp.zeros((batch, 8), jnp.int32),
                         jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool), jnp.zeros((batch,), jnp.int32),
                         jnp.zeros((17,), jnp.int32), jnp.int32(0), gen.uniform_rows(Sampling(), batch, 10**6, key))


def add_moe_options(ap) -> None:
    """The MoE figures' options (scripts/bench/moe_step.py) and the budget table's."""
    ap.add_argument("--moe-expert-times", action=argparse.BooleanOptionalAction, default=True,
                    help="MoE targets: time every layer's expert products alone at each step's routing (one "
                         "compilation per token count)")
    ap.add_argument("--moe-correlated-steps", action="store_true",
                    help="MoE targets: also time each DDTree budget's whole step with the correlated stand-in "
                         "router (one more compilation a budget; without it the bracket is an estimate)")
    ap.add_argument("--compile-workers", type=int, default=1,
                    help="compile a batch's programs this many at once, all finished before the first is timed "
                         "(scripts/bench/compile_pool.py: the GPU call's time is mostly compilation; XLA's "
                         "autotuning then measures side by side); 1: each compiled when first run")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no batch, timing or MoE figure after this many seconds (what finished is in the "
                         "JSON; compiles already running finish before the process ends)")
    ap.add_argument("--acceptance", default=None,
                    help="print tokens/s per choice from the step times: 'demo' (the demo pair's measured "
                         "acceptance) or a JSON file {choice: tokens a step} (scripts/bench/budget_table.py)")


def moe_figures(args, cfg, pool, params, dparams, state, budgets, row, report) -> None:
    """The MoE figures of one batch into row["moe"] (programs from `pool`, moe_step.submit_programs);
    the roofline's bytes become the chosen experts'."""
    fast = args.smoke
    row["moe"] = moe_step.batch_figures(
        cfg, pool, params, dparams, state, budgets, step_ms=row["step_ms_by_choice"],
        dense_decode_bytes=row["decode_bytes"], read_GBps=report["bandwidth"]["best_GBps"],
        times=args.moe_expert_times, loop_iters=1 if fast else 4, repeats=2 if fast else 5,
        correlated_steps=args.moe_correlated_steps, loop_steps=2 if fast else args.loop_steps,
        log=lambda line: print(line, flush=True))
    row["decode_bytes"] = row["moe"]["decode_bytes"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(ap)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--modes", default="ar,ddtree", help="'ar' alone times plain decoding only (no DDTree, no phases); "
                    "add dflash to time the DFlash chain's step")
    ap.add_argument("--budgets", default="", help="more DDTree budgets whose loop step is timed (step_ms_by_choice)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--loop-steps", type=int, default=16)
    ap.add_argument("--no-phases", action="store_true",
                    help="skip batch 1's phase split (four more compilations): more step samples a GPU call")
    ap.add_argument("--phase-inner", type=int, default=32,
                    help="iterations of each phase per timed call (the phase split is the difference of "
                         "calls of N and 2N iterations; at 8 the 27B commit phase drowned in dispatch jitter)")
    add_route_options(ap)
    add_moe_options(ap)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "e2e.json"))
    args = ap.parse_args(argv)
    t_start = time.time()
    try:
        extra_budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--budgets: expected comma-separated integers, got {args.budgets!r}")
    try:
        acceptance = budget_table.load_acceptance(args.acceptance) if args.acceptance else None
    except (OSError, ValueError) as e:
        ap.error(f"--acceptance {args.acceptance}: {e}")
    route_fields = apply_route_options(ap, args)  # the autotune cache before the backend starts
    report = start_report("scripts.bench.e2e", argv, **route_fields, runs=[])

    def save():
        write_report(args.out, report)

    print(f"[bench] device {report['device']}, jax {jax.__version__}", flush=True)
    cache_dir = os.environ.get("JAX_CACHE_DIR")
    if cache_dir:  # persistent compilation cache: a second call on a warm machine skips compiles
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    report["bandwidth"] = measure_bandwidth(args.smoke)
    print(f"[bench] HBM read rate: {report['bandwidth']['best_GBps']:.0f} GB/s", flush=True)
    save()

    t0 = time.time()
    shape, cfg, dcfg, context = model_configs(args)
    graphdef, params, proposer, dparams, fields = model_setup(args, cfg, dcfg)
    jax.block_until_ready((params, dparams))
    report.update(fields, shape=shape, context=context, target_params_GB=nbytes(params) / 1e9,
                  drafter_params_GB=nbytes(dparams) / 1e9)
    print(f"[bench] {shape} weights on device in {time.time() - t0:.1f} s: target "
          f"{report['target_params_GB']:.2f} GB, drafter {report['drafter_params_GB']:.2f} GB (with its variant's "
          f"draft head); kernels: {args.routes.impl}", flush=True)
    routes = args.routes
    eos = jnp.zeros((0,), jnp.int32)
    key = jax.random.PRNGKey(0)

    @routed_jit(static_argnames=("spec",))
    def n_steps(params, dparams, s, n, spec):
        return gen._advance(nnx.merge(graphdef, params), dparams, s, eos, spec, n)

    pool = CompilePool(args.compile_workers)

    for batch in [int(b) for b in args.batches.split(",")]:
        if args.deadline_s and time.time() - t_start > args.deadline_s:
            report.setdefault("batches_skipped_after_deadline", []).append(batch)
            continue
        capacity = context + 64
        cache, dcache = filled_caches(cfg, dcfg, batch, context, capacity, seed=batch)
        row = {"batch": batch, "context": context, "lengths": np.asarray(cache.lengths).tolist()}
        max_new = 10**6
        state = loop_state(cache, dcache, batch, key)
        modes = [m for m in ("ar", "ddtree") if m in args.modes.split(",")]
        # (key, mode, budget): ar and ddtree at --budget keep their keys; DFlash and --budgets add runs
        extra = [("dflash", "dflash", args.budget)] if "dflash" in args.modes.split(",") else []
        extra += [(f"ddtree{b}", "ddtree", b) for b in extra_budgets if b != args.budget]
        row["step_ms_by_choice"] = {}
        # One compiled on-device loop per choice; the step count is traced, so a single step and a
        # run of n steps share the compilation. Every program of the batch goes to the pool first.
        choices = {}
        for key_, mode, budget in [(m, m, args.budget) for m in modes] + extra:
            spec = gen.GenSpec(mode, budget, None, max_new, Sampling(), capacity,
                               None if mode == "ar" else proposer, routes)
            s = state if mode != "ar" else state._replace(dstate=None, hist=jnp.zeros((2,), jnp.int32))
            choices[key_] = (mode, budget, spec, s)
            pool.submit(key_, functools.partial(n_steps.lower, params, dparams, s, jnp.int32(1), spec))
        moe = moe_step.is_moe(cfg) and "ddtree" in modes
        tree_budgets = sorted({args.budget, *extra_budgets})
        if moe:
            spec = gen.GenSpec("ddtree", args.budget, None, max_new, Sampling(), capacity, proposer, routes)
            moe_step.submit_programs(pool, cfg, graphdef, params, dparams, state, spec, tree_budgets,
                                     args.moe_expert_times, args.moe_correlated_steps)
        row["compile_wait_s"] = pool.wait()  # no timed step shares the GPU with a compile
        for key_, (mode, budget, _spec, s) in choices.items():
            if args.deadline_s and time.time() - t_start > args.deadline_s:
                row.setdefault("skipped_after_deadline", []).append(key_)
                continue
            t_c = time.time()
            run, row[f"{key_}_compile"] = pool.get(key_)
            ms = B.median_ms(lambda: run(params, dparams, s, jnp.int32(1)), args.repeats)
            row[f"{key_}_step_ms"] = ms
            row[f"{key_}_compile_and_warm_s"] = time.time() - t_c  # the wait for its compile, then the warm-up
            n = args.loop_steps
            per, fixed, pairs = B.paired_marginal_ms(lambda k: lambda: run(params, dparams, s, jnp.int32(k)),
                                                     n, max(5, args.repeats))
            row[f"{key_}_loop_step_ms"] = per  # marginal: what one more step costs (median of paired runs)
            row[f"{key_}_loop_step_pairs_ms"] = pairs
            row[f"{key_}_dispatch_ms"] = fixed
            row[f"{key_}_loop_incl_dispatch_ms"] = per + fixed / n  # T(n) / n: the step with 1/n of the dispatch
            print(f"[bench] batch {batch} {key_}: {ms:.2f} ms/step (single call), {per:.2f} ms/step in the on-device "
                  f"loop ({n} -> {2 * n} steps), {row[f'{key_}_loop_incl_dispatch_ms']:.2f} ms/step over {n} steps "
                  f"with the call's dispatch ({fixed:.2f} ms a call)", flush=True)
            row["step_ms_by_choice"][mode if mode != "ddtree" else str(budget)] = per
            save()
        row["decode_bytes"] = decode_bytes(cfg, params, cache)
        if moe_step.is_moe(cfg) and not moe:  # no routing probe: count the experts a step reads
            row["decode_bytes"], row["decode_bytes_experts"] = moe_step.unprobed_decode_bytes(
                cfg, row["decode_bytes"], batch)
        late = args.deadline_s and time.time() - t_start > args.deadline_s
        if moe and not late:
            moe_figures(args, cfg, pool, params, dparams, state, tree_budgets, row, report)
            save()
        pool.drop()  # programs a deadline left unasked
        row["roofline_ms"] = row["decode_bytes"] / (report["bandwidth"]["best_GBps"] * 1e6)
        # Per-step figures from inside the on-device loop (what generation runs); single-call
        # figures add the host dispatch of a ~1000-leaf params pytree and are reported beside them.
        if "ar_loop_step_ms" in row:
            row["decode_fraction_of_roofline"] = row["roofline_ms"] / row["ar_loop_step_ms"]
            row["decode_fraction_of_roofline_incl_dispatch"] = row["roofline_ms"] / row["ar_loop_incl_dispatch_ms"]
        row["ddtree_over_decode"] = (row["ddtree_loop_step_ms"] / row["ar_loop_step_ms"]
                                     if {"ar_loop_step_ms", "ddtree_loop_step_ms"} <= set(row) else None)
        row["phases_ms"] = None
        # Phase split of the DDTree step (batch 1 only, unless --no-phases: four more compilations).
        if (batch == 1 or args.smoke) and "ddtree" in modes and not args.no_phases and not late:
            spec = gen.GenSpec("ddtree", args.budget, None, max_new, Sampling(), capacity, proposer, routes)
            inner = 2 if args.smoke else args.phase_inner
            row["phases_ms"] = B.phase_times_at(graphdef, params, dparams, state, spec, key, repeats=args.repeats,
                                                inner=inner)
            row["phase_inner"] = inner
            row["phases_sum_ms"] = sum(row["phases_ms"].values())  # against ddtree_loop_step_ms: the split's check
            print(f"[bench] batch {batch} ddtree phases (ms, in-loop): {row['phases_ms']}", flush=True)
        stats = jax.local_devices()[0].memory_stats() or {}
        row["peak_memory_GB"] = stats.get("peak_bytes_in_use", 0) / 1e9 or None
        report["runs"].append(row)
        save()
        del cache, dcache, state

    pool.close()
    report["elapsed_s"] = time.time() - t_start
    save()
    nan = float("nan")
    n = args.loop_steps
    print(f"\n(decode / ddtree: marginal in-loop step; /{n}: T({n}) / {n} with the call's dispatch)")
    print(f"batch  decode_ms  roofline_ms  %roofline  ddtree_ms  ratio  {f'decode/{n}':>9}  {f'%roof/{n}':>8}  "
          "1call_ar  1call_tree  draft  build  verify  commit  peakGB")
    for r in report["runs"]:
        p = r["phases_ms"] or dict.fromkeys(("draft", "build", "verify", "commit"), nan)
        print(f"{r['batch']:5d}  {r.get('ar_loop_step_ms', nan):9.2f}  {r['roofline_ms']:11.2f}  "
              f"{100 * r.get('decode_fraction_of_roofline', nan):8.1f}%  {r.get('ddtree_loop_step_ms', nan):9.2f}  "
              f"{r['ddtree_over_decode'] or nan:5.2f}  {r.get('ar_loop_incl_dispatch_ms', nan):9.2f}  "
              f"{100 * r.get('decode_fraction_of_roofline_incl_dispatch', nan):7.1f}%  "
              f"{r.get('ar_step_ms', nan):8.2f}  "
              f"{r.get('ddtree_step_ms', nan):10.2f}  {p['draft']:5.2f}  {p['build']:5.2f}  {p['verify']:6.2f}  "
              f"{p['commit']:6.2f}  {r['peak_memory_GB'] or nan:6.1f}")
    print(f"HBM read rate {report['bandwidth']['best_GBps']:.0f} GB/s; wrote {args.out}")
    if any("moe" in r for r in report["runs"]):
        moe_step.print_table(report["runs"])
    if acceptance is not None:
        try:
            budget_table.print_tables(report, *acceptance)
        except ValueError as e:  # a step time that came out <= 0 (timer noise on tiny smoke steps)
            print(f"no budget table: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
