"""GPU check + benchmark of the one-launch DDTree node selection (pallas_kernels/tree_select.py)
against the XLA form it replaces (ddtree_jax.speculative.build.select_nodes_xla: the depth-by-depth
beam, the top-budget over all depths and the index mapping, ~4 launches per depth + ~10).

Correctness: the kernel's depth / rank / parent / valid arrays equal the XLA form's on random
per-depth candidates with exact ties (quantized values) and -inf, at every warp count timed.
Timing: each variant runs inside one jitted on-device loop (as in the generation loop, where a
small model's step is bound by launches), median of rounds after a warm-up, never on zeros.
Prints a table and writes JSON.

    PYTHONPATH=. python3 scripts/gpu_tree_select.py --out $OUT/tree_select.json      # on the H200
    PYTHONPATH=. python3 scripts/gpu_tree_select.py --cpu-smoke                      # any machine
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from gpu_bench_common import err_str, finish_checked, kernel_run_setup, record_row, time_jax  # noqa: E402


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
    ap.add_argument("--budgets", default="8,16,32,64", help="tree budgets (k = budget candidates per depth)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--depth", type=int, default=15, help="draft depths (DFlash block 16 -> 15)")
    ap.add_argument("--warps", default="", help="also time the kernel at these num_warps, e.g. 1,2,4,8")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tree_select.json"))
    args = ap.parse_args(argv)
    setup = kernel_run_setup("gpu_tree_select.py", argv, args.cpu_smoke, depth=4 if args.cpu_smoke else args.depth)
    if setup is None:
        return 2
    on_gpu, impl, report = setup
    import jax

    from pallas_kernels.tree_select import DEFAULT_WARPS, select_nodes

    depth = report["depth"]
    budgets = [int(x) for x in args.budgets.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    for batch in batches:
        for budget in budgets:
            row = {"batch": batch, "budget": budget, "k": budget}
            sets = problem(batch * 100 + budget, batch, depth, budget, 1 if args.cpu_smoke else 4)
            variants = {"xla": dict(impl="xla"), "kernel": dict(impl=impl)}
            for nw in [int(x) for x in args.warps.split(",") if x]:
                if nw != DEFAULT_WARPS:
                    variants[f"kernel_w{nw}"] = dict(impl=impl, num_warps=nw)
            want = None
            for name, opts in variants.items():
                try:
                    got = jax.jit(lambda v, o=opts: select_nodes(v, budget, **o))(sets[0])
                    got = [np.asarray(a) for a in got]
                    if want is None:
                        want = got
                    else:
                        row[name + "_equal"] = all(bool((a == b).all()) for a, b in zip(want, got))
                    # i (the loop index) shifts every candidate by the same amount: same ties, new values
                    t, _ = time_jax(lambda i, v, o=opts: select_nodes(v - i * 2.0**-10, budget, **o), sets, 30e-6,
                                    on_gpu=on_gpu)
                    row[name + "_us"] = t * 1e6
                except Exception as e:
                    row[name + "_error"] = err_str(e)
            record_row(report, row, args.out, f"[select] {row}")
    equal = lambda r: all(v for key, v in r.items() if key.endswith("_equal"))
    return finish_checked(report, [("batch", "B", 2, None), ("budget", "budget", 6, None)], equal, args.out)


if __name__ == "__main__":
    sys.exit(main())
