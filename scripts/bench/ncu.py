"""One kernel of the 27B verify at its shape, launched a few times: a target for Nsight Compute
(ncu) on the H200, which then profiles exactly the launch asked for (no checks, sweeps or peers
launching the same kernel at other shapes first).

    ncu --profile-from-start off --kernel-name regex:gdn_tree_verify --launch-count 1 --set full \\
        --page details --csv python -m scripts.bench.ncu gdn --tree deep > gdn.csv
    ncu --profile-from-start off --kernel-name regex:tree_attention --launch-count 1 --set full \\
        --page details --csv python -m scripts.bench.ncu attention > attention.csv

The call is compiled and run once (XLA's GEMM autotuner launches many candidate kernels while
compiling), then the timed launches are bracketed by the driver's cuProfilerStart / Stop, so
`--profile-from-start off` profiles the real launches only.

Kernels of the Qwen3.6-35B-A3B decode step at batch 1: "moe_decode" (the experts' two decode
launches, moe_decode_up / moe_decode_down, in the model's form: 8 of 256 experts of intermediate
512 plus the shared expert with its gate, weighted parts out) and "gdn_decode" (16 k / 32 v heads
of 128). Kernels: "gdn" (gdn_tree_verify: 16 k / 48 v heads of 128, bf16 q / k / v, 65 nodes, batch 1),
"attention" (tree_attention: 24 q / 4 kv heads of 256, 4096 committed keys, 65 nodes, batch 1) and
"gemm" (XLA's dot of 65 rows by a 27B weight, --weight down | out | qkvzba | gate_up: what the
verify's cuBLAS / Triton GEMMs read, e.g. `--kernel-name regex:"nvjet|gemm"`). The inputs are
scripts.bench.kernels' problems (kernels_gdn.py, kernels_attention.py): random, never zeros. For
"gdn", --tree star puts every node under the root (what the random-weight benchmark's drafter
builds), deep a DDTree-like tree of depth <= 15;
--launches calls in a row (default 4); --impl xla runs the references (the tool's check on a
machine without a GPU).
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.gdn_tree import gdn_tree_verify
from pallas_kernels.tree_attention import tree_attention
from scripts.bench.kernels_attention import attention_problem
from scripts.bench.kernels_gdn import gdn_args, gdn_problem

GEMM_WEIGHTS = {"down": (17408, 5120), "out": (6144, 5120), "qkvzba": (5120, 16480), "gate_up": (5120, 34816)}


def cuda_profiler():
    """on -> cuProfilerStart / cuProfilerStop of the CUDA driver (what ncu --profile-from-start off
    waits for); a no-op without a CUDA driver (CPU machines: the tool still runs)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return lambda on: None
    return lambda on: (lib.cuProfilerStart if on else lib.cuProfilerStop)()


def gdn_call(nodes: int, tree: str, impl: str):
    args = gdn_args(gdn_problem(0, 1, nodes, "ddtree" if tree == "deep" else tree), jnp.bfloat16)
    f = jax.jit(lambda *a: gdn_tree_verify(*a, impl=impl))
    return lambda: f(*args)


def attention_call(nodes: int, impl: str):
    [args] = attention_problem(jax.random.PRNGKey(0), 1, nodes, 4096 + 64, [4096], jnp.bfloat16)
    f = jax.jit(lambda *a: tree_attention(*a, scale=args[0].shape[-1] ** -0.5, impl=impl))
    return lambda: f(*args)


def moe_decode_call(impl: str):
    from pallas_kernels import moe_experts as moe

    e, k, h, inter = 256, 8, 2048, 512
    key = jax.random.PRNGKey(0)
    r = lambda i, shape, scale: (jax.random.normal(jax.random.fold_in(key, i), shape) * scale).astype(jnp.bfloat16)
    x = r(0, (1, h), 1.0)
    ids = jax.random.permutation(jax.random.fold_in(key, 1), e)[:k][None].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(jax.random.fold_in(key, 2), (1, k)))
    w_in, w_out = r(3, (e, h, 2 * inter), h**-0.5), r(4, (e, inter, h), inter**-0.5)
    shared = moe.Shared(r(5, (1, h, 2 * inter), h**-0.5), r(6, (1, inter, h), inter**-0.5), gate_w=r(7, (h,), h**-0.5))
    f = jax.jit(lambda *a: moe.expert_mlp(*a, act=moe.ACTS[0], impl=impl, shared=shared, parts=True))
    return lambda: f(x, ids, w, w_in, w_out)


def gdn_decode_call(impl: str):
    from pallas_kernels.gdn_decode import gdn_decode
    from scripts.bench.kernels_gdn import gdn_decode_problem

    args = gdn_decode_problem(0, 1, hk=16, hv=32, dk=128, dv=128, taps=4, hidden=2048, dtype=jnp.bfloat16)
    f = jax.jit(lambda *a: gdn_decode(*a, num_k_heads=16, eps=1e-6, impl=impl)[0])
    return lambda: f(*args)


def gemm_call(rows: int, weight: str):
    k, n = GEMM_WEIGHTS[weight]
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (rows, k)).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (k, n)) * k**-0.5).astype(jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    return lambda: f(x, w)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=("gdn", "attention", "gemm", "moe_decode", "gdn_decode"))
    ap.add_argument("--weight", choices=tuple(GEMM_WEIGHTS), default="down", help="gemm: the 27B weight")
    ap.add_argument("--tree", choices=("star", "deep"), default="star")
    ap.add_argument("--nodes", type=int, default=65, help="tree nodes (gemm: rows)")
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--impl", choices=("pallas", "xla", "pallas_interpret"), default="pallas")
    args = ap.parse_args(argv)
    if args.kernel == "gemm":
        call = gemm_call(args.nodes, args.weight)
    elif args.kernel == "moe_decode":
        call = moe_decode_call(args.impl)
    elif args.kernel == "gdn_decode":
        call = gdn_decode_call(args.impl)
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
    print(f"[ncu] {args.kernel} tree={args.tree} weight={args.weight} nodes={args.nodes}: {args.launches} launches, "
          f"out {out.shape} finite={bool(jnp.isfinite(out.astype(jnp.float32)).all())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
