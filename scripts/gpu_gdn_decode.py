"""GPU check + benchmark of the GDN decode kernel (pallas_kernels/gdn_decode.py) against its
reference, the model's XLA decode path for the same part of the layer (the a / b products and
gates, conv + SiLU, q / k norms, the recurrent step, the gated norm, the window slide), at a
Qwen3.6-27B GDN layer (hidden 5120, 16 k / 48 v heads of 128, conv 4, bf16 inputs, float32 state).

Correctness: y, state and window against the reference (float32 relative error and bf16 within
its rounding), idle rows unchanged. Timing: each form inside one jitted on-device loop that carries
the state, the window, y (as the next step's gate input) and the hidden row from call to call, as
decoding does: nothing is hoisted, no output is dead, and the in-place state update needs no copy. Median of
rounds after a warm-up, never on zeros. Prints a table and writes JSON.

    PYTHONPATH=. python3 scripts/gpu_gdn_decode.py --warps 4,16 --out $OUT/gdn_decode.json   # on the H200
    PYTHONPATH=. python3 scripts/gpu_gdn_decode.py --cpu-smoke                                 # any machine
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from gpu_bench_common import err_str, finish_dtype_checked, kernel_run_setup, max_rel_err  # noqa: E402
from ddtree_jax import atomic  # noqa: E402


STATE = 9  # argument position of the state


def problem(seed: int, batch: int, hk: int, hv: int, dk: int, dv: int, taps: int, hidden: int, dtype):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    c = 2 * hk * dk + hv * dv
    r = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    n_valid = jnp.asarray((np.arange(batch) % 4 != 3).astype(np.int32))  # every 4th row idle
    return (r(batch, c).astype(dtype), r(batch, hv, dv).astype(dtype), r(batch, hidden).astype(dtype),
            (r(hidden, hv) * hidden**-0.5).astype(dtype), (r(hidden, hv) * hidden**-0.5).astype(dtype),
            r(hv).astype(dtype), r(hv).astype(dtype), r(batch, taps - 1, c).astype(dtype),
            (r(taps, c) * 0.5).astype(dtype), r(batch, hv, dk, dv) * 0.1, (1 + 0.1 * r(dv)).astype(dtype), n_valid)


def carried_step_us(a, hk: int, opts: dict, on_gpu: bool, steps: int = 64, rounds: int = 7) -> float:
    """Median us per decode step of `steps` steps in one jitted loop, state / window / y carried."""
    import statistics
    import time

    import jax
    import jax.numpy as jnp
    from jax import lax

    from pallas_kernels.gdn_decode import gdn_decode

    mixed, z, x, w_a, w_b, a_log, dt_bias, window, conv_w, state, norm_w, n_valid = a
    if not on_gpu:
        steps, rounds = 2, 2

    @jax.jit
    def run(state, window, z, x):
        def body(i, carry):
            st, win, zz, xx = carry
            y, st, win = gdn_decode(mixed, zz, xx, w_a, w_b, a_log, dt_bias, win, conv_w, st, norm_w, n_valid,
                                    num_k_heads=hk, eps=1e-6, **opts)
            # the hidden row changes every step, as in decoding: the a / b products cannot be hoisted
            xx = (xx.astype(jnp.float32) * 0.999 + 1e-3 * y[:, 0, :1].astype(jnp.float32)).astype(xx.dtype)
            return st, win, y, xx
        return lax.fori_loop(0, steps, body, (state, window, z, x))

    jax.block_until_ready(run(state, window, z, x))  # compile + warm up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(run(state, window, z, x))
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="interpret mode, small shapes (checks the script)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--warps", default="", help="also time the kernel at these num_warps, e.g. 4,16")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gdn_decode.json"))
    args = ap.parse_args(argv)
    hk, hv, dk, dv, taps, hidden = (2, 4, 16, 16, 4, 64) if args.cpu_smoke else (16, 48, 128, 128, 4, 5120)
    setup = kernel_run_setup("gpu_gdn_decode.py", argv, args.cpu_smoke,
                             shape=dict(k_heads=hk, v_heads=hv, dk=dk, dv=dv, taps=taps, hidden=hidden))
    if setup is None:
        return 2
    on_gpu, impl, report = setup
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gdn_decode import DEFAULT_WARPS, gdn_decode

    batches = [2] if args.cpu_smoke else [int(x) for x in args.batches.split(",")]
    for batch in batches:
        row = {"batch": batch}
        variants = {"xla": dict(impl="xla"), "kernel": dict(impl=impl)}
        for nw in [int(x) for x in args.warps.split(",") if x]:
            if nw != DEFAULT_WARPS:
                variants[f"kernel_w{nw}"] = dict(impl=impl, num_warps=nw)
        for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
            args_ = problem(batch, batch, hk, hv, dk, dv, taps, hidden, dtype)
            with jax.default_matmul_precision("highest"):  # no TF32 in the reference's float32 a / b products
                want = jax.jit(lambda *a: gdn_decode(*a, num_k_heads=hk, eps=1e-6, impl="xla"))(*args_)
            try:
                got = jax.jit(lambda *a: gdn_decode(*a, num_k_heads=hk, eps=1e-6, impl=impl))(*args_)
                err = max_rel_err(want, got)
                idle = [i for i in range(batch) if int(args_[-1][i]) == 0]
                same_idle = all(bool((np.asarray(got[1][i]) == np.asarray(args_[STATE][i])).all()) for i in idle)
                row[f"{jnp.dtype(dtype).name}_rel_err"] = err
                row[f"{jnp.dtype(dtype).name}_ok"] = err <= tol and same_idle
            except Exception as e:
                row[f"{jnp.dtype(dtype).name}_error"] = err_str(e)
        a = problem(batch * 10, batch, hk, hv, dk, dv, taps, hidden, jnp.bfloat16)
        for name, opts in variants.items():
            try:
                row[name + "_us"] = carried_step_us(a, hk, opts, on_gpu)
            except Exception as e:
                row[name + "_error"] = err_str(e)
        report["rows"].append(row)
        atomic.write_json(args.out, report)
        print(f"[gdn_decode] {row}", flush=True)
    return finish_dtype_checked(report, [("batch", "B", 2, None)], args.out)


if __name__ == "__main__":
    sys.exit(main())
