"""What a launch boundary costs against a grid-wide barrier inside one launch, on a chain of
dependent GEMVs shaped like a MoE decode layer's experts (the question of issue #26's decode gap).

Each "layer" is two dependent products of one row: h = W1 x (W1 [N1, K1], float32 h), then
y = W2 g with g = h[:K2] * sigmoid(h[K2:]) (W2 [N2, K2], K2 = N1 / 2; the gate / up product's shape:
top-8 + the shared expert of the 35B-A3B shape is N1 = 9 x 1024, K1 = 2048, N2 = 2048, so 37.7 +
18.9 MB a layer). `--layers` layers with weights of their own run in one jitted call, y of one
layer scaled into the next one's x. Forms, every one the same arithmetic in the same order (so
the same y, bit for bit):

- "grid": two launches a layer, one program per unit of bn rows (today's kernels' form);
- "persistent": two launches a layer, P programs each looping over units pid, pid + P, ...;
- "barrier": one launch a layer, P programs: the first product's units, a grid-wide barrier
  (an acquire-release atomic counter with a generation flag, `grid_barrier`), the second's;
- "barrier_prefetch": as "barrier", each program loading its first W2 unit's first tile (a rolled
  K loop) or all of its tiles (unrolled: the config's 8th field) before it waits;
- "floor": one launch a layer reading both matrices with no dependency (g: W2's first row): the bytes'
  time with one launch and no wait.

A barrier needs every program resident at once: P <= the SMs (one program each) here. Interpret
mode runs programs one after another, so the barrier forms run only on a GPU (the others are
checked against jnp on any device). Times: medians of interleaved rounds of the jitted call,
per layer, and the read rate they imply.

    python -m scripts.bench.grid_barrier --out $OUT/grid_barrier.json      # on the H200
    python -m scripts.bench.grid_barrier --smoke --out /tmp/grid_barrier.json
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import H200_SMS, compiler_params, load, pltriton, store
from scripts.bench.common import record_row, start_report, write_report

GAIN = 2.0  # keeps the chain's values O(1) layer after layer (g's gating halves them)
FORMS = ("grid", "persistent", "barrier", "barrier_prefetch", "floor")


def grid_barrier(sync_ref, programs: int):
    """Wait until every one of `programs` programs has reached this call. sync_ref int32[2]:
    [arrived, generation], arrived 0 between barriers. The generation is read before arriving (it
    cannot move until this program arrives); the last to arrive resets the count and bumps the
    generation; the others spin on it. Every atomic is acquire-release at GPU scope; a CTA barrier
    first, so that all the program's threads' stores precede its single-thread release."""
    pltriton.debug_barrier()
    zero, one = jnp.zeros((), jnp.int32), jnp.ones((), jnp.int32)
    gen = pltriton.atomic_add(sync_ref, 1, zero)
    arrived = pltriton.atomic_add(sync_ref, 0, one)

    @pl.when(arrived == programs - 1)
    def _release():
        pltriton.atomic_xchg(sync_ref, 0, zero)
        pltriton.atomic_add(sync_ref, 1, one)

    lax.while_loop(lambda g: g == gen, lambda _: pltriton.atomic_add(sync_ref, 1, zero), gen)
    pltriton.debug_barrier()


def _first_unit(w1_ref, x_ref, h_ref, u, *, bn, bk, k1, unroll=False):
    """h's rows of unit u: W1's [bn, K1] slab times x, in K steps of bk (unrolled: every step's
    loads issued before the first product)."""
    if unroll:
        n = k1 // bk
        ws = [load(w1_ref, (pl.ds(u * bn, bn), pl.ds(i * bk, bk))) for i in range(n)]
        xs = [load(x_ref, (pl.ds(0, 1), pl.ds(i * bk, bk))) for i in range(n)]
        acc = ws[0].astype(jnp.float32) * xs[0].astype(jnp.float32)
        for w, xv in zip(ws[1:], xs[1:]):
            acc = acc + w.astype(jnp.float32) * xv.astype(jnp.float32)
        store(h_ref, (pl.ds(0, 1), pl.ds(u * bn, bn)), jnp.sum(acc, axis=1)[None, :])
        return

    def step(i, acc):
        k0 = i * bk
        w = load(w1_ref, (pl.ds(u * bn, bn), pl.ds(k0, bk))).astype(jnp.float32)
        return acc + w * load(x_ref, (pl.ds(0, 1), pl.ds(k0, bk))).astype(jnp.float32)

    acc = lax.fori_loop(0, k1 // bk, step, jnp.zeros((bn, bk), jnp.float32))
    store(h_ref, (pl.ds(0, 1), pl.ds(u * bn, bn)), jnp.sum(acc, axis=1)[None, :])


def _g(h_ref, k0, bk, k2, other_sms: bool):
    """g's chunk at k0. Written by other SMs in this launch (the barrier forms): volatile loads,
    past L1, which is not coherent across SMs (jax's Triton lowering refuses the "cg" modifier:
    it looks ".cg" up in a table keyed "cg")."""
    if other_sms:
        a = pltriton.load(h_ref.at[pl.ds(0, 1), pl.ds(k0, bk)], volatile=True)
        b = pltriton.load(h_ref.at[pl.ds(0, 1), pl.ds(k2 + k0, bk)], volatile=True)
    else:
        a = load(h_ref, (pl.ds(0, 1), pl.ds(k0, bk)))
        b = load(h_ref, (pl.ds(0, 1), pl.ds(k2 + k0, bk)))
    return a * jax.nn.sigmoid(b)


def w2_tiles(w2_ref, u, *, bn, bk, k2):
    """Every K step's W2 tile of unit u (the unrolled form's loads)."""
    return [load(w2_ref, (pl.ds(u * bn, bn), pl.ds(i * bk, bk))) for i in range(k2 // bk)]


def _second_unit(w2_ref, g_of, y_ref, u, *, bn, bk, k2, scale, first=None, unroll=False):
    """y's rows of unit u: W2's [bn, K2] slab times g. first: the first K step's tile (rolled) or
    every step's tiles (unrolled), loaded before the barrier."""
    if unroll:
        ws = first if first is not None else w2_tiles(w2_ref, u, bn=bn, bk=bk, k2=k2)
        gs = [g_of(i * bk) for i in range(len(ws))]
        acc = ws[0].astype(jnp.float32) * gs[0]
        for w, gv in zip(ws[1:], gs[1:]):
            acc = acc + w.astype(jnp.float32) * gv
        store(y_ref, (pl.ds(0, 1), pl.ds(u * bn, bn)), (jnp.sum(acc, axis=1) * scale).astype(y_ref.dtype)[None, :])
        return

    def step(i, acc):
        k0 = i * bk
        w = load(w2_ref, (pl.ds(u * bn, bn), pl.ds(k0, bk))).astype(jnp.float32)
        return acc + w * g_of(k0)

    if first is None:
        acc = lax.fori_loop(0, k2 // bk, step, jnp.zeros((bn, bk), jnp.float32))
    else:  # the first K step's tile was loaded before the barrier
        acc = lax.fori_loop(1, k2 // bk, step, first.astype(jnp.float32) * g_of(0))
    store(y_ref, (pl.ds(0, 1), pl.ds(u * bn, bn)), (jnp.sum(acc, axis=1) * scale).astype(y_ref.dtype)[None, :])


def _units(pid, programs, n):
    """This program's unit count of n units dealt round-robin over `programs`."""
    return (n - pid + programs - 1) // programs


def _each_unit(pid, programs, n, run, start=0):
    """run(u) for this program's units u = pid + j programs, j >= start, of n dealt round-robin."""
    def body(j, carry):
        run(pid + j * programs)
        return carry

    lax.fori_loop(start, _units(pid, programs, n), body, 0)


def layer(x, w1, w2, sync, *, form: str, bn1: int, bk1: int, bn2: int, bk2: int, programs: int, warps: int,
          stages: int, interpret: bool, unroll: bool = False):
    """One layer in `form`: (y [1, N2] bfloat16, sync)."""
    n1, k1 = w1.shape
    n2, k2 = w2.shape
    assert n1 == 2 * k2 and n1 % bn1 == 0 and n2 % bn2 == 0 and k1 % bk1 == 0 and k2 % bk2 == 0
    u1, u2 = n1 // bn1, n2 // bn2
    scale = float(GAIN / np.sqrt(k2))
    first = functools.partial(_first_unit, bn=bn1, bk=bk1, k1=k1, unroll=unroll)
    second = functools.partial(_second_unit, bn=bn2, bk=bk2, k2=k2, scale=scale, unroll=unroll)
    params = None if interpret else compiler_params(warps, stages)
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    h_shape = jax.ShapeDtypeStruct((1, n1), jnp.float32)
    y_shape = jax.ShapeDtypeStruct((1, n2), jnp.bfloat16)

    def call(kernel, grid, operands, outs, aliases=None):
        return pl.pallas_call(kernel, grid=grid, in_specs=[full(a) for a in operands],
                              out_specs=[full(o) for o in outs], out_shape=outs,
                              input_output_aliases=aliases or {}, compiler_params=params,
                              interpret=interpret, name=f"gb_{form}")(*operands)

    def h_of(h_ref):
        return lambda k0: _g(h_ref, k0, bk2, k2, form.startswith("barrier"))

    if form in ("grid", "persistent"):
        per = form == "persistent"

        def k_first(x_ref, w1_ref, h_ref):
            pid = pl.program_id(0)
            if not per:
                return first(w1_ref, x_ref, h_ref, pid)
            _each_unit(pid, programs, u1, lambda u: first(w1_ref, x_ref, h_ref, u))

        def k_second(h_ref, w2_ref, y_ref):
            pid = pl.program_id(0)
            if not per:
                return second(w2_ref, h_of(h_ref), y_ref, pid)
            _each_unit(pid, programs, u2, lambda u: second(w2_ref, h_of(h_ref), y_ref, u))

        (h,) = call(k_first, (programs if per else u1,), (x, w1), (h_shape,))
        (y,) = call(k_second, (programs if per else u2,), (h, w2), (y_shape,))
        return y, sync

    if form == "floor":
        def k_floor(x_ref, w1_ref, w2_ref, h_ref, y_ref):
            pid = pl.program_id(0)
            _each_unit(pid, programs, u1, lambda u: first(w1_ref, x_ref, h_ref, u))
            xg = lambda k0: load(w2_ref, (pl.ds(0, 1), pl.ds(k0, bk2))).astype(jnp.float32)  # W2's row 0
            _each_unit(pid, programs, u2, lambda u: second(w2_ref, xg, y_ref, u))

        _, y = call(k_floor, (programs,), (x, w1, w2), (h_shape, y_shape))
        return y, sync

    prefetch = form == "barrier_prefetch"

    def k_barrier(x_ref, w1_ref, w2_ref, sync_in, h_ref, y_ref, sync_ref):
        del sync_in
        pid = pl.program_id(0)
        _each_unit(pid, programs, u1, lambda u: first(w1_ref, x_ref, h_ref, u))
        tile = None
        if prefetch:  # this program's first W2 unit: its first tile, or all of it unrolled
            u_first = jnp.minimum(pid, u2 - 1)
            tile = (w2_tiles(w2_ref, u_first, bn=bn2, bk=bk2, k2=k2) if unroll
                    else load(w2_ref, (pl.ds(u_first * bn2, bn2), pl.ds(0, bk2))))
        grid_barrier(sync_ref, programs)
        start = 0
        if prefetch:
            pl.when(pid < u2)(lambda: second(w2_ref, h_of(h_ref), y_ref, pid, first=tile))
            start = 1
        _each_unit(pid, programs, u2, lambda u: second(w2_ref, h_of(h_ref), y_ref, u), start=start)

    sync_shape = jax.ShapeDtypeStruct(sync.shape, sync.dtype)
    _, y, sync = call(k_barrier, (programs,), (x, w1, w2, sync), (h_shape, y_shape, sync_shape), {3: 2})
    return y, sync


def reference(x, w1, w2):
    """jnp form of one layer (float32 products; the kernels' sums differ in order only)."""
    h = jnp.dot(w1.astype(jnp.float32), x[0].astype(jnp.float32))
    k2 = w2.shape[1]
    y = jnp.dot(w2.astype(jnp.float32), h[:k2] * jax.nn.sigmoid(h[k2:])) * GAIN / np.sqrt(k2)
    return y.astype(jnp.bfloat16)[None, :]


def chain(form, cfg, interpret):
    @jax.jit
    def run(x, weights, sync):
        for w1, w2 in weights:
            x, sync = layer(x, w1, w2, sync, form=form, interpret=interpret, **cfg)
        return x, sync
    return run


def make_weights(layers, n1, k1, n2, seed=0):
    """Random bfloat16 weights scaled so the chain stays O(1) (never zeros)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * layers)
    k2 = n1 // 2
    normal = lambda i, shape, scale: (jax.random.normal(keys[i], shape, jnp.float32) * scale).astype(jnp.bfloat16)
    return [(normal(2 * i, (n1, k1), k1**-0.5), normal(2 * i + 1, (n2, k2), 1.0)) for i in range(layers)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n1", type=int, default=9 * 1024)
    p.add_argument("--k1", type=int, default=2048)
    p.add_argument("--n2", type=int, default=2048)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--configs", default="32:256:16:512:132:4:3",
                   help="comma list of bn1:bk1:bn2:bk2:programs:warps:stages[:unroll (0 / 1)]")
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 layers, interpret mode off a GPU")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.n2 != a.k1:
        p.error(f"--n2 ({a.n2}) must equal --k1 ({a.k1}): one layer's y is the next one's x")
    gpu = jax.devices()[0].platform == "gpu"
    forms = a.forms.split(",")
    if a.smoke:
        a.n1, a.k1, a.n2, a.layers, a.rounds = 256, 128, 128, 2, 2
        a.configs = "32:64:16:64:4:4:3,16:128:32:64:3:4:3:1"
    problems = [f"unknown form {f!r} (forms: {', '.join(FORMS)})" for f in forms if f not in FORMS]
    for spec in a.configs.split(","):
        f = spec.split(":")
        if len(f) not in (7, 8) or not all(v.isdigit() for v in f):
            problems.append(f"config {spec!r} is not bn1:bk1:bn2:bk2:programs:warps:stages[:unroll]")
        elif any(int(v) & (int(v) - 1) for v in f[:4]):
            problems.append(f"config {spec!r}: blocks must be powers of two (the Triton lowering's tiles)")
        elif a.n1 % int(f[0]) or a.k1 % int(f[1]) or a.n2 % int(f[2]) or (a.n1 // 2) % int(f[3]):
            problems.append(f"config {spec!r}: the blocks must divide N1 {a.n1}, K1 {a.k1}, N2 {a.n2}, K2 {a.n1 // 2}")
    if problems:
        p.error("; ".join(problems))
    if not gpu:
        forms = [f for f in forms if not f.startswith("barrier")]  # programs run one at a time there
    sms = getattr(jax.devices()[0], "core_count", H200_SMS) if gpu else H200_SMS
    report = start_report("scripts.bench.grid_barrier", argv, sms=sms, rows=[])
    weights = make_weights(a.layers, a.n1, a.k1, a.n2)
    x0 = jax.random.normal(jax.random.PRNGKey(7), (1, a.k1), jnp.float32).astype(jnp.bfloat16)
    layer_bytes = 2 * (a.n1 * a.k1 + a.n2 * a.n1 // 2)
    for spec in a.configs.split(","):
        fields = [int(v) for v in spec.split(":")]
        bn1, bk1, bn2, bk2, programs, warps, stages = fields[:7]
        unroll = bool(fields[7]) if len(fields) > 7 else False
        if programs > sms:
            print(f"skip {spec}: {programs} programs > {sms} SMs (the barrier needs them all resident)")
            continue
        cfg = dict(bn1=bn1, bk1=bk1, bn2=bn2, bk2=bk2, programs=programs, warps=warps, stages=stages, unroll=unroll)
        runs, outs = {}, {}
        for form in forms:
            fn = chain(form, cfg, interpret=not gpu)
            sync = jnp.zeros((2,), jnp.int32)
            t0 = time.perf_counter()
            y, s = fn(x0, weights, sync)
            y.block_until_ready()
            runs[form] = (fn, time.perf_counter() - t0)
            outs[form] = np.asarray(y.astype(jnp.float32))
        ref = outs.get("grid")
        same = {f: bool(np.array_equal(o, ref)) for f, o in outs.items() if f != "floor"}
        if not gpu or a.smoke:  # the first layer against jnp (the kernels' sums run in another order)
            y1, _ = layer(x0, *weights[0], jnp.zeros((2,), jnp.int32), form="grid", interpret=not gpu, **cfg)
            r1 = reference(x0, *weights[0])
            same["grid_vs_jnp_max_abs"] = float(jnp.max(jnp.abs(y1.astype(jnp.float32) - r1.astype(jnp.float32))))
        times = {f: [] for f in forms}
        for _ in range(a.rounds):
            for form in forms:  # interleaved
                fn = runs[form][0]
                sync = jnp.zeros((2,), jnp.int32)
                jax.block_until_ready(sync)
                t0 = time.perf_counter()
                y, _ = fn(x0, weights, sync)
                y.block_until_ready()
                times[form].append(time.perf_counter() - t0)
        row = {"config": cfg, "layer_bytes": layer_bytes, "bit_equal_to_grid": same,
               "compile_s": {f: round(runs[f][1], 2) for f in forms}}
        for form in forms:
            med = statistics.median(times[form]) / a.layers
            row[form] = {"us_per_layer": round(med * 1e6, 2), "tb_per_s": round(layer_bytes / med / 1e12, 3),
                         "rounds_us": [round(t / a.layers * 1e6, 2) for t in times[form]]}
        line = " ".join(f"{f}={row[f]['us_per_layer']:.2f}us" for f in forms)
        record_row(report, row, a.out, f"{spec}: {line} equal={same}")
    write_report(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
