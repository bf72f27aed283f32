"""GPU check + benchmark of the skinny matmul kernel with int8 weights (pallas_kernels/skinny_matmul.py,
weight-only int8 with a float32 column scale: the int8 drafter, ddtree_jax/models/int8.py) against
XLA's int8 product (the same math: `skinny_matmul.reference`) and XLA's bf16 product of the same
weights, at the 27B-width drafter's shapes and a DFlash block's rows (16 at batch 1; 128 at
batch 8; the draft head 15 / 120).

Why: session 13 measured XLA's int8 GEMMs at 16 rows reading 1.9-3.2 TB/s of int8, so the int8
drafter saved less than half of the bytes it halves; a kernel that streams int8 at the bf16 GEMMs'
rate would take the draft phase from ~1.35 to ~0.9 ms (docs/benchmarks.md section 4).

Correctness: each variant's output against XLA's int8 product (relative max error; same values up
to accumulation order and one rounding). Timing: `gpu_skinny_matmul.time_variant` (inside one
jitted on-device loop, the weights rotated over distinct copies past L2, x behind an optimization
barrier; median of rounds after a warm-up, never on zeros), and with --trace the kernel time from
a profiler trace. TB/s is of the stored weight (int8: 1 byte an element). Prints a table, writes
JSON (rewritten after every row); exits 1 when a variant errs or disagrees.

    PYTHONPATH=. python3 scripts/gpu_int8_matmul.py --out $OUT/int8_matmul.json      # on the H200
    PYTHONPATH=. python3 scripts/gpu_int8_matmul.py --cpu-smoke                      # any machine
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_bench_common import err_str, fmt, kernel_run_setup, record_row  # noqa: E402
from gpu_skinny_matmul import kernel_us, problem, time_variant  # noqa: E402

# (K, N) of the 27B-width DFlash drafter (hidden 5120, FFN 17408, 32 q / 8 kv heads of 128, 5 target
# layers' features into fc) and the target's head it drafts through
SHAPES = {
    "gate_up": (5120, 34816),
    "down": (17408, 5120),
    "qkv": (5120, 6144),
    "o": (4096, 5120),
    "ctx_kv": (5120, 1024),
    "fc": (25600, 5120),
    "lm_head": (5120, 248320),
}
SMOKE_SHAPES = {"a": (256, 384), "b": (192, 100)}
ROWS = {"lm_head": (15, 120)}  # the draft head sees the block's positions 1..15
DEFAULT_ROWS = (16, 128)


def configs(k: int, n: int, smoke: bool) -> dict:
    """{name: (tiling, weight layout)} to time for a [K, N] weight: the default and variations of
    it (the K split of each sized by the same rule as the default: skinny_matmul.filling_split),
    with the weight stored [K, N] ("in_out", ours) and, names ending "_t", [N, K] ("out_in": each
    tile K-major, the form wgmma's A operand loads without a byte transpose; offline sm_90 SASS:
    74 registers and 64 PRMT against 156 and 480, `offline_triton_compile.py int8_matmul`)."""
    from pallas_kernels.skinny_matmul import SkinnyConfig, default_config, filling_split

    if smoke:
        return {"default": (default_config(16, k, n, int8=True), "in_out"),
                "c32_cvt": (SkinnyConfig(block_n=32, block_k=32, dequant="cvt"), "in_out"),
                "r32": (SkinnyConfig(block_n=32, block_k=32, layout="rows"), "in_out"),
                "c32_t": (SkinnyConfig(block_n=32, block_k=32), "out_in")}
    out = {"default": (default_config(16, k, n, int8=True), "in_out")}
    for bn, bk, warps, stages, dequant, layout, w_layout in [
            (64, 128, 4, 4, "magic", "cols", "in_out"), (64, 256, 4, 3, "magic", "cols", "in_out"),
            (128, 128, 8, 4, "magic", "cols", "in_out"), (128, 128, 8, 4, "cvt", "cols", "in_out"),
            (64, 128, 4, 4, "magic", "rows", "in_out"),
            (64, 128, 4, 4, "magic", "cols", "out_in"), (128, 128, 8, 4, "magic", "cols", "out_in"),
            (128, 128, 8, 4, "cvt", "cols", "out_in"), (128, 256, 8, 3, "magic", "cols", "out_in"),
            (64, 256, 4, 4, "magic", "cols", "out_in"), (128, 128, 4, 4, "magic", "cols", "out_in")]:
        cfg = SkinnyConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, dequant=dequant,
                           layout=layout, split_k=filling_split(k, n, bn, bk))
        out[f"{layout[0]}{bn}_k{bk}_w{warps}_s{stages}_{dequant}" + ("_t" if w_layout == "out_in" else "")] = (
            cfg, w_layout)
    return out


def quantize_cols_fp8(w):
    """w [K, N] -> (q float8_e4m3fn [N, K] (stored [out, in]), scale float32 [N]) per column."""
    import jax.numpy as jnp

    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=0)
    sc = jnp.where(amax > 0, amax / float(jnp.finfo(jnp.float8_e4m3fn).max), 1.0)
    return jnp.asarray((w32 / sc).astype(jnp.float8_e4m3fn).T), sc


def fp8_product(x, w):
    """The e4m3 form of W8A8 (models.int8.w8a8_product is the int8 one, the drafter's): x [M, K]
    per row and w = (q [N, K], column scale) both float8 e4m3 (absmax / 448), the GEMM multiplies
    the 8-bit values into float32 (cuBLASLt's FP8 kernels on Hopper), the two scales after."""
    import jax
    import jax.numpy as jnp

    q, wsc = w
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    xsc = jnp.where(amax > 0, amax / float(jnp.finfo(jnp.float8_e4m3fn).max), 1.0)
    y = jax.lax.dot_general((x32 / xsc).astype(jnp.float8_e4m3fn), q, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return (y * xsc * wsc).astype(x.dtype)


def run_row(name: str, m: int, k: int, n: int, on_gpu: bool, impl: str, smoke: bool, trace: bool,
            xla_only: bool = False) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax.models import int8
    from pallas_kernels.skinny_matmul import reference, skinny_matmul

    row = {"shape": name, "m": m, "k": k, "n": n}
    x, ws = problem(hash((name, m)) % 2**31, m, k, n, on_gpu)
    qs = [int8.quantize(w) for w in ws]  # as many copies as the bf16 rotation: past L2 either way
    qts = [(jnp.asarray(q.T), sc) for q, sc in qs]  # stored [N, K]
    f8s = [quantize_cols_fp8(w) for w in ws]  # stored [N, K]
    weights = {"in_out": qs, "out_in": qts}
    fns = {"xla_bf16": (lambda a, w: jnp.matmul(a, w), ws), "xla_int8": (lambda a, w: reference(a, *w), qs),
           "xla_int8_t": (lambda a, w: reference(a, *w, w_layout="out_in"), qts),
           "xla_w8a8_t": (lambda a, w: int8.w8a8_product(a, *w, layout="out_in"), qts),
           "xla_fp8_t": (fp8_product, f8s)}
    for cname, (cfg, w_layout) in ({} if xla_only else configs(k, n, smoke)).items():
        fns[cname] = (lambda a, w, c=cfg, lay=w_layout: skinny_matmul(a, w[0], w[1], impl=impl, config=c,
                                                                      w_layout=lay), weights[w_layout])
        row[cname + "_config"] = dict(vars(cfg), w_layout=w_layout)
    want = np.asarray(jax.jit(fns["xla_int8"][0])(x, qs[0]).astype(jnp.float32))
    scale = float(np.abs(want).max()) or 1.0
    for vname, (f, weights) in fns.items():
        try:
            got = np.asarray(jax.jit(f)(x, weights[0]).astype(jnp.float32))
            row[vname + "_err"] = float(np.abs(got - want).max()) / scale
            t = time_variant(f, x, weights, on_gpu)
            row[vname + "_us"] = t * 1e6
            row[vname + "_TBps"] = (2 if vname == "xla_bf16" else 1) * k * n / t / 1e12  # bytes of the weight
            if trace:
                row[vname + "_kernel_us"] = kernel_us(f, x, weights, on_gpu)
        except Exception as e:  # one failing variant never hides the others
            row[vname + "_error"] = err_str(e)
    del ws, qs, qts, f8s, weights
    return row


def best_kernel(row: dict) -> tuple[str | None, float | None]:
    times = {key[:-3]: v for key, v in row.items() if key.endswith("_us") and not key.startswith("xla")
             and not key.endswith("kernel_us") and v is not None}
    if not times:
        return None, None
    name = min(times, key=times.get)
    return name, times[name]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="interpret mode, small shapes (checks the script)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default=None, help="row counts (default: 16 and 128; the draft head 15 and 120)")
    ap.add_argument("--trace", action="store_true", help="also the kernel time from a profiler trace")
    ap.add_argument("--xla-only", action="store_true", help="XLA's products only (bf16, int8, W8A8), no kernel tilings")
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting rows after this many seconds")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "int8_matmul.json"))
    args = ap.parse_args(argv)
    setup = kernel_run_setup("gpu_int8_matmul.py", argv, args.cpu_smoke)
    if setup is None:
        return 2
    on_gpu, impl, report = setup
    shapes = SMOKE_SHAPES if args.cpu_smoke else SHAPES
    names = list(shapes) if args.cpu_smoke else args.shapes.split(",")
    unknown = [s for s in names if s not in shapes]
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {', '.join(shapes)}")
    t0 = time.time()
    for name in names:
        k, n = shapes[name]
        rows = ([int(v) for v in args.rows.split(",")] if args.rows
                else (16,) if args.cpu_smoke else ROWS.get(name, DEFAULT_ROWS))
        for m in rows:
            if time.time() - t0 > args.budget_s:
                report["stopped"] = f"budget of {args.budget_s} s reached"
                break
            row = run_row(name, m, k, n, on_gpu, impl, args.cpu_smoke, args.trace, args.xla_only)
            row["best"], row["best_us"] = best_kernel(row)
            record_row(report, row, args.out,
                       f"[int8] {name} m={m}: bf16 {fmt(row.get('xla_bf16_us'))} us, xla int8 "
                       f"{fmt(row.get('xla_int8_us'))} us ([N, K]: {fmt(row.get('xla_int8_t_us'))}; W8A8 int8 "
                       f"{fmt(row.get('xla_w8a8_t_us'))}, e4m3 {fmt(row.get('xla_fp8_t_us'))}), kernel default "
                       f"{fmt(row.get('default_us'))} us, best {row['best']} {fmt(row['best_us'])} us")
    # the kernel and XLA's int8 product compute the same values up to accumulation order and the
    # output's rounding (bf16: 2^-8 of the largest product); bf16 weights differ by the quantization,
    # W8A8 also by the activations' (int8: 1/254 of a row's absmax; e4m3: 3 mantissa bits, both operands)
    tol = {"xla_bf16": 5e-2, "xla_w8a8": 5e-2, "xla_fp8_": 2e-1}
    ok = lambda r: all(v < tol.get(key[:8], 1e-2) for key, v in r.items()
                       if key.endswith("_err")) and not any(key.endswith("_error") for key in r)
    print(f"\n{'shape':>8} {'m':>4} {'ok':>5} {'bf16 us':>9} {'int8 us':>9} {'[N,K]':>9} {'W8A8 i8':>9} {'W8A8 f8':>9} "
          f"{'default':>9} {'TB/s':>6} {'best us':>9}  best")
    for r in report["rows"]:
        print(f"{r['shape']:>8} {r['m']:>4} {str(ok(r)):>5} {fmt(r.get('xla_bf16_us')):>9} {fmt(r.get('xla_int8_us')):>9} "
              f"{fmt(r.get('xla_int8_t_us')):>9} {fmt(r.get('xla_w8a8_t_us')):>9} {fmt(r.get('xla_fp8_t_us')):>9} "
              f"{fmt(r.get('default_us')):>9} {fmt(r.get('default_TBps'), '.2f'):>6} {fmt(r.get('best_us')):>9}  {r['best']}")
    bad = [f"{r['shape']} m={r['m']}" for r in report["rows"] if not ok(r)]
    if bad:
        print(f"FAILED (error or disagreement): {', '.join(bad)}")
    print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
