"""GPU benchmark of the routed-expert product (pallas_kernels/moe_experts.py) at the
Qwen3.6-35B-A3B expert shape (hidden 2048, 256 experts, top-8, expert intermediate 512, silu GLU,
bf16, random weights, never zeros), decode to batch-of-trees token counts.

For each token count T and routing ("random": uniform top-k; "correlated": each token shares 6
of its 8 experts with the previous token's, as trained routers do along a sequence), one row:
distinct experts touched, their weight bytes, and the time of every form: the grouped kernel at
its default tiling and a small sweep around it, and on rows of up to --decode-max-pairs pairs the
decode path (no grouping: one row per (token, choice) pair) at its default tiling and a sweep
(decode_sweep; its one-launch form: fused_sweep), on weights stored [E, in, out] and [E, out, in]
(HF's) (`kernel` is the best of them, `kernel_default` the grouped default, `kernel_decode` the decode path's default,
`kernel_route` what the library's route takes at this T (`route_config`: moe_experts.kernel_config),
all on [E, in, out]; the JSON has every tiling's time and each layout's best), XLA's gathered `reference`,
`grouped_xla`, a `ragged` form (lax.ragged_dot over the pairs sorted by expert) and `dense` (every
expert on every token), plus `prep`, the grouping alone (the XLA part of the kernel route). The
forms that XLA compiles or runs too slowly at many pairs are gated by --max-*-pairs. Times: each
form in a jitted on-device loop over rotated routings (enough distinct experts per round that L2
holds none; the routing and x behind an optimization barrier with the loop index, so nothing is
hoisted), the median of interleaved rounds after a warm-up. The kernel's read rate is the
touched-expert bytes over its time, set against a large device-to-device copy timed in the same
run (`x roofline`: kernel time / (touched bytes / copy rate), where the copy rate counts the bytes
read and written). Every form is checked against the dense form (or, where that is gated, the
first form that ran). Prints a table last and writes JSON (rewritten after every row).

    python -m scripts.bench.moe_experts --out $OUT/moe_experts.json      # on the H200
    python -m scripts.bench.moe_experts --tokens 1,8,16 --sweep decode --max-gather-pairs 8 \
        --max-ragged-pairs 0 --max-grouped-pairs 0 --out $OUT/moe_decode.json   # the decode rows (~1.5 min)
    python -m scripts.bench.moe_experts --tokens 1 --sweep fused --max-gather-pairs 0 --max-ragged-pairs 0 \
        --max-grouped-pairs 0 --max-dense-pairs 0 --out $OUT/moe_fused.json       # one launch against two
    python -m scripts.bench.moe_experts --smoke                          # CPU, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

from ddtree_jax import atomic
from scripts.bench.common import err_str, jax_rates, print_timing_table, record_row, start_report


def kernel_run_setup(argv, smoke: bool):
    """(on the GPU, the kernels' impl, the report) - jax on the CPU for --smoke; None (after saying
    why) when no GPU is visible without --smoke."""
    if smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    if not on_gpu and not smoke:
        print("no GPU visible to jax: run on the H200, or use --smoke", file=sys.stderr)
        return None
    report = start_report("scripts.bench.moe_experts", argv, rows=[])
    return on_gpu, ("pallas" if on_gpu else "pallas_interpret"), report


def finish_checked(report, lead, ok, out: str) -> int:
    """The table, where the report went, and the exit code (1 if a row failed a check or errored)."""
    print_timing_table(report["rows"], lead, ok)
    print(f"wrote {out}")
    failed = [r for r in report["rows"] if not ok(r) or any(k.endswith("error") for k in r)]
    return 1 if failed else 0

SHAPE = {"hidden": 2048, "experts": 256, "top_k": 8, "inter": 512}
SMOKE_SHAPE = {"hidden": 64, "experts": 8, "top_k": 2, "inter": 32}
TOKENS = "1,8,16,33,65,130,520,1040"
SMOKE_TOKENS = "1,9"
SHARED = 6  # correlated routing: choices a token shares with the previous token's
L2_CLEAR_BYTES = 200e6  # touched-expert bytes a timing round covers at least (H200 L2: 50 MB)
XLA_FORMS = ("reference", "grouped_xla", "ragged", "dense")


def routing(rng, t: int, k: int, e: int, how: str):
    """[T, k] int32 distinct experts per token and [T, k] float32 combine weights (positive, sum 1)."""
    import numpy as np

    ids = np.empty((t, k), np.int32)
    ids[0] = rng.choice(e, k, replace=False)
    for i in range(1, t):
        if how == "random" or k <= SHARED or e - k < k - SHARED:
            ids[i] = rng.choice(e, k, replace=False)
        else:  # exactly SHARED of the previous token's choices, the rest new
            keep = rng.choice(ids[i - 1], SHARED, replace=False)
            new = rng.choice(np.setdiff1d(np.arange(e), ids[i - 1]), k - SHARED, replace=False)
            ids[i] = rng.permutation(np.r_[keep, new])
    w = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


def sweep_configs(base, which: str):
    """{name: (tiling, w_layout)} of the kernel variants timed (which: none / smoke / small / full):
    the default on both weight layouts and tilings around it. "nosplit_n32" / "nosplit_n16": no K
    split, narrower column blocks instead (as many programs, no XLA sum of partials; on [E, out, in]
    weights a narrow block still reads long contiguous rows)."""
    both = lambda cfg=base, **kw: dataclasses.replace(cfg, up=dataclasses.replace(cfg.up, **kw),
                                                      down=dataclasses.replace(cfg.down, **kw))
    flip = "rows" if base.up.layout == "cols" else "cols"
    out = {"default": (base, "in_out")}
    if which in ("decode", "fused"):  # the decode rows' call: the grouped default only, beside decode_sweep's
        return out
    out["default_out_in"] = (base, "out_in")
    if which == "none":
        return out
    out["flip_layout"] = (both(layout=flip), "in_out")
    if which == "smoke":
        return out
    bm2 = min(128, 2 * base.block_m)
    out["bm_x2"] = (both(dataclasses.replace(base, block_m=bm2), num_warps=8 if bm2 >= 128 else base.up.num_warps),
                    "in_out")
    for n in (32, 16) if which == "full" else (32,):
        cfg = dataclasses.replace(base, up=dataclasses.replace(base.up, block_n=n, split_k=1),
                                  down=dataclasses.replace(base.down, split_k=1))
        out[f"nosplit_n{n}"] = (cfg, "in_out")
        out[f"nosplit_n{n}_out_in"] = (cfg, "out_in")
    if which == "full":
        out["k128"] = (both(block_k=128), "in_out")
        out["stages3"] = (both(num_stages=3), "in_out")
        out["stages5"] = (both(num_stages=5), "in_out")
        out["n128_w8"] = (both(block_n=128, num_warps=8), "in_out")
        out["up_split_x2"] = (dataclasses.replace(base, up=dataclasses.replace(base.up, split_k=2 * base.up.split_k)),
                              "in_out")
        out["k128_out_in"] = (both(block_k=128), "out_in")
    return out


def decode_sweep(base, which: str):
    """{name: (DecodeConfig, w_layout)} of the decode path's variants timed (which as sweep_configs;
    "decode" = "small"): the default on both weight layouts, then one change each: the other
    combine, K blocks of 128, the "cols" MMA form (the weight columns on the MMA's M side; the
    default before decision 0065), launch (1)'s row loaded and padded (not one masked load), 6 stages,
    launch (1)'s K split doubled, column blocks of 32 (launch (1)'s split halved: as many programs),
    and column blocks of 16 with K blocks of 128, no split and the combine in the kernel (most
    programs; on [E, out, in] weights each reads whole contiguous rows). Column blocks under 64 take
    the "rows" form: with the weight columns on the MMA's M side (< 64: no wgmma) sm_90 Triton 3.6
    did not pipeline the weight loads (no cp.async in the offline compile). Then the "fma" form (no
    MMA) with the default blocks on both layouts, blocks of 128 x 32 (256-byte rows), K blocks of
    128 (at 8 warps; with twice the K split), twice the K split, 2 stages, and "fma" for launch (1)
    only."""
    rep = dataclasses.replace
    both = lambda **kw: rep(base, up=rep(base.up, **kw), down=rep(base.down, **kw))
    out = {"decode": (base, "in_out"), "decode_out_in": (base, "out_in")}
    if which == "none":
        return out
    flip = "xla" if base.combine == "kernel" else "kernel"
    out[f"decode_combine_{flip}"] = (rep(base, combine=flip, down=rep(base.down, split_k=1)), "in_out")
    if which == "smoke":
        return out
    out["decode_k128"] = (both(block_k=128), "in_out")
    out["decode_cols"] = (both(layout="cols"), "in_out")
    # launch (1)'s row loaded and padded by a select (the form before decision 0064)
    out["decode_padded_row"] = (rep(base, up=rep(base.up, masked_row=False)), "in_out")
    out["decode_stages6"] = (both(num_stages=6), "in_out")
    out["decode_up_split_x2"] = (rep(base, up=rep(base.up, split_k=2 * base.up.split_k)), "in_out")
    out["decode_n32"] = (rep(base, up=rep(base.up, block_n=32, split_k=max(1, base.up.split_k // 2), layout="rows"),
                             down=rep(base.down, block_n=32, layout="rows")), "in_out")
    narrow = dict(block_n=16, block_k=128, split_k=1, layout="rows")
    n16 = rep(base, combine="kernel", up=rep(base.up, **narrow), down=rep(base.down, **narrow))
    out["decode_n16_kernel"] = (n16, "in_out")
    out["decode_n16_kernel_out_in"] = (n16, "out_in")
    # "fma": no MMA, the row broadcast over the weight tile (a GEMV on the CUDA cores), its tiles
    # wider along the contiguous columns of [E, in, out] weights, more programs, more warps
    fma = both(layout="fma", masked_row=False)
    out["decode_fma"] = (fma, "in_out")
    out["decode_fma_out_in"] = (fma, "out_in")
    out["decode_fma_n128_k32"] = (rep(fma, up=rep(fma.up, block_n=128, block_k=32),
                                      down=rep(fma.down, block_n=128, block_k=32)), "in_out")
    out["decode_fma_k128_w8"] = (rep(fma, up=rep(fma.up, block_k=128, num_warps=8),
                                     down=rep(fma.down, block_k=128, num_warps=8)), "in_out")
    out["decode_fma_split_x2"] = (rep(fma, up=rep(fma.up, split_k=2 * fma.up.split_k),
                                      down=rep(fma.down, split_k=2 if fma.combine == "xla" else 1)), "in_out")
    out["decode_fma_stages2"] = (rep(fma, up=rep(fma.up, num_stages=2), down=rep(fma.down, num_stages=2)), "in_out")
    out["decode_fma_k128"] = (rep(fma, up=rep(fma.up, block_k=128), down=rep(fma.down, block_k=128)), "in_out")
    out["decode_fma_k128_split_x2"] = (rep(fma, up=rep(fma.up, block_k=128, split_k=2 * fma.up.split_k),
                                           down=rep(fma.down, block_k=128)), "in_out")
    out["decode_fma_up_mma_down"] = (rep(base, up=fma.up), "in_out")
    return out


def fused_sweep(base, which: str):
    """{name: (DecodeConfig, w_layout)} of the one-launch decode path's variants (combine "fused",
    pallas_kernels/_moe_fused.py; which as sweep_configs): its default on both weight layouts, then
    one change each: chunks of 16 / 64 intermediate columns (twice / half the programs; 64 at 8
    warps), K steps of 256, down steps of 512 columns, 8 warps, 2 stages, and the MMA forms
    ("rows", "cols") on the padded row; "full" (--sweep fused) adds changes around "rows": weights
    stored [E, out, in], chunks of 16, 6 stages, K steps of 256 at 8 warps, down steps of 512."""
    rep = dataclasses.replace
    up = lambda **kw: rep(base, up=rep(base.up, **kw))
    down = lambda **kw: rep(base, down=rep(base.down, **kw))
    out = {"fused": (base, "in_out"), "fused_out_in": (base, "out_in")}
    if which in ("none", "smoke"):
        return out
    out["fused_c16"] = (up(block_n=16), "in_out")
    out["fused_c64_w8"] = (up(block_n=64, num_warps=8), "in_out")
    out["fused_k256"] = (up(block_k=256), "in_out")
    out["fused_down512"] = (down(block_n=512), "in_out")
    out["fused_w8"] = (up(num_warps=8), "in_out")
    out["fused_stages2"] = (up(num_stages=2), "in_out")
    for layout in ("rows", "cols"):
        out[f"fused_{layout}"] = (rep(base, up=rep(base.up, layout=layout), down=rep(base.down, layout=layout)),
                                  "in_out")
    if which == "full":  # around the MMA "rows" form (its weight loads pipelined: cp.async)
        rows = rep(base, up=rep(base.up, layout="rows"), down=rep(base.down, layout="rows"))
        out["fused_rows_out_in"] = (rows, "out_in")
        out["fused_rows_c16_out_in"] = (rep(rows, up=rep(rows.up, block_n=16)), "out_in")
        out["fused_rows_c16"] = (rep(rows, up=rep(rows.up, block_n=16)), "in_out")
        out["fused_rows_stages6"] = (rep(rows, up=rep(rows.up, num_stages=6)), "in_out")
        out["fused_rows_k256_w8"] = (rep(rows, up=rep(rows.up, block_k=256, num_warps=8)), "in_out")
        out["fused_rows_down512"] = (rep(rows, down=rep(rows.down, block_n=512)), "in_out")
    return out


def ragged(x, ids, w, w_in, w_out, *, act):
    """The pairs sorted by expert, both products as lax.ragged_dot over the experts' groups."""
    import jax.numpy as jnp
    from jax import lax

    from pallas_kernels.moe_experts import activate, combine_choices

    t, k = ids.shape
    e = w_in.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.sum((flat[None, :] == jnp.arange(e)[:, None]).astype(jnp.int32), axis=1)
    pre = lax.ragged_dot(x[order // k], w_in, sizes)
    o = lax.ragged_dot(activate(pre, act, x.dtype), w_out, sizes)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
    return combine_choices(o[back].reshape(t, k, -1), w, jnp.ones((t, k), bool), x.dtype)


def make_runner(f):
    """jit(run(sets, weights, n)): n loop iterations, each f on every rotation set (x, ids, w);
    the set goes through an optimization barrier with the loop index, so XLA cannot hoist any of
    f's work (the grouping included) out of the loop."""
    import jax
    from jax import lax

    def run(sets, weights, n):
        out_shape = jax.eval_shape(lambda s: f(*s, *weights), sets[0])
        init = tuple(jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype), out_shape) for _ in sets)

        def body(i, carry):
            return tuple(f(*lax.optimization_barrier((s, i))[0], *weights) for s in sets)

        return lax.fori_loop(0, n, body, init)

    return jax.jit(run)


def time_interleaved(runners: dict, sets, weights: dict, *, round_s: float, rounds: int):
    """({name: median seconds per call}, {name: error}, {name: output on the first set}): every
    runner compiled and warmed (one iteration: its output is what the checks read), its
    iteration count set so a round lasts round_s, then `rounds` rounds visiting the runners in
    turn. weights: name -> the weight pair the runner reads. A runner that fails is reported."""
    import jax

    iters, times, errors, outs = {}, {}, {}, {}
    for name, run in runners.items():
        try:
            outs[name] = jax.block_until_ready(run(sets, weights[name], 1))[0]
            t0 = time.perf_counter()
            jax.block_until_ready(run(sets, weights[name], 1))
            est = (time.perf_counter() - t0) / len(sets)
            iters[name] = max(1, min(1000, math.ceil(round_s / max(est * len(sets), 1e-7))))
            times[name] = []
        except Exception as e:  # noqa: BLE001 - a form that does not compile or run is reported, not fatal
            errors[name] = err_str(e)
    for _ in range(rounds):
        for name in times:
            t0 = time.perf_counter()
            jax.block_until_ready(runners[name](sets, weights[name], iters[name]))
            times[name].append((time.perf_counter() - t0) / (iters[name] * len(sets)))
    return {name: statistics.median(ts) for name, ts in times.items()}, errors, outs


def copy_rate(on_gpu: bool) -> float:
    """Bytes read + written per second by a large device-to-device copy (a 2 GiB bf16 buffer
    scaled by a traced 1: a kernel that reads and writes every byte), median of 7."""
    import jax
    import jax.numpy as jnp

    n = 2**30 if on_gpu else 2**20
    a = jax.random.normal(jax.random.PRNGKey(7), (n,), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda a, s: a * s)
    one = jnp.asarray(1, jnp.bfloat16)
    jax.block_until_ready(f(a, one))
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, one))
        ts.append(time.perf_counter() - t0)
    return 2 * a.nbytes / statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny shapes (checks the script)")
    ap.add_argument("--tokens", default=None, help=f"token counts T (default {TOKENS}; smoke {SMOKE_TOKENS})")
    ap.add_argument("--routings", default="random,correlated")
    ap.add_argument("--act", default="silu_glu", choices=("silu_glu", "relu2"))
    ap.add_argument("--sweep", default=None, choices=("none", "smoke", "small", "full", "decode", "fused"),
                    help="kernel tilings timed beside the default (sweep_configs, decode_sweep, fused_sweep; default "
                         "small, smoke with --smoke; decode: the decode path's variants and the grouped default only; "
                         "fused: the one-launch decode path's variants beside the two-launch and grouped defaults)")
    ap.add_argument("--decode-max-pairs", type=int, default=128,
                    help="time the decode path (decode_sweep) on rows of up to this many pairs T k")
    ap.add_argument("--out-in", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the kernel on weights stored [E, out, in] (HF's layout; a second copy)")
    ap.add_argument("--max-gather-pairs", type=int, default=64,
                    help="time XLA's gathered reference up to this many pairs T k (at 264 it did not finish in ~200 s)")
    ap.add_argument("--max-ragged-pairs", type=int, default=64, help="the same for the ragged_dot form")
    ap.add_argument("--max-grouped-pairs", type=int, default=1040, help="the same for grouped_xla")
    ap.add_argument("--max-dense-pairs", type=int, default=8320, help="the same for the dense form")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--round-ms", type=float, default=5.0)
    ap.add_argument("--budget-s", type=float, default=520, help="stop starting rows after this many seconds")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe_experts.json"))
    args = ap.parse_args(argv)
    setup = kernel_run_setup(argv, args.smoke)
    if setup is None:
        return 2
    on_gpu, impl, report = setup

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import moe_experts as moe

    t_start = time.time()
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    h, e, k, inter = shape["hidden"], shape["experts"], shape["top_k"], shape["inter"]
    n1 = 2 * inter if args.act == "silu_glu" else inter
    dtype = jnp.bfloat16
    expert_bytes = (h * n1 + inter * h) * jnp.dtype(dtype).itemsize
    tokens = [int(v) for v in (args.tokens or (SMOKE_TOKENS if args.smoke else TOKENS)).split(",")]
    routings = args.routings.split(",")
    bad = [r for r in routings if r not in ("random", "correlated")]
    if bad:
        ap.error(f"unknown routings {bad}: random, correlated")
    copy_Bps = copy_rate(on_gpu)
    report.update(shape=dict(shape, act=args.act, dtype="bfloat16", expert_bytes=expert_bytes),
                  copy_TBps=copy_Bps / 1e12, read_rates=jax_rates(on_gpu, quick=True, matmul=False),
                  gates={"gather": args.max_gather_pairs, "ragged": args.max_ragged_pairs,
                         "grouped": args.max_grouped_pairs, "dense": args.max_dense_pairs})
    print(f"[moe] copy rate {copy_Bps / 1e12:.2f} TB/s (read + written); read rates {report['read_rates']}", flush=True)

    key = jax.random.PRNGKey(0)
    k1, k2 = jax.random.split(key)
    w_in = (jax.random.normal(k1, (e, h, n1), jnp.float32) * h**-0.5).astype(dtype)
    w_out = (jax.random.normal(k2, (e, inter, h), jnp.float32) * inter**-0.5).astype(dtype)
    w_t = (jnp.swapaxes(w_in, 1, 2), jnp.swapaxes(w_out, 1, 2)) if args.out_in else None
    act = args.act

    for t in tokens:
        pairs = t * k
        base = moe.default_config(t, k, e, h, inter)
        which = args.sweep or ("smoke" if args.smoke else "small")
        configs = sweep_configs(base, which)
        if pairs <= args.decode_max_pairs:
            small = "small" if which in ("decode", "fused", "full") else which
            if which != "fused":
                configs.update(decode_sweep(moe.default_decode_config(t, k, e, h, inter), small))
            else:  # the two-launch default beside the one-launch variants
                configs.update(decode_sweep(moe.default_decode_config(t, k, e, h, inter), "none"))
            fused = moe.default_fused_config(t, k, e, h, inter)
            configs.update(fused_sweep(fused, "full" if which == "fused" else small))
        route = "decode" if isinstance(moe.kernel_config(t, k, e, h, inter), moe.DecodeConfig) else "default"
        forms, weights_of = {}, {}
        for name, (cfg, layout) in configs.items():
            if layout == "out_in" and w_t is None:
                continue
            forms[f"kernel:{name}"] = (lambda c, lay: lambda *a: moe.expert_mlp(
                *a, act=act, impl=impl, config=c, w_layout=lay))(cfg, layout)
            weights_of[f"kernel:{name}"] = (w_in, w_out) if layout == "in_out" else w_t
        gated = {"reference": args.max_gather_pairs, "ragged": args.max_ragged_pairs,
                 "grouped_xla": args.max_grouped_pairs, "dense": args.max_dense_pairs}
        xla_fns = {"reference": moe.reference, "grouped_xla": moe.grouped_xla, "ragged": ragged,
                   "dense": moe.dense_reference}
        for name in XLA_FORMS:
            if pairs <= gated[name]:
                forms[name] = (lambda f: lambda *a: f(*a, act=act))(xla_fns[name])
                weights_of[name] = (w_in, w_out)
        forms["prep"] = lambda x, ids, w, wi, wo: moe.group_pairs(ids, e, base.block_m).token
        weights_of["prep"] = (w_in, w_out)
        runners = {name: make_runner(f) for name, f in forms.items()}
        # rotations: enough routings that a round touches > L2_CLEAR_BYTES of experts under the
        # routing touching fewest (correlated); one count for every routing (same compiled runners)
        fewest = min(e, k + (t - 1) * (k - SHARED)) if "correlated" in routings else min(e, pairs)
        nrot = max(1, min(8, math.ceil(L2_CLEAR_BYTES / (fewest * expert_bytes)))) if on_gpu else 1
        for how in routings:
            if time.time() - t_start > args.budget_s:
                report["stopped"] = f"budget of {args.budget_s} s reached before T={t} {how}"
                break
            rng = np.random.default_rng(1000 * t + len(how))
            sets, counts = [], []
            for r in range(nrot):
                ids, w = routing(rng, t, k, e, how)
                counts.append(len(np.unique(ids)))
                x = jax.random.normal(jax.random.PRNGKey(r + 1), (t, h), jnp.float32).astype(dtype)
                sets.append((x, jnp.asarray(ids), jnp.asarray(w)))
            row = {"tokens": t, "routing": how, "pairs": pairs, "distinct": statistics.mean(counts),
                   "touched_MB": statistics.mean(counts) * expert_bytes / 1e6, "rotations": nrot,
                   "default_config": dataclasses.asdict(base), "route_config": route}
            times, errors, outs = time_interleaved(runners, sets, weights_of, round_s=args.round_ms / 1e3,
                                                   rounds=args.rounds if on_gpu else 2)
            for name, msg in errors.items():
                row[name.replace(":", "_") + "_error"] = msg
            # every form's output on the first set against the dense form's, else the first form's
            outs = {n: np.asarray(o, np.float32) for n, o in outs.items() if n != "prep"}
            truth = outs.get("dense", next(iter(outs.values()), None))
            scale = max(float(np.abs(truth).max()), 1e-30) if truth is not None else 1.0
            for name, got in outs.items():
                row[name.replace(":", "_") + "_err"] = float(np.abs(got - truth).max()) / scale
            sweep = {n.split(":", 1)[1]: s * 1e6 for n, s in times.items() if n.startswith("kernel:")}
            row["tilings"] = sweep  # {tiling: us}
            if sweep:
                best = min(sweep, key=sweep.get)
                row.update(kernel_us=sweep[best], best_config=best, kernel_default_us=sweep.get("default"),
                           kernel_route_us=sweep.get(route), kernel_decode_us=sweep.get("decode"))
                row["best_config_fields"] = dict(dataclasses.asdict(configs[best][0]), w_layout=configs[best][1])
                in_out = {n: v for n, v in sweep.items() if configs[n][1] == "in_out"}
                out_in = {n: v for n, v in sweep.items() if configs[n][1] == "out_in"}
                if in_out and out_in:  # the layout question: each layout's best tiling
                    row["kernel_best_in_out_us"] = min(in_out.values())
                    row["kernel_best_out_in_us"] = min(out_in.values())
                row["kernel_TBps"] = row["touched_MB"] * 1e6 / (sweep[best] * 1e-6) / 1e12
                row["x_roofline"] = sweep[best] * 1e-6 / (row["touched_MB"] * 1e6 / copy_Bps)
            for name in XLA_FORMS:
                if name in times:
                    row[name + "_us"] = times[name] * 1e6
            if "prep" in times:
                row["prep_time"] = times["prep"] * 1e6
            us = " ".join(f"{key[:-3]}={v:.1f}" for key, v in row.items() if key.endswith("_us") and v)
            line = (f"[moe] T={t} {how}: {row['distinct']:.1f} experts, {us} us (best tiling "
                    f"{row.get('best_config')}), prep {row.get('prep_time', 0):.1f} us")
            record_row(report, row, args.out, line)
        if "stopped" in report:
            break
    report["elapsed_s"] = time.time() - t_start
    atomic.write_json(args.out, report)
    lead = [("tokens", "T", 5, None), ("routing", "routing", 10, None), ("distinct", "experts", 7, ".1f"),
            ("touched_MB", "MB", 7, ".0f"), ("kernel_TBps", "kern TB/s", 9, ".2f"),
            ("x_roofline", "x roof", 6, ".2f"), ("prep_time", "prep us", 7, ".1f"), ("best_config", "tiling", 12, None)]
    ok = lambda r: all(v < 2e-2 for key, v in r.items() if key.endswith("_err"))
    print(f"\ncopy rate {copy_Bps / 1e12:.2f} TB/s; expert {expert_bytes / 1e6:.2f} MB; "
          f"x roof = kernel time / (touched bytes / copy rate)")
    return finish_checked(report, lead, ok, args.out)


if __name__ == "__main__":
    sys.exit(main())
