"""GPU check and benchmark of the Gated DeltaNet tree kernels (pallas_kernels/gdn_tree.py,
pallas_kernels/gdn_commit.py).

Run from the repo root on the H200:

    PYTHONPATH=. python3 scripts/gpu_gdn.py              # full run (< 4 min)
    PYTHONPATH=. python3 scripts/gpu_gdn.py --quick      # N in {16, 64}, no tile sweep, fewer peers
    PYTHONPATH=. python3 scripts/gpu_gdn.py --cpu-smoke  # no GPU: interpreter, tiny shapes

flash-linear-attention is optional: `import fla`, else the first .whl/*.whl whose name starts
with flash_linear_attention or fla (unpacked to a temp dir; pure Python + Triton).

Steps (each guarded: a failure is recorded in the JSON and the table, never fatal):
1. environment (python / jax / jaxlib / torch / triton / fla, device);
2. HBM read rate: the best of a 2 GiB bf16 -> f32 reduction and a bf16 GEMV in jax (median of rounds);
3. correctness at bench shapes: tree verify pallas vs xla (bf16 inputs, the default "tf32"
   float32-matmul precision; float32 inputs with "tf32x3"), NaN checks; path commit pallas vs
   xla (bf16 and float32); the torch per-node-state peer and the FLA per-path peer vs xla;
4. tree verify at Qwen3.6-27B GDN shapes (16 key heads read by 48 value heads, dk = dv = 128,
   bf16 q/k/v, float32 g/beta/state), DDTree-like random trees (depth <= 15) of N = 16 / 64 /
   128 / 256 nodes (+ a 16-chain = linear DFlash), batch 1 and 8 (different trees per
   sequence): ours (pallas; a small tile sweep at batch 1), the XLA reference, the peers'
   per-node-state approach in torch (one fp32 state per node built level by level from its
   parent's, as SGLang / vLLM keep per-node state buffers: memory N x H x dk x dv x 4 bytes per
   sequence, reported), and FLA's fused recurrent kernel over every root-to-leaf path
   (tree-correct, inputs pre-gathered, each path re-reads the state) plus FLA fused-recurrent /
   chunked over a chain of N tokens (NOT tree-correct: a lower bound on what a chain kernel
   costs for N tokens);
5. path commit at P = 16 (all accepted): ours vs XLA gather + scan, and the per-node peer's
   commit (copy of the accepted leaf's state);
6. achieved bandwidth = bytes that must move (state read / written, inputs, outputs) / time,
   against the measured HBM read rate; table printed last; JSON to --out (default
   $OUT/gdn.json when $OUT is set).

Timing: jax calls run back to back in one jitted fori_loop over rotated input copies (enough to
exceed L2); tree calls see the loop index through the ancestor bits (a select XLA cannot fold,
fused into the wrapper's bits preparation), commit calls carry the state from call to call;
wall clock around block_until_ready, median of rounds. torch peers: CUDA graph when capturable
(eager otherwise), CUDA events, median of rounds.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for torch peers

import numpy as np  # noqa: E402

from gpu_bench_common import err_str, fmt, jax_rates, time_torch  # noqa: E402
from gpu_gdn_peers import FlaPaths, TorchPerNode, fla_chain_fns, import_fla  # noqa: E402
from ddtree_jax import atomic  # noqa: E402

T0 = time.time()
L2_BYTES = 50 * 2**20
HK, HV, DK, DV = 16, 48, 128, 128  # Qwen3.6-27B GDN layer
MAX_DEPTH = 15  # DFlash block size 16


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def elapsed():
    return time.time() - T0


# ---------------------------------------------------------------------------------------------
# environment and optional peers
# ---------------------------------------------------------------------------------------------
FLA = {"ops": None}


def environment(on_gpu):
    import jax

    env = {"python": sys.version.split()[0], "jax": jax.__version__}
    try:
        import jaxlib

        env["jaxlib"] = jaxlib.__version__
    except Exception as e:  # pragma: no cover
        env["jaxlib"] = err_str(e)
    try:
        env["gpu"] = [str(d.device_kind) for d in jax.devices("gpu")]
    except Exception:
        env["gpu"] = []
    for mod in ("torch", "triton"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:
            env[mod] = f"unavailable ({type(e).__name__})"
    if on_gpu:
        FLA["ops"], how = import_fla()
        version = getattr(sys.modules.get("fla"), "__version__", "?")
        env["fla"] = f"{version} {how}" if FLA["ops"] else how
    else:
        env["fla"] = "skipped on CPU"
    return env


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def time_jax(f, arg_sets, est_s, *, carry=None, round_s=0.01, rounds=7, on_gpu=True):
    """Median seconds per call, calls back to back inside one jitted fori_loop.

    Without `carry`: f(i, args) -> out, i = traced loop index (f must let it reach the kernel's
    inputs so nothing is hoisted). With carry=k: f(args) returns the new value of args[k], which
    feeds the next call on that rotation (a true dependency chain).
    """
    import jax
    from jax import lax

    nrot = len(arg_sets)
    iters = max(1, min(200, math.ceil(round_s / max(est_s * nrot, 1e-7))))
    if not on_gpu:
        iters, rounds = 1, 2

    if carry is None:
        out_shape = jax.eval_shape(lambda a: f(0, a), arg_sets[0])

        def run(sets):
            zeros = lambda: jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), out_shape)
            return lax.fori_loop(0, iters, lambda i, c: tuple(f(i, a) for a in sets), tuple(zeros() for _ in sets))
    else:

        def run(sets):
            def body(i, states):
                return tuple(f(a[:carry] + (s,) + a[carry + 1 :]) for a, s in zip(sets, states))

            return lax.fori_loop(0, iters, body, tuple(a[carry] for a in sets))

    run = jax.jit(run)
    t = time.perf_counter()
    jax.block_until_ready(run(arg_sets))  # compile + warm-up
    compile_s = time.perf_counter() - t
    jax.block_until_ready(run(arg_sets))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(run(arg_sets))
        times.append((time.perf_counter() - t) / (iters * nrot))
    outs = run(arg_sets)
    info = {"iters": iters, "rotations": nrot, "rounds": rounds, "first_call_s": round(compile_s, 2)}
    return statistics.median(times), info, outs[0]


def rotations_for(nbytes, cap=16):
    return int(max(1, min(cap, math.ceil(2 * L2_BYTES / max(nbytes, 1)))))


# ---------------------------------------------------------------------------------------------
# problems
# ---------------------------------------------------------------------------------------------
def random_parents(rng, n, kind="ddtree"):
    """Topological parent array: a chain, a star (every node under the root: what the random-weight
    benchmark's drafter gives), or DDTree-like (ddtree_jax.bench.deep_parents: extend the last
    node often, else branch from a random shallower node), depth <= MAX_DEPTH."""
    if kind == "chain":
        return [-1] + list(range(n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    from ddtree_jax.bench import deep_parents

    return deep_parents(n, rng, MAX_DEPTH).tolist()


def pack_bits(parents):
    from ddtree_jax.tree import root_path

    n = len(parents)
    words = np.zeros((n, -(-n // 32)), np.uint32)
    for i in range(n):
        for j in root_path(parents, i):
            words[i, j // 32] |= np.uint32(1 << (j % 32))
    return words


def make_problem(seed, b, n, kind="ddtree", hk=HK, hv=HV, dk=DK, dv=DV):
    """float32 numpy inputs (bf16 casts happen per framework, both round to nearest even)."""
    rng = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    trees = [random_parents(rng, n, kind) for _ in range(b)]
    return {
        "q": (unit(rng.normal(size=(b, hk, n, dk))) * dk**-0.5).astype(np.float32),
        "k": unit(rng.normal(size=(b, hk, n, dk))).astype(np.float32),
        "v": rng.normal(size=(b, hv, n, dv)).astype(np.float32),
        "g": (-rng.uniform(0.01, 1.0, size=(b, hv, n))).astype(np.float32),
        "beta": rng.uniform(0.05, 1.0, size=(b, hv, n)).astype(np.float32),
        "state": (0.5 * rng.normal(size=(b, hv, dk, dv))).astype(np.float32),
        "bits": np.stack([pack_bits(t) for t in trees]),
        "trees": trees,
    }


def jax_args(pb, dtype):
    import jax.numpy as jnp

    c = lambda x, dt=jnp.float32: jnp.asarray(x, dt)
    return (c(pb["q"], dtype), c(pb["k"], dtype), c(pb["v"], dtype), c(pb["g"]), c(pb["beta"]), c(pb["state"]), jnp.asarray(pb["bits"]))


def perturbed_copies(args, nrot):
    """Rotation copies on device (distinct buffers, values nudged so nothing is shared)."""
    import jax.numpy as jnp

    out = [args]
    for r in range(1, nrot):
        q, k, v, g, beta, state, bits = args
        out.append((q * 1, k * 1, v + jnp.asarray(1e-3 * r, v.dtype), g * (1 - 1e-3 * r), beta * 1, state * (1 + 1e-3 * r), bits + 0))
    return out


def tree_bytes(b, n, itemsize=2, hk=HK, hv=HV, dk=DK, dv=DV):
    """Bytes a tree verify must move: state read, q/k/v/g/beta/bits read, o (fp32) written."""
    state = b * hv * dk * dv * 4
    inputs = b * n * (2 * hk * dk * itemsize + hv * dv * itemsize + 2 * hv * 4 + 4 * max(1, n // 32))
    out = b * hv * n * dv * 4
    return state + inputs + out


def commit_bytes(b, p, itemsize=2, hk=HK, hv=HV, dk=DK, dv=DV):
    """State read + written, and the path's k / v / g / beta rows."""
    return 2 * b * hv * dk * dv * 4 + b * p * (hk * dk * itemsize + hv * dv * itemsize + 2 * hv * 4)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if np.isnan(out).any():
        return float("nan")
    return float(np.abs(out - ref).max() / max(1e-30, np.abs(ref).max()))


# ---------------------------------------------------------------------------------------------
# jax functions under test
# ---------------------------------------------------------------------------------------------
def tree_fn(impl, **tuning):
    import jax.numpy as jnp

    from pallas_kernels.gdn_tree import gdn_tree_verify

    def f(i, a):
        q, k, v, g, beta, state, bits = a
        bits = jnp.where(i < 0, bits ^ jnp.uint32(1), bits)  # the loop index reaches the kernel
        return gdn_tree_verify(q, k, v, g, beta, state, bits, impl=impl, **tuning)

    return f


def commit_fn(impl, path, count, window=None, conv_in=None, **tuning):
    from pallas_kernels.gdn_commit import gdn_path_commit

    def f(a):
        k, v, g, beta, state = a
        if window is None:
            return gdn_path_commit(k, v, g, beta, state, path, count, impl=impl, **tuning)
        return gdn_path_commit(k, v, g, beta, state, path, count, window=window, conv_in=conv_in, impl=impl,
                               **tuning)[0]

    return f


def leaf_path(tree, p):
    """The deepest root-to-leaf path, padded to p entries (the accepted path of a commit)."""
    from ddtree_jax.tree import root_path

    depth = [len(root_path(tree, i)) for i in range(len(tree))]
    path = root_path(tree, int(np.argmax(depth)))[:p]
    return path + [0] * (p - len(path)), len(path)


# ---------------------------------------------------------------------------------------------
# steps
# ---------------------------------------------------------------------------------------------
def measure_bandwidth(on_gpu, quick):
    rates = jax_rates(on_gpu, quick, matmul=False)
    return {**rates, "hbm_read_GBps": rates["hbm_GBps"]}


def correctness(cfg, result):
    import jax
    import jax.numpy as jnp

    rows = result["correctness"]  # (bf16 tree rows are added by tree_benchmark from the timed outputs)
    impl = cfg.impl
    n = 64 if not cfg.cpu else cfg.sizes[-1]
    for prec in ["tf32x3"]:  # ("ieee" compiles to FMA loops that spill heavily: not worth the time)
        try:
            pb = make_problem(7, 1, n, **cfg.shape)
            a = jax_args(pb, jnp.float32)
            out = jax.jit(lambda *x: tree_fn(impl, precision=prec)(0, x))(*a)
            ref = jax.jit(lambda *x: tree_fn("xla")(0, x))(*a)
            e = rel_err(out, ref)
            rows.append({"what": f"tree fp32 ({prec})", "b": 1, "n": n, "rel_err": e, "ok": bool(e <= 1e-5)})
        except Exception as ex:
            rows.append({"what": f"tree fp32 ({prec})", "b": 1, "n": n, "error": err_str(ex), "ok": False})
        log("correctness", rows[-1])
    for dt, name, tol in ((jnp.bfloat16, "bf16", 1e-5), (jnp.float32, "fp32", 1e-5)):
        try:
            b, p = cfg.batches[-1], cfg.p
            pb = make_problem(9, b, 64 if not cfg.cpu else 16, **cfg.shape)
            lp = [leaf_path(t, p) for t in pb["trees"]]
            path = jnp.asarray([x for x, _ in lp], jnp.int32)
            count = jnp.asarray([c for _, c in lp], jnp.int32)
            q, k, v, g, beta, state, _ = jax_args(pb, dt)
            out = jax.jit(commit_fn(impl, path, count))((k, v, g, beta, state))
            ref = jax.jit(commit_fn("xla", path, count))((k, v, g, beta, state))
            e = rel_err(out, ref)
            rows.append({"what": f"commit {name}", "b": b, "p": p, "rel_err": e, "ok": bool(e <= tol)})
        except Exception as ex:
            rows.append({"what": f"commit {name}", "error": err_str(ex), "ok": False})
        log("correctness", rows[-1])


def tree_benchmark(cfg, result, hbm, fla_ops):
    import jax
    import jax.numpy as jnp
    import torch

    from ddtree_jax.tree import root_path
    from pallas_kernels._common import pow2_at_least as _pow2
    from pallas_kernels.gdn_tree import default_blocks

    device = "cuda" if cfg.on_gpu else "cpu"
    rows = result["tree"]
    best = {}
    cases = [(n, "ddtree") for n in cfg.sizes] + ([(16, "chain")] if 16 in cfg.sizes and not cfg.quick and not cfg.cpu else [])
    for n, kind in cases:
        for b in cfg.batches:
            label = f"{kind}{n}"
            pb = make_problem(1000 + n + b, b, n, kind=kind, **cfg.shape)
            nbytes = tree_bytes(b, n, **cfg.dims)
            nrot = rotations_for(nbytes) if cfg.on_gpu else 1
            base = jax_args(pb, jnp.bfloat16)
            sets = perturbed_copies(base, nrot)
            depth = max(len(root_path(t, i)) for t in pb["trees"] for i in range(n)) - 1
            common = {"case": label, "b": b, "n": n, "max_depth": depth, "bytes": nbytes}

            def record(impl_name, t, info=None, **extra):
                row = dict(common, impl=impl_name, us=t * 1e6, GBps=nbytes / t / 1e9, pct_hbm=100 * nbytes / t / 1e9 / hbm, **extra)
                if info:
                    row["timing"] = info
                rows.append(row)
                log("tree", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "timing"})

            # XLA reference first: its output is the reference for everything below
            ref = None
            try:
                t, info, out = time_jax(tree_fn("xla"), sets, 100e-6, on_gpu=cfg.on_gpu)
                ref = np.asarray(out)
                record("xla reference", t, info)
            except Exception as ex:
                rows.append(dict(common, impl="xla reference", error=err_str(ex)))
                log("xla error", err_str(ex))
            if ref is None:
                ref = np.asarray(jax.jit(lambda *x: tree_fn("xla")(0, x))(*base))
            # ours: default tiles (+ a small sweep at batch 1)
            n_pad = _pow2(n)
            bn, bdv, bk, nw = default_blocks(n_pad, _pow2(cfg.dims["dk"]), _pow2(cfg.dims["dv"]), b * cfg.dims["hv"])
            variants = [{}]
            if cfg.sweep and b == cfg.batches[0] and 64 <= n <= 128 and kind == "ddtree" and elapsed() < cfg.budget_s * 0.4:
                variants += [{"block_dv": d} for d in (32, 64, 128) if d != bdv and d <= cfg.dims["dv"]]
                if n == 64:
                    variants += [{"precision": "tf32x3"}, {"num_warps": 4 if nw == 8 else 8}]
            elif (n, kind) in best and b != cfg.batches[0]:
                variants = [{}, best[(n, kind)]] if best[(n, kind)] else [{}]
            timings = []
            for tv in variants:
                try:
                    t, info, out = time_jax(tree_fn(cfg.impl, **tv), sets, 20e-6, on_gpu=cfg.on_gpu)
                    e = rel_err(out, ref)
                    tiles = dict({"block_n": bn, "block_dv": bdv, "block_k": bk, "num_warps": nw, "precision": "tf32"}, **tv)
                    record("ours (pallas)" + (f" {tv}" if tv else ""), t, info, tiles=tiles, rel_err_vs_xla=e)
                    if not tv:
                        result["correctness"].append(
                            {"what": f"tree bf16 {kind} (tf32 matmuls)", "b": b, "n": n, "rel_err": e, "ok": bool(e <= 1e-2)}
                        )
                    timings.append((t, tv))
                except Exception as ex:
                    rows.append(dict(common, impl=f"ours (pallas) {tv}", error=err_str(ex)))
                    log("tree error", tv, err_str(ex))
            if timings and b == cfg.batches[0]:
                best[(n, kind)] = min(timings, key=lambda x: x[0])[1]
            # torch per-node states
            if cfg.peers:
                try:
                    peer = TorchPerNode(pb, "bf16", device)
                    peer()
                    e = rel_err(peer.output_bhnv(), ref)
                    t, info = time_torch([peer])
                    record("torch per-node states", t, info, rel_err_vs_xla=e, per_node_state_bytes=peer.state_bytes)
                    del peer
                    torch.cuda.empty_cache() if cfg.on_gpu else None
                except Exception as ex:
                    rows.append(dict(common, impl="torch per-node states", error=err_str(ex)))
                    log("torch per-node error", err_str(ex))
            # FLA
            if fla_ops is not None and cfg.peers and kind == "ddtree":
                try:
                    fp = FlaPaths(fla_ops, pb, device)
                    fp()
                    e = rel_err(fp.output_bhnv(), ref)
                    t, info = time_torch([fp])
                    record("fla fused_recurrent, every root-to-leaf path", t, info, rel_err_vs_xla=e, paths=fp.n_paths, path_len=fp.t_len)
                    del fp
                except Exception as ex:
                    rows.append(dict(common, impl="fla per-path", error=err_str(ex)))
                    log("fla per-path error", err_str(ex))
                if not cfg.quick and elapsed() < cfg.budget_s:
                    for name, fn in fla_chain_fns(fla_ops, pb, device).items():
                        try:
                            fn()
                            t, info = time_torch([fn])
                            record(name, t, info)
                        except Exception as ex:
                            rows.append(dict(common, impl=name, error=err_str(ex)))
                            log(name, "error", err_str(ex))
            del sets, base
    result["tree_best_tiles"] = {f"{k[1]}{k[0]}": v for k, v in best.items()}


def commit_benchmark(cfg, result, hbm):
    import jax.numpy as jnp
    import torch

    rows = result["commit"]
    p = cfg.p
    n = 64 if not cfg.cpu else 16
    for b, accepted in [(b, c) for b in cfg.batches for c in cfg.commit_counts]:
        pb = make_problem(3000 + b, b, n, **cfg.shape)
        lp = [leaf_path(t, p) for t in pb["trees"]]
        path = jnp.asarray([x for x, _ in lp], jnp.int32)
        count = jnp.full((b,), min(accepted, p), jnp.int32)  # the path may revisit 0 past its end
        nbytes = commit_bytes(b, min(accepted, p), **cfg.dims)
        nrot = rotations_for(nbytes) if cfg.on_gpu else 1
        _, k, v, g, beta, state, _ = jax_args(pb, jnp.bfloat16)
        sets = [(k, v, g, beta, state * (1 + 1e-3 * r)) for r in range(nrot)]
        common = {"b": b, "p": p, "count": int(min(accepted, p)), "n": n, "bytes": nbytes}
        conv_dim = 2 * cfg.dims["hk"] * cfg.dims["dk"] + cfg.dims["hv"] * cfg.dims["dv"]
        window = jnp.ones((b, 3, conv_dim), jnp.bfloat16)
        conv_in = jnp.ones((b, n, conv_dim + cfg.dims["hv"] * cfg.dims["dv"]), jnp.bfloat16)

        def record(impl_name, t, info=None, **extra):
            row = dict(common, impl=impl_name, us=t * 1e6, GBps=nbytes / t / 1e9, pct_hbm=100 * nbytes / t / 1e9 / hbm, **extra)
            if info:
                row["timing"] = info
            rows.append(row)
            log("commit", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "timing"})

        variants = [{}, {"window": True}]  # the model's form slides the conv window in the same launch
        if cfg.sweep and b == cfg.batches[0]:
            variants += [{"block_dv": 8}, {"block_dv": 16, "num_warps": 2}, {"block_dv": 32},
                         {"block_dv": 32, "num_warps": 2}, {"block_dv": 64, "num_warps": 4}]
        for tv in variants:
            try:
                kw = dict(tv)
                if kw.pop("window", False):
                    kw.update(window=window, conv_in=conv_in)
                t, info, _ = time_jax(commit_fn(cfg.impl, path, count, **kw), sets, 5e-6, carry=4, on_gpu=cfg.on_gpu)
                record("ours (pallas)" + (f" {tv}" if tv else ""), t, info)
            except Exception as ex:
                rows.append(dict(common, impl=f"ours (pallas) {tv}", error=err_str(ex)))
                log("commit error", tv, err_str(ex))
        try:
            t, info, _ = time_jax(commit_fn("xla", path, count), sets, 30e-6, carry=4, on_gpu=cfg.on_gpu)
            record("xla gather + scan", t, info)
        except Exception as ex:
            rows.append(dict(common, impl="xla gather + scan", error=err_str(ex)))
        if cfg.peers:  # the per-node peer commits by copying the accepted leaf's state
            try:
                device = "cuda" if cfg.on_gpu else "cpu"
                states = torch.randn(b * n, cfg.dims["hv"], cfg.dims["dk"], cfg.dims["dv"], device=device)
                leaf = torch.tensor([bi * n + c - 1 for bi, (_, c) in enumerate(lp)], device=device)
                dst = torch.empty(b, *states.shape[1:], device=device)
                t, info = time_torch([lambda: dst.copy_(states[leaf])])
                record("torch per-node: copy the accepted leaf state", t, info)
                del states
            except Exception as ex:
                rows.append(dict(common, impl="torch per-node copy", error=err_str(ex)))


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def print_tables(result):
    print("\n=== correctness ===")
    for r in result["correctness"]:
        print(f"  {'OK ' if r.get('ok') else 'BAD'} {r['what']:<28} b={r.get('b', '-')} n/p={r.get('n', r.get('p', '-'))} "
              f"rel_err={fmt(r.get('rel_err'), '.2e')} {r.get('error', '')}")
    hbm = result["bandwidth"].get("hbm_read_GBps")
    print(f"\n=== HBM read rate (best of a 2 GiB bf16 reduction and GEMV): {fmt(hbm, '.0f')} GB/s ===")
    print("\n=== tree verify, one GDN layer (Hk 16 -> Hv 48, dk = dv = 128, bf16 q/k/v) ===")
    print(f"  {'case':<9}{'B':>3} {'impl':<52}{'us':>10}{'GB/s':>9}{'%HBM':>7}  notes")
    for r in result["tree"]:
        notes = []
        if "rel_err_vs_xla" in r:
            notes.append(f"err {r['rel_err_vs_xla']:.1e}")
        if "per_node_state_bytes" in r:
            notes.append(f"per-node states {r['per_node_state_bytes'] / 2**20:.0f} MiB")
        if "paths" in r:
            notes.append(f"{r['paths']} paths x {r['path_len']}")
        if "error" in r:
            notes.append(r["error"][:80])
        print(f"  {r['case']:<9}{r['b']:>3} {r['impl'][:51]:<52}{fmt(r.get('us')):>10}{fmt(r.get('GBps'), '.0f'):>9}"
              f"{fmt(r.get('pct_hbm'), '.0f'):>7}  {'; '.join(notes)}")
    print("\n=== path commit (count of P accepted nodes, state fp32 read + written once) ===")
    print(f"  {'B':>3} {'cnt':>3} {'impl':<52}{'us':>10}{'GB/s':>9}{'%HBM':>7}")
    for r in result["commit"]:
        print(f"  {r['b']:>3} {r.get('count', r['p']):>3} {r['impl'][:51]:<52}{fmt(r.get('us')):>10}{fmt(r.get('GBps'), '.0f'):>9}"
              f"{fmt(r.get('pct_hbm'), '.0f'):>7}  {r.get('error', '')[:80]}")
    print(f"\n  total {elapsed():.0f}s; env {result['env']}")


class Cfg:
    pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="N in {16, 64}, no tile sweep, no FLA chain peers")
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: interpreter, tiny shapes (structure test)")
    ap.add_argument("--no-peers", action="store_true", help="skip torch / FLA peers")
    ap.add_argument("--no-sweep", action="store_true", help="default tiles only")
    ap.add_argument("--budget-s", type=float, default=190.0, help="skip optional work past this many seconds")
    ap.add_argument("--batches", default=None, help="comma list narrowing the sweep, e.g. 8")
    ap.add_argument("--sizes", default=None, help="comma list of tree sizes, e.g. 256")
    ap.add_argument("--steps", default="bandwidth,correctness,tree,commit", help="comma list of the steps to run")
    ap.add_argument("--commit-counts", default="16",
                    help="accepted nodes of the timed commits (comma list; random-weight drafters accept 1-2)")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gdn.json when $OUT is set)")
    args = ap.parse_args(argv)

    cfg = Cfg()
    cfg.cpu = args.cpu_smoke
    if cfg.cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    cfg.on_gpu = not cfg.cpu and any(d.platform == "gpu" for d in jax.devices())
    if not cfg.cpu and not cfg.on_gpu:
        print("no GPU found: use --cpu-smoke for a structure test", file=sys.stderr)
        return 2
    cfg.quick = args.quick
    cfg.impl = "pallas" if cfg.on_gpu else "pallas_interpret"
    cfg.sweep = not (args.quick or args.no_sweep or cfg.cpu)
    cfg.peers = not args.no_peers
    cfg.budget_s = args.budget_s
    cfg.p = 16 if not cfg.cpu else 8
    cfg.commit_counts = [int(x) for x in args.commit_counts.split(",")]
    if cfg.cpu:
        cfg.sizes, cfg.batches = [16, 32], [1, 2]
        cfg.shape = {"hk": 2, "hv": 4, "dk": 32, "dv": 32}
    else:
        cfg.sizes = [16, 64] if args.quick else [16, 64, 128, 256]
        cfg.batches = [1, 8]
        if args.sizes:
            cfg.sizes = [int(x) for x in args.sizes.split(",")]
        if args.batches:
            cfg.batches = [int(x) for x in args.batches.split(",")]
        cfg.shape = {"hk": HK, "hv": HV, "dk": DK, "dv": DV}
    cfg.dims = dict(cfg.shape)

    result = {"env": environment(cfg.on_gpu), "config": {"quick": cfg.quick, "cpu_smoke": cfg.cpu, "sizes": cfg.sizes,
              "batches": cfg.batches, "shape": cfg.shape, "P": cfg.p},
              "bandwidth": {}, "correctness": [], "tree": [], "commit": [], "failures": []}
    log("env", result["env"])
    fla_ops = FLA["ops"] if cfg.peers else None

    steps = [
        ("bandwidth", lambda: result["bandwidth"].update(measure_bandwidth(cfg.on_gpu, cfg.quick))),
        ("correctness", lambda: correctness(cfg, result)),
        ("tree", lambda: tree_benchmark(cfg, result, result["bandwidth"].get("hbm_read_GBps", 3000.0), fla_ops)),
        ("commit", lambda: commit_benchmark(cfg, result, result["bandwidth"].get("hbm_read_GBps", 3000.0))),
    ]
    wanted = args.steps.split(",")
    for name, step in [(name, step) for name, step in steps if name in wanted]:
        try:
            log("step", name)
            step()
        except Exception as ex:
            result["failures"].append(f"{name}: {err_str(ex)}")
            traceback.print_exc()
    out = args.out or (os.path.join(os.environ["OUT"], "gdn.json") if os.environ.get("OUT") else None)
    if out:
        atomic.write_json(out, result, indent=1, default=str)
        log("wrote", out)
    print_tables(result)
    bad = [r for r in result["correctness"] if not r.get("ok")]
    return 1 if bad or result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
