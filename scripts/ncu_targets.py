"""One kernel of the 27B verify at its shape, run a few times: a target for Nsight
Compute (ncu) on the H200, which then profiles exactly the launch asked for (no correctness
checks, sweeps or peers launching the same kernel at other shapes first).

    ncu --profile-from-start off --kernel-name regex:gdn_tree_verify --launch-count 1 --set full \\
        --page details --csv python3 scripts/ncu_targets.py gdn --tree deep > gdn.csv
    ncu --profile-from-start off --kernel-name regex:tree_attention --launch-count 1 --set full \\
        --page details --csv python3 scripts/ncu_targets.py attention > attention.csv

The script compiles and runs the call once (XLA's GEMM autotuner launches many candidate kernels
while compiling), then brackets the timed launches with the driver's cuProfilerStart / Stop, so
`--profile-from-start off` profiles the real launches only.

Kernels: "gdn" (gdn_tree_verify: 16 k / 48 v heads of 128, bf16 q / k / v, 65 nodes, batch 1),
"attention" (tree_attention: 24 q / 4 kv heads of 256, 4096 committed keys, 65 nodes, batch 1) and
"gemm" (XLA's dot of 65 rows by a 27B weight, --weight down | out | qkvzba | gate_up: what the
verify's cuBLAS / Triton GEMMs read, e.g. `--kernel-name regex:"nvjet|gemm"`) and "int8" (an int8
drafter product at --nodes rows, default 16: --weight gate_up | down | head, stored [out, in] as the
int8 drafter stores it; --impl pallas: the skinny matmul kernel at its best session-14 tiling,
`--kernel-name regex:skinny_matmul`; --impl xla: XLA's int8 GEMM, `regex:"gemm|nvjet"`: why either
reads only 2.2-3.1 TB/s of int8, docs/kernels_dense.md).
The inputs are the benchmark scripts' own problems (scripts/gpu_gdn.py, gpu_attention_problems.py):
random, never zeros. For "gdn", --tree star puts every node under the root (what the random-weight
benchmark's drafter gives), deep a DDTree-like tree of depth <= 15 (ddtree_jax.bench.deep_parents);
--launches calls in a row (default 4).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the problems of gpu_gdn.py / gpu_attention_problems.py

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def cuda_profiler():
    """on -> cuProfilerStart / cuProfilerStop of the CUDA driver (what ncu --profile-from-start off
    waits for); a no-op without a CUDA driver (CPU machines: the script still runs)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return lambda on: None
    return lambda on: (lib.cuProfilerStart if on else lib.cuProfilerStop)()


def gdn_call(nodes: int, tree: str, impl: str = "pallas"):
    """gdn_tree_verify on scripts/gpu_gdn.py's problem (seed 0: its "ddtree" tree is
    profile_step.py --tree-shape deep's)."""
    from gpu_gdn import jax_args, make_problem
    from pallas_kernels.gdn_tree import gdn_tree_verify

    args = jax_args(make_problem(0, 1, nodes, "ddtree" if tree == "deep" else tree), jnp.bfloat16)
    f = jax.jit(lambda *a: gdn_tree_verify(*a, impl=impl))
    return lambda: f(*args)


def attention_call(nodes: int, impl: str = "pallas"):
    """tree_attention on scripts/gpu_attention_problems.py's problem: 4096 committed keys of a
    4160-slot cache, a random tree of depth <= 15 (the shape barely matters to this kernel)."""
    from gpu_attention_problems import make_problem
    from pallas_kernels.tree_attention import tree_attention

    (args,), _ = make_problem(jax.random.PRNGKey(0), 1, nodes, 4096 + 64, [4096], jnp.bfloat16)
    f = jax.jit(lambda *a: tree_attention(*a, scale=args[0].shape[-1] ** -0.5, impl=impl))
    return lambda: f(*args)


GEMM_WEIGHTS = {"down": (17408, 5120), "out": (6144, 5120), "qkvzba": (5120, 16480), "gate_up": (5120, 34816)}


def gemm_call(rows: int, weight: str, key):
    k, n = GEMM_WEIGHTS[weight]
    x = jax.random.normal(key, (rows, k)).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (k, n)) * k**-0.5).astype(jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    return lambda: f(x, w)


INT8_WEIGHTS = {"gate_up": (5120, 34816), "down": (17408, 5120), "head": (5120, 248320)}


def int8_call(rows: int, weight: str, impl: str, key):
    from ddtree_jax.models import int8
    from pallas_kernels.skinny_matmul import SkinnyConfig, filling_split, skinny_matmul

    k, n = INT8_WEIGHTS[weight]
    x = jax.random.normal(key, (rows, k)).astype(jnp.bfloat16)
    q, scale = int8.quantize(jax.random.normal(jax.random.fold_in(key, 1), (k, n)) * k**-0.5)
    q = int8.stored(q, "out_in")
    cfg = SkinnyConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=filling_split(k, n, 64, 128))
    f = jax.jit(lambda a, w, s: skinny_matmul(a, w, s, impl=impl, config=cfg, w_layout="out_in"))
    return lambda: f(x, q, scale)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=("gdn", "attention", "gemm", "int8"))
    ap.add_argument("--weight", choices=tuple(GEMM_WEIGHTS) + ("head",), default="down",
                    help="gemm: down | out | qkvzba | gate_up; int8: gate_up | down | head")
    ap.add_argument("--tree", choices=("star", "deep"), default="star")
    ap.add_argument("--nodes", type=int, default=None, help="rows (default 65; int8: 16)")
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--impl", choices=("pallas", "xla"), default="pallas",
                    help="xla: the kernels' references (the script's check on a machine without a GPU)")
    args = ap.parse_args(argv)
    if args.nodes is None:
        args.nodes = 16 if args.kernel == "int8" else 65
    weights = {"gemm": GEMM_WEIGHTS, "int8": INT8_WEIGHTS}.get(args.kernel)
    if weights is not None and args.weight not in weights:
        ap.error(f"--weight {args.weight} is not a {args.kernel} weight: {args.kernel} takes {', '.join(weights)}")
    if args.kernel == "int8":
        call = int8_call(args.nodes, args.weight, args.impl, jax.random.PRNGKey(0))
    elif args.kernel == "gemm":
        call = gemm_call(args.nodes, args.weight, jax.random.PRNGKey(0))
    elif args.kernel == "gdn":
        call = gdn_call(args.nodes, args.tree, args.impl)
    else:
        call = attention_call(args.nodes, args.impl)
    out = jax.block_until_ready(call())  # compile (and autotune) outside the profiled range
    profiler = cuda_profiler()
    profiler(True)
    for _ in range(args.launches):
        out = jax.block_until_ready(call())
    profiler(False)
    print(f"[ncu_targets] {args.kernel} tree={args.tree} weight={args.weight} nodes={args.nodes}: {args.launches} launches, "
          f"out {out.shape} finite={bool(jnp.isfinite(out.astype(jnp.float32)).all())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
