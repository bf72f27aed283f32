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
