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
  row_top_k       row top-k of the draft's log-probabilities (row_top_k.py) against the staged XLA
                  top-k of the DDTree build and plain lax.top_k
  tree_select     DDTree node selection in one launch (tree_select.py) against the XLA form
  add_rms_norm    residual add + RMSNorm taking split-K partial sums (add_rms_norm.py) against XLA's
                  reduce + the plain kernel, per tiling; GPU kernel time from a profiler trace

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
import dataclasses
import functools
import os
import sys
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.bench import deep_parents
from ddtree_jax.speculative.build import top_k
from ddtree_jax.tree import ancestor_bits_from_parents, geometry, make_tree, root_path
from pallas_kernels import add_rms_norm as arn
from pallas_kernels._common import pow2_at_least, summed_partials
from pallas_kernels.gdn_commit import gdn_path_commit
from pallas_kernels.gdn_decode import DEFAULT_WARPS as GDN_DECODE_WARPS
from pallas_kernels.gdn_decode import gdn_decode
from pallas_kernels.gdn_tree import default_blocks, gdn_tree_verify
from pallas_kernels.gdn_tree_prologue import gdn_tree_prologue
from pallas_kernels.row_top_k import DEFAULT_WARPS as ROW_TOP_K_WARPS
from pallas_kernels.row_top_k import row_top_k
from pallas_kernels.ssd_tree import ssd_path_commit, ssd_tree_verify
from pallas_kernels.tree_attention import choose_config, tree_attention
from pallas_kernels.tree_mask import ancestor_bits
from pallas_kernels.tree_select import DEFAULT_WARPS as TREE_SELECT_WARPS
from pallas_kernels.tree_select import select_nodes
from scripts.bench import peers
from scripts.bench.common import (err_str, fmt, jax_rates, max_rel_err, on_gpu, print_timing_table, record_row,
                                  rotations_for, start_report, time_jax, time_torch, trace_kernel_us, write_report)
from scripts.bench.shapes import ATTENTION_27B, DRAFT_DEPTHS, GDN_27B, SSD_NEMOTRON_H_8B


# ---------------------------------------------------------------------------------------------
# the registry and what every kernel's run shares
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """One kernel's run: options, device, the impl under test and the report being written."""

    name: str
    args: argparse.Namespace
    gpu: bool
    impl: str  # "pallas" on a GPU, "pallas_interpret" with --cpu-smoke
    report: dict
    out: str
    t0: float = dataclasses.field(default_factory=time.time)

    @property
    def smoke(self) -> bool:
        return self.args.cpu_smoke

    @property
    def quick(self) -> bool:
        return self.args.quick or self.args.cpu_smoke

    def rates(self) -> dict:
        """The device's read rate and matmul rate, measured once per run (common.jax_rates)."""
        if "rates" not in self.report:
            self.report["rates"] = jax_rates(self.gpu, self.quick)
            print(f"[{self.name}] read rate {self.report['rates']['hbm_GBps']:.0f} GB/s, bf16 matmul "
                  f"{self.report['rates']['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
        return self.report["rates"]

    def time(self, f, arg_sets, est_s, **kw):
        return time_jax(f, arg_sets, est_s, gpu=self.gpu, **kw)

    def rotations(self, nbytes: int, **kw) -> int:
        return rotations_for(nbytes, **kw) if self.gpu else 1

    def elapsed(self) -> float:
        return time.time() - self.t0

    def record(self, row: dict) -> None:
        record_row(self.report, row, self.out, f"[{self.name}] " + ", ".join(
            f"{k}={fmt(v, '.3g') if isinstance(v, float) else v}" for k, v in row.items() if not isinstance(v, dict)))


@dataclasses.dataclass(frozen=True)
class Kernel:
    run: Callable[[Run], None]  # records rows with run.record
    lead: tuple  # the table's leading columns: (row key, title, width, number format or None)
    options: Callable[[argparse.ArgumentParser], None]
    help: str


KERNELS: dict[str, Kernel] = {}


def kernel(name: str, lead, help: str, options=lambda ap: None):
    """Register a kernel's run under `name`."""
    def register(run):
        KERNELS[name] = Kernel(run, tuple(lead), options, help)
        return run
    return register


PEERS = ("torch_", "fla_", "sdpa", "flex")  # a peer that fails to run is reported, not a failed check


def row_ok(row: dict) -> bool:
    """A row passed: its checks (`ok`, every `*_equal`) hold and none of our forms raised."""
    return bool(row.get("ok", True)) and all(v for k, v in row.items() if k.endswith("_equal")) and not any(
        k.endswith("_error") and not k.startswith(PEERS) for k in row)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def variant_name(base: str, opts: dict) -> str:
    """'kernel' for the defaults, else e.g. 'kernel_dv32_w4' / 'kernel_tf32x3'."""
    short = {"block_dv": "dv", "block_n": "n", "block_p": "p", "block_k": "k", "block_r": "r", "num_warps": "w",
             "num_stages": "s", "precision": "", "split_scale": "split", "window": "window"}
    parts = [f"{short.get(k, k)}{'' if v is True else v}" for k, v in opts.items() if v is not None]
    return "_".join([base] + parts)


def rel_err(out, ref) -> float:
    return max_rel_err([ref], [out])


def add_batches(ap, default="1,8"):
    ap.add_argument("--batches", default=default, help="batch sizes (comma list)")


def add_warps(ap):
    ap.add_argument("--warps", default="", help="also time the kernel at these num_warps, e.g. 4,16")


def add_peers(ap):
    ap.add_argument("--no-peers", action="store_true", help="skip the PyTorch / FLA peers")


def add_sweep(ap):
    ap.add_argument("--no-sweep", action="store_true", help="default tiles only")


def tree_parents(rng, n: int, kind: str = "ddtree") -> list[int]:
    """A topological parent list: a chain, a star (every node under the root: what the random-weight
    benchmark's drafter builds), or DDTree-like (ddtree_jax.bench.deep_parents: depth <= 15)."""
    if kind == "chain":
        return [-1] + list(range(n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    return deep_parents(n, rng, DRAFT_DEPTHS).tolist()


def ancestor_words(trees) -> jax.Array:
    """[B, N, ceil(N / 32)] uint32 ancestor-or-self bits of parent lists (the library's form)."""
    n = len(trees[0])
    return ancestor_bits_from_parents(jnp.asarray(np.asarray(trees, np.int32)), max(n - 1, 0))


# ---------------------------------------------------------------------------------------------
# GDN: tree verify, path commit, decode step, tree prologue
# ---------------------------------------------------------------------------------------------
def gdn_problem(seed: int, b: int, n: int, kind: str = "ddtree", hk=GDN_27B["hk"], hv=GDN_27B["hv"],
                dk=GDN_27B["dk"], dv=GDN_27B["dv"]) -> dict:
    """float32 numpy inputs of a GDN tree verify, [B, H, N, ...] (q / k unit rows, q scaled by
    dk^-1/2, decays in (-1, 0), betas in (0.05, 1)), a tree per batch row and its ancestor bits."""
    rng = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    trees = [tree_parents(rng, n, kind) for _ in range(b)]
    return {
        "q": (unit(rng.normal(size=(b, hk, n, dk))) * dk**-0.5).astype(np.float32),
        "k": unit(rng.normal(size=(b, hk, n, dk))).astype(np.float32),
        "v": rng.normal(size=(b, hv, n, dv)).astype(np.float32),
        "g": (-rng.uniform(0.01, 1.0, size=(b, hv, n))).astype(np.float32),
        "beta": rng.uniform(0.05, 1.0, size=(b, hv, n)).astype(np.float32),
        "state": (0.5 * rng.normal(size=(b, hv, dk, dv))).astype(np.float32),
        "bits": np.asarray(ancestor_words(trees)),
        "trees": trees,
    }


def gdn_args(pb: dict, dtype) -> tuple:
    """(q, k, v, g, beta, state, bits) on the device: q / k / v in dtype, the rest float32."""
    c = lambda x, dt=jnp.float32: jnp.asarray(x, dt)
    return (c(pb["q"], dtype), c(pb["k"], dtype), c(pb["v"], dtype), c(pb["g"]), c(pb["beta"]), c(pb["state"]),
            jnp.asarray(pb["bits"]))


def gdn_copy(args: tuple, r: int) -> tuple:
    """Rotation copy r of gdn_args (distinct buffers, values nudged so nothing is shared)."""
    if r == 0:
        return args
    q, k, v, g, beta, state, bits = args
    return (q * 1, k * 1, v + jnp.asarray(1e-3 * r, v.dtype), g * (1 - 1e-3 * r), beta * 1, state * (1 + 1e-3 * r),
            bits + 0)


def gdn_tree_call(impl: str, **tuning):
    """f(i, (q, k, v, g, beta, state, bits)): the loop index reaches the kernel through the bits
    (a select XLA cannot fold, fused into the wrapper's own bits preparation)."""
    def f(i, a):
        q, k, v, g, beta, state, bits = a
        bits = jnp.where(i < 0, bits ^ jnp.uint32(1), bits)
        return gdn_tree_verify(q, k, v, g, beta, state, bits, impl=impl, **tuning)

    return f


def gdn_tree_bytes(b, n, itemsize=2, hk=GDN_27B["hk"], hv=GDN_27B["hv"], dk=GDN_27B["dk"], dv=GDN_27B["dv"]):
    """Bytes a tree verify must move: state read, q / k / v / g / beta / bits read, o (float32) written."""
    inputs = b * n * (2 * hk * dk * itemsize + hv * dv * itemsize + 2 * hv * 4 + 4 * max(1, n // 32))
    return b * hv * dk * dv * 4 + inputs + b * hv * n * dv * 4


def gdn_layer(run: Run) -> dict:
    return dict(hk=2, hv=4, dk=32, dv=32) if run.smoke else {k: GDN_27B[k] for k in ("hk", "hv", "dk", "dv")}


def leaf_path(tree, p: int):
    """The deepest root-to-leaf path padded to p entries (an accepted path) and its length."""
    depth = [len(root_path(tree, i)) for i in range(len(tree))]
    path = root_path(tree, int(np.argmax(depth)))[:p]
    return path + [0] * (p - len(path)), len(path)


def gdn_tree_options(ap):
    add_batches(ap)
    ap.add_argument("--sizes", default="16,64,128,256", help="tree sizes (nodes; --quick: 16,64)")
    add_sweep(ap)
    add_peers(ap)
    ap.add_argument("--budget-s", type=float, default=190.0, help="skip the sweep and FLA chain peers past this")


@kernel("gdn_tree", [("case", "tree", 9, None), ("b", "B", 2, None), ("max_depth", "depth", 5, None),
                     ("kernel_GBps", "GB/s", 6, ".0f"), ("kernel_pct_hbm", "%HBM", 5, ".0f"),
                     ("kernel_err", "err", 8, ".1e")],
        "GDN tree verify against XLA and the per-node / FLA peers", gdn_tree_options)
def run_gdn_tree(run: Run) -> None:
    a = run.args
    dims = gdn_layer(run)
    sizes = [16, 32] if run.smoke else ([16, 64] if a.quick else ints(a.sizes))
    batches = [1, 2] if run.smoke else ints(a.batches)
    fla_ops = None
    if run.gpu and not a.no_peers:
        fla_ops, how = peers.import_fla()
        run.report["fla"] = (f"{getattr(sys.modules.get('fla'), '__version__', '?')} {how}" if fla_ops else how)
    hbm = run.rates()["hbm_GBps"]
    device = "cuda" if run.gpu else "cpu"
    best = {}
    cases = [(n, "ddtree") for n in sizes] + ([(16, "chain")] if 16 in sizes and not run.quick else [])
    for n, kind in cases:
        for b in batches:
            pb = gdn_problem(1000 + n + b, b, n, kind, **dims)
            nbytes = gdn_tree_bytes(b, n, **dims)
            sets = [gdn_copy(gdn_args(pb, jnp.bfloat16), r) for r in range(run.rotations(nbytes))]
            depth = max(len(root_path(t, i)) for t in pb["trees"] for i in range(n)) - 1
            row = {"case": f"{kind}{n}", "b": b, "n": n, "max_depth": depth, "bytes": nbytes}
            t, info = run.time(gdn_tree_call("xla"), sets, 100e-6)
            row["xla_us"], ref = t * 1e6, np.asarray(info["out"])
            # ours at the default tiles; a small sweep at the first batch size, its best reused after
            bn, bdv, bk, nw = default_blocks(pow2_at_least(n), pow2_at_least(dims["dk"]), pow2_at_least(dims["dv"]),
                                             b * dims["hv"])
            row["default_tiles"] = {"block_n": bn, "block_dv": bdv, "block_k": bk, "num_warps": nw, "precision": "tf32"}
            variants = [{}]
            if (not (a.no_sweep or run.quick) and b == batches[0] and 64 <= n <= 128 and kind == "ddtree"
                    and run.elapsed() < a.budget_s * 0.4):
                variants += [{"block_dv": d} for d in (32, 64, 128) if d != bdv and d <= dims["dv"]]
                if n == 64:
                    variants += [{"precision": "tf32x3"}, {"num_warps": 4 if nw == 8 else 8}]
            elif best.get((n, kind)):
                variants.append(best[(n, kind)])
            timings = []
            for tv in variants:
                name = variant_name("kernel", tv)
                try:
                    t, info = run.time(gdn_tree_call(run.impl, **tv), sets, 20e-6)
                    row[name + "_us"], row[name + "_err"] = t * 1e6, rel_err(info["out"], ref)
                    timings.append((t, tv))
                except Exception as e:
                    row[name + "_error"] = err_str(e)
            if timings and b == batches[0]:
                best[(n, kind)] = min(timings, key=lambda x: x[0])[1]
            # bf16 inputs, TF32 products on the GPU: within 1e-2 of the float32 XLA reference
            row["ok"] = all(row[k] <= 1e-2 for k in row if k.endswith("_err"))
            if "kernel_us" in row:
                row["kernel_GBps"] = nbytes / row["kernel_us"] / 1e3
                row["kernel_pct_hbm"] = 100 * row["kernel_GBps"] / hbm
            if not a.no_peers:
                gdn_tree_peers(run, row, pb, ref, device, fla_ops, kind)
            run.record(row)
    run.report["best_tiles"] = {f"{kind}{n}": tv for (n, kind), tv in best.items()}


def gdn_tree_peers(run: Run, row: dict, pb: dict, ref, device: str, fla_ops, kind: str) -> None:
    import torch  # the peers' framework: optional, imported only when they run

    try:
        peer = peers.TorchPerNode(pb, "bf16", device)
        peer()
        row["torch_per_node_err"] = rel_err(peer.output_bhnv(), ref)
        row["torch_per_node_us"] = time_torch([peer])[0] * 1e6
        row["torch_per_node_state_MiB"] = peer.state_bytes / 2**20
        del peer
        if run.gpu:
            torch.cuda.empty_cache()
    except Exception as e:
        row["torch_per_node_error"] = err_str(e)
    if fla_ops is None or kind != "ddtree":
        return
    try:
        fp = peers.FlaPaths(fla_ops, pb, "cuda")
        fp()
        row["fla_paths_err"] = rel_err(fp.output_bhnv(), ref)
        row["fla_paths_us"] = time_torch([fp])[0] * 1e6
        row["fla_paths"] = f"{fp.n_paths} paths x {fp.t_len}"
        del fp
    except Exception as e:
        row["fla_paths_error"] = err_str(e)
    if run.quick or run.elapsed() > run.args.budget_s:
        return
    for name, fn in peers.fla_chain_fns(fla_ops, pb, "cuda").items():
        try:
            fn()
            row[name + "_us"] = time_torch([fn])[0] * 1e6
        except Exception as e:
            row[name + "_error"] = err_str(e)


def gdn_commit_options(ap):
    add_batches(ap)
    ap.add_argument("--counts", default="16",
                    help="accepted nodes of the timed commits (comma list; random-weight drafters accept 1-2)")
    add_sweep(ap)
    add_peers(ap)


@kernel("gdn_commit", [("b", "B", 2, None), ("count", "cnt", 3, None), ("kernel_GBps", "GB/s", 6, ".0f"),
                       ("kernel_pct_hbm", "%HBM", 5, ".0f"), ("kernel_err", "err", 8, ".1e")],
        "GDN path commit (with and without the conv window) against XLA's gather + scan", gdn_commit_options)
def run_gdn_commit(run: Run) -> None:
    a = run.args
    dims = gdn_layer(run)
    p = 8 if run.smoke else 16
    n = 16 if run.smoke else 64
    batches = [1, 2] if run.smoke else ints(a.batches)
    hbm = run.rates()["hbm_GBps"]

    def commit_call(impl, path, count, window=None, conv_in=None, **tuning):
        def f(args):
            k, v, g, beta, state = args
            if window is None:
                return gdn_path_commit(k, v, g, beta, state, path, count, impl=impl, **tuning)
            return gdn_path_commit(k, v, g, beta, state, path, count, window=window, conv_in=conv_in, impl=impl,
                                   **tuning)[0]
        return f

    for b in batches:
        for accepted in ints(a.counts):
            pb = gdn_problem(3000 + b, b, n, **dims)
            lp = [leaf_path(t, p) for t in pb["trees"]]
            path = jnp.asarray([x for x, _ in lp], jnp.int32)
            cnt = min(accepted, p)
            count = jnp.full((b,), cnt, jnp.int32)  # the path may revisit node 0 past its end
            itemsize = 2
            nbytes = 2 * b * dims["hv"] * dims["dk"] * dims["dv"] * 4 + b * cnt * (
                dims["hk"] * dims["dk"] * itemsize + dims["hv"] * dims["dv"] * itemsize + 2 * dims["hv"] * 4)
            _, k, v, g, beta, state, _ = gdn_args(pb, jnp.bfloat16)
            sets = [(k, v, g, beta, state * (1 + 1e-3 * r)) for r in range(run.rotations(nbytes))]
            conv_dim = 2 * dims["hk"] * dims["dk"] + dims["hv"] * dims["dv"]
            window = jnp.ones((b, 3, conv_dim), jnp.bfloat16)
            conv_in = jnp.ones((b, n, conv_dim + dims["hv"] * dims["dv"]), jnp.bfloat16)
            row = {"b": b, "p": p, "count": cnt, "n": n, "bytes": nbytes}
            ref = jax.jit(commit_call("xla", path, count))(sets[0])
            row["xla_us"] = run.time(commit_call("xla", path, count), sets, 30e-6, carry=4)[0] * 1e6
            variants = [{}, {"window": True}]  # the model's form slides the conv window in the same launch
            if not (a.no_sweep or run.quick) and b == batches[0]:
                variants += [{"block_dv": 8}, {"block_dv": 16, "num_warps": 2}, {"block_dv": 32},
                             {"block_dv": 32, "num_warps": 2}, {"block_dv": 64, "num_warps": 4}]
            for tv in variants:
                name = variant_name("kernel", tv)
                kw = dict(tv)
                if kw.pop("window", False):
                    kw.update(window=window, conv_in=conv_in)
                try:
                    f = commit_call(run.impl, path, count, **kw)
                    row[name + "_err"] = rel_err(jax.jit(f)(sets[0]), ref)
                    row[name + "_us"] = run.time(f, sets, 5e-6, carry=4)[0] * 1e6
                except Exception as e:
                    row[name + "_error"] = err_str(e)
            row["ok"] = all(row[k] <= 1e-5 for k in row if k.endswith("_err"))
            if "kernel_us" in row:
                row["kernel_GBps"] = nbytes / row["kernel_us"] / 1e3
                row["kernel_pct_hbm"] = 100 * row["kernel_GBps"] / hbm
            if not a.no_peers:  # the per-node implementations commit by copying the accepted leaf's state
                try:
                    import torch

                    device = "cuda" if run.gpu else "cpu"
                    states = torch.randn(b * n, dims["hv"], dims["dk"], dims["dv"], device=device)
                    leaf = torch.tensor([bi * n + c - 1 for bi, (_, c) in enumerate(lp)], device=device)
                    dst = torch.empty(b, *states.shape[1:], device=device)
                    row["torch_leaf_copy_us"] = time_torch([lambda: dst.copy_(states[leaf])])[0] * 1e6
                    del states
                except Exception as e:
                    row["torch_leaf_copy_error"] = err_str(e)
            run.record(row)


def gdn_decode_problem(seed: int, batch: int, hk: int, hv: int, dk: int, dv: int, taps: int, hidden: int, dtype):
    """gdn_decode's arguments: a random step of `batch` rows, every 4th row idle (n_valid 0)."""
    rng = np.random.default_rng(seed)
    c = 2 * hk * dk + hv * dv
    r = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    n_valid = jnp.asarray((np.arange(batch) % 4 != 3).astype(np.int32))
    return (r(batch, c).astype(dtype), r(batch, hv, dv).astype(dtype), r(batch, hidden).astype(dtype),
            (r(hidden, hv) * hidden**-0.5).astype(dtype), (r(hidden, hv) * hidden**-0.5).astype(dtype),
            r(hv).astype(dtype), r(hv).astype(dtype), r(batch, taps - 1, c).astype(dtype),
            (r(taps, c) * 0.5).astype(dtype), r(batch, hv, dk, dv) * 0.1, (1 + 0.1 * r(dv)).astype(dtype), n_valid)


GDN_DECODE_STATE, GDN_DECODE_CARRIED = 9, (1, 2, 7, 9)  # state; z, x, window, state: carried step to step


def gdn_decode_options(ap):
    add_batches(ap)
    add_warps(ap)


@kernel("gdn_decode", [("batch", "B", 2, None), ("float32_rel_err", "fp32 err", 9, ".1e"),
                       ("bfloat16_rel_err", "bf16 err", 9, ".1e")],
        "GDN decode step against the model's XLA decode path", gdn_decode_options)
def run_gdn_decode(run: Run) -> None:
    a = run.args
    shape = dict(hk=2, hv=4, dk=16, dv=16, taps=4, hidden=64) if run.smoke else dict(GDN_27B)
    run.report["shape"] = shape
    hk = shape["hk"]
    decode = lambda impl, **opts: jax.jit(functools.partial(gdn_decode, num_k_heads=hk, eps=1e-6, impl=impl, **opts))

    def carried_step(opts):
        def f(args):
            y, state, window = gdn_decode(*args, num_k_heads=hk, eps=1e-6, **opts)
            x = args[2]  # the hidden row changes every step, as in decoding: the a / b products are not hoisted
            x = (x.astype(jnp.float32) * 0.999 + 1e-3 * y[:, 0, :1].astype(jnp.float32)).astype(x.dtype)
            return y, x, window, state
        return f

    for batch in [2] if run.smoke else ints(a.batches):
        row = {"batch": batch}
        variants = {"xla": dict(impl="xla"), "kernel": dict(impl=run.impl)}
        variants.update({f"kernel_w{nw}": dict(impl=run.impl, num_warps=nw) for nw in ints(a.warps)
                         if nw != GDN_DECODE_WARPS})
        for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
            args = gdn_decode_problem(batch, batch, **shape, dtype=dtype)
            name = jnp.dtype(dtype).name
            with jax.default_matmul_precision("highest"):  # no TF32 in the reference's float32 a / b products
                want = decode("xla")(*args)
            try:
                got = decode(run.impl)(*args)
                row[f"{name}_rel_err"] = err = max_rel_err(want, got)
                idle = [i for i in range(batch) if int(args[-1][i]) == 0]
                same = all(bool((np.asarray(got[1][i]) == np.asarray(args[GDN_DECODE_STATE][i])).all()) for i in idle)
                row[f"{name}_ok"] = bool(err <= tol and same)
            except Exception as e:
                row[f"{name}_error"] = err_str(e)
        row["ok"] = bool(row.get("float32_ok") and row.get("bfloat16_ok"))
        args = gdn_decode_problem(batch * 10, batch, **shape, dtype=jnp.bfloat16)
        for name, opts in variants.items():
            try:
                row[name + "_us"] = run.time(carried_step(opts), [args], 20e-6, carry=GDN_DECODE_CARRIED)[0] * 1e6
            except Exception as e:
                row[name + "_error"] = err_str(e)
        run.record(row)


def gdn_prologue_problem(seed: int, batch: int, nodes: int, hk: int, hv: int, dk: int, dv: int, taps: int, dtype):
    """(mixed, window, conv_w, conv_src) of a random tree per batch row (parents among the 4 previous
    nodes: deep paths, as DDTree's best-first trees have)."""
    rng = np.random.default_rng(seed)
    c = 2 * hk * dk + hv * dv
    parents = np.stack([[-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, nodes)] for _ in range(batch)])
    tree = make_tree(jnp.zeros((batch, nodes), jnp.int32), jnp.asarray(parents, jnp.int32),
                     jnp.ones((batch, nodes), bool), jnp.zeros((batch,), jnp.int32), max_depth=nodes - 1)
    r = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return (r(batch, nodes, c).astype(dtype), r(batch, taps - 1, c).astype(dtype), (r(taps, c) * 0.5).astype(dtype),
            geometry(tree, taps).conv_src)


def gdn_prologue_options(ap):
    add_batches(ap)
    ap.add_argument("--sizes", default="17,33,65", help="tree sizes (DDTree budget + 1)")
    add_warps(ap)


@kernel("gdn_prologue", [("batch", "B", 2, None), ("nodes", "N", 4, None), ("float32_rel_err", "fp32 err", 9, ".1e"),
                         ("bfloat16_rel_err", "bf16 err", 9, ".1e")],
        "GDN tree prologue against the model's XLA form", gdn_prologue_options)
def run_gdn_prologue(run: Run) -> None:
    a = run.args
    shape = (dict(hk=2, hv=6, dk=16, dv=16, taps=4) if run.smoke else
             {k: GDN_27B[k] for k in ("hk", "hv", "dk", "dv", "taps")})
    run.report["shape"] = shape
    kw = dict(num_k_heads=shape["hk"], head_k_dim=shape["dk"], head_v_dim=shape["dv"])
    for batch in [2] if run.smoke else ints(a.batches):
        for nodes in [17] if run.smoke else ints(a.sizes):
            row = {"batch": batch, "nodes": nodes}
            for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):  # bf16: the reference rounds each conv tap
                args = gdn_prologue_problem(batch * 100 + nodes, batch, nodes, **shape, dtype=dtype)
                want = jax.jit(functools.partial(gdn_tree_prologue, impl="xla", **kw))(*args)
                name = jnp.dtype(dtype).name
                try:
                    got = jax.jit(functools.partial(gdn_tree_prologue, impl=run.impl, **kw))(*args)
                    row[f"{name}_rel_err"] = err = max_rel_err(want, got)  # over q, k, v, k32
                    row[f"{name}_ok"] = bool(err <= tol)
                except Exception as e:
                    row[f"{name}_error"] = err_str(e)
            row["ok"] = bool(row.get("float32_ok") and row.get("bfloat16_ok"))
            sets = [gdn_prologue_problem(batch * 1000 + nodes * 10 + s, batch, nodes, **shape, dtype=jnp.bfloat16)
                    for s in range(3)]
            variants = {"xla": dict(impl="xla"), "kernel": dict(impl=run.impl)}
            variants.update({f"kernel_w{nw}": dict(impl=run.impl, num_warps=nw) for nw in ints(a.warps)})
            for vname, opts in variants.items():
                f = lambda i, x, opts=opts: gdn_tree_prologue(  # the loop index scales the node inputs
                    (x[0].astype(jnp.float32) * (1 + 1e-3 * jnp.asarray(i, jnp.float32))).astype(x[0].dtype), *x[1:],
                    **kw, **opts)
                try:
                    row[vname + "_us"] = run.time(f, sets, 10e-6)[0] * 1e6
                except Exception as e:
                    row[vname + "_error"] = err_str(e)
            run.record(row)


# ---------------------------------------------------------------------------------------------
# tree attention and the ancestor bits
# ---------------------------------------------------------------------------------------------
def attention_lengths(b: int, cap: int) -> list[int]:
    """Batch 1: the full cache. Batch > 1: different lengths, the longest = capacity."""
    if b == 1:
        return [cap]
    return [int(cap * x) - i * 7 for i, x in enumerate(np.linspace(0.55, 1.0, b))][:-1] + [cap]


def attention_problem(key, b: int, n: int, cap: int, lengths, dtype, nrot: int = 1, nq=ATTENTION_27B["heads"],
                      nkv=ATTENTION_27B["kv_heads"], hd=ATTENTION_27B["head_dim"]):
    """nrot random argument sets (q, k_cache, v_cache, lengths, k_tree, v_tree, bits) of tree_attention
    sharing one DDTree-like tree per batch row."""
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**30)))
    bits = ancestor_words([tree_parents(rng, n) for _ in range(b)])
    lens = jnp.asarray(lengths, jnp.int32)
    sets = []
    for r in range(nrot):
        ks = jax.random.split(jax.random.fold_in(key, r), 5)
        q = jax.random.normal(ks[0], (b, n, nq, hd), jnp.float32).astype(dtype)
        kc = jax.random.normal(ks[1], (b, nkv, cap, hd), jnp.float32).astype(dtype)
        vc = jax.random.normal(ks[2], (b, nkv, cap, hd), jnp.float32).astype(dtype)
        kt = jax.random.normal(ks[3], (b, n, nkv, hd), jnp.float32).astype(dtype)
        vt = jax.random.normal(ks[4], (b, n, nkv, hd), jnp.float32).astype(dtype)
        sets.append((q, kc, vc, lens, kt, vt, bits))
    return sets


def attention_call(impl: str, tuning=None):
    """f(i, args) of tree_attention; tuning may hold split_scale (a factor on the default split
    count). The loop index reaches the lengths (the kernel's) or q (the reference's)."""
    tuning = dict(tuning or {})
    split_scale = tuning.pop("split_scale", None)

    def f(i, a):
        q, kc, vc, lens, kt, vt, bits = a
        kw = dict(tuning) if impl != "xla" else {}
        if split_scale is not None and impl != "xla":
            b, n, nq, hd = q.shape
            cfg = choose_config(b, n, kc.shape[1], nq // kc.shape[1], hd, kc.shape[2], **tuning)
            kw["num_splits"] = max(1, min(64, round(cfg.num_splits * split_scale)))
        lens = jnp.minimum(lens, kc.shape[2] + i)  # == lens; depends on the loop index
        if impl == "xla":  # its Q K^T does not read lens
            q = jnp.where(i < 0, -q, q)
        return tree_attention(q, kc, vc, lens, kt, vt, bits, scale=q.shape[-1] ** -0.5, impl=impl, **kw)

    return f


def attention_bytes(lengths, nkv, hd, itemsize=2) -> int:
    """Cache bytes a call must read (K and V up to each row's length)."""
    return int(sum(lengths) * nkv * hd * 2 * itemsize)


def attention_flops(lengths, n, nq, hd) -> int:
    """Q K^T and P V over the visible cache and the tree keys (dense over the tree)."""
    return int(sum(4 * n * nq * hd * (length + n) for length in lengths))


def tree_attention_options(ap):
    add_batches(ap)
    ap.add_argument("--caches", default="1024,8192,32768", help="cache lengths (--quick: 8192)")
    ap.add_argument("--sizes", default="1,16,64,128,256", help="tree sizes; 1 is a decode step (--quick: 1,16,64)")
    add_sweep(ap)
    ap.add_argument("--sweep-cache", type=int, default=8192, help="cache length of the tile sweep")
    ap.add_argument("--sweep-nodes", type=int, default=64, help="tree size of the tile sweep (65: DDTree-64)")
    add_peers(ap)
    ap.add_argument("--flex-all", action="store_true",
                    help="time flex_attention at every selected tree shape (default: a fixed subset)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip flex_attention past this many seconds")


def attention_sweep(run: Run, dims, cache: int, nodes: int) -> dict:
    """Tile sweep at batch 1: tree (N = nodes) and decode (N = 1). Returns the best tuning of each."""
    if run.smoke:
        cands = {"tree": [dict(block_r=16, block_k=16), dict(split_scale=2.0)], "decode": [dict(block_k=16)]}
        cache, shapes = 64, {"tree": 4, "decode": 1}
    else:
        shapes = {"tree": nodes, "decode": 1}
        cands = {
            "tree": [dict(block_r=br, block_k=bk, num_warps=w, num_stages=s)
                     for br, bk, w, s in [(64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2),
                                          (64, 32, 4, 3), (32, 64, 4, 3)]],
            "decode": [dict(block_k=bk, num_warps=w, num_stages=s)
                       for bk, w, s in [(64, 4, 2), (64, 4, 3), (128, 4, 2), (32, 4, 4), (64, 8, 3)]],
        }
        for kind in cands:
            cands[kind] += [dict(split_scale=0.5), dict(split_scale=2.0)]
    best, rows = {}, []
    for kind, n in shapes.items():
        nbytes = attention_bytes([cache], dims["nkv"], dims["hd"])
        sets = attention_problem(jax.random.PRNGKey(3), 1, n, cache, [cache], jnp.bfloat16,
                                 run.rotations(nbytes, cap=8), **dims)
        top = None
        for tuning in cands[kind]:
            row = {"kind": kind, "nodes": n, "cache": cache, **tuning}
            try:
                t, _ = run.time(attention_call(run.impl, tuning), sets, nbytes / (run.rates()["hbm_GBps"] * 1e9))
                row.update(us=t * 1e6, GBps=nbytes / t / 1e9)
                if top is None or t < top[0]:
                    top = (t, tuning)
            except Exception as e:
                row["error"] = err_str(e)
            print(f"[tree_attention] sweep {row}", flush=True)
            rows.append(row)
        best[kind] = top[1] if top else {}
    run.report["sweep"] = rows
    run.report["best_tuning"] = best
    write_report(run.out, run.report)
    return best


@kernel("tree_attention", [("batch", "B", 2, None), ("cache", "cache", 6, None), ("nodes", "N", 4, None),
                           ("kernel_GBps", "GB/s", 6, ".0f"), ("kernel_pct_hbm", "%HBM", 5, ".0f"),
                           ("kernel_TFLOPs", "TF/s", 5, ".0f"), ("bound_us", "bound", 7, ".1f"),
                           ("kernel_over_bound", "x bnd", 5, ".2f"), ("over_decode", "x dec", 5, ".2f")],
        "tree attention against XLA, SDPA and flex_attention", tree_attention_options)
def run_tree_attention(run: Run) -> None:
    a = run.args
    dims = dict(nq=4, nkv=2, hd=32) if run.smoke else dict(nq=ATTENTION_27B["heads"], nkv=ATTENTION_27B["kv_heads"],
                                                           hd=ATTENTION_27B["head_dim"])
    rates = run.rates()
    hbm, tflops = rates["hbm_GBps"], rates["matmul_TFLOPs"]
    best = {} if (a.no_sweep or (a.quick and run.gpu)) else attention_sweep(run, dims, a.sweep_cache, a.sweep_nodes)
    if run.smoke:
        batches, caches, sizes = (1, 2), (64,), (1, 4)
        flex_shapes = set()  # torch.compile of flex_attention needs a GPU here
    else:
        batches = ints(a.batches)
        caches = (8192,) if a.quick else ints(a.caches)
        sizes = (1, 16, 64) if a.quick else ints(a.sizes)
        flex_shapes = ({(b, c, n) for b in batches for c in caches for n in sizes if n > 1} if a.flex_all else
                       {(1, 8192, 64)} if a.quick else {(1, 8192, 64), (8, 8192, 64), (1, 32768, 64), (1, 8192, 256)})
    torch_peers = None
    if not a.no_peers:
        try:
            torch_peers = peers.TorchAttention()
        except Exception as e:
            run.report["peers"] = f"unavailable: {err_str(e)}"
    for b in batches:
        for cap in caches:
            lens = attention_lengths(b, cap)
            nbytes = attention_bytes(lens, dims["nkv"], dims["hd"])
            decode_us = None
            for n in sizes:
                row = {"batch": b, "cache": cap, "nodes": n, "lengths": lens, "cache_bytes": nbytes,
                       "flops": attention_flops(lens, n, dims["nq"], dims["hd"])}
                row["bound_us"] = max(nbytes / (hbm * 1e9), row["flops"] / (tflops * 1e12)) * 1e6
                key = jax.random.PRNGKey(b * 1000 + cap + n)
                sets = attention_problem(key, b, n, cap, lens, jnp.bfloat16, run.rotations(nbytes, cap=8, factor=1.25),
                                         **dims)
                est = row["bound_us"] * 1e-6 + 5e-6
                ours = None
                try:
                    t, info = run.time(attention_call(run.impl, best.get("tree" if n > 1 else "decode")), sets, est)
                    row["kernel_us"], ours = t * 1e6, info["out"]
                except Exception as e:
                    row["kernel_error"] = err_str(e)
                try:
                    t, info = run.time(attention_call("xla"), sets[:1], est * 20)
                    row["xla_us"] = t * 1e6
                    if ours is not None:  # bf16 outputs of both: a sanity check of what was timed
                        row["kernel_err"] = rel_err(ours, info["out"])
                        row["ok"] = row["kernel_err"] <= 2e-2
                except Exception as e:
                    row["xla_error"] = err_str(e)
                if torch_peers is not None:
                    try:
                        fns = torch_peers.sdpa_fns(sets, decode=n == 1)
                        if ours is not None:
                            row["sdpa_err"] = torch_peers.check(fns[0], ours)
                        row["sdpa_us"] = time_torch(fns)[0] * 1e6
                        row["sdpa_gqa"] = torch_peers.gqa_mode
                        del fns
                    except Exception as e:
                        row["sdpa_error"] = err_str(e)
                    if (b, cap, n) in flex_shapes and run.elapsed() < a.budget_s:
                        try:  # flex_attention compiles slowly: a subset of the shapes, while the budget lasts
                            fns = torch_peers.flex_fns(sets)
                            if ours is not None:
                                row["flex_err"] = torch_peers.check(fns[0], ours)
                            row["flex_us"] = time_torch(fns)[0] * 1e6
                            del fns
                        except Exception as e:
                            row["flex_error"] = err_str(e)
                if "kernel_us" in row:
                    us = row["kernel_us"]
                    row["kernel_GBps"] = nbytes / us * 1e-3
                    row["kernel_pct_hbm"] = 100 * row["kernel_GBps"] / hbm
                    row["kernel_TFLOPs"] = row["flops"] / us * 1e-6
                    row["kernel_over_bound"] = us / row["bound_us"]
                    peers_us = [row[k] for k in ("xla_us", "sdpa_us", "flex_us") if k in row]
                    row["faster_than_all_peers"] = all(us < t for t in peers_us)
                    if n == 1:
                        decode_us = min([us] + peers_us)
                    elif decode_us:
                        row["over_decode"] = us / decode_us  # against the fastest single-query decode
                del sets
                run.record(row)
    rows = [r for r in run.report["rows"] if "kernel_us" in r]
    run.report["targets"] = {
        "min_pct_hbm_at_8k_plus": min((r["kernel_pct_hbm"] for r in rows if r["cache"] >= 8192), default=None),
        "faster_than_all_peers_everywhere": all(r["faster_than_all_peers"] for r in rows) if rows else None,
        "note": "at head_dim 256, group 6 the tree part is compute-bound from N ~ 40 (docs/kernels_attention.md): "
                "compare kernel_over_bound, not %HBM, there",
    }


def ancestor_bits_options(ap):
    ap.add_argument("--shapes", default="1x64,8x64,1x256,8x256", help="BATCHxNODES list")


@kernel("ancestor_bits", [("batch", "B", 2, None), ("nodes", "N", 4, None)],
        "ancestor bitsets of a tree against the XLA doubling", ancestor_bits_options)
def run_ancestor_bits(run: Run) -> None:
    shapes = ([(2, 9), (1, 40)] if run.smoke else
              [tuple(int(x) for x in s.split("x")) for s in run.args.shapes.split(",")])
    for b, n in shapes:
        rng = np.random.default_rng(n)
        par = jnp.asarray(np.asarray([tree_parents(rng, n) for _ in range(b)], np.int32))
        row = {"batch": b, "nodes": n}
        want = np.asarray(jax.jit(lambda p: ancestor_bits(p, impl="xla"))(par))
        row["kernel_equal"] = bool((np.asarray(jax.jit(lambda p: ancestor_bits(p, impl=run.impl))(par)) == want).all())
        for name, impl in (("kernel", run.impl), ("xla", "xla")):
            try:
                f = lambda i, p, impl=impl: ancestor_bits(jnp.minimum(p, n + i), impl=impl)
                row[name + "_us"] = run.time(f, [par], 5e-6)[0] * 1e6
            except Exception as e:
                row[name + "_error"] = err_str(e)
        run.record(row)


# ---------------------------------------------------------------------------------------------
# Mamba2 / SSD: tree verify, path commit
# ---------------------------------------------------------------------------------------------
def ssd_problem(rng, b: int, n: int, heads: int, head_dim: int, groups: int, state: int, kind: str = "ddtree"):
    """ssd_tree_verify's arguments (x, dt, a, bm, cm, d, state, bits), float32, a tree per row."""
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    x, bm, cm = f(b, n, heads, head_dim), f(b, n, groups, state) * state**-0.5, f(b, n, groups, state) * state**-0.5
    d, s0 = f(heads), f(b, heads, head_dim, state)
    dt = jnp.asarray(rng.uniform(0.001, 0.5, (b, n, heads)), jnp.float32)
    a = -jnp.asarray(rng.uniform(0.5, 8.0, (heads,)), jnp.float32)
    parents = jnp.asarray(np.asarray([tree_parents(rng, n, kind) for _ in range(b)], np.int32))
    tree = make_tree(jnp.zeros((b, n), jnp.int32), parents, jnp.ones((b, n), bool), jnp.zeros((b,), jnp.int32),
                     max_depth=n - 1 if kind == "chain" else min(n - 1, DRAFT_DEPTHS))
    return x, dt, a, bm, cm, d, s0, tree.ancestor_bits


def ssd_layer(run: Run) -> dict:
    a = run.args
    return (dict(heads=4, head_dim=16, groups=2, state=16) if run.smoke else
            dict(heads=a.heads, head_dim=a.head_dim, groups=a.groups, state=a.state))


def ssd_options(ap):
    add_batches(ap)
    ap.add_argument("--heads", type=int, default=SSD_NEMOTRON_H_8B["heads"])
    ap.add_argument("--head-dim", type=int, default=SSD_NEMOTRON_H_8B["head_dim"])
    ap.add_argument("--groups", type=int, default=SSD_NEMOTRON_H_8B["groups"])
    ap.add_argument("--state", type=int, default=SSD_NEMOTRON_H_8B["state"])


def ssd_tree_options(ap):
    ssd_options(ap)
    ap.add_argument("--sizes", default="16,64,128,256", help="tree sizes (--quick: 16,64)")
    add_sweep(ap)


@kernel("ssd_tree", [("batch", "B", 2, None), ("n", "N", 4, None), ("kernel_GBps", "GB/s", 6, ".0f"),
                     ("kernel_err", "err", 8, ".1e")],
        "Mamba2 / SSD tree verify against the model's XLA path", ssd_tree_options)
def run_ssd_tree(run: Run) -> None:
    a = run.args
    L = ssd_layer(run)
    run.report["shape"] = L
    rng = np.random.default_rng(0)
    h, hd, g, ns = L["heads"], L["head_dim"], L["groups"], L["state"]
    sizes = [16, 40] if run.smoke else ([16, 64] if a.quick else ints(a.sizes))
    batches = [1] if run.smoke or a.quick else ints(a.batches)

    def call(impl, **kw):
        def f(i, args):
            *rest, bits = args
            return ssd_tree_verify(*rest, jnp.where(i < 0, bits ^ jnp.uint32(1), bits), impl=impl, **kw)
        return f

    for b in batches:
        for n in sizes:
            moved = b * h * hd * ns * 4 + b * n * (h * hd * 4 + 2 * g * ns * 4 + h * 4) + b * n * (-(-n // 32)) * 4 \
                + b * n * h * hd * 4  # state, per-node inputs and bits read; y written
            sets = [ssd_problem(rng, b, n, **L) for _ in range(run.rotations(moved, cap=64))]
            row = {"batch": b, "n": n, "bytes": moved}
            t, info = run.time(call("xla"), sets, 50e-6)
            row["xla_us"], ref = t * 1e6, info["out"]
            scale = max(1.0, float(jnp.abs(ref).max()))
            variants = [{}]
            if not (a.no_sweep or run.quick) and b == batches[0]:
                variants += [dict(block_n=bn, block_p=bp) for bn in (None, 16, 32, 64) for bp in (None, 32)][1:]
            for kw in variants:
                name = variant_name("kernel", kw)
                try:
                    t, info = run.time(call(run.impl, **kw), sets, 10e-6)
                    row[name + "_us"] = t * 1e6
                    row[name + "_err"] = float(jnp.abs(info["out"] - ref).max()) / scale
                except Exception as e:
                    row[name + "_error"] = err_str(e)
            row["ok"] = all(row[k] <= 1e-4 for k in row if k.endswith("_err"))  # tf32x3 products on the GPU
            if "kernel_us" in row:
                row["kernel_GBps"] = moved / row["kernel_us"] / 1e3
            run.record(row)


@kernel("ssd_commit", [("batch", "B", 2, None), ("p", "P", 3, None), ("kernel_GBps", "GB/s", 6, ".0f"),
                       ("kernel_err", "err", 8, ".1e")],
        "Mamba2 / SSD path commit against XLA's gather + scan", ssd_options)
def run_ssd_commit(run: Run) -> None:
    L = ssd_layer(run)
    run.report["shape"] = L
    rng = np.random.default_rng(1)
    h, hd, g, ns = L["heads"], L["head_dim"], L["groups"], L["state"]
    n, p = (40, 16) if run.smoke else (256, 16)
    call = lambda impl: lambda args: ssd_path_commit(*args, impl=impl)
    for b in [1] if run.smoke else ints(run.args.batches):
        moved = 2 * b * h * hd * ns * 4 + b * p * (h * hd * 4 + g * ns * 4 + h * 4)  # state read + written, path rows
        sets = []
        for _ in range(run.rotations(moved, cap=64)):
            x, dt, a, bm, _, _, s0, _ = ssd_problem(rng, b, n, **L)
            path = jnp.asarray(np.sort(rng.integers(0, n, (b, p)), axis=1), jnp.int32)
            sets.append((x, dt, a, bm, s0, path, jnp.full((b,), p, jnp.int32)))
        row = {"batch": b, "p": p, "bytes": moved}
        ref = jax.jit(call("xla"))(sets[0])
        for name, impl in (("xla", "xla"), ("kernel", run.impl)):
            try:
                if impl != "xla":
                    row["kernel_err"] = float(jnp.abs(jax.jit(call(impl))(sets[0]) - ref).max()) / max(
                        1.0, float(jnp.abs(ref).max()))
                row[name + "_us"] = run.time(call(impl), sets, 10e-6, carry=4)[0] * 1e6
            except Exception as e:
                row[name + "_error"] = err_str(e)
        row["ok"] = row.get("kernel_err", 1.0) <= 1e-5
        if "kernel_us" in row:
            row["kernel_GBps"] = moved / row["kernel_us"] / 1e3
        run.record(row)


# ---------------------------------------------------------------------------------------------
# the DDTree build: row top-k, node selection
# ---------------------------------------------------------------------------------------------
def row_top_k_problem(seed: int, batch: int, depth: int, n: int, rotations: int):
    """Log-softmax rows with many exact ties (logits on a coarse grid) and some -inf."""
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(rotations):
        logits = np.round(rng.normal(size=(batch, depth, n)) * 4) / 2
        logits[rng.random(logits.shape) < 0.01] = -np.inf
        sets.append(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    return sets


def row_top_k_options(ap):
    add_batches(ap)
    ap.add_argument("--sizes", default="2048,8192", help="row lengths (the demo's vocabulary: 8192)")
    ap.add_argument("--ks", default="16,32", help="candidates per row (DDTree: k = min(budget, vocab))")
    add_warps(ap)


@kernel("row_top_k", [("batch", "B", 2, None), ("n", "n", 6, None), ("k", "k", 3, None)],
        "row top-k against the DDTree build's staged XLA top-k and lax.top_k", row_top_k_options)
def run_row_top_k(run: Run) -> None:
    a = run.args
    depth = 2 if run.smoke else DRAFT_DEPTHS
    for batch in [1] if run.smoke else ints(a.batches):
        for n in ints(a.sizes):
            for k in ints(a.ks):
                row = {"batch": batch, "n": n, "k": k, "depth": depth}
                sets = row_top_k_problem(batch * 1000 + n + k, batch, depth, n, 1 if run.smoke else 4)
                variants = {"lax_top_k": lambda v: jax.lax.top_k(v, k), "xla": lambda v: top_k(v, k),
                            "kernel": lambda v: row_top_k(v, k, impl=run.impl)}
                variants.update({f"kernel_w{nw}": lambda v, nw=nw: row_top_k(v, k, impl=run.impl, num_warps=nw)
                                 for nw in ints(a.warps) if nw != ROW_TOP_K_WARPS})
                want = [np.asarray(x) for x in jax.jit(lambda v: jax.lax.top_k(v, k))(sets[0])]
                for name, f in variants.items():
                    try:
                        got = [np.asarray(x) for x in jax.jit(f)(sets[0])]
                        row[name + "_equal"] = all(bool((x == y).all()) for x, y in zip(want, got))
                        # the loop index shifts every entry by the same amount: same ties, new values
                        row[name + "_us"] = run.time(lambda i, v, f=f: f(v - i * 2.0**-10), sets, 20e-6)[0] * 1e6
                    except Exception as e:
                        row[name + "_error"] = err_str(e)
                run.record(row)


def tree_select_problem(seed: int, batch: int, depth: int, k: int, rotations: int):
    """Rotated [batch, depth, k] candidate sets in lax.top_k order, with ties and some -inf."""
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(rotations):
        x = np.round(-np.abs(rng.normal(size=(batch, depth, k))).astype(np.float32) * 3 * 4) / 4
        x[rng.random(x.shape) < 0.03] = -np.inf
        sets.append(jax.lax.top_k(jnp.asarray(x), k)[0])
    return sets


def tree_select_options(ap):
    add_batches(ap)
    ap.add_argument("--budgets", default="8,16,32,64", help="tree budgets (k = budget candidates per depth)")
    add_warps(ap)


@kernel("tree_select", [("batch", "B", 2, None), ("budget", "budget", 6, None)],
        "DDTree node selection in one launch against the XLA form", tree_select_options)
def run_tree_select(run: Run) -> None:
    a = run.args
    depth = 4 if run.smoke else DRAFT_DEPTHS
    for batch in ints(a.batches):
        for budget in ints(a.budgets):
            row = {"batch": batch, "budget": budget, "k": budget, "depth": depth}
            sets = tree_select_problem(batch * 100 + budget, batch, depth, budget, 1 if run.smoke else 4)
            variants = {"xla": dict(impl="xla"), "kernel": dict(impl=run.impl)}
            variants.update({f"kernel_w{nw}": dict(impl=run.impl, num_warps=nw) for nw in ints(a.warps)
                             if nw != TREE_SELECT_WARPS})
            want = [np.asarray(x) for x in jax.jit(lambda v: select_nodes(v, budget, impl="xla"))(sets[0])]
            for name, opts in variants.items():
                try:
                    if name != "xla":
                        got = [np.asarray(x) for x in jax.jit(lambda v, o=opts: select_nodes(v, budget, **o))(sets[0])]
                        row[name + "_equal"] = all(bool((x == y).all()) for x, y in zip(want, got))
                    # the loop index shifts every candidate by the same amount: same ties, new values
                    f = lambda i, v, o=opts: select_nodes(v - i * 2.0**-10, budget, **o)
                    row[name + "_us"] = run.time(f, sets, 30e-6)[0] * 1e6
                except Exception as e:
                    row[name + "_error"] = err_str(e)
            run.record(row)


# ---------------------------------------------------------------------------------------------
# residual add + RMSNorm over split-K partials
# ---------------------------------------------------------------------------------------------
ADD_NORM_TILINGS = ((1024, 8), (2048, 16), (4096, 16), (4096, 32))  # (PARTS_CHUNK, PARTS_WARPS)


def add_rms_norm_options(ap):
    ap.add_argument("--parts", default="4,8", help="partial sums S (4: the 27B output projections, 8: MLP down)")
    ap.add_argument("--rows", type=int, default=65, help="rows (a DDTree-64 verify: 65)")


@kernel("add_rms_norm", [("parts", "S", 3, None), ("rows", "rows", 5, None)],
        "add + RMSNorm over split-K partials against XLA's reduce + the plain kernel", add_rms_norm_options)
def run_add_rms_norm(run: Run) -> None:
    h, rows = (80, 3) if run.smoke else (GDN_27B["hidden"], run.args.rows)
    tilings = ((32, 4),) if run.smoke else ADD_NORM_TILINGS
    for parts in ints(run.args.parts):
        row = {"parts": parts, "rows": rows, "h": h}
        key = jax.random.PRNGKey(parts)
        x = jax.random.normal(key, (rows, h), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(jax.random.fold_in(key, 1), (h,), jnp.float32) * 0.1).astype(jnp.bfloat16)
        ds = [jax.random.normal(jax.random.fold_in(key, 2 + r), (parts, rows, h), jnp.float32)
              for r in range(8 if run.gpu else 1)]
        norm = lambda d, impl, warps=None, chunk=None: arn.add_rms_norm(
            x, d, w, eps=1e-6, mode="zero_centered", impl=impl, num_warps=warps, parts_chunk=chunk)
        want = jax.jit(lambda d: norm(d, "xla"))(ds[0])
        forms = {"xla": lambda d: norm(summed_partials(d, x.dtype), run.impl)}  # XLA's reduce, then the plain kernel
        for chunk, warps in tilings:
            forms[f"c{chunk}w{warps}"] = (lambda c, wp: lambda d: norm(d, run.impl, wp, c))(chunk, warps)
        for name, f in forms.items():
            try:
                got = jax.jit(f)(ds[0])
                stream_ok = bool(np.array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)))
                normed = np.asarray(want[1], np.float32)
                err = float(np.max(np.abs(np.asarray(got[1], np.float32) - normed)))
                row[name + "_ok"] = stream_ok and err <= 2**-6 * max(1.0, float(np.max(np.abs(normed))))
                us = trace_kernel_us(f, ds, run.gpu)
                if us is not None:
                    row[name + "_us"] = us
            except Exception as e:
                row[name + "_error"] = err_str(e)
        row["ok"] = all(v for k, v in row.items() if k.endswith("_ok"))
        run.record(row)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
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
