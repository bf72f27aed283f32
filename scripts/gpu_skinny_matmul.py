"""GPU check + benchmark of the skinny matmul kernel (pallas_kernels/skinny_matmul.py) against
XLA's dot (cuBLAS / XLA's Triton GEMM, whichever XLA picks) on the 27B-shaped target's projections
at a DDTree verify's 65 rows (budget 64 + root) and a DFlash block's 16.

Two passes: (1) every config of CONFIGS on the sweep shapes at the sweep rows (default: the four
largest projections at 65 rows); (2) the `--keep` configs with the best geometric-mean time of
pass 1 on every shape at every row count. Correctness: each kernel output against XLA's (relative
max error, bf16). Timing: inside one jitted on-device loop, the weight rotated over distinct
copies (>= 512 MB per round, so L2 holds none of them), x behind an optimization barrier with
the loop index (XLA cannot hoist the product out of the loop; no extra kernel); median of rounds
after a warm-up, never on zeros. Prints a table and writes JSON (rewritten after every row).

    PYTHONPATH=. python3 scripts/gpu_skinny_matmul.py --out $OUT/skinny.json      # on the H200
    PYTHONPATH=. python3 scripts/gpu_skinny_matmul.py --cpu-smoke                 # any machine
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_bench_common import err_str, kernel_run_setup, print_timing_table, time_jax  # noqa: E402
from ddtree_jax import atomic  # noqa: E402

# (name, K, N) of the 27B-shaped target (hidden 5120, FFN 17408, attention 24 x 256 with output
# gate, 4 kv heads; GDN 16 k / 48 v heads of 128; vocab 248320)
SHAPES = {
    "mlp_gate_up": (5120, 17408),
    "mlp_down": (17408, 5120),
    "gdn_qkv": (5120, 10240),
    "gdn_z": (5120, 6144),
    "out_proj": (6144, 5120),
    "attn_q": (5120, 12288),
    "mlp_gate_up_merged": (5120, 34816),
    "attn_kv": (5120, 1024),
    "lm_head": (5120, 248320),
}
SMOKE_SHAPES = {"a": (128, 256), "b": (96, 100)}


def configs(smoke: bool):
    from pallas_kernels.skinny_matmul import SkinnyConfig as C

    if smoke:
        return {"c64": C(block_n=64, block_k=32), "r32": C(block_n=32, block_k=32, layout="rows")}
    # session 7's first sweep (wall clock): the 64-column configs and split-K 2 led; rows layout,
    # 256 columns, 8 warps and 32 columns lost everywhere
    out = {}
    for bn, bk, stages, split in [(64, 64, 3, 1), (64, 64, 5, 1), (64, 128, 3, 1), (64, 128, 5, 1), (64, 64, 6, 1),
                                  (64, 256, 3, 1), (64, 64, 4, 2), (64, 128, 4, 2), (64, 128, 4, 4),
                                  (128, 64, 4, 2), (128, 64, 5, 1), (128, 64, 4, 4), (128, 128, 4, 2)]:
        out[f"c{bn}_k{bk}_s{stages}" + (f"_split{split}" if split > 1 else "")] = C(
            block_n=bn, block_k=bk, num_stages=stages, split_k=split)
    out["c128_k64_s4_tile128"] = C(block_n=128, block_k=64, num_stages=4, max_row_tile=128)
    out["r64_k64_s4"] = C(block_n=64, block_k=64, num_stages=4, layout="rows")
    return out


MGPU_CONFIGS = {  # jax's own Hopper matmul (TMA loads, wgmma; jax.experimental.pallas.ops.gpu): (tile_n, tile_k, steps)
    "mgpu_n128_k64_s4": (128, 64, 4),
    "mgpu_n64_k64_s6": (64, 64, 6),
    "mgpu_n64_k64_s4": (64, 64, 4),  # (the larger tilings exceed shared memory: checked by --cpu-smoke)
}


def mgpu_matmul(tile_n: int, tile_k: int, steps: int):
    """x [m <= 128, k] @ w through jax's Hopper matmul kernel (Pallas Mosaic GPU) with x padded to
    one 128-row tile: whether TMA + wgmma streams a weight at the GEMV rate at few rows, which
    would justify a skinny kernel of our own in that form (docs/kernels_dense.md)."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    cfg = hm.TuningConfig(tile_m=128, tile_n=tile_n, tile_k=tile_k, max_concurrent_steps=steps)

    def f(x, w):
        m = x.shape[0]
        if m > 128:
            raise ValueError(f"mgpu variant takes up to 128 rows, got {m}")
        xp = jnp.pad(x, ((0, 128 - m), (0, 0))) if m < 128 else x
        return hm.matmul(xp, w, None, cfg)[:m]

    return f


def check_mgpu_lowering() -> dict:
    """--cpu-smoke: the Mosaic GPU variants cannot run off a GPU, but they must lower for CUDA
    (catches API changes of the jax version at hand). Returns {variant: 'ok' or the error}."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    sms = hm.get_num_sms
    hm.get_num_sms = lambda: 132  # no device to ask on the CPU
    out = {}
    try:
        for name, (tn, tk, st) in MGPU_CONFIGS.items():
            x = jax.ShapeDtypeStruct((65, 5120), jnp.bfloat16)
            w = jax.ShapeDtypeStruct((5120, 17408), jnp.bfloat16)
            try:
                jax.jit(mgpu_matmul(tn, tk, st)).trace(x, w).lower(lowering_platforms=("cuda",))
                out[name] = "ok"
            except Exception as e:
                out[name] = err_str(e)
    finally:
        hm.get_num_sms = sms
    return out


def problem(seed: int, m: int, k: int, n: int, on_gpu: bool):
    """x [m, k] and distinct weight copies [k, n] (bf16, normal / sqrt(k))."""
    import jax
    import jax.numpy as jnp

    nbytes = 2 * k * n
    rot = min(16, max(1, math.ceil(512e6 / nbytes))) if on_gpu else 1
    key = jax.random.PRNGKey(seed)
    x = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
    ws = [(jax.random.normal(jax.random.fold_in(key, r + 1), (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
          for r in range(rot)]
    return x, ws


def kernel_us(f, x, ws, on_gpu):
    """GPU kernel time per product from a profiler trace of back-to-back calls (no loop, no host
    work in the window): what a profile of the model reports for the same kernels."""
    import tempfile

    import jax

    from profile_step import gpu_kernels

    if not on_gpu:
        return None
    run = jax.jit(lambda ws: [f(x, w) for w in ws])
    jax.block_until_ready(run(ws))
    calls = 3
    d = tempfile.mkdtemp(prefix="skinny_trace_")
    with jax.profiler.trace(d):
        for _ in range(calls):
            jax.block_until_ready(run(ws))
    events = gpu_kernels(d)
    return sum(us for _, _, us in events) / (calls * len(ws))


def time_variant(f, x, ws, on_gpu):
    from jax import lax

    def call(i, w):
        xi, _ = lax.optimization_barrier((x, i))
        return f(xi, w)

    import jax

    est = sum(a.nbytes for a in jax.tree_util.tree_leaves(ws[0])) / 4e12  # a weight may be a (q, scale) pytree
    t, _ = time_jax(call, ws, est, on_gpu=on_gpu)
    return t


def run_row(name, m, k, n, variants, on_gpu, impl, trace=False, mgpu=()):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.skinny_matmul import skinny_matmul

    row = {"shape": name, "m": m, "k": k, "n": n}
    x, ws = problem(hash((name, m)) % 2**31, m, k, n, on_gpu)
    want = np.asarray(jax.jit(jnp.matmul)(x, ws[0]).astype(jnp.float32))
    scale = float(np.abs(want).max()) or 1.0
    fns = {"xla": jnp.matmul}
    if m == 1:  # the decode GEMV: the rate the verify's products are measured against
        variants = {}
    fns.update({cname: (lambda a, w, c=c: skinny_matmul(a, w, impl=impl, config=c)) for cname, c in variants.items()})
    if m > 1:
        fns.update({v: mgpu_matmul(*MGPU_CONFIGS[v]) for v in mgpu})
    for vname, f in fns.items():
        try:
            got = np.asarray(jax.jit(f)(x, ws[0]).astype(jnp.float32))
            row[vname + "_err"] = float(np.abs(got - want).max()) / scale
            t = time_variant(f, x, ws, on_gpu)
            row[vname + "_us"] = t * 1e6
            row[vname + "_TBps"] = 2 * k * n / t / 1e12
            if trace:
                row[vname + "_kernel_us"] = kernel_us(f, x, ws, on_gpu)
        except Exception as e:
            row[vname + "_error"] = err_str(e)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="interpret mode, small shapes (checks the script)")
    ap.add_argument("--sweep-shapes", default="mlp_gate_up,mlp_down,gdn_qkv,out_proj")
    ap.add_argument("--sweep-rows", default="65")
    ap.add_argument("--rows", default="1,16,65", help="row counts of pass 2 (1: XLA's GEMV only)")
    ap.add_argument("--trace", action="store_true",
                    help="also read each variant's kernel time from a profiler trace (and rank configs by it)")
    ap.add_argument("--keep", type=int, default=3, help="configs carried into pass 2")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting rows after this many seconds")
    ap.add_argument("--mgpu", default=",".join(MGPU_CONFIGS),
                    help="jax's Hopper matmul variants to time beside ours ('' for none): " + ", ".join(MGPU_CONFIGS))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "skinny_matmul.json"))
    args = ap.parse_args(argv)
    setup = kernel_run_setup("gpu_skinny_matmul.py", argv, args.cpu_smoke)
    if setup is None:
        return 2
    on_gpu, impl, report = setup
    t_start = time.time()
    shapes = SMOKE_SHAPES if args.cpu_smoke else SHAPES
    sweep_shapes = list(shapes) if args.cpu_smoke else args.sweep_shapes.split(",")
    all_cfgs = configs(args.cpu_smoke)
    report["configs"] = {name: vars(c) for name, c in all_cfgs.items()}
    rows_ok = lambda r: all(v < 2e-2 for key, v in r.items() if key.endswith("_err"))
    mgpu = [v for v in args.mgpu.split(",") if v]
    unknown = [v for v in mgpu if v not in MGPU_CONFIGS]
    if unknown:
        ap.error(f"unknown --mgpu variants {unknown}; known: {', '.join(MGPU_CONFIGS)}")
    if not on_gpu:  # cannot run off a GPU: check that they lower for CUDA instead
        report["mgpu_lowering"] = check_mgpu_lowering()
        print(f"[skinny] Mosaic GPU variants lowered for CUDA: {report['mgpu_lowering']}", flush=True)
        mgpu = []

    def add(row, tag):
        row["pass"] = tag
        report["rows"].append(row)
        atomic.write_json(args.out, report)
        times = " ".join(f"{key[:-3]}={v:.1f}" for key, v in row.items() if key.endswith("_us") and v is not None)
        print(f"[skinny {tag}] {row['shape']} m={row['m']}: {times} us", flush=True)

    for name in sweep_shapes:
        for m in [int(v) for v in args.sweep_rows.split(",")]:
            if time.time() - t_start > args.budget_s:
                break
            k, n = shapes[name]
            add(run_row(name, m, k, n, all_cfgs, on_gpu, impl, args.trace, mgpu), "sweep")
    sweep = [r for r in report["rows"] if r["pass"] == "sweep"]
    score = {}
    for c in list(all_cfgs) + mgpu:
        unit = "_kernel_us" if args.trace and on_gpu else "_us"  # rank by kernel time when traced
        rel = [r[c + unit] / r["xla" + unit] for r in sweep
               if r.get(c + unit) and r.get("xla" + unit) and r.get(c + "_err", 1) < 2e-2]
        if len(rel) == len(sweep) and rel:
            score[c] = math.exp(sum(math.log(v) for v in rel) / len(rel))
    report["sweep_score"] = score  # geometric mean of kernel / XLA time over the sweep rows (traced: kernel time)
    keep = sorted(score, key=score.get)[: args.keep]
    report["kept"] = keep
    print(f"sweep score (kernel / xla time, geometric mean): {sorted(score.items(), key=lambda kv: kv[1])}")
    for name, (k, n) in shapes.items():
        for m in [int(v) for v in args.rows.split(",")]:
            if time.time() - t_start > args.budget_s:
                report["stopped"] = f"budget of {args.budget_s} s reached"
                break
            add(run_row(name, m, k, n, {c: all_cfgs[c] for c in keep if c in all_cfgs}, on_gpu, impl, args.trace,
                        [c for c in keep if c in MGPU_CONFIGS]), "all")
    atomic.write_json(args.out, report)
    print_timing_table([r for r in report["rows"] if r["pass"] == "all"] or report["rows"],
                       [("shape", "shape", 12, None), ("m", "m", 4, None)], rows_ok)
    print(f"wrote {args.out}")
    failed = [r for r in report["rows"] if not rows_ok(r) or any(key.endswith("error") for key in r)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
