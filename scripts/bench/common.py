"""What the benchmarks share: reports (JSON rewritten after every row), timing (jax calls back to
back inside one jitted loop, torch calls in a CUDA graph, GPU kernel time from a profiler trace),
the device's read rate, the timing table, and the model benchmarks' options (shape, drafter,
kernel routes).

Timing rules every tool follows: random inputs (never zeros), a warm-up call before timing, inputs
rotated over copies larger than L2 where a kernel streams them, the median of rounds.
"""

from __future__ import annotations

import datetime
import glob
import importlib.metadata
import math
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.profiler import ProfileData

from ddtree_jax import atomic, autotune_cache
from ddtree_jax import routes as routes_mod
from ddtree_jax.models import int8
from ddtree_jax.speculative.dflash import DFlashProposer
from ddtree_jax.speculative.draft_vocab import first_ids
from scripts.bench.shapes import SHAPES, random_models

L2_BYTES = 50 * 2**20  # the H200's L2


# ---------------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------------
def err_str(e: BaseException, limit: int = 600) -> str:
    """One-line description of an exception, cut to `limit` characters."""
    s = f"{type(e).__name__}: {e}"
    return s if len(s) < limit else s[:limit] + " ..."


def fmt(x, spec=".1f"):
    """A table cell: '-' for None, numbers formatted, anything else as text."""
    return "-" if x is None else (format(x, spec) if isinstance(x, (int, float)) else str(x))


def versions() -> dict:
    """python, jax, jaxlib, torch and triton versions (installed packages; none is imported)."""
    env = {"python": sys.version.split()[0], "jax": jax.__version__}
    for name in ("jaxlib", "torch", "triton"):
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = "not installed"
    return env


def start_report(tool: str, argv, **extra) -> dict:
    """The head of a report: date, the command as typed, device, versions and `extra`. The first
    device use: call it after anything that must precede the backend (XLA flags, platform)."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python -m", tool] + list(argv if argv is not None else sys.argv[1:])),
            "device": jax.devices()[0].device_kind, **versions(), **extra}


def write_report(path: str, report: dict) -> None:
    """Rewrite the report atomically (a run cut short keeps what it finished)."""
    atomic.write_json(path, report, indent=1, default=str)


def record_row(report: dict, row: dict, out: str, line: str | None = None) -> None:
    """Add a finished row to report["rows"], rewrite the JSON and print `line` (default: the row)."""
    report["rows"].append(row)
    write_report(out, report)
    print(line if line is not None else str(row), flush=True)


def on_gpu() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def rotations_for(nbytes: int, cap: int = 16, factor: float = 2.0) -> int:
    """Input copies so one pass over all of them moves `factor` x L2 (at most `cap`): each call
    then reads its inputs from HBM, as in the model, where every layer has its own."""
    return int(max(1, min(cap, math.ceil(factor * L2_BYTES / max(nbytes, 1)))))


def time_jax(f, arg_sets, est_s: float, *, carry=None, round_s=0.005, rounds=7, max_iters=400, gpu=True):
    """Median seconds per call of f over rotated argument sets, the calls back to back inside one
    jitted fori_loop (no host work between them). Returns (seconds, info); info["out"] is the first
    set's last output.

    Without `carry`: f(i, args) -> out, i the traced loop index, which f must let reach the kernel's
    inputs (a select XLA cannot fold) so that nothing is hoisted out of the loop. With `carry`
    (an argument position, or a tuple of them): f(args) returns the new value(s) at those positions,
    which the next call on that set takes (a true dependency chain: a state updated in place).
    """
    nrot = len(arg_sets)
    iters = max(1, min(max_iters, math.ceil(round_s / max(est_s * nrot, 1e-7))))
    if not gpu:  # --cpu-smoke: exercise the path only
        iters, rounds = 1, 2
    positions = (carry,) if isinstance(carry, int) else carry

    if positions is None:
        out_shape = jax.eval_shape(lambda a: f(0, a), arg_sets[0])

        def run(sets):
            zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
            return lax.fori_loop(0, iters, lambda i, c: tuple(f(i, a) for a in sets), tuple(zeros() for _ in sets))
    else:
        def step(a, held):
            a = list(a)
            for p, v in zip(positions, held):
                a[p] = v
            new = f(tuple(a))
            return new if isinstance(carry, tuple) else (new,)

        def run(sets):
            body = lambda i, held: tuple(step(a, h) for a, h in zip(sets, held))
            return lax.fori_loop(0, iters, body, tuple(tuple(a[p] for p in positions) for a in sets))

    run = jax.jit(run)
    t = time.perf_counter()
    jax.block_until_ready(run(arg_sets))  # compile + warm-up
    first = time.perf_counter() - t
    jax.block_until_ready(run(arg_sets))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        outs = jax.block_until_ready(run(arg_sets))
        times.append((time.perf_counter() - t) / (iters * nrot))
    out = outs[0] if positions is None else (outs[0] if isinstance(carry, tuple) else outs[0][0])
    return statistics.median(times), {"iters": iters, "rotations": nrot, "rounds": rounds,
                                      "first_call_s": round(first, 2), "out": out}


def time_torch(fns, *, round_s=0.005, rounds=7, max_iters=200):
    """Median seconds per call over rotated zero-argument torch callables: captured in one CUDA
    graph when they allow it (eager otherwise), CUDA events; on a CPU only the path runs."""
    import torch  # the peers' framework: optional, imported only when one runs

    nrot = len(fns)
    if not torch.cuda.is_available():  # --cpu-smoke
        ts = []
        for _ in range(2):
            t = time.perf_counter()
            for f in fns:
                f()
            ts.append((time.perf_counter() - t) / nrot)
        return statistics.median(ts), {"mode": "cpu wall clock"}
    for f in fns:
        f()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for f in fns:
        f()
    e1.record()
    torch.cuda.synchronize()
    est = e0.elapsed_time(e1) / 1e3 / nrot
    iters = max(1, min(max_iters, math.ceil(round_s / max(est * nrot, 1e-7))))
    mode = "cuda graph"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                for f in fns:
                    f()
        run = graph.replay
        run()
    except Exception as e:  # not capturable: eager launches
        mode = f"eager ({err_str(e)[:100]})"

        def run():
            for _ in range(iters):
                for f in fns:
                    f()

        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        e0.record()
        run()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3 / (iters * nrot))
    return statistics.median(times), {"iters": iters, "rotations": nrot, "rounds": rounds, "mode": mode}


def jax_rates(gpu: bool, quick: bool = False, matmul: bool = True) -> dict:
    """The device's best read rate measured in jax (a bf16 reduction and a bf16 GEMV over 1-2 GiB;
    hbm_GBps is the faster of the two) and, with matmul, the bf16 matmul rate (8192^3)."""
    res = {}
    n = (2**30 if not quick else 2**29) if gpu else 2**20
    x = jax.random.normal(jax.random.PRNGKey(1), (n,), jnp.float32).astype(jnp.bfloat16)
    red = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))

    def bench(f, *a, reps=10):
        jax.block_until_ready(f(*a))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                out = f(*a)
            jax.block_until_ready(out)
            ts.append((time.perf_counter() - t0) / reps)
        return statistics.median(ts)

    res["reduction_GBps"] = 2 * n / bench(red, x) / 1e9
    del x
    side = int(math.isqrt(n))
    w = jax.random.normal(jax.random.PRNGKey(2), (side, side), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(3), (side,), jnp.float32).astype(jnp.bfloat16)
    gemv = jax.jit(lambda w, v: jnp.dot(w, v, preferred_element_type=jnp.float32))
    res["gemv_GBps"] = 2 * side * side / bench(gemv, w, v) / 1e9
    del w, v
    res["hbm_GBps"] = max(res["reduction_GBps"], res["gemv_GBps"])
    if matmul:
        m = 8192 if gpu else 256
        a = jax.random.normal(jax.random.PRNGKey(4), (m, m), jnp.float32).astype(jnp.bfloat16)
        mm = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        res["matmul_TFLOPs"] = 2 * m**3 / bench(mm, a, reps=5) / 1e12
    return res


def trace_kernels(trace_dir: str) -> list[tuple[str, str, float]]:
    """(kernel name, hlo_op, duration us) of every event on the GPU planes of a jax.profiler trace."""
    out = []
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if "stream" not in line.name.lower():
                    continue
                for ev in line.events:
                    stats = dict(ev.stats)
                    out.append((ev.name, str(stats.get("hlo_op", "")), ev.duration_ns / 1e3))
    return out


def trace_kernel_stats(fn, arg_sets, gpu: bool, calls: int = 3) -> tuple[float, float] | None:
    """(GPU kernel time us, kernel launches) per fn(args) from a profiler trace of calls over the
    rotated sets, summed over every kernel fn launches (what a profile of the model reports for
    them; None off the GPU)."""
    if not gpu:
        return None
    run = jax.jit(lambda sets: [fn(a) for a in sets])
    jax.block_until_ready(run(arg_sets))
    d = tempfile.mkdtemp(prefix="kernel_trace_")
    with jax.profiler.trace(d):
        for _ in range(calls):
            jax.block_until_ready(run(arg_sets))
    events = trace_kernels(d)
    per_call = calls * len(arg_sets)
    return sum(us for _, _, us in events) / per_call, len(events) / per_call


def trace_kernel_us(fn, arg_sets, gpu: bool, calls: int = 3) -> float | None:
    """The kernel time of `trace_kernel_stats` (None off the GPU)."""
    stats = trace_kernel_stats(fn, arg_sets, gpu, calls)
    return None if stats is None else stats[0]


# ---------------------------------------------------------------------------------------------
# checks and the timing table
# ---------------------------------------------------------------------------------------------
def max_rel_err(want, got) -> float:
    """max |got - want| / max |want| over pairs of arrays (float64 comparison), the largest pair;
    NaN anywhere in got gives NaN."""
    errs = []
    for w, g in zip(want, got):
        w64, g64 = np.asarray(w, np.float64), np.asarray(g, np.float64)
        if np.isnan(g64).any():
            return float("nan")
        errs.append(float(np.max(np.abs(g64 - w64))) / max(1e-30, float(np.max(np.abs(w64)))))
    return max(errs)


def print_timing_table(rows, lead, ok) -> None:
    """Rows of `<variant>_us` timings: the leading columns (key, title, width, number format or None
    for plain text), `ok(row)`, the XLA form first, every other variant after it, the fastest."""
    lead_keys = {key for key, *_ in lead}
    cols = sorted({k[:-3] for r in rows for k in r if k.endswith("_us") and k not in lead_keys},
                  key=lambda c: (c != "xla", c))
    cell = lambda r, key, spec: str(r.get(key, "-")) if spec is None else fmt(r.get(key), spec)
    print("\n" + " ".join(f"{title:>{w}}" for _, title, w, _ in lead) + f" {'ok':>5}"
          + "".join(f" {c + ' us':>14}" for c in cols) + "  best")
    for r in rows:
        times = {c: r[c + "_us"] for c in cols if c + "_us" in r}
        best = min(times, key=times.get) if times else "-"
        print(" ".join(f"{cell(r, key, spec):>{w}}" for key, _, w, spec in lead) + f" {str(ok(r)):>5}"
              + "".join(f" {fmt(r.get(c + '_us')):>14}" for c in cols) + f"  {best}")


# ---------------------------------------------------------------------------------------------
# the model benchmarks' options (e2e, profile)
# ---------------------------------------------------------------------------------------------
def add_model_options(ap) -> None:
    """--shape / --smoke / --context and the drafter variants (`model_setup`)."""
    ap.add_argument("--shape", choices=tuple(SHAPES), default="27b",
                    help="target + drafter shape (scripts/bench/shapes.py)")
    ap.add_argument("--smoke", action="store_true",
                    help="the smoke shape and short runs: checks the tool on any device")
    ap.add_argument("--context", type=int, default=None, help="committed tokens in the caches (default: the shape's)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="draft from ids 0..N-1 only (ddtree_jax/speculative/draft_vocab.py; 0 = the whole vocabulary)")
    ap.add_argument("--int8-drafter", nargs="?", const="w8a8", default=None, choices=sorted(int8.SCHEMES),
                    help="the drafter and its draft head with int8 weights (ddtree_jax/models/int8.py): w8a8 (the "
                    "default scheme) or weight-only")


def add_route_options(ap) -> None:
    """The kernel routes a model benchmark runs (--impl, --route NAME=VALUE: ddtree_jax/routes.py)
    and XLA's autotune cache. `apply_route_options` resolves them."""
    routes_mod.add_arguments(ap)
    autotune_cache.add_argument(ap)


def apply_route_options(ap, args) -> dict:
    """The autotune cache before the backend starts (XLA reads its flags then), then the Routes
    (args.routes); returns the report fields (the routes whole)."""
    cache_dir = autotune_cache.use_autotune_cache(args.autotune_cache) if args.autotune_cache else None
    try:
        args.routes = routes_mod.from_args(args)
    except ValueError as e:
        ap.error(str(e))
    return {"routes": args.routes.as_dict(), "autotune_cache": cache_dir}


def model_configs(args):
    """(shape name, target config, drafter config, context) the options ask for."""
    shape = SHAPES[SHAPES[args.shape].smoke if args.smoke else args.shape]
    cfg = shape.target()
    context = shape.context if args.smoke or args.context is None else args.context
    return shape.name, cfg, shape.drafter(cfg), context


def model_setup(args, cfg, dcfg):
    """(graphdef, params, proposer, drafter params, report fields) of `model_configs`' pair with
    random weights on the device, as the drafter options ask (draft vocabulary, int8)."""
    graphdef, params, dgraph, dparams = random_models(cfg, dcfg)
    proposer = DFlashProposer(dgraph, dcfg)
    if args.draft_vocab:
        target = nnx.merge(graphdef, params)
        proposer, dparams = proposer.with_draft_vocab(dparams, target, first_ids(args.draft_vocab, cfg.vocab_size))
    if args.int8_drafter:
        proposer, dparams = proposer.with_int8(dparams, nnx.merge(graphdef, params), int8.SCHEMES[args.int8_drafter])
    fields = {"draft_vocab": args.draft_vocab or None, "int8_drafter": args.int8_drafter,
              "int8_scheme": proposer.int8.as_dict() if args.int8_drafter else None}
    return graphdef, params, proposer, dparams, fields
