"""GPU check + benchmark of the one-launch DDTree beam (pallas_kernels/tree_beam.py) against the
XLA beam it replaces (ddtree_jax.spec.build.beam_xla: pairwise ranks, ~4 launches per depth).

Correctness: the kernel's scores / parents / ranks equal the XLA beam's array for array on
random per-depth candidates with exact ties (quantized values) and -inf. Timing: both forms run
back to back inside one jitted on-device loop (as in the generation loop, where a small model's
step is bound by launches), median of rounds after a warm-up, never on zeros. Prints a table and
writes JSON.

    PYTHONPATH=. python3 scripts/gpu_tree_beam.py --out $OUT/tree_beam.json      # on the H200
    PYTHONPATH=. python3 scripts/gpu_tree_beam.py --cpu-smoke                    # any machine
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from gpu_bench_common import err_str, fmt, time_jax  # noqa: E402
from ddtree_jax import atomic  # noqa: E402


def problem(seed: int, batch: int, depth: int, k: int, rotations: int):
    """Rotated [batch, depth, k] candidate sets in lax.top_k order, with ties and some -inf."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(rotations):
        x = -np.abs(rng.normal(size=(batch, depth, k))).astype(np.float32) * 3
        x = np.round(x * 4) / 4
        x[rng.random(x.shape) < 0.03] = -np.inf
        sets.append(jax.lax.top_k(jnp.asarray(x), k)[0])
    return sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="interpret mode, small shapes (checks the script)")
    ap.add_argument("--budgets", default="4,8,16", help="beam widths (k = budget candidates per depth)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--depth", type=int, default=15, help="draft depths (DFlash block 16 -> 15)")
    ap.add_argument("--warps", default="", help="also time the kernel at these num_warps, e.g. 1,2,4,8")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tree_beam.json"))
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from pallas_kernels.tree_beam import beam

    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    if not on_gpu and not args.cpu_smoke:
        print("no GPU visible to jax: run on the H200, or use --cpu-smoke", file=sys.stderr)
        return 2
    impl = "pallas" if on_gpu else "pallas_interpret"
    depth = 4 if args.cpu_smoke else args.depth
    budgets = [int(x) for x in args.budgets.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["scripts/gpu_tree_beam.py"] + (argv if argv is not None else sys.argv[1:])),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, "depth": depth, "rows": []}
    for batch in batches:
        for budget in budgets:
            row = {"batch": batch, "budget": budget, "k": budget}
            sets = problem(batch * 100 + budget, batch, depth, budget, 1 if args.cpu_smoke else 4)
            # i (the loop index) shifts every candidate by the same amount: same ties, new values
            fns = {name: (lambda i, v, im=im: beam(v - i * 2.0**-10, budget, impl=im))
                   for name, im in (("kernel", impl), ("xla", "xla"))}
            for nw in [int(x) for x in args.warps.split(",") if x]:
                fns[f"kernel_w{nw}"] = lambda i, v, nw=nw: beam(v - i * 2.0**-10, budget, impl=impl, num_warps=nw)
            try:
                want = jax.jit(lambda v: beam(v, budget, impl="xla"))(sets[0])
                got = jax.jit(lambda v: beam(v, budget, impl=impl))(sets[0])
                row["equal"] = all(bool((np.asarray(a) == np.asarray(b)).all()) for a, b in zip(want, got))
            except Exception as e:
                row["error"] = err_str(e)
            for name, f in fns.items():
                try:
                    t, info = time_jax(f, sets, 30e-6, on_gpu=on_gpu)
                    row[name + "_us"] = t * 1e6
                except Exception as e:
                    row[name + "_error"] = err_str(e)
            report["rows"].append(row)
            atomic.write_json(args.out, report)
            print(f"[beam] {row}", flush=True)
    extra = sorted({k for r in report["rows"] for k in r if k.startswith("kernel_w") and k.endswith("_us")})
    print(f"\n{'B':>2} {'budget':>6} {'equal':>6} {'kernel us':>10} {'xla us':>8} {'xla/kernel':>10}"
          + "".join(f" {k[7:-3] + ' us':>9}" for k in extra))
    for r in report["rows"]:
        ratio = r["xla_us"] / r["kernel_us"] if "xla_us" in r and "kernel_us" in r else None
        print(f"{r['batch']:>2} {r['budget']:>6} {str(r.get('equal', '-')):>6} {fmt(r.get('kernel_us')):>10}"
              f" {fmt(r.get('xla_us')):>8} {fmt(ratio, '.2f'):>10}" + "".join(f" {fmt(r.get(k)):>9}" for k in extra))
    print(f"wrote {args.out}")
    failed = [r for r in report["rows"] if not r.get("equal") or any(k.endswith("error") for k in r)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
