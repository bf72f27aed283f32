"""GPU check and benchmark of the Mamba2 / SSD tree kernels (pallas_kernels/ssd_tree.py).

Run from the repo root on the H200:

    PYTHONPATH=. python3 scripts/gpu_ssd.py              # full run (a few minutes)
    PYTHONPATH=. python3 scripts/gpu_ssd.py --quick      # N in {16, 64}, batch 1, fewer rounds
    PYTHONPATH=. python3 scripts/gpu_ssd.py --cpu-smoke  # no GPU: interpreter, tiny shapes

Steps (each guarded: a failure is recorded in the JSON and the table, never fatal):
1. environment (python / jax / jaxlib, device);
2. correctness: tree verify pallas vs xla (float32 inputs; precisions "tf32x3" (default) and
   "ieee"), NaN checks, random DDTree-like trees incl. a chain; path commit pallas vs xla;
3. timing at NemotronH-like Mamba2 layer shapes (128 heads x head_dim 64, 8 groups, state 128:
   Nemotron-H 8B; --heads / --head-dim / --groups / --state to change), trees of N = 16 / 64 /
   128 / 256 nodes (depth <= 15) at batch 1 and 8: ours (pallas, a small block sweep at batch 1)
   vs the XLA reference (the model's current path: dense visibility + ssd.block); path commit at
   P = 16 (all accepted) vs XLA gather + scan;
4. achieved bandwidth = bytes that must move (state read (+ written for commit), per-node
   inputs, outputs) / time; table printed last; JSON to --out (default $OUT/ssd.json when $OUT
   is set, else ./ssd.json).

Timing: each configuration gets enough independent input copies to exceed L2 (50 MiB on the
H200); the jitted call is dispatched over the copies back to back (async dispatch keeps the
GPU busy), wall clock around block_until_ready, median of rounds, reported per call. Very
small kernels (< ~10 us) can be dispatch-bound: compare them with care.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import numpy as np

from ddtree_jax import atomic

T0 = time.time()
L2_BYTES = 50 * 2**20
MAX_DEPTH = 15


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def err_str(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) < 500 else s[:500] + " ..."


def random_parents(rng, n, kind="ddtree"):
    """Topological parents: a chain, or a DDTree-like tree (depth <= MAX_DEPTH, wide near the root)."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        if kind == "chain":
            p = i - 1
        else:
            while True:
                p = int(rng.integers(max(0, i - 8), i)) if rng.random() < 0.7 else int(rng.integers(0, i))
                if depth[p] < MAX_DEPTH:
                    break
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def make_inputs(jnp, rng, b, n, h, hd, g, ns, kind="ddtree"):
    from ddtree_jax.tree import make_tree

    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    x, bm, cm, d, state = f(b, n, h, hd), f(b, n, g, ns) * ns**-0.5, f(b, n, g, ns) * ns**-0.5, f(h), f(b, h, hd, ns)
    dt = jnp.asarray(rng.uniform(0.001, 0.5, (b, n, h)), jnp.float32)
    a = -jnp.asarray(rng.uniform(0.5, 8.0, (h,)), jnp.float32)
    parents = jnp.asarray(np.stack([random_parents(rng, n, kind) for _ in range(b)]), jnp.int32)
    tree = make_tree(jnp.zeros((b, n), jnp.int32), parents, jnp.ones((b, n), bool), jnp.zeros((b,), jnp.int32),
                     max_depth=min(n - 1, MAX_DEPTH + 1))
    return dict(x=x, dt=dt, a=a, bm=bm, cm=cm, d=d, state=state, bits=tree.ancestor_bits, parents=parents)


def bench(jax, fn, copies, rounds):
    out = [fn(*c) for c in copies[:2]]
    jax.block_until_ready(out)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        out = [fn(*c) for c in copies]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / len(copies))
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: pallas_interpret, tiny shapes")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ssd_tree import ssd_path_commit, ssd_tree_verify

    impl = "pallas_interpret" if args.cpu_smoke else "pallas"
    report = {"env": {}, "checks": [], "timings": [], "errors": []}
    report["env"] = {
        "python": sys.version.split()[0], "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
        "impl": impl, "argv": sys.argv[1:],
    }
    log("env", report["env"])
    if args.cpu_smoke:
        h, hd, g, ns, sizes, batches, rounds = 4, 16, 2, 16, [16, 40], [1], 2
    else:
        h, hd, g, ns = args.heads, args.head_dim, args.groups, args.state
        sizes = [16, 64] if args.quick else [16, 64, 128, 256]
        batches = [1] if args.quick else [1, 8]
        rounds = 5 if args.quick else args.rounds
    rng = np.random.default_rng(0)

    # ---- correctness ---------------------------------------------------------------------------
    for n in sizes:
        for kind in ("ddtree", "chain"):
            name = f"verify N={n} {kind}"
            try:
                inp = make_inputs(jnp, rng, 2, n, h, hd, g, ns, kind)
                ref = ssd_tree_verify(inp["x"], inp["dt"], inp["a"], inp["bm"], inp["cm"], inp["d"], inp["state"],
                                      inp["bits"], impl="xla")
                scale = max(1.0, float(jnp.abs(ref).max()))
                for prec in ("tf32x3", "ieee"):
                    got = jax.jit(lambda *xs, prec=prec: ssd_tree_verify(*xs, impl=impl, precision=prec))(
                        inp["x"], inp["dt"], inp["a"], inp["bm"], inp["cm"], inp["d"], inp["state"], inp["bits"])
                    diff = float(jnp.abs(got - ref).max()) / scale
                    finite = bool(jnp.all(jnp.isfinite(got)))
                    ok = finite and diff < (1e-4 if prec == "tf32x3" else 2e-5)
                    report["checks"].append(dict(name=name, precision=prec, rel_diff=diff, finite=finite, ok=ok))
                    log(name, prec, f"rel diff {diff:.2e}", "finite" if finite else "NaN!", "OK" if ok else "FAIL")
            except Exception as e:  # noqa: BLE001
                report["errors"].append(dict(step=name, error=err_str(e), tb=traceback.format_exc()[-2000:]))
                log(name, "ERROR", err_str(e))
    try:
        n, p = sizes[-1], 16
        inp = make_inputs(jnp, rng, 2, n, h, hd, g, ns)
        path = jnp.asarray(np.sort(rng.integers(0, n, (2, p)), axis=1), jnp.int32)
        count = jnp.asarray([p, p // 2], jnp.int32)
        ref = ssd_path_commit(inp["x"], inp["dt"], inp["a"], inp["bm"], inp["state"], path, count, impl="xla")
        got = jax.jit(lambda *xs: ssd_path_commit(*xs, impl=impl))(inp["x"], inp["dt"], inp["a"], inp["bm"],
                                                                  inp["state"], path, count)
        diff = float(jnp.abs(got - ref).max()) / max(1.0, float(jnp.abs(ref).max()))
        report["checks"].append(dict(name=f"commit P={p}", rel_diff=diff, ok=diff < 1e-5))
        log(f"commit P={p}", f"rel diff {diff:.2e}", "OK" if diff < 1e-5 else "FAIL")
    except Exception as e:  # noqa: BLE001
        report["errors"].append(dict(step="commit check", error=err_str(e), tb=traceback.format_exc()[-2000:]))
        log("commit check ERROR", err_str(e))

    # ---- timing ----------------------------------------------------------------------------------
    rows = []
    for b in batches:
        for n in sizes:
            state_bytes = b * h * hd * ns * 4
            in_bytes = b * n * (h * hd * 4 + 2 * g * ns * 4 + h * 4) + b * n * (-(-n // 32)) * 4
            out_bytes = b * n * h * hd * 4
            moved = state_bytes + in_bytes + out_bytes
            copies_n = max(2, min(64, -(-2 * L2_BYTES // moved)))
            copies = []
            for _ in range(copies_n):
                inp = make_inputs(jnp, rng, b, n, h, hd, g, ns)
                copies.append((inp["x"], inp["dt"], inp["a"], inp["bm"], inp["cm"], inp["d"], inp["state"], inp["bits"]))
            variants = [("xla", {})]
            blocks = [None] if (args.quick or b > 1 or args.cpu_smoke) else [None, 16, 32, 64]
            for bn in blocks:
                for bp in ([None] if args.quick or args.cpu_smoke else [None, 32]):
                    variants.append((impl, dict(block_n=bn, block_p=bp)))
            for which, kw in variants:
                label = f"verify b={b} N={n} {which} {kw if kw else ''}".strip()
                try:
                    fn = jax.jit(lambda *xs, which=which, kw=tuple(kw.items()): ssd_tree_verify(*xs, impl=which, **dict(kw)))
                    t = bench(jax, fn, copies, rounds)
                    row = dict(op="verify", batch=b, n=n, impl=which, opts=kw, us=t * 1e6, gbps=moved / t / 1e9)
                    rows.append(row)
                    log(label, f"{t * 1e6:9.1f} us  {moved / t / 1e9:7.1f} GB/s")
                except Exception as e:  # noqa: BLE001
                    report["errors"].append(dict(step=label, error=err_str(e), tb=traceback.format_exc()[-2000:]))
                    log(label, "ERROR", err_str(e))
        # commit at P = 16, all accepted
        n, p = sizes[-1], 16
        moved = 2 * b * h * hd * ns * 4 + b * p * (h * hd * 4 + g * ns * 4 + h * 4)
        copies = []
        for _ in range(max(2, min(64, -(-2 * L2_BYTES // moved)))):
            inp = make_inputs(jnp, rng, b, n, h, hd, g, ns)
            path = jnp.asarray(np.sort(rng.integers(0, n, (b, p)), axis=1), jnp.int32)
            copies.append((inp["x"], inp["dt"], inp["a"], inp["bm"], inp["state"], path, jnp.full((b,), p, jnp.int32)))
        for which in ("xla", impl):
            label = f"commit b={b} P={p} {which}"
            try:
                fn = jax.jit(lambda *xs, which=which: ssd_path_commit(*xs, impl=which))
                t = bench(jax, fn, copies, rounds)
                rows.append(dict(op="commit", batch=b, n=n, p=p, impl=which, us=t * 1e6, gbps=moved / t / 1e9))
                log(label, f"{t * 1e6:9.1f} us  {moved / t / 1e9:7.1f} GB/s")
            except Exception as e:  # noqa: BLE001
                report["errors"].append(dict(step=label, error=err_str(e), tb=traceback.format_exc()[-2000:]))
                log(label, "ERROR", err_str(e))
    report["timings"] = rows

    print("\nop      batch    N  impl              opts                              us      GB/s")
    for r in rows:
        print(f"{r['op']:7s} {r['batch']:5d} {r['n']:4d}  {r['impl']:16s}  {str(r.get('opts', '')):30s} "
              f"{r['us']:8.1f}  {r['gbps']:8.1f}")
    print(f"\nchecks: {sum(c['ok'] for c in report['checks'])}/{len(report['checks'])} ok; "
          f"errors: {len(report['errors'])}; {time.time() - T0:.0f} s")
    out = args.out or (os.path.join(os.environ["OUT"], "ssd.json") if os.environ.get("OUT") else "ssd.json")
    atomic.write_json(out, report, indent=1, default=str)
    log("wrote", out)
    return 0 if not report["errors"] and all(c["ok"] for c in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
