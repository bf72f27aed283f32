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
verify's cuBLAS / Triton GEMMs read, e.g. `--kernel-name regex:"nvjet|gemm"`).
--tree star puts every node under the root (what the random-weight benchmark's drafter gives),
deep a DDTree-like tree of depth <= 15 (ddtree_jax.bench.deep_parents). Inputs are random
(never zeros); --launches calls in a row (default 4).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.bench import deep_parents
from ddtree_jax.tree import ancestor_bits_from_parents


def cuda_profiler():
    """on -> cuProfilerStart / cuProfilerStop of the CUDA driver (what ncu --profile-from-start off
    waits for); a no-op without a CUDA driver (CPU machines: the script still runs)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return lambda on: None
    return lambda on: (lib.cuProfilerStart if on else lib.cuProfilerStop)()


def parents_of(kind: str, n: int) -> np.ndarray:
    if kind == "star":
        return np.asarray([-1] + [0] * (n - 1), np.int32)
    return deep_parents(n, seed=0)


def gdn_call(parents, key, impl="pallas"):
    from pallas_kernels.gdn_tree import gdn_tree_verify

    n, hk, hv, d = len(parents), 16, 48, 128
    ks = jax.random.split(key, 6)
    unit = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    q = (unit(jax.random.normal(ks[0], (1, hk, n, d))) * d**-0.5).astype(jnp.bfloat16)
    k = unit(jax.random.normal(ks[1], (1, hk, n, d))).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, hv, n, d)).astype(jnp.bfloat16)
    g = -jax.random.uniform(ks[3], (1, hv, n), minval=0.01, maxval=1.0)
    beta = jax.random.uniform(ks[4], (1, hv, n), minval=0.05, maxval=1.0)
    state = 0.5 * jax.random.normal(ks[5], (1, hv, d, d))
    bits = ancestor_bits_from_parents(jnp.asarray(parents)[None], 15)
    f = jax.jit(lambda *a: gdn_tree_verify(*a, impl=impl))
    return lambda: f(q, k, v, g, beta, state, bits)


def attention_call(parents, key, impl="pallas"):
    from pallas_kernels.tree_attention import tree_attention

    n, nh, kv, hd, length = len(parents), 24, 4, 256, 4096
    cap = length + 64
    ks = jax.random.split(key, 5)
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (1, n, nh, hd)).astype(bf)
    kc = jax.random.normal(ks[1], (1, kv, cap, hd)).astype(bf)
    vc = jax.random.normal(ks[2], (1, kv, cap, hd)).astype(bf)
    kt = jax.random.normal(ks[3], (1, n, kv, hd)).astype(bf)
    vt = jax.random.normal(ks[4], (1, n, kv, hd)).astype(bf)
    lengths = jnp.array([length], jnp.int32)
    bits = ancestor_bits_from_parents(jnp.asarray(parents)[None], 15)
    f = jax.jit(lambda *a: tree_attention(*a, scale=hd**-0.5, impl=impl))
    return lambda: f(q, kc, vc, lengths, kt, vt, bits)


GEMM_WEIGHTS = {"down": (17408, 5120), "out": (6144, 5120), "qkvzba": (5120, 16480), "gate_up": (5120, 34816)}


def gemm_call(rows: int, weight: str, key):
    k, n = GEMM_WEIGHTS[weight]
    x = jax.random.normal(key, (rows, k)).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (k, n)) * k**-0.5).astype(jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    return lambda: f(x, w)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=("gdn", "attention", "gemm"))
    ap.add_argument("--weight", choices=tuple(GEMM_WEIGHTS), default="down")
    ap.add_argument("--tree", choices=("star", "deep"), default="star")
    ap.add_argument("--nodes", type=int, default=65)
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--impl", choices=("pallas", "xla"), default="pallas",
                    help="xla: the kernels' references (the script's check on a machine without a GPU)")
    args = ap.parse_args(argv)
    parents = parents_of(args.tree, args.nodes)
    key = jax.random.PRNGKey(0)
    if args.kernel == "gemm":
        call = gemm_call(args.nodes, args.weight, key)
    else:
        call = (gdn_call if args.kernel == "gdn" else attention_call)(parents, key, args.impl)
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
