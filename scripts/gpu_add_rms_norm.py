"""GPU check + benchmark of the residual add + RMSNorm kernel's split-K partials path
(pallas_kernels/add_rms_norm.py) against what it replaces: XLA's reduce of the partials followed by
the plain kernel.

Per partial count S (4: the 27B output projections, 8: the MLP down product at 65 rows) and per
tiling (PARTS_CHUNK columns a block, PARTS_WARPS warps), the GPU kernel time of one call from a
profiler trace (partials rotated past L2 between calls), and the result against the reference
(stream exact, normed within a bf16 rounding).

    PYTHONPATH=. python3 scripts/gpu_add_rms_norm.py --out $OUT/add_rms_norm.json    # on the H200
    PYTHONPATH=. python3 scripts/gpu_add_rms_norm.py --cpu-smoke                      # any machine
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_bench_common import err_str, finish_checked, kernel_run_setup, record_row  # noqa: E402
from gpu_skinny_matmul import kernel_us  # noqa: E402

TILINGS = ((1024, 8), (2048, 16), (4096, 16), (4096, 32))  # (PARTS_CHUNK, PARTS_WARPS)


def run_row(parts: int, rows: int, h: int, on_gpu: bool, impl: str, tilings) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels.add_rms_norm as arn
    from pallas_kernels._common import summed_partials

    row = {"parts": parts, "rows": rows, "h": h}
    key = jax.random.PRNGKey(parts)
    x = jax.random.normal(key, (rows, h), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (h,), jnp.float32) * 0.1).astype(jnp.bfloat16)
    rot = 8 if on_gpu else 1
    ds = [jax.random.normal(jax.random.fold_in(key, 2 + r), (parts, rows, h), jnp.float32) for r in range(rot)]
    norm = lambda d, impl_, warps=None: arn.add_rms_norm(x, d, w, eps=1e-6, mode="zero_centered", impl=impl_,
                                                        num_warps=warps)
    want = jax.jit(lambda d: norm(d, "xla"))(ds[0])
    forms = {"xla": lambda _, d: norm(summed_partials(d, x.dtype), impl)}  # XLA's reduce, then the plain kernel
    for chunk, warps in tilings:
        forms[f"c{chunk}w{warps}"] = (lambda c, wp: lambda _, d: _with_chunk(c, lambda: norm(d, impl, wp)))(chunk, warps)
    for name, f in forms.items():
        try:
            got = jax.jit(lambda d: f(None, d))(ds[0])
            stream_ok = bool(np.array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)))
            normed_err = float(np.max(np.abs(np.asarray(got[1], np.float32) - np.asarray(want[1], np.float32))))
            row[name + "_ok"] = stream_ok and normed_err <= 2**-6 * max(1.0, float(np.max(np.abs(np.asarray(want[1], np.float32)))))
            us = kernel_us(f, None, ds, on_gpu)
            if us is not None:
                row[name + "_us"] = us
        except Exception as e:
            row[name + "_error"] = err_str(e)
    return row


def _with_chunk(chunk: int, fn):
    """fn() traced with PARTS_CHUNK = chunk (the kernel reads it when traced)."""
    import pallas_kernels.add_rms_norm as arn

    old, arn.PARTS_CHUNK = arn.PARTS_CHUNK, chunk
    try:
        return fn()
    finally:
        arn.PARTS_CHUNK = old


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="interpret mode, a small row (checks the script)")
    ap.add_argument("--parts", default="4,8")
    ap.add_argument("--rows", type=int, default=65)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "add_rms_norm.json"))
    args = ap.parse_args(argv)
    setup = kernel_run_setup("gpu_add_rms_norm.py", argv, args.cpu_smoke)
    if setup is None:
        return 2
    on_gpu, impl, report = setup
    h, rows = (80, 3) if args.cpu_smoke else (5120, args.rows)
    tilings = ((32, 4),) if args.cpu_smoke else TILINGS
    for parts in [int(p) for p in args.parts.split(",")]:
        row = run_row(parts, rows, h, on_gpu, impl, tilings)
        record_row(report, row, args.out, f"[add_rms_norm] {row}")
    ok = lambda r: all(v for k, v in r.items() if k.endswith("_ok"))
    return finish_checked(report, [("parts", "S", 3, None), ("rows", "rows", 5, None)], ok, args.out)


if __name__ == "__main__":
    sys.exit(main())
