"""Compile a benchmark's programs ahead, several at once: each is lowered in turn on the calling
thread (tracing is Python and holds the GIL) and handed to a worker thread for XLA's compile
(which releases it), so the compiles of a batch's step programs overlap one another and the
tracing of the next. A model benchmark's GPU call is mostly compilation (a 35B-A3B DDTree step
program: tens of seconds each, one per budget and batch); run one after another they did not fit
one call. workers = 1 compiles each program when it is first asked for, as a plain jit call would.

Caveat: XLA autotunes GEMM and fusion configurations on the GPU while it compiles; compiles run at
once measure their candidates side by side, so a configuration may differ from what a lone compile
picks (an A/B with workers = 1 tells). `wait` before timing anything: no timed step shares the
GPU with a compile.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


def _compile(lowered) -> tuple[Any, float]:
    t0 = time.time()
    compiled = lowered.compile()
    return compiled, time.time() - t0


class CompilePool:
    """submit(key, lower) lowers now and compiles in a worker; get(key) waits for the compiled
    program and returns (compiled, {"lower_s", "compile_s", "waited_s"})."""

    def __init__(self, workers: int):
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers) if workers > 1 else None
        self._jobs: dict[str, tuple[Future | Callable, float]] = {}

    def submit(self, key: str, lower: Callable[[], Any]) -> None:
        if self._pool is None:  # lazily, at get(): a plain jit call's order
            self._jobs[key] = (lower, 0.0)
            return
        t0 = time.time()
        lowered = lower()
        self._jobs[key] = (self._pool.submit(_compile, lowered), time.time() - t0)

    def get(self, key: str) -> tuple[Any, dict]:
        job, lower_s = self._jobs.pop(key)
        t0 = time.time()
        if self._pool is None:
            lowered = job()
            lower_s = time.time() - t0
            compiled, compile_s = _compile(lowered)
        else:
            compiled, compile_s = job.result()
        return compiled, {"lower_s": lower_s, "compile_s": compile_s, "waited_s": time.time() - t0}

    def wait(self) -> float:
        """Block until every submitted compile is done (seconds waited)."""
        t0 = time.time()
        for job, _ in self._jobs.values():
            if isinstance(job, Future):
                job.exception()  # waits; a failure is raised by get()
        return time.time() - t0

    def drop(self) -> None:
        """Forget what was not asked for (a deadline passed): pending compiles are cancelled."""
        for job, _ in self._jobs.values():
            if isinstance(job, Future):
                job.cancel()
        self._jobs.clear()

    def close(self) -> None:
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
