"""Helpers shared by the GPU check / benchmark scripts: timing, formatting, the common start of
the kernel scripts and their timing table."""

from __future__ import annotations

import math
import statistics
import time


def err_str(e: BaseException, limit: int = 600) -> str:
    """One-line description of an exception, cut to `limit` characters."""
    s = f"{type(e).__name__}: {e}"
    return s if len(s) < limit else s[:limit] + " ..."


def fmt(x, spec=".1f"):
    """A table cell: '-' for None, numbers formatted, anything else as text."""
    return "-" if x is None else (format(x, spec) if isinstance(x, (int, float)) else str(x))


def time_torch(fns, *, round_s=0.01, rounds=7, max_iters=100):
    """Median seconds per call over rotated zero-argument callables (CUDA graph when possible)."""
    import torch

    nrot = len(fns)
    if not torch.cuda.is_available():  # --cpu-smoke: exercise the path only
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
    except Exception as e:
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


def jax_rates(on_gpu, quick, matmul=True):
    """The device's best read rate measured in jax (a bf16 reduction and a bf16 GEMV over 1-2 GiB;
    hbm_GBps is the faster of the two) and, with matmul, the bf16 matmul rate (8192^3)."""
    import jax
    import jax.numpy as jnp

    res = {}
    n = (2**30 if not quick else 2**29) if on_gpu else 2**20
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

    t = bench(red, x)
    res["reduction_GBps"] = 2 * n / t / 1e9
    del x
    side = int(math.isqrt(n))
    w = jax.random.normal(jax.random.PRNGKey(2), (side, side), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(3), (side,), jnp.float32).astype(jnp.bfloat16)
    gemv = jax.jit(lambda w, v: jnp.dot(w, v, preferred_element_type=jnp.float32))
    t = bench(gemv, w, v)
    res["gemv_GBps"] = 2 * side * side / t / 1e9
    del w, v
    res["hbm_GBps"] = max(res["reduction_GBps"], res["gemv_GBps"])
    if not matmul:
        return res
    m = 8192 if on_gpu else 256
    a = jax.random.normal(jax.random.PRNGKey(4), (m, m), jnp.float32).astype(jnp.bfloat16)
    mm = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    t = bench(mm, a, reps=5)
    res["matmul_TFLOPs"] = 2 * m**3 / t / 1e12
    return res


def time_jax(f, arg_sets, est_s, *, round_s=0.005, rounds=7, on_gpu=True):
    """Median seconds per call of f(i, args) over rotated arg_sets, calls back to back in jit.

    f takes the loop index i (traced int32) to perturb something cheap (lengths) so XLA cannot
    hoist the calls out of the loop.
    """
    import jax
    from jax import lax

    nrot = len(arg_sets)
    iters = max(1, min(400, math.ceil(round_s / max(est_s * nrot, 1e-7))))
    if not on_gpu:
        iters, rounds = 1, 2

    out_shapes = jax.eval_shape(lambda a: f(0, a), arg_sets[0])

    def run(sets):
        init = tuple(jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), out_shapes) for _ in sets)

        def body(i, carry):
            return tuple(f(i, a) for a in sets)

        return lax.fori_loop(0, iters, body, init)

    run = jax.jit(run)
    jax.block_until_ready(run(arg_sets))  # compile + warm up
    jax.block_until_ready(run(arg_sets))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = jax.block_until_ready(run(arg_sets))
        times.append((time.perf_counter() - t0) / (iters * nrot))
    return statistics.median(times), {"iters": iters, "rotations": nrot, "rounds": rounds, "out": outs[0]}


def kernel_run_setup(script: str, argv, cpu_smoke: bool, **extra):
    """The start every kernel check / benchmark script shares: jax on the CPU for --cpu-smoke,
    a GPU required otherwise. Returns (on_gpu, impl, report) - impl "pallas" on a GPU, else
    "pallas_interpret"; the report holds date, command, device, jax and `extra` - or None (after
    saying why) when no GPU is visible without --cpu-smoke."""
    import datetime
    import os
    import sys

    if cpu_smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    if not on_gpu and not cpu_smoke:
        print("no GPU visible to jax: run on the H200, or use --cpu-smoke", file=sys.stderr)
        return None
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([f"scripts/{script}"] + (argv if argv is not None else sys.argv[1:])),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, **extra, "rows": []}
    return on_gpu, ("pallas" if on_gpu else "pallas_interpret"), report


def print_timing_table(rows, lead, ok) -> None:
    """Rows of `<variant>_us` timings: the leading columns (key, title, width, number format or
    None for plain text), `ok(row)`, the XLA form first, every other variant after it, the fastest."""
    cols = sorted({k[:-3] for r in rows for k in r if k.endswith("_us")}, key=lambda c: (c != "xla", c))
    cell = lambda r, key, spec: str(r.get(key, "-")) if spec is None else fmt(r.get(key), spec)
    print("\n" + " ".join(f"{title:>{w}}" for _, title, w, _ in lead) + f" {'ok':>5}"
          + "".join(f" {c + ' us':>14}" for c in cols) + "  best")
    for r in rows:
        times = {c: r[c + "_us"] for c in cols if c + "_us" in r}
        best = min(times, key=times.get) if times else "-"
        print(" ".join(f"{cell(r, key, spec):>{w}}" for key, _, w, spec in lead) + f" {str(ok(r)):>5}"
              + "".join(f" {fmt(r.get(c + '_us')):>14}" for c in cols) + f"  {best}")


def max_rel_err(want, got) -> float:
    """max |got - want| / max |want| over pairs of arrays (float32 comparison), the largest pair."""
    import numpy as np

    errs = []
    for w, g in zip(want, got):
        w32, g32 = np.asarray(w, np.float32), np.asarray(g, np.float32)
        errs.append(float(np.max(np.abs(g32 - w32))) / max(1e-9, float(np.max(np.abs(w32)))))
    return max(errs)


DTYPE_ERR_COLUMNS = [("float32_rel_err", "fp32 err", 9, ".1e"), ("bfloat16_rel_err", "bf16 err", 9, ".1e")]


def record_row(report, row, out: str, line: str | None = None) -> None:
    """Add a finished row to the report, rewrite the JSON (a cut run keeps its rows) and print
    `line` (default: the row)."""
    from ddtree_jax import atomic

    report["rows"].append(row)
    atomic.write_json(out, report)
    print(line if line is not None else str(row), flush=True)


def finish_checked(report, lead, ok, out: str) -> int:
    """The end of a kernel script whose rows hold `<variant>_us` timings and checks that `ok(row)`
    reads: the table, where the report went, and the exit code (1 if a row failed a check or
    has an error)."""
    print_timing_table(report["rows"], lead, ok)
    print(f"wrote {out}")
    failed = [r for r in report["rows"] if not ok(r) or any(k.endswith("error") for k in r)]
    return 1 if failed else 0


def finish_dtype_checked(report, lead, out: str) -> int:
    """finish_checked for rows holding float32_ok / bfloat16_ok checks (and their error columns)."""
    ok = lambda r: bool(r.get("float32_ok") and r.get("bfloat16_ok"))
    return finish_checked(report, list(lead) + DTYPE_ERR_COLUMNS, ok, out)

