"""The Mamba2 / SSD runs of scripts.bench.kernels (ssd_tree, ssd_commit): random problems at the
Nemotron-H 8B layer (or the --heads / --head-dim / --groups / --state given) and the timed calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.tree import make_tree
from pallas_kernels.ssd_tree import ssd_path_commit, ssd_tree_verify
from scripts.bench.common import err_str
from scripts.bench.kernels_harness import (Kernel, Run, add_batches, add_sweep, ints, masked_rows_apply, registrar,
                                           tree_parents, variant_name)
from scripts.bench.shapes import DRAFT_DEPTHS, SSD_NEMOTRON_H_8B

KERNELS: dict[str, Kernel] = {}
kernel = registrar(KERNELS)


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
    ap.add_argument("--sizes", default="16,64,128,256", help="tree sizes (--quick: 16,64); a size neither a power "
                    "of two nor peeled (9: DDTree-8) also times the padded form (masked_rows=False)")
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
    sizes = [9, 16, 40] if run.smoke else ([16, 64] if a.quick else ints(a.sizes))
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
            if masked_rows_apply(n):  # the default reads the rows masked (decision 0070): the padded form too
                variants.append({"masked_rows": False})  # the XLA pads before the kernel, timed with it
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
