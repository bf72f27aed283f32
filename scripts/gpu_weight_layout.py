"""Does the stored orientation of a weight change XLA's product speed at decode and verify rows?

Our Linear stores kernel [in, out] (x @ W); HF's nn.Linear stores weight [out, in] (x @ W^T, each
output's inputs contiguous). At a DDTree verify's 65 rows cuBLAS reads the 27B's deep / narrow
products well below the decode GEMVs' rate (session 9 profile: MLP down 48.2 us + a 2-4 us reduce
against 41.7 us, out projections 21.2 + reduce against 17.7), and a split of K into a batched
GEMM did not help (cuBLAS's CTA count is not the limit). This script times XLA's product over
both orientations of the same weights, per 27B product and row count, by kernel time (profiler
trace) and wall time, weights rotated past L2, and checks the two give the same values. A win at
65 rows that does not lose at 1 row would make [out, in] storage worth building (converters,
merged layouts and kernels read kernels as [in, out] today).

--int8 adds the weight-only int8 forms of the drafter (ddtree_jax/models/int8.py: int8 kernel, one
float32 scale per output column) in both orientations: session 13 measured XLA's int8 GEMM at 16
rows streaming the stored [in, out] int8 weights at 1.9-3.2 TB/s (gate | up 94.6 us against ~83
in bf16), so whether [out, in] int8 (each output's inputs contiguous, K-major for the MMA) streams
faster decides the next layout of the int8 drafter. Their error is against the bf16 product.

    PYTHONPATH=. python3 scripts/gpu_weight_layout.py --out $OUT/weight_layout.json   # on the H200
    PYTHONPATH=. python3 scripts/gpu_weight_layout.py --int8 --rows 16 --shapes drafter_gate_up,drafter_down,lm_head --out $OUT/int8_layout.json
    PYTHONPATH=. python3 scripts/gpu_weight_layout.py --cpu-smoke                      # any machine
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_bench_common import err_str, fmt, kernel_run_setup, record_row  # noqa: E402
from gpu_skinny_matmul import SHAPES, SMOKE_SHAPES, kernel_us, problem, time_variant  # noqa: E402

ORIENTATIONS = ("in_out", "out_in")
INT8_FORMS = ("int8_in_out", "int8_out_in")


def product(orientation: str):
    """x [m, K] times a weight stored [K, N] ("in_out", ours) or [N, K] ("out_in", HF's); the int8
    forms take (q, scale) and scale the float32 product per output column (models/int8.py)."""
    import jax.numpy as jnp

    from pallas_kernels.skinny_matmul import reference

    if orientation == "in_out":
        return lambda x, w: jnp.einsum("mk,kn->mn", x, w)
    if orientation == "out_in":
        return lambda x, w: jnp.einsum("mk,nk->mn", x, w)
    layout = orientation[len("int8_"):]  # the int8 drafter's own product in that storage
    return lambda x, w: reference(x, *w, w_layout=layout)


def run_row(name: str, m: int, k: int, n: int, on_gpu: bool, with_int8: bool = False) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax.models import int8

    row = {"shape": name, "m": m, "k": k, "n": n}
    x, ws = problem(hash((name, m)) % 2**31, m, k, n, on_gpu)
    weights = {"in_out": ws, "out_in": [jnp.asarray(w.T) for w in ws]}  # materialized [N, K] copies
    forms = ORIENTATIONS
    if with_int8:
        quantized = [int8.quantize(w) for w in ws]
        weights["int8_in_out"] = quantized
        weights["int8_out_in"] = [(jnp.asarray(q.T), sc) for q, sc in quantized]
        forms = ORIENTATIONS + INT8_FORMS
    want = None
    for o in forms:
        f = product(o)
        try:
            got = np.asarray(jax.jit(f)(x, weights[o][0]).astype(jnp.float32))
            if want is None:
                want = got
            row[o + "_err"] = float(np.abs(got - want).max()) / (float(np.abs(want).max()) or 1.0)
            t = time_variant(f, x, weights[o], on_gpu)
            row[o + "_us"] = t * 1e6
            row[o + "_TBps"] = (1 if o.startswith("int8") else 2) * k * n / t / 1e12  # of the stored weight
            row[o + "_kernel_us"] = kernel_us(f, x, weights[o], on_gpu)
        except Exception as e:
            row[o + "_error"] = err_str(e)
    del weights, ws
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="small shapes on any device (checks the script)")
    ap.add_argument("--shapes", default="mlp_down,out_proj,mlp_gate_up_merged,gdn_qkv_z,attn_qkv",
                    help="products to time: " + ", ".join(list(SHAPES) + ["gdn_qkv_z", "attn_qkv"]))
    ap.add_argument("--rows", default="1,65")
    ap.add_argument("--int8", action="store_true", help="also the int8 weight-only forms, both orientations")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "weight_layout.json"))
    args = ap.parse_args(argv)
    setup = kernel_run_setup("gpu_weight_layout.py", argv, args.cpu_smoke)
    if setup is None:
        return 2
    on_gpu, _, report = setup
    # the merged layouts the model stores (docs/kernels_dense.md): GDN qkv | z, attention q | k | v
    # the model's merged layouts (docs/kernels_dense.md) and the 27B-width drafter's products
    shapes = dict(SHAPES, gdn_qkv_z=(5120, 16384), attn_qkv=(5120, 14336), drafter_gate_up=(5120, 34816),
                  drafter_down=(17408, 5120), drafter_qkv=(5120, 6144), drafter_o=(4096, 5120))
    names = list(SMOKE_SHAPES) if args.cpu_smoke else args.shapes.split(",")
    unknown = [s for s in names if s not in shapes and s not in SMOKE_SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}")
    for name in names:
        k, n = SMOKE_SHAPES[name] if args.cpu_smoke else shapes[name]
        for m in [int(v) for v in args.rows.split(",")]:
            row = run_row(name, m, k, n, on_gpu, args.int8)
            record_row(report, row, args.out, f"[layout] {row}")
    # bf16 orientations agree to rounding; int8 forms to their quantization (~1 % of the product)
    ok = lambda r: all(v < (5e-2 if key.startswith("int8") else 2e-2) for key, v in r.items()
                       if key.endswith("_err")) and not any(key.endswith("_error") for key in r)
    forms = ORIENTATIONS + (INT8_FORMS if args.int8 else ())
    print(f"\n{'shape':>18} {'m':>4} {'ok':>5} " + " ".join(f"{f + ' us':>16} {'kernel ' + f:>20}" for f in forms))
    for r in report["rows"]:
        print(f"{r['shape']:>18} {r['m']:>4} {str(ok(r)):>5} "
              + " ".join(f"{fmt(r.get(f + '_us')):>16} {fmt(r.get(f + '_kernel_us')):>20}" for f in forms))
    return 0 if all(ok(r) for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
