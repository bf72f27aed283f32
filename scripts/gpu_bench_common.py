"""Timing helpers shared by the GPU check / benchmark scripts (gpu_gdn.py, gpu_tree_attention.py)."""

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
