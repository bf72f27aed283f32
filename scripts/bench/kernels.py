"""Per-kernel GPU timings: each Pallas kernel against its XLA reference (and the public PyTorch /
flash-linear-attention implementations where they exist, scripts/bench/peers.py) at the layer
shapes of the models it serves (scripts/bench/shapes.py).

    python -m scripts.bench.kernels NAME [options]

NAME (one registry entry each; `python -m scripts.bench.kernels NAME --help` lists its options):
  gdn_tree        GDN tree verify (pallas_kernels/gdn_tree.py), 27B GDN layer, DDTree-like trees of
                  16 - 256 nodes (+ a 16-node chain: linear DFlash), batch 1 and 8 (a tree per row);
                  a small tile sweep; peers: one float32 state per node in torch (memory N x H x dk x
                  dv x 4 bytes a sequence, reported), FLA's fused recurrent kernel over every
                  root-to-leaf path, and FLA over a chain of N tokens (not tree-correct: a lower bound)
  gdn_commit      GDN path commit (gdn_commit.py), with and without the conv window slide; peer: the
                  per-node implementations' commit, a copy of the accepted leaf's state
  gdn_decode      GDN decode step (gdn_decode.py): state, window, output and hidden row carried from
                  step to step as decoding does
  gdn_prologue    GDN tree prologue (gdn_tree_prologue.py): conv over each node's path, norms, layout
  tree_attention  tree attention (tree_attention.py), 27B attention layer, caches of 1k / 8k / 32k
                  keys, trees of 1 (a decode step) to 256 nodes, batch 1 and 8 (ragged lengths); a tile
                  sweep; peers: torch SDPA with a boolean mask, flex_attention with a block mask;
                  roofline bound max(bytes / read rate, FLOPs / matmul rate)
  ancestor_bits   ancestor bitsets of a tree (tree_mask.py)
  ssd_tree        Mamba2 / SSD tree verify (ssd_tree.py), Nemotron-H 8B layer (128 heads x 64, 8
                  groups, state 128); a small block sweep
  ssd_commit      SSD path commit (all P = 16 nodes accepted)
  mamba2_decode   Mamba2 decode step (mamba2_decode.py) against the model's XLA path: state, window
                  and input product carried from step to step as decoding does
  row_top_k       row top-k of the draft's log-probabilities (row_top_k.py) against the staged XLA
                  top-k of the DDTree build and plain lax.top_k
  tree_select     DDTree node selection in one launch (tree_select.py) against the XLA form
  add_rms_norm    residual add + RMSNorm taking split-K partial sums (add_rms_norm.py) against XLA's
                  reduce + the plain kernel, per tiling; GPU kernel time from a profiler trace
  softmax_top_k   an MoE softmax router's softmax + top-k + renormalisation in one launch
                  (softmax_top_k.py) against XLA's launches, per num_warps; kernel time from a trace
  row_product     one-row products of the 35B-A3B decode step (row_product.py) against XLA's padded
                  GEMM (the output projection with its add + RMSNorm), per tiling; kernel time from a trace
  pair_groups     an MoE layer's (token, choice) pairs grouped by expert in one launch (pair_groups.py)
                  against XLA's fusions (group_pairs), per num_warps; kernel time and launches from a
                  trace, wall time of 64 calls in one jit

Each row holds the XLA form's and every kernel variant's time (`<variant>_us`), the kernel's
error against the reference on the same inputs (a check of what was timed: the strict checks at
these shapes are the native GPU tests, `python -m pytest -m gpu`), and, for kernels that stream
memory, bytes moved and the share of the device's read rate measured in the same run. Prints a
table, rewrites the JSON after every row (--out, default $OUT/NAME.json); exits 1 if a row failed.

Timing (common.time_jax): calls back to back inside one jitted loop over input copies larger than
L2, the loop index reaching every call's inputs (nothing hoisted) or the state carried from call
to call, median of rounds after a warm-up; torch peers in a CUDA graph, CUDA events.

    python -m scripts.bench.kernels gdn_tree --out $OUT/gdn_tree.json    # on the H200
    python -m scripts.bench.kernels tree_attention --quick
    python -m scripts.bench.kernels row_top_k --cpu-smoke                # any machine: interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import jax

from scripts.bench import kernels_attention, kernels_dense, kernels_gdn, kernels_ssd, kernels_tree_build
from scripts.bench.common import err_str, on_gpu, print_timing_table, start_report, write_report
from scripts.bench.kernels_harness import Kernel, Run, row_ok

# Each family's module registers its runs in its own KERNELS (kernels_gdn.py; kernels_attention.py with the
# ancestor bits; kernels_ssd.py; kernels_tree_build.py; kernels_dense.py); what they share (Run, the registry
# entry, row_ok, the option helpers) is kernels_harness.py. This order is the subcommands' order in --help.
KERNELS: dict[str, Kernel] = {**kernels_gdn.KERNELS, **kernels_attention.KERNELS, **kernels_ssd.KERNELS,
                              **kernels_tree_build.KERNELS, **kernels_dense.KERNELS}


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU: the interpreter at tiny shapes (checks the tool)")
    common.add_argument("--quick", action="store_true", help="fewer shapes, no sweeps")
    common.add_argument("--out", default=None, help="JSON path (default $OUT/NAME.json, or ./NAME.json)")
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, k in KERNELS.items():
        k.options(sub.add_parser(name, parents=[common], help=k.help, description=k.help))
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    elif not getattr(args, "no_peers", True):
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # leave room for the torch peers
    gpu = on_gpu()
    if not gpu and not args.cpu_smoke:
        print("no GPU visible to jax: run on the H200, or use --cpu-smoke to check the tool", file=sys.stderr)
        return 2
    k = KERNELS[args.name]
    out = args.out or os.path.join(os.environ.get("OUT", "."), f"{args.name}.json")
    report = start_report("scripts.bench.kernels", argv, kernel=args.name, impl="pallas" if gpu else "pallas_interpret",
                          rows=[])
    run = Run(args.name, args, gpu, report["impl"], report, out)
    try:
        k.run(run)
    except Exception as e:  # the rows measured so far are kept, and the table printed
        traceback.print_exc()
        report["failure"] = err_str(e, 2000)
    report["seconds"] = round(run.elapsed(), 1)
    write_report(out, report)
    print_timing_table(report["rows"], k.lead, row_ok)
    print(f"wrote {out}" + (f"; the run stopped early: {report['failure'][:200]}" if "failure" in report else ""))
    return 0 if all(row_ok(r) for r in report["rows"]) and "failure" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
