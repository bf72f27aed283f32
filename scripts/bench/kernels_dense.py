"""The dense-layer run of scripts.bench.kernels (add_rms_norm): residual add + RMSNorm over split-K
partial sums against XLA's reduce + the plain kernel, per tiling, GPU kernel time from a profiler
trace."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import add_rms_norm as arn
from pallas_kernels._common import summed_partials
from scripts.bench.common import err_str, trace_kernel_us
from scripts.bench.kernels_harness import Kernel, Run, ints, registrar
from scripts.bench.shapes import GDN_27B

KERNELS: dict[str, Kernel] = {}
kernel = registrar(KERNELS)


ADD_NORM_TILINGS = ((1024, 8), (2048, 16), (4096, 16), (4096, 32))  # (PARTS_CHUNK, PARTS_WARPS)


def add_rms_norm_options(ap):
    ap.add_argument("--parts", default="4,8", help="partial sums S (4: the 27B output projections, 8: MLP down)")
    ap.add_argument("--rows", type=int, default=65, help="rows (a DDTree-64 verify: 65)")


@kernel("add_rms_norm", [("parts", "S", 3, None), ("rows", "rows", 5, None)],
        "add + RMSNorm over split-K partials against XLA's reduce + the plain kernel", add_rms_norm_options)
def run_add_rms_norm(run: Run) -> None:
    h, rows = (80, 3) if run.smoke else (GDN_27B["hidden"], run.args.rows)
    tilings = ((32, 4),) if run.smoke else ADD_NORM_TILINGS
    for parts in ints(run.args.parts):
        row = {"parts": parts, "rows": rows, "h": h}
        key = jax.random.PRNGKey(parts)
        x = jax.random.normal(key, (rows, h), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(jax.random.fold_in(key, 1), (h,), jnp.float32) * 0.1).astype(jnp.bfloat16)
        ds = [jax.random.normal(jax.random.fold_in(key, 2 + r), (parts, rows, h), jnp.float32)
              for r in range(8 if run.gpu else 1)]
        norm = lambda d, impl, warps=None, chunk=None: arn.add_rms_norm(
            x, d, w, eps=1e-6, mode="zero_centered", impl=impl, num_warps=warps, parts_chunk=chunk)
        want = jax.jit(lambda d: norm(d, "xla"))(ds[0])
        forms = {"xla": lambda d: norm(summed_partials(d, x.dtype), run.impl)}  # XLA's reduce, then the plain kernel
        for chunk, warps in tilings:
            forms[f"c{chunk}w{warps}"] = (lambda c, wp: lambda d: norm(d, run.impl, wp, c))(chunk, warps)
        for name, f in forms.items():
            try:
                got = jax.jit(f)(ds[0])
                stream_ok = bool(np.array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)))
                normed = np.asarray(want[1], np.float32)
                err = float(np.max(np.abs(np.asarray(got[1], np.float32) - normed)))
                row[name + "_ok"] = stream_ok and err <= 2**-6 * max(1.0, float(np.max(np.abs(normed))))
                us = trace_kernel_us(f, ds, run.gpu)
                if us is not None:
                    row[name + "_us"] = us
            except Exception as e:
                row[name + "_error"] = err_str(e)
        row["ok"] = all(v for k, v in row.items() if k.endswith("_ok"))
        run.record(row)
