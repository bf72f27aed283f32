"""The per-layer runs of scripts.bench.kernels that are not attention, GDN or the tree build, GPU
kernel time from a profiler trace: add_rms_norm (residual add + RMSNorm over split-K partial sums
against XLA's reduce + the plain kernel, per tiling) and softmax_top_k (an MoE softmax router's
softmax + top-k + renormalisation in one launch against XLA's launches, per num_warps)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import add_rms_norm as arn
from pallas_kernels import softmax_top_k as stk
from pallas_kernels._common import summed_partials
from scripts.bench.common import err_str, trace_kernel_us
from scripts.bench.kernels_harness import Kernel, Run, ints, registrar
from scripts.bench.shapes import GDN_27B

KERNELS: dict[str, Kernel] = {}
kernel = registrar(KERNELS)


ADD_NORM_TILINGS = ((1024, 8), (2048, 16), (4096, 16), (4096, 32))  # (PARTS_CHUNK, PARTS_WARPS)


def check_and_time(run: Run, row: dict, forms: dict, sets: list, agrees) -> None:
    """Each form run on sets[0] and checked (`agrees(output) -> bool` into row[name_ok]), then its GPU
    kernel time from a trace over `sets` (row[name_us]); a form that fails records its error. Then
    row["ok"] and the row is recorded."""
    for name, f in forms.items():
        try:
            row[name + "_ok"] = bool(agrees(jax.jit(f)(sets[0])))
            us = trace_kernel_us(f, sets, run.gpu)
            if us is not None:
                row[name + "_us"] = us
        except Exception as e:
            row[name + "_error"] = err_str(e)
    row["ok"] = all(v for k, v in row.items() if k.endswith("_ok"))
    run.record(row)


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
        normed = np.asarray(want[1], np.float32)

        def agrees(got):
            stream_ok = np.array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
            err = float(np.max(np.abs(np.asarray(got[1], np.float32) - normed)))
            return stream_ok and err <= 2**-6 * max(1.0, float(np.max(np.abs(normed))))

        check_and_time(run, row, forms, ds, agrees)


def softmax_top_k_options(ap):
    ap.add_argument("--rows", default="1,8,65", help="tokens (a batch-1 / batch-8 decode step, a DDTree-64 verify)")
    ap.add_argument("--experts", default="256,512", help="router widths (Qwen3.6-35B-A3B: 256, Qwen3-Next: 512)")
    ap.add_argument("--ks", default="8,10", help="top-k (paired with --experts)")
    ap.add_argument("--warps", default="1,2,4,8", help="num_warps of the kernel variants")


@kernel("softmax_top_k", [("rows", "rows", 5, None), ("experts", "E", 4, None), ("k", "k", 3, None)],
        "MoE softmax router (softmax + top-k + renormalisation) in one launch against XLA's launches",
        softmax_top_k_options)
def run_softmax_top_k(run: Run) -> None:
    a = run.args
    pairs = [(40, 4)] if run.smoke else list(zip(ints(a.experts), ints(a.ks)))
    for rows in [3] if run.smoke else ints(a.rows):
        for e, k in pairs:
            row = {"rows": rows, "experts": e, "k": k}
            key = jax.random.PRNGKey(rows * 1000 + e)
            sets = [(jax.random.normal(jax.random.fold_in(key, r), (rows, e), jnp.float32) * 2).astype(jnp.bfloat16)
                    for r in range(8 if run.gpu else 1)]
            route = lambda x, impl, warps=None: stk.softmax_top_k(x, k, norm=True, weights_dtype=jnp.bfloat16,
                                                                  impl=impl, num_warps=warps)
            want = jax.jit(lambda x: route(x, "xla"))(sets[0])
            forms = {"xla": lambda x: route(x, "xla")}
            for warps in [4] if run.smoke else ints(a.warps):
                forms[f"kernel_w{warps}"] = (lambda w: lambda x: route(x, run.impl, w))(warps)
            check_and_time(run, row, forms, sets, lambda got, want=want: (
                np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
                and float(np.max(np.abs(np.asarray(got[1]) - np.asarray(want[1])))) <= 2**-8))
