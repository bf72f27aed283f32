"""scripts/bench/compile_pool.py: programs lowered in turn and compiled in worker threads give the
same results as plain jit calls; with one worker nothing compiles before it is asked for; a
dropped program is never compiled after."""

import functools

import jax
import jax.numpy as jnp

from scripts.bench.compile_pool import CompilePool


@functools.partial(jax.jit, static_argnames=("scale",))
def _f(x, n, scale):
    return jax.lax.fori_loop(0, n, lambda i, acc: acc * scale + x, x)


def test_pool_compiles_ahead_and_matches_jit():
    x = jnp.arange(4.0)
    for workers in (1, 3):
        pool = CompilePool(workers)
        lowered = []
        for scale in (1.0, 2.0, 3.0):
            def lower(scale=scale):
                lowered.append(scale)
                return _f.lower(x, jnp.int32(1), scale)
            pool.submit(f"s{scale}", lower)
        assert lowered == ([] if workers == 1 else [1.0, 2.0, 3.0])  # one worker: lazily, at get()
        assert pool.wait() >= 0
        for scale in (2.0, 1.0):
            run, info = pool.get(f"s{scale}")
            assert set(info) == {"lower_s", "compile_s", "waited_s"}
            assert (run(x, jnp.int32(3)) == _f(x, jnp.int32(3), scale)).all()
        pool.drop()
        assert lowered == ([2.0, 1.0] if workers == 1 else [1.0, 2.0, 3.0])  # s3.0 dropped, never lowered lazily
        pool.close()
