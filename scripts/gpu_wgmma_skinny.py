"""GPU check + benchmark of the Mosaic GPU skinny matmul (pallas_kernels/wgmma_skinny.py) against
XLA's dot (cuBLAS) at the 27B target's projections, 65 rows (a DDTree verify; --rows 65,16 adds a
DFlash block's 16).

Per shape and row count: correctness of every kernel config against XLA's dot (relative max
error, random bf16 data, never zeros), then time per product of XLA's dot and of each config
inside one jitted on-device loop with the weight rotated over distinct copies (>= 512 MB per
round, so the 60 MB L2 holds none of them) and x behind an optimization barrier with the loop
index; warm-up, then the median of rounds (gpu_bench_common.time_jax). Reports us and weight
GB/s (weight bytes / time). A config that fails (compile error, shared memory) is recorded in the
JSON and the table and the others go on. JSON is rewritten (atomically) after every row.

    PYTHONPATH=. python3 scripts/gpu_wgmma_skinny.py --out $OUT/wgmma.json    # on the H200
    PYTHONPATH=. python3 scripts/gpu_wgmma_skinny.py --cpu-smoke               # any machine: lowers only
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_bench_common import err_str, fmt, time_jax  # noqa: E402
from ddtree_jax import atomic  # noqa: E402

SHAPES = {  # name: (K, N) of the 27B-shaped target
    "mlp_down": (17408, 5120),
    "out_proj": (6144, 5120),
    "gdn_qkvzba": (5120, 16480),
    "mlp_gate_up": (5120, 34816),
    "attn_qkv": (5120, 14336),
}
ERR_OK = 2e-2


def configs():
    from pallas_kernels.wgmma_skinny import WgmmaSkinnyConfig as C

    return {
        "sk_n128_k64_s6": C(block_n=128, tile_k=64, stages=6),
        "sk_n256_k64_s4": C(block_n=256, tile_k=64, stages=4),
        "sk_n128_k128_s3": C(block_n=128, tile_k=128, stages=3),
        "split_n128_k64_s6": C(block_n=128, tile_k=64, stages=6, schedule="split_k"),
    }


def problem(seed: int, m: int, k: int, n: int):
    """x [m, k] and distinct weight copies [k, n] (bf16, normal / sqrt(k)): >= 512 MB a round."""
    import jax
    import jax.numpy as jnp

    rot = min(8, max(2, math.ceil(512e6 / (2 * k * n))))
    key = jax.random.PRNGKey(seed)
    x = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
    ws = [(jax.random.normal(jax.random.fold_in(key, r + 1), (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
          for r in range(rot)]
    return x, ws


def time_variant(f, x, ws):
    from jax import lax

    def call(i, w):
        xi, _ = lax.optimization_barrier((x, i))
        return f(xi, w)

    t, _ = time_jax(call, ws, 2 * ws[0].size / 4e12)
    return t


def run_row(name, m, k, n, cfgs):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.wgmma_skinny import wgmma_skinny

    row = {"shape": name, "m": m, "k": k, "n": n, "weight_MB": 2 * k * n / 1e6}
    x, ws = problem(abs(hash((name, m))) % 2**31, m, k, n)
    want = np.asarray(jax.jit(jnp.matmul)(x, ws[0]).astype(jnp.float32))
    scale = float(np.abs(want).max()) or 1.0
    fns = {"xla": jnp.matmul}
    fns.update({c: (lambda a, w, cfg=cfg: wgmma_skinny(a, w, impl="mosaic", config=cfg)) for c, cfg in cfgs.items()})
    for vname, f in fns.items():
        try:
            got = np.asarray(jax.jit(f)(x, ws[0]).astype(jnp.float32))
            row[vname + "_err"] = float(np.abs(got - want).max()) / scale
            t = time_variant(f, x, ws)
            row[vname + "_us"] = t * 1e6
            row[vname + "_GBps"] = 2 * k * n / t / 1e9
        except Exception as e:  # one failing config must not stop the others
            row[vname + "_error"] = err_str(e)
    del ws
    return row


def cpu_smoke(rows) -> dict:
    """Lower every config for CUDA at every shape (no GPU): {config: {shape_m: 'ok' | error}}."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.wgmma_skinny import wgmma_skinny

    out = {}
    for cname, cfg in configs().items():
        out[cname] = {}
        for sname, (k, n) in SHAPES.items():
            for m in rows:
                x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
                w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
                try:
                    jax.jit(lambda x, w: wgmma_skinny(x, w, impl="mosaic", config=cfg)).trace(x, w).lower(
                        lowering_platforms=("cuda",))
                    res = "ok"
                except Exception as e:
                    res = err_str(e)
                out[cname][f"{sname}_m{m}"] = res
                print(f"[wgmma smoke] {cname:>20} {sname:>12} m={m:<3} {res}", flush=True)
    return out


def print_table(rows, variants):
    print(f"\n{'shape':>12} {'m':>4} {'MB':>7}" + "".join(f" {v[:20]:>20}" for v in variants) + "  best")
    for r in rows:
        cells, best, best_t = [], "-", float("inf")
        for v in variants:
            if v + "_error" in r:
                cells.append("ERROR")
            elif r.get(v + "_us") is None:
                cells.append("-")
            else:
                bad = "" if r.get(v + "_err", 1) < ERR_OK else " BAD"
                cells.append(f"{fmt(r[v + '_us'])}us {fmt(r[v + '_GBps'], '.0f')}{bad}")
                if not bad and r[v + "_us"] < best_t:
                    best, best_t = v, r[v + "_us"]
        print(f"{r['shape']:>12} {r['m']:>4} {r['weight_MB']:>7.0f}" + "".join(f" {c:>20}" for c in cells) + f"  {best}")
    print("(cells: time us, weight GB/s; BAD: relative error >= %g; errors in the JSON)" % ERR_OK)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: lower every config for CUDA")
    ap.add_argument("--rows", default="65", help="row counts, e.g. 65,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--configs", default="", help="subset of " + ", ".join(configs()))
    ap.add_argument("--budget-s", type=float, default=170, help="stop starting rows after this many seconds")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "wgmma.json"))
    args = ap.parse_args(argv)
    rows = [int(v) for v in args.rows.split(",")]
    if args.cpu_smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import datetime

    import jax

    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["scripts/gpu_wgmma_skinny.py"] + (argv if argv is not None else sys.argv[1:])),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": []}
    all_cfgs = configs()
    names = [c for c in args.configs.split(",") if c] or list(all_cfgs)
    unknown = [c for c in names if c not in all_cfgs]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {', '.join(all_cfgs)}")
    cfgs = {c: all_cfgs[c] for c in names}
    report["configs"] = {c: vars(cfg) for c, cfg in cfgs.items()}
    if args.cpu_smoke:
        report["lowering"] = cpu_smoke(rows)
        atomic.write_json(args.out, report)
        bad = {c: {s: r for s, r in v.items() if r != "ok"} for c, v in report["lowering"].items()}
        bad = {c: v for c, v in bad.items() if v}
        print(f"wrote {args.out}; " + ("all configs lower" if not bad else f"lowering failures: {bad}"))
        return 1 if bad else 0
    if not any(d.platform == "gpu" for d in jax.devices()):
        print("no GPU visible to jax: run on the H200, or use --cpu-smoke", file=sys.stderr)
        return 2
    t0 = time.time()
    for sname in args.shapes.split(","):
        k, n = SHAPES[sname]
        for m in rows:
            if time.time() - t0 > args.budget_s:
                report["stopped"] = f"budget of {args.budget_s} s reached"
                break
            row = run_row(sname, m, k, n, cfgs)
            row["elapsed_s"] = time.time() - t0
            report["rows"].append(row)
            atomic.write_json(args.out, report)
            times = " ".join(f"{key[:-3]}={v:.1f}" for key, v in row.items() if key.endswith("_us"))
            errs = " ".join(f"{key[:-6]}: {v[:160]}" for key, v in row.items() if key.endswith("_error"))
            print(f"[wgmma] {sname} m={m}: {times} us {errs}", flush=True)
    atomic.write_json(args.out, report)
    print_table(report["rows"], ["xla", *cfgs])
    print(f"wrote {args.out}")
    failed = [r for r in report["rows"]
              if any(key.endswith("_error") for key in r) or any(v >= ERR_OK for key, v in r.items() if key.endswith("_err"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
