"""The per-layer runs of scripts.bench.kernels that are not attention, GDN or the tree build, GPU
kernel time from a profiler trace: add_rms_norm (residual add + RMSNorm over split-K partial sums
against XLA's reduce + the plain kernel, per tiling) and softmax_top_k (an MoE softmax router's
softmax + top-k + renormalisation in one launch against XLA's launches, per num_warps) and
row_product (one-row products in one launch against XLA's padded GEMM, per tiling) and pair_groups (an MoE
layer's pairs grouped by expert in one launch against XLA's fusions)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import add_rms_norm as arn
from pallas_kernels import softmax_top_k as stk
from pallas_kernels._common import summed_partials
from scripts.bench.common import err_str, trace_kernel_stats
from scripts.bench.kernels_harness import Kernel, Run, ints, registrar
from scripts.bench.shapes import GDN_27B

KERNELS: dict[str, Kernel] = {}
kernel = registrar(KERNELS)


ADD_NORM_TILINGS = ((1024, 8), (2048, 16), (4096, 16), (4096, 32))  # (PARTS_CHUNK, PARTS_WARPS)


def check_and_time(run: Run, row: dict, forms: dict, sets: list, agrees) -> None:
    """Each form run on sets[0] and checked (`agrees(output) -> bool` into row[name_ok]), then its GPU
    kernel time and launches from a trace over `sets` (row[name_us], row[name_launches]); a form that
    fails records its error. Then row["ok"] and the row is recorded."""
    for name, f in forms.items():
        try:
            row[name + "_ok"] = bool(agrees(jax.jit(f)(sets[0])))
            stats = trace_kernel_stats(f, sets, run.gpu)
            if stats is not None:
                row[name + "_us"], row[name + "_launches"] = stats
        except Exception as e:
            row[name + "_error"] = err_str(e)
    row["ok"] = all(v for k, v in row.items() if k.endswith("_ok"))
    run.record(row)


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
        normed = np.asarray(want[1], np.float32)

        def agrees(got):
            stream_ok = np.array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
            err = float(np.max(np.abs(np.asarray(got[1], np.float32) - normed)))
            return stream_ok and err <= 2**-6 * max(1.0, float(np.max(np.abs(normed))))

        check_and_time(run, row, forms, ds, agrees)


def softmax_top_k_options(ap):
    ap.add_argument("--rows", default="1,8,65", help="tokens (a batch-1 / batch-8 decode step, a DDTree-64 verify)")
    ap.add_argument("--experts", default="256,512", help="router widths (Qwen3.6-35B-A3B: 256, Qwen3-Next: 512)")
    ap.add_argument("--ks", default="8,10", help="top-k (paired with --experts)")
    ap.add_argument("--warps", default="1,2,4,8", help="num_warps of the kernel variants")


@kernel("softmax_top_k", [("rows", "rows", 5, None), ("experts", "E", 4, None), ("k", "k", 3, None)],
        "MoE softmax router (softmax + top-k + renormalisation) in one launch against XLA's launches",
        softmax_top_k_options)
def run_softmax_top_k(run: Run) -> None:
    a = run.args
    pairs = [(40, 4)] if run.smoke else list(zip(ints(a.experts), ints(a.ks)))
    for rows in [3] if run.smoke else ints(a.rows):
        for e, k in pairs:
            row = {"rows": rows, "experts": e, "k": k}
            key = jax.random.PRNGKey(rows * 1000 + e)
            sets = [(jax.random.normal(jax.random.fold_in(key, r), (rows, e), jnp.float32) * 2).astype(jnp.bfloat16)
                    for r in range(8 if run.gpu else 1)]
            route = lambda x, impl, warps=None: stk.softmax_top_k(x, k, norm=True, weights_dtype=jnp.bfloat16,
                                                                  impl=impl, num_warps=warps)
            want = jax.jit(lambda x: route(x, "xla"))(sets[0])
            forms = {"xla": lambda x: route(x, "xla")}
            for warps in [4] if run.smoke else ints(a.warps):
                forms[f"kernel_w{warps}"] = (lambda w: lambda x: route(x, run.impl, w))(warps)
            check_and_time(run, row, forms, sets, lambda got, want=want: (
                np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
                and float(np.max(np.abs(np.asarray(got[1]) - np.asarray(want[1])))) <= 2**-8))


# (name, K, N, partials: the product's split-K partials go to add_rms_norm) at the Qwen3.6-35B-A3B
# shape's one-row products: the router, the GDN and attention input projections, the output
# projections (4096 -> 2048, into the residual add + RMSNorm), the LM head
ROW_PRODUCT_SHAPES = (("router", 2048, 256, False), ("gdn_in", 2048, 12352, False), ("attn_in", 2048, 9216, False),
                      ("out_proj", 4096, 2048, True), ("lm_head", 2048, 248320, False))


def row_product_options(ap):
    ap.add_argument("--shapes", default=",".join(s[0] for s in ROW_PRODUCT_SHAPES),
                    help="which of ROW_PRODUCT_SHAPES (router, gdn_in, attn_in, out_proj, lm_head)")


def row_product_variants(k: int, n: int, partials: bool, smoke: bool) -> dict:
    """{name: RowConfig} timed: the default, then one change each (the other form, column and K
    blocks, the K split halved / doubled / quadrupled, warps, stages, a few of them combined, and
    the unrolled K loop (all loads first) at 1, 2 and 4 times the split)."""
    from pallas_kernels import row_product as rp
    rep = dataclasses.replace
    base = rp.default_config(k, n, partials=partials)
    out = {"kernel": base}
    if smoke:
        return out
    s = base.split_k
    out.update(dot=rep(base, form="dot"), dot_k128=rep(base, form="dot", block_k=128), n32=rep(base, block_n=32),
               n128=rep(base, block_n=128), k128=rep(base, block_k=128), k256=rep(base, block_k=256),
               k128_w8=rep(base, block_k=128, num_warps=8), k256_w8=rep(base, block_k=256, num_warps=8),
               split_half=rep(base, split_k=max(1, s // 2)), split_x2=rep(base, split_k=2 * s),
               split_x4=rep(base, split_k=4 * s), k128_split_x2=rep(base, block_k=128, split_k=2 * s),
               k128_split_x4=rep(base, block_k=128, split_k=4 * s),
               k256_split_x4_w8=rep(base, block_k=256, split_k=4 * s, num_warps=8),
               n32_split_x2=rep(base, block_n=32, split_k=2 * s), n32_k128_split_x2=rep(base, block_n=32, block_k=128,
                                                                                        split_k=2 * s),
               w2=rep(base, num_warps=2), w8=rep(base, num_warps=8), stages1=rep(base, num_stages=1),
               unroll=rep(base, unroll=True), unroll_split_x2=rep(base, unroll=True, split_k=2 * s),
               unroll_split_x4=rep(base, unroll=True, split_k=4 * s),
               unroll_k128_split_x4=rep(base, unroll=True, block_k=128, split_k=4 * s))
    return {name: cfg.fit(k, n) for name, cfg in out.items()}


@kernel("row_product", [("shape", "product", 9, None), ("k", "K", 5, None), ("n", "N", 7, None)],
        "one-row products (a batch-1 decode step) in one launch against XLA's padded GEMM (+ add_rms_norm "
        "where the partials go)", row_product_options)
def run_row_product(run: Run) -> None:
    from pallas_kernels import row_product as rp
    wanted = run.args.shapes.split(",")
    shapes = [("smoke", 256, 96, False), ("smoke_parts", 256, 64, True)] if run.smoke else [
        s for s in ROW_PRODUCT_SHAPES if s[0] in wanted]
    read = run.rates()["hbm_GBps"] if run.gpu else None
    for name, k, n, partials in shapes:
        key = jax.random.PRNGKey(k * 7 + n)
        nbytes = 2 * k * n
        count = max(2, min(128, -(-(256 << 20) // nbytes))) if run.gpu else 1  # weights >> L2
        sets = [((jax.random.normal(jax.random.fold_in(key, 2 * r), (1, k), jnp.float32)).astype(jnp.bfloat16),
                 (jax.random.normal(jax.random.fold_in(key, 2 * r + 1), (k, n), jnp.float32) * k**-0.5
                  ).astype(jnp.bfloat16)) for r in range(count)]
        row = {"shape": name, "k": k, "n": n, "partials": partials, "MB": nbytes / 1e6}
        if read:
            row["roof_us"] = nbytes / (read * 1e3)
        if partials:  # the output projection into the residual add + RMSNorm, as the decode step runs it
            xs = jnp.ones((1, n), jnp.bfloat16)
            wn = jnp.full((n,), 0.1, jnp.bfloat16)
            norm = lambda d: arn.add_rms_norm(xs, d, wn, eps=1e-6, mode="zero_centered", impl=run.impl)
            forms = {"xla_pad": lambda a: norm(_padded_row(a[0], a[1]))}
            for v, cfg in row_product_variants(k, n, True, run.smoke).items():
                forms[v] = (lambda c: lambda a: norm(rp.row_product(a[0], a[1], config=c, partials=True,
                                                                    impl=run.impl)))(cfg)
            want = np.asarray(jax.jit(lambda a: norm(rp.reference(a[0], a[1])))(sets[0])[1], np.float32)
            agrees = lambda got: float(np.max(np.abs(np.asarray(got[1], np.float32) - want))) <= 2**-6 * max(
                1.0, float(np.max(np.abs(want))))
        else:
            forms = {"xla_pad": lambda a: _padded_row(a[0], a[1]), "xla": lambda a: rp.reference(a[0], a[1])}
            for v, cfg in row_product_variants(k, n, False, run.smoke).items():
                forms[v] = (lambda c: lambda a: rp.row_product(a[0], a[1], config=c, impl=run.impl))(cfg)
            want = np.asarray(jax.jit(lambda a: rp.reference(a[0].astype(jnp.float32), a[1].astype(jnp.float32)))(
                sets[0]), np.float32)
            agrees = lambda got: float(np.max(np.abs(np.asarray(got, np.float32) - want))) <= 2**-7 * max(
                1.0, float(np.max(np.abs(want))))
        row["configs"] = {v: dataclasses.asdict(c) for v, c in row_product_variants(k, n, partials, run.smoke).items()}
        check_and_time(run, row, forms, sets, agrees)


def _padded_row(x, w):
    """The XLA route of a one-row product on a GPU today (models.layers._padded_row_product)."""
    from ddtree_jax.models.layers import _padded_row_product
    return _padded_row_product(x, w)


def pair_groups_options(ap):
    ap.add_argument("--tokens", default="9,17,33,65,72",
                    help="tokens (batch-1 DDTree verifies of budgets 8 / 16 / 32 / 64; batch 8 at budget 8)")
    ap.add_argument("--experts", type=int, default=256, help="experts (Qwen3.6-35B-A3B: 256)")
    ap.add_argument("--k", type=int, default=8, help="choices a token")
    ap.add_argument("--block-m", type=int, default=16, help="the grouped kernel's row tile")
    ap.add_argument("--warps", default="1,2,4,8", help="num_warps of the kernel variants")


@kernel("pair_groups", [("tokens", "tokens", 6, None), ("experts", "E", 4, None)],
        "an MoE layer's (token, choice) pairs grouped by expert in one launch (pair_groups.py) against "
        "XLA's fusions (group_pairs); kernel time from a trace, launches, and wall time of 64 calls in one jit",
        pair_groups_options)
def run_pair_groups(run: Run) -> None:
    import time

    from pallas_kernels import pair_groups as pg
    a = run.args
    e, k, bm = (40, 4, 16) if run.smoke else (a.experts, a.k, a.block_m)
    calls = 64 if run.gpu else 2
    for t in [3] if run.smoke else ints(a.tokens):
        row = {"tokens": t, "experts": e, "k": k, "block_m": bm}
        rng = np.random.default_rng(t)
        sets = [jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
                for _ in range(calls)]
        want = pg.reference(sets[0], e, bm)
        forms = {"xla": lambda ids: pg.pair_groups(ids, e, bm, impl="xla")}
        for warps in [4] if run.smoke else ints(a.warps):
            forms[f"kernel_w{warps}"] = (lambda w: lambda ids: pg.pair_groups(ids, e, bm, impl=run.impl,
                                                                             num_warps=w))(warps)
        for name, f in forms.items():  # wall time of the calls back to back in one jit, dispatch included
            try:
                many = jax.jit(lambda s, f=f: [f(ids) for ids in s])
                jax.block_until_ready(many(sets))
                walls = []
                for _ in range(7 if run.gpu else 1):
                    t0 = time.perf_counter()
                    jax.block_until_ready(many(sets))
                    walls.append(time.perf_counter() - t0)
                row[name + "_wall_us"] = float(np.median(walls)) / calls * 1e6
            except Exception as ex:
                row[name + "_error"] = err_str(ex)
        check_and_time(run, row, forms, sets, lambda got: all(
            np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want)))
