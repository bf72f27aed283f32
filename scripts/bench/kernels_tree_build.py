"""The DDTree build's runs of scripts.bench.kernels (row_top_k, tree_select): candidate rows with
exact ties and -inf entries, the kernel's equality with the XLA forms, and their timings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.speculative.build import top_k
from pallas_kernels.row_top_k import DEFAULT_WARPS as ROW_TOP_K_WARPS
from pallas_kernels.row_top_k import row_top_k
from pallas_kernels.tree_select import DEFAULT_WARPS as TREE_SELECT_WARPS
from pallas_kernels.tree_select import select_nodes
from scripts.bench.common import err_str
from scripts.bench.kernels_harness import Kernel, Run, add_batches, add_warps, ints, registrar
from scripts.bench.shapes import DRAFT_DEPTHS

KERNELS: dict[str, Kernel] = {}
kernel = registrar(KERNELS)


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
