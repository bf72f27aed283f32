"""The Mamba2 / SSD runs of scripts.bench.kernels (ssd_tree, ssd_commit, mamba2_decode): random problems
at the Nemotron-H 8B layer (or the --heads / --head-dim / --groups / --state given) and the timed calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.tree import make_tree
from pallas_kernels.mamba2_decode import DEFAULT_WARPS as MAMBA2_DECODE_WARPS
from pallas_kernels.mamba2_decode import mamba2_decode
from pallas_kernels.ssd_tree import ssd_path_commit, ssd_tree_verify
from scripts.bench.common import err_str
from scripts.bench.kernels_harness import (Kernel, Run, add_batches, add_sweep, add_warps, check_decode_step, ints,
                                           masked_rows_apply, registrar, time_carried, tree_parents, variant_name)
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


def mamba2_decode_problem(seed: int, batch: int, heads: int, head_dim: int, groups: int, state: int, taps: int,
                          dtype):
    """mamba2_decode's arguments: a random step of `batch` rows, every 4th row idle (n_valid 0)."""
    rng = np.random.default_rng(seed)
    inter, c = heads * head_dim, heads * head_dim + 2 * groups * state
    r = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    n_valid = jnp.asarray((np.arange(batch) % 4 != 3).astype(np.int32))
    return (r(batch, inter + c + heads).astype(dtype), r(batch, taps - 1, c).astype(dtype),
            (r(taps, c) * 0.5).astype(dtype), (0.1 * r(c)).astype(dtype), (0.5 * r(heads)).astype(dtype),
            (0.3 * r(heads)).astype(dtype), (1.0 + 0.2 * r(heads)).astype(dtype),
            0.1 * r(batch, heads, head_dim, state), (1.0 + 0.1 * r(inter)).astype(dtype), n_valid)


MAMBA2_DECODE_STATE, MAMBA2_DECODE_CARRIED = 7, (0, 1, 7)  # state; proj, window, state: carried step to step


def mamba2_decode_options(ap):
    ssd_options(ap)
    add_warps(ap)
    ap.add_argument("--p-splits", default="2,4", help="also time the kernel with a head's rows over these many "
                    "programs (p_split), at the default warps and at each of --warps")


@kernel("mamba2_decode", [("batch", "B", 2, None), ("float32_rel_err", "fp32 err", 9, ".1e"),
                          ("bfloat16_rel_err", "bf16 err", 9, ".1e")],
        "Mamba2 decode step against the model's XLA decode path", mamba2_decode_options)
def run_mamba2_decode(run: Run) -> None:
    a = run.args
    L = ssd_layer(run)
    run.report["shape"] = L
    shape = dict(L, taps=4)
    kw = dict(num_heads=L["heads"], groups=L["groups"], eps=1e-5, dt_limit=(0.001, float("inf")))
    decode = lambda impl, **opts: jax.jit(lambda *args: mamba2_decode(*args, impl=impl, **kw, **opts))

    def carried_step(opts):
        def f(args):
            y, state, window = mamba2_decode(*args, **kw, **opts)
            proj = args[0]  # the input product changes every step, as in decoding
            proj = (proj.astype(jnp.float32) * 0.999 + 1e-3 * y[:, :1].astype(jnp.float32)).astype(proj.dtype)
            return proj, window, state
        return f

    for batch in [2] if run.smoke else ints(a.batches):
        row = {"batch": batch}
        variants = {"xla": dict(impl="xla"), "kernel": dict(impl=run.impl)}
        warps = [None] + [nw for nw in ints(a.warps) if nw != MAMBA2_DECODE_WARPS]
        for sp in [1] + ([2] if run.smoke else [s for s in ints(a.p_splits) if s > 1 and L["head_dim"] % s == 0]):
            for nw in warps:
                for norm in (False, True):  # the group norm after the kernel (XLA) or in its last programs
                    if sp > 1 or nw or norm:
                        variants[variant_name("kernel", dict(s=sp if sp > 1 else None, w=nw, norm=norm or None))] = \
                            dict(impl=run.impl, num_warps=nw, p_split=sp, norm_in_kernel=norm)
        check_decode_step(row, lambda dtype: mamba2_decode_problem(batch, batch, **shape, dtype=dtype), decode("xla"),
                          decode(run.impl), MAMBA2_DECODE_STATE)
        args = mamba2_decode_problem(batch * 10, batch, **shape, dtype=jnp.bfloat16)
        time_carried(run, row, variants, carried_step, args, 10e-6, MAMBA2_DECODE_CARRIED)
        run.record(row)
