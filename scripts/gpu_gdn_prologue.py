"""GPU check + benchmark of the GDN tree prologue kernel (pallas_kernels/gdn_tree_prologue.py)
against its reference, the model's XLA form of the same work (window | nodes concatenation, the
conv over each node's path, SiLU, head split, q / k norms, heads-first layout, casts), at a
Qwen3.6-27B GDN layer (16 k / 48 v heads of 128, conv 4, bf16) over random DDTree-shaped trees.

Correctness: q, k, v and the float32 k against the reference (max |error| / max |reference|:
float32 <= 1e-5, bf16 <= 3e-2: the reference's conv rounds to bf16 after every tap). Timing: `gpu_bench_common.time_jax` (calls back to back inside one jitted loop, the
node inputs perturbed by the loop index so nothing is hoisted, rotated input sets, median of
rounds after a warm-up, never on zeros). Prints a table and writes JSON.

    PYTHONPATH=. python3 scripts/gpu_gdn_prologue.py --out $OUT/gdn_prologue.json   # on the H200
    PYTHONPATH=. python3 scripts/gpu_gdn_prologue.py --cpu-smoke                     # any machine
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from gpu_bench_common import err_str, finish_dtype_checked, kernel_run_setup, max_rel_err, time_jax  # noqa: E402
from ddtree_jax import atomic  # noqa: E402


def problem(seed: int, batch: int, nodes: int, hk: int, hv: int, dk: int, dv: int, taps: int, dtype):
    """(mixed, window, conv_w, conv_src) of a random tree per batch row (parents among the 4 previous
    nodes: deep paths, as DDTree's best-first trees have)."""
    import jax.numpy as jnp

    from ddtree_jax.tree import geometry, make_tree

    rng = np.random.default_rng(seed)
    c = 2 * hk * dk + hv * dv
    parents = np.stack([[-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, nodes)] for _ in range(batch)])
    tree = make_tree(jnp.zeros((batch, nodes), jnp.int32), jnp.asarray(parents, jnp.int32),
                     jnp.ones((batch, nodes), bool), jnp.zeros((batch,), jnp.int32), max_depth=nodes - 1)
    r = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return (r(batch, nodes, c).astype(dtype), r(batch, taps - 1, c).astype(dtype), (r(taps, c) * 0.5).astype(dtype),
            geometry(tree, taps).conv_src)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="interpret mode, small shapes (checks the script)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--nodes", default="17,33,65", help="tree sizes (DDTree budget + 1)")
    ap.add_argument("--warps", default="", help="also time the kernel at these num_warps, e.g. 4")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gdn_prologue.json"))
    args = ap.parse_args(argv)
    hk, hv, dk, dv, taps = (2, 6, 16, 16, 4) if args.cpu_smoke else (16, 48, 128, 128, 4)
    setup = kernel_run_setup("gpu_gdn_prologue.py", argv, args.cpu_smoke,
                             shape=dict(k_heads=hk, v_heads=hv, dk=dk, dv=dv, taps=taps))
    if setup is None:
        return 2
    on_gpu, impl, report = setup
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels.gdn_tree_prologue import gdn_tree_prologue

    kw = dict(num_k_heads=hk, head_k_dim=dk, head_v_dim=dv)
    batches = [2] if args.cpu_smoke else [int(x) for x in args.batches.split(",")]
    node_list = [17] if args.cpu_smoke else [int(x) for x in args.nodes.split(",")]
    for batch in batches:
        for nodes in node_list:
            row = {"batch": batch, "nodes": nodes}
            variants = {"xla": dict(impl="xla"), "kernel": dict(impl=impl)}
            for nw in [int(x) for x in args.warps.split(",") if x]:
                variants[f"kernel_w{nw}"] = dict(impl=impl, num_warps=nw)
            for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
                a = problem(batch * 100 + nodes, batch, nodes, hk, hv, dk, dv, taps, dtype)
                want = jax.jit(functools.partial(gdn_tree_prologue, impl="xla", **kw))(*a)
                name = jnp.dtype(dtype).name
                try:
                    got = jax.jit(functools.partial(gdn_tree_prologue, impl=impl, **kw))(*a)
                    row[f"{name}_rel_err"] = err = max_rel_err(want, got)  # over q, k, v, k32
                    row[f"{name}_ok"] = err <= tol
                except Exception as e:
                    row[f"{name}_error"] = err_str(e)
            sets = [problem(batch * 1000 + nodes * 10 + s, batch, nodes, hk, hv, dk, dv, taps, jnp.bfloat16)
                    for s in range(3)]
            for vname, opts in variants.items():
                f = lambda i, a, opts=opts: gdn_tree_prologue(
                    (a[0].astype(jnp.float32) * (1 + 1e-3 * jnp.asarray(i, jnp.float32))).astype(a[0].dtype), *a[1:],
                    **kw, **opts)
                try:
                    row[vname + "_us"] = time_jax(f, sets, 10e-6, on_gpu=on_gpu)[0] * 1e6
                except Exception as e:
                    row[vname + "_error"] = err_str(e)
            report["rows"].append(row)
            atomic.write_json(args.out, report)
            print(f"[gdn_prologue] {row}", flush=True)
    return finish_dtype_checked(report, [("batch", "B", 2, None), ("nodes", "N", 4, None)], args.out)


if __name__ == "__main__":
    sys.exit(main())
