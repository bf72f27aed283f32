"""The GDN kernels' runs of scripts.bench.kernels (gdn_tree, gdn_commit, gdn_decode,
gdn_prologue): their random problems at the 27B GDN layer, the timed calls, and the PyTorch / FLA
peers of the tree verify."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.tree import geometry, make_tree, root_path
from pallas_kernels._common import pow2_at_least
from pallas_kernels.gdn_commit import gdn_path_commit
from pallas_kernels.gdn_decode import DEFAULT_WARPS as GDN_DECODE_WARPS
from pallas_kernels.gdn_decode import gdn_decode, gdn_decode_packed
from pallas_kernels.gdn_tree import default_blocks, gdn_tree_verify
from pallas_kernels.gdn_tree_prologue import gdn_tree_prologue
from scripts.bench import peers
from scripts.bench.common import err_str, max_rel_err, time_torch
from scripts.bench.kernels_harness import (Kernel, Run, add_batches, add_peers, add_sweep, add_warps, ancestor_words,
                                           check_decode_step, ints, masked_rows_apply, registrar, rel_err,
                                           time_carried, tree_parents, variant_name)
from scripts.bench.shapes import GDN_27B, LAYERS

KERNELS: dict[str, Kernel] = {}
kernel = registrar(KERNELS)


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
    layer = LAYERS[getattr(run.args, "layer", "27b")][0]
    return dict(hk=2, hv=4, dk=32, dv=32) if run.smoke else {k: layer[k] for k in ("hk", "hv", "dk", "dv")}


def leaf_path(tree, p: int):
    """The deepest root-to-leaf path padded to p entries (an accepted path) and its length."""
    depth = [len(root_path(tree, i)) for i in range(len(tree))]
    path = root_path(tree, int(np.argmax(depth)))[:p]
    return path + [0] * (p - len(path)), len(path)


def gdn_tree_options(ap):
    add_batches(ap)
    ap.add_argument("--sizes", default="16,64,128,256", help="tree sizes (nodes; --quick: 16,64); a size that is "
                    "not a power of two >= 16 (9: DDTree-8) also times the padded form (masked_rows=False)")
    ap.add_argument("--layer", choices=tuple(LAYERS), default="27b", help="the GDN layer's shape")
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
    sizes = [9, 16, 32] if run.smoke else ([16, 64] if a.quick else ints(a.sizes))
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
            if masked_rows_apply(n):  # the default reads the rows masked: the padded form too
                variants.append({"masked_rows": False})  # the XLA pads before the kernel, timed with it
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
GDN_PACKED_CARRIED = (0, 3, 5)  # gdn_decode_packed's product, window and state


def gdn_decode_options(ap):
    add_batches(ap)
    add_warps(ap)
    ap.add_argument("--layer", choices=tuple(LAYERS), default="27b", help="the GDN layer's shape")
    ap.add_argument("--dv-splits", default="4", help="also time the kernel with a head's columns over these many "
                    "programs (dv_split; the gated norm after it), e.g. 2,4,8")
    ap.add_argument("--packed", action="store_true", help="time the models' form: one qkv | z | b | a product read "
                    "in place (gdn_decode_packed); the errors are the x form's either way")


def packed_args(args, seed: int):
    """gdn_decode's arguments as gdn_decode_packed's: the conv inputs, z and random b | a products as
    one product, then a_log .. n_valid."""
    mixed, z = args[0], args[1]
    b, hv = z.shape[0], z.shape[1]
    ba = jax.random.normal(jax.random.PRNGKey(seed), (b, 2 * hv)).astype(mixed.dtype)
    return (jnp.concatenate([mixed, z.reshape(b, -1), ba], -1),) + tuple(args[5:])


@kernel("gdn_decode", [("batch", "B", 2, None), ("float32_rel_err", "fp32 err", 9, ".1e"),
                       ("bfloat16_rel_err", "bf16 err", 9, ".1e")],
        "GDN decode step against the model's XLA decode path", gdn_decode_options)
def run_gdn_decode(run: Run) -> None:
    a = run.args
    shape = dict(hk=2, hv=4, dk=16, dv=32, taps=4, hidden=64) if run.smoke else dict(LAYERS[a.layer][0])
    run.report["shape"] = shape
    hk, dv = shape["hk"], shape["dv"]
    decode = lambda impl, **opts: jax.jit(functools.partial(gdn_decode, num_k_heads=hk, eps=1e-6, impl=impl, **opts))

    def carried_step(opts):
        def f(args):
            y, state, window = gdn_decode(*args, num_k_heads=hk, eps=1e-6, **opts)
            x = args[2]  # the hidden row changes every step, as in decoding: the a / b products are not hoisted
            x = (x.astype(jnp.float32) * 0.999 + 1e-3 * y[:, 0, :1].astype(jnp.float32)).astype(x.dtype)
            return y, x, window, state
        return f

    def carried_packed_step(opts):
        def f(args):
            y, state, window = gdn_decode_packed(*args, num_k_heads=hk, head_v_dim=dv, eps=1e-6, **opts)
            proj = args[0]  # the product changes every step, as in decoding
            proj = (proj.astype(jnp.float32) * 0.999 + 1e-3 * y[:, :1, 0].astype(jnp.float32)).astype(proj.dtype)
            return proj, window, state
        return f

    for batch in [2] if run.smoke else ints(a.batches):
        row = {"batch": batch}
        variants = {"xla": dict(impl="xla"), "kernel": dict(impl=run.impl)}
        variants.update({f"kernel_w{nw}": dict(impl=run.impl, num_warps=nw) for nw in ints(a.warps)
                         if nw != GDN_DECODE_WARPS})
        variants.update({f"kernel_s{sp}": dict(impl=run.impl, dv_split=sp)
                         for sp in ([2] if run.smoke else ints(a.dv_splits)) if sp != 1 and dv // sp >= 16})
        check_decode_step(row, lambda dtype: gdn_decode_problem(batch, batch, **shape, dtype=dtype), decode("xla"),
                          decode(run.impl), GDN_DECODE_STATE)
        args = gdn_decode_problem(batch * 10, batch, **shape, dtype=jnp.bfloat16)
        if a.packed:
            args, step, carried = packed_args(args, batch), carried_packed_step, GDN_PACKED_CARRIED
        else:
            step, carried = carried_step, GDN_DECODE_CARRIED
        time_carried(run, row, variants, step, args, 20e-6, carried)
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
