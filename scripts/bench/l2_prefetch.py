"""Does reading the next weight-streaming launch's weights into L2, from extra programs of the
latency-bound launch before it, shorten a decode step's pair of launches? (issue #26's decode gap)

A batch-1 decode step alternates launches that barely use HBM (add + RMSNorm: ~2.5 us, a few KB)
with launches that stream a weight (the projections: 17-51 MB at 2.2-3.2 TB/s, each paying its own
start). Weights do not depend on the activations, so the small launch could already be reading
the next one's weight while it waits on its own latency chain, and the big launch would then find
part of it in the H200's L2 (50-60 MB). This measures that on a chain of `--layers` units with
weights of their own (no unit finds another's bytes in L2), one jitted call:

    lead:     x = rms_norm(y[k mod N] summed over y's S rows + r) * w_norm     (program 0)
              + Q programs that each load `--unroll` [16, 256] tiles of the first fraction f
                of this unit's W at once (loads marked evict_last), whose sum is stored only
                if it is NaN (never, for finite W: the loads stay in the program)
    consumer: y = x @ W, W [K, N]: "row" = pallas_kernels/row_product (float32 partials, as the
              output projections run: decision 0054); "xla" = XLA's GEMM of the row padded to
              two rows (the GDN input projection's form: decision 0049)

Forms: f = 0 (the lead without prefetch programs) and each fraction in `--fractions`. Times:
medians of interleaved rounds, per unit; and each launch's own time from a profiler trace (the
lead grows by what the prefetch costs it, the consumer shrinks by what L2 saves it).

    python -m scripts.bench.l2_prefetch --out $OUT/l2_prefetch.json          # on the H200
    python -m scripts.bench.l2_prefetch --smoke --out /tmp/l2_prefetch.json  # interpret mode
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import row_product as rp
from pallas_kernels._common import compiler_params, load, pltriton, store
from scripts.bench.common import record_row, start_report, trace_kernels, write_report

TILE = (16, 256)  # one prefetch load: 8 KB of bf16, 16 registers a thread at 4 warps
EPS = 1e-6
SHAPES = {"out_proj": ("row", 4096, 2048), "in_proj": ("xla", 2048, 12352)}  # the 35B-A3B layer's


def _lead_kernel(y_ref, r_ref, nw_ref, w_ref, x_ref, sink_ref, *, rows: int, k: int, n: int, tiles: int,
                 programs: int, unroll: int, groups: int, gpu: bool):
    pid = pl.program_id(0)

    @pl.when(pid == 0)
    def _norm():
        cols = lax.iota(jnp.int32, k) % n
        y = load(y_ref, (0, cols)).astype(jnp.float32)
        for s in range(1, rows):
            y = y + load(y_ref, (s, cols)).astype(jnp.float32)
        h = y + load(r_ref, (pl.ds(0, k),)).astype(jnp.float32)
        inv = lax.rsqrt(jnp.mean(h * h) + EPS)
        store(x_ref, (pl.ds(0, k),), (h * inv * load(nw_ref, (pl.ds(0, k),)).astype(jnp.float32)).astype(x_ref.dtype))

    if tiles:
        @pl.when(pid > 0)
        def _prefetch():
            q = pid - 1
            acc = jnp.zeros(TILE, jnp.float32)
            for g in range(groups):  # each group's loads issued together (independent addresses)
                loaded = []
                for u in range(unroll):
                    t = jnp.minimum((g * programs + q) * unroll + u, tiles - 1)
                    idx = (pl.ds(t * TILE[0], TILE[0]), pl.ds(0, TILE[1]))
                    if gpu:  # interpret mode (the CPU smoke run) takes no cache hints: plain loads there
                        loaded.append(pltriton.load(w_ref.at[idx], eviction_policy="evict_last"))
                    else:
                        loaded.append(load(w_ref, idx))
                for v in loaded:
                    acc = acc + v.astype(jnp.float32)
            total = jnp.sum(acc)

            @pl.when(jnp.isnan(total))
            def _keep():
                store(sink_ref, (pl.ds(q, 1),), jnp.full((1,), total, jnp.float32))


def lead(y, r, nw, w, *, fraction: float, programs: int, unroll: int, warps: int, gpu: bool):
    """x [1, K] (the consumer's row) from y [S, N]; with fraction > 0, `programs` more programs
    read the first `fraction` of w [K, N] (as [K N / 256, 256] rows of tiles)."""
    y = y.reshape(-1, y.shape[-1])  # the row product's partials come as [S, 1, N]
    rows, n = y.shape
    k = r.shape[0]
    flat = w.reshape(-1, TILE[1])
    tiles = int(round(fraction * flat.shape[0] / TILE[0]))
    per_group = programs * unroll
    groups = -(-tiles // per_group) if tiles else 0
    q = programs if tiles else 0
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    kernel = functools.partial(_lead_kernel, rows=rows, k=k, n=n, tiles=tiles, programs=q, unroll=unroll,
                               groups=groups, gpu=gpu)
    x, _ = pl.pallas_call(
        kernel,
        grid=(1 + q,),
        in_specs=[full(y.shape), full(r.shape), full(nw.shape), full(flat.shape)],
        out_specs=[full((k,)), full((max(q, 1),))],
        out_shape=[jax.ShapeDtypeStruct((k,), r.dtype), jax.ShapeDtypeStruct((max(q, 1),), jnp.float32)],
        compiler_params=compiler_params(warps, 1) if gpu else None,
        interpret=not gpu,
        name="l2_lead",
    )(y, r, nw, flat)
    return x.reshape(1, k)


def consumer(kind: str, x, w, gpu: bool):
    """y [S, N]: the row product's float32 partials ("row") or XLA's padded GEMM's two rows ("xla")."""
    k, n = w.shape
    if kind == "row":
        cfg = rp.default_config(k, n, partials=True)
        return rp.row_product(x, w, config=cfg, partials=True, impl="pallas" if gpu else "pallas_interpret")
    pad = jnp.concatenate([x, jnp.zeros_like(x)], axis=0)
    return jnp.dot(pad, w, preferred_element_type=jnp.float32).astype(x.dtype)


def chain(kind: str, fraction: float, *, programs: int, unroll: int, warps: int, gpu: bool):
    def run(y, rs, nw, ws):
        for r, w in zip(rs, ws):
            x = lead(y, r, nw, w, fraction=fraction, programs=programs, unroll=unroll, warps=warps, gpu=gpu)
            y = consumer(kind, x, w, gpu)
        return y
    return jax.jit(run)


def kernel_times(fn, args, layers: int) -> dict:
    """us a unit of each launch name in one traced call."""
    d = tempfile.mkdtemp(prefix="l2_prefetch_")
    with jax.profiler.trace(d):
        jax.block_until_ready(fn(*args))
    per = collections.defaultdict(float)
    for name, _, us in trace_kernels(d):
        per[name] += us / layers
    return {name: round(us, 2) for name, us in sorted(per.items(), key=lambda kv: -kv[1]) if us >= 0.05}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="out_proj,in_proj", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--fractions", default="0.25,0.5,1.0")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--programs", default="128", help="comma list: prefetch programs a lead launch")
    p.add_argument("--unroll", type=int, default=8)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 layers, interpret mode off a GPU")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    shapes = a.shapes.split(",")
    bad = [f"unknown shape {s!r} (shapes: {', '.join(SHAPES)})" for s in shapes if s not in SHAPES]
    fractions = [float(f) for f in a.fractions.split(",") if f]
    bad += [f"fraction {f} is not in (0, 1]" for f in fractions if not 0 < f <= 1]
    if bad:
        p.error("; ".join(bad))
    gpu = jax.devices()[0].platform == "gpu"
    if a.smoke:
        a.layers, a.rounds = 2, 2
    report = start_report("scripts.bench.l2_prefetch", argv, rows=[])
    rng = np.random.default_rng(0)
    for shape in shapes:
        kind, k, n = SHAPES[shape]
        if a.smoke:
            k, n = k // 32, n // 32 if kind == "row" else 512
        ws = [jnp.asarray(rng.standard_normal((k, n), np.float32) / np.sqrt(k), jnp.bfloat16) for _ in range(a.layers)]
        rs = [jnp.asarray(rng.standard_normal(k, np.float32), jnp.bfloat16) for _ in range(a.layers)]
        nw = jnp.asarray(1 + 0.1 * rng.standard_normal(k, np.float32), jnp.bfloat16)
        x0 = jnp.asarray(rng.standard_normal((1, k), np.float32), jnp.bfloat16)
        y0 = consumer(kind, x0, ws[0], gpu)
        args = (y0, rs, nw, ws)
        forms = {"f0": chain(kind, 0.0, programs=1, unroll=a.unroll, warps=a.warps, gpu=gpu)}
        for q in [int(v) for v in a.programs.split(",")]:
            for f in fractions:
                forms[f"f{f:g}_q{q}"] = chain(kind, f, programs=q, unroll=a.unroll, warps=a.warps, gpu=gpu)
        outs, compile_s = {}, {}
        for name, fn in forms.items():
            t0 = time.perf_counter()
            outs[name] = np.asarray(jax.block_until_ready(fn(*args)).astype(jnp.float32))
            compile_s[name] = round(time.perf_counter() - t0, 2)
        equal = {name: bool(np.array_equal(o, outs["f0"])) for name, o in outs.items()}
        times = {name: [] for name in forms}
        for _ in range(a.rounds):
            for name, fn in forms.items():  # interleaved
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[name].append((time.perf_counter() - t0) / a.layers * 1e6)
        row = {"shape": shape, "consumer": kind, "k": k, "n": n, "weight_MB": round(2 * k * n / 1e6, 2),
               "layers": a.layers, "equal_to_f0": equal, "compile_s": compile_s,
               "us_per_unit": {name: round(statistics.median(t), 2) for name, t in times.items()},
               "rounds_us": {name: [round(v, 2) for v in t] for name, t in times.items()}}
        if gpu:
            row["kernel_us_per_unit"] = {name: kernel_times(fn, args, a.layers) for name, fn in forms.items()}
        line = " ".join(f"{name}={us:.2f}" for name, us in row["us_per_unit"].items())
        record_row(report, row, a.out, f"{shape} ({kind}, {row['weight_MB']} MB) us a unit: {line} equal={equal}")
    write_report(a.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
