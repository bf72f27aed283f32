"""GPU check + benchmark of the row top-k kernel (pallas_kernels/row_top_k.py) against the GPU
form of the vocabulary top-k it replaces in the DDTree build (ddtree_jax.speculative.build.top_k: sorts
staged over chunks of 2048, then over the chunk winners) and plain lax.top_k.

Correctness: values and indices equal lax.top_k's on log-softmax rows with exact ties
(quantized logits) and -inf. Timing: each form runs inside one jitted on-device loop (as in the
generation loop), median of rounds after a warm-up, never on zeros. Shapes: the draft depths'
rows ([batch, 15, n]). Prints a table and writes JSON.

    PYTHONPATH=. python3 scripts/gpu_row_top_k.py --warps 4,16 --out $OUT/row_top_k.json   # on the H200
    PYTHONPATH=. python3 scripts/gpu_row_top_k.py --cpu-smoke                                 # any machine
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from gpu_bench_common import err_str, kernel_run_setup, print_timing_table, time_jax  # noqa: E402
from ddtree_jax import atomic  # noqa: E402


def problem(seed: int, batch: int, depth: int, n: int, rotations: int):
    """Log-softmax rows with many exact ties (logits on a coarse grid) and some -inf."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(rotations):
        logits = np.round(rng.normal(size=(batch, depth, n)) * 4) / 2
        logits[rng.random(logits.shape) < 0.01] = -np.inf
        sets.append(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    return sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="interpret mode, small shapes (checks the script)")
    ap.add_argument("--lengths", default="2048,8192", help="row lengths (the demo's vocabulary: 8192)")
    ap.add_argument("--ks", default="16,32", help="candidates per row (DDTree: k = min(budget, vocab))")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--depth", type=int, default=15, help="draft depths (DFlash block 16 -> 15)")
    ap.add_argument("--warps", default="", help="also time the kernel at these num_warps, e.g. 4,16")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "row_top_k.json"))
    args = ap.parse_args(argv)
    setup = kernel_run_setup("gpu_row_top_k.py", argv, args.cpu_smoke, depth=2 if args.cpu_smoke else args.depth)
    if setup is None:
        return 2
    on_gpu, impl, report = setup
    import jax

    from ddtree_jax.speculative.build import top_k
    from pallas_kernels.row_top_k import DEFAULT_WARPS, row_top_k

    depth = report["depth"]
    batches = [1] if args.cpu_smoke else [int(x) for x in args.batches.split(",")]
    for batch in batches:
        for n in [int(x) for x in args.lengths.split(",")]:
            for k in [int(x) for x in args.ks.split(",")]:
                row = {"batch": batch, "n": n, "k": k}
                sets = problem(batch * 1000 + n + k, batch, depth, n, 1 if args.cpu_smoke else 4)
                variants = {"lax_top_k": lambda v: jax.lax.top_k(v, k), "xla": lambda v: top_k(v, k),
                            "kernel": lambda v: row_top_k(v, k, impl=impl)}
                for nw in [int(x) for x in args.warps.split(",") if x]:
                    if nw != DEFAULT_WARPS:
                        variants[f"kernel_w{nw}"] = lambda v, nw=nw: row_top_k(v, k, impl=impl, num_warps=nw)
                want = [np.asarray(a) for a in jax.jit(lambda v: jax.lax.top_k(v, k))(sets[0])]
                for name, f in variants.items():
                    try:
                        got = [np.asarray(a) for a in jax.jit(f)(sets[0])]
                        row[name + "_equal"] = all(bool((a == b).all()) for a, b in zip(want, got))
                        # i (the loop index) shifts every entry by the same amount: same ties, new values
                        t, _ = time_jax(lambda i, v, f=f: f(v - i * 2.0**-10), sets, 20e-6, on_gpu=on_gpu)
                        row[name + "_us"] = t * 1e6
                    except Exception as e:
                        row[name + "_error"] = err_str(e)
                report["rows"].append(row)
                atomic.write_json(args.out, report)
                print(f"[row_top_k] {row}", flush=True)
    equal = lambda r: all(v for key, v in r.items() if key.endswith("_equal"))
    print_timing_table(report["rows"], [("batch", "B", 2, None), ("n", "n", 6, None), ("k", "k", 3, None)], equal)
    print(f"wrote {args.out}")
    failed = [r for r in report["rows"] if not equal(r) or any(key.endswith("error") for key in r)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
