"""What programmatic dependent launch (PDL) saves at a launch boundary, on a chain of dependent
memory-bound Mosaic GPU kernels shaped like a decode step's weight reads (issue #26's decode gap).

Each "layer" is one launch of a one-row product over its own weight W_l [R, C] (bfloat16):
out = s * W_l x + d with x = d[:C] and d the previous layer's out (float32). The weights stream
through a TMA pipeline (one warpgroup a block of 64 rows, `stages` tiles in flight); x and d are
read only once the dependency is met. `--layers` such launches run in one jitted call.
`--op rowsum` reads the same weights but only sums their rows (out = s * the row sums + d, no x:
the first measured form, decision 0077). `--io direct` reads the previous out's rows and writes
the launch's own with the threads' loads and stores instead of TMA, taking two memory round trips
off each launch's dependent path. Forms:

- "plain": Mosaic GPU kernels launched as jax launches them (stream order);
- "pdl_start": launched with PDL (pallas_kernels/_mosaic_pdl.py), each kernel letting its
  dependents launch at once and waiting on its predecessor before its first load;
- "pdl_prefetch": as pdl_start, but the wait comes inside the pipeline's first step, after the
  first `stages` weight tiles are issued: a kernel streams weights while its predecessor drains;
- "pdl_nowait": a diagnostic race, PDL with no wait at all: x read at once. Its out differs from
  plain's only if launches really overlap, which shows PDL in effect;
- "xla": the same product by XLA (`dot_general` of bfloat16 operands, float32 result);
- "one_launch": one plain launch reading every layer's weights (with the first x): the bytes with
  no boundary.
The Mosaic forms do the same arithmetic in the same order, so every one but pdl_nowait must give
plain's out bit for bit (the report checks it; `tests/test_mosaic_pdl.py -m gpu` asserts it).

Times: medians over interleaved rounds of paired calls (`--layers` and `--base-layers` layers,
back to back, one_launch's over as many layers' columns); the per-layer figure is their
difference over the layers between, which cancels the call's fixed cost (100-250 us here, against a
few us a layer). `--check-jax` also lists the files of jax that name the PDL attribute (none in
0.10.2). A call compiles two programs a form, size and config (~6 s each with its timing on the
H200), so the default sweep (108) does not fit one 600 s device call; decision 0077 splits it.

    python -m scripts.bench.mosaic_pdl --configs 128:8 --check-jax --out $OUT/mosaic_pdl.json   # H200
    python -m scripts.bench.mosaic_pdl --smoke --out /tmp/mosaic_pdl.json                        # lowering only
"""

from __future__ import annotations

import argparse
import functools
import itertools
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mosaic_pdl import USES_PDL_ATTR, PdlCompilerParams
from scripts.bench.common import max_rel_err, record_row, start_report, write_report

FORMS = ("plain", "pdl_start", "pdl_prefetch", "pdl_nowait", "xla", "one_launch")
MOSAIC_FORMS = ("plain", "pdl_start", "pdl_prefetch", "pdl_nowait")
PDL_FORMS = ("pdl_start", "pdl_prefetch", "pdl_nowait")
BLOCK_ROWS = 64  # one warpgroup's WGMMA-layout tile of rows
TMA_MAX = 256  # elements a TMA copy moves along one dimension at most


OPS = ("gemv", "rowsum")
IOS = ("tma", "direct")


def scale_for(cols: int, op: str = "gemv") -> float:
    """Keeps the chain's values O(1): a product adds ~ d / 4 in norm; a row sum is scaled as the
    first measured run (decision 0077) scaled it."""
    return 0.25 / float(np.sqrt(cols)) if op == "gemv" else 1.0 / 64


def layer_launch(w, d, *, layer: int, cols: int, form: str, op: str = "gemv", io: str = "tma",
                 block_cols: int = 128, stages: int = 4, layers_in_launch: int = 1):
    """One launch: out = scale * W[:, layer * cols:(layer + layers_in_launch) * cols] @ tile(x) + d,
    x = d[:cols] (bfloat16 W, float32 x and out; tile(x): x repeated over the launch's layers).
    op "rowsum": the same read with no x (out = scale * the row sums + d; the first probe's form)."""
    rows = w.shape[0]
    if rows % BLOCK_ROWS or cols % block_cols or rows < cols:
        raise ValueError(f"rows {rows} must divide by {BLOCK_ROWS} and hold cols {cols}; cols must divide "
                         f"by {block_cols}")
    steps_per_layer = cols // block_cols
    steps = steps_per_layer * layers_in_launch
    x_chunks = -(-cols // TMA_MAX)
    scale = scale_for(cols, op)
    gemv = op == "gemv"
    pdl = form in PDL_FORMS
    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    wgmma_cols = plgpu.Layout.WGMMA.reduce(0)  # a [block_cols] vector broadcast over the rows
    wgmma_rows = plgpu.Layout.WGMMA.reduce(1)  # a [BLOCK_ROWS] vector, one value a row

    def body(w_ref, d_ref, o_ref, x_smem, d_smem, o_smem, x_barrier, d_barrier):
        def load_x():  # TMA moves at most 256 elements a dimension: x in chunks, one barrier
            for i in range(x_chunks):
                chunk = pl.ds(i * TMA_MAX, min(TMA_MAX, cols - i * TMA_MAX))
                plgpu.copy_gmem_to_smem(d_ref.at[chunk], x_smem.at[chunk], x_barrier)
            plgpu.barrier_wait(x_barrier)

        if pdl:
            plgpu.griddepcontrol_launch_dependents()
        if form == "pdl_start":
            plgpu.griddepcontrol_wait()
        if gemv and form in ("plain", "pdl_start", "pdl_nowait"):  # pdl_nowait: a race, on purpose
            load_x()
        blk = lax.axis_index("rows")

        def step(idx, w_smem, acc):
            if form == "pdl_prefetch":  # the first tiles are in flight: now wait, then read x
                @pl.when(idx[0] == 0)
                def _wait():
                    plgpu.griddepcontrol_wait()
                    if gemv:
                        load_x()
            w_tile = plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            if not gemv:
                return acc + w_tile
            x = plgpu.load(x_smem.at[pl.ds((idx[0] % steps_per_layer) * block_cols, block_cols)], (),
                           layout=wgmma_cols)
            return acc + w_tile * lax.broadcast_in_dim(x, (BLOCK_ROWS, block_cols), (1,))

        acc = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS, block_cols), jnp.float32), plgpu.Layout.WGMMA)
        acc = plgpu.emit_pipeline(
            step, grid=(steps,),
            in_specs=[plgpu.BlockSpec((BLOCK_ROWS, block_cols),
                                      lambda k: (blk, layer * steps_per_layer + k), transforms=tiles)],
            max_concurrent_steps=min(stages, steps), init_carry=acc)(w_ref)
        rows_here = pl.ds(blk * BLOCK_ROWS, BLOCK_ROWS)
        if io == "direct":  # d read and out written by the threads: no barrier, no store wait
            prev = plgpu.load(d_ref.at[rows_here], (), layout=wgmma_rows, optimized=False)  # per-thread loads
            o_ref[rows_here] = acc.sum(axis=1) * scale + prev
            return
        plgpu.copy_gmem_to_smem(d_ref.at[rows_here], d_smem, d_barrier)
        plgpu.barrier_wait(d_barrier)
        o_smem[...] = acc.sum(axis=1) * scale + plgpu.load(d_smem, (), layout=wgmma_rows)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[rows_here])
        plgpu.wait_smem_to_gmem(0)

    params = (PdlCompilerParams if pdl else plgpu.CompilerParams)()
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((rows,), jnp.float32), grid=(rows // BLOCK_ROWS,),
        grid_names=("rows",), compiler_params=params,
        scratch_types=[plgpu.SMEM((cols if gemv else 8,), jnp.float32), plgpu.SMEM((BLOCK_ROWS,), jnp.float32),
                       plgpu.SMEM((BLOCK_ROWS,), jnp.float32), plgpu.Barrier(num_arrivals=x_chunks),
                       plgpu.Barrier(num_arrivals=1)],
    )(w, d)


def chain(w, d, *, layers: int, cols: int, form: str, op: str = "gemv", io: str = "tma",
          block_cols: int = 128, stages: int = 4):
    """`layers` dependent GEMVs over W's column blocks 0 .. layers - 1 (each `cols` wide); the
    one_launch form reads the same weights in one launch with the first x for every block."""
    if form == "one_launch":
        return layer_launch(w, d, layer=0, cols=cols, form="plain", op=op, io=io, block_cols=block_cols,
                            stages=stages, layers_in_launch=layers)
    for layer in range(layers):
        if form == "xla":
            part = w[:, layer * cols:(layer + 1) * cols]
            if op == "gemv":
                prod = lax.dot_general(part, d[:cols].astype(jnp.bfloat16), (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)
            else:  # no dependency on d: XLA may compute every layer's sum at once
                prod = part.astype(jnp.float32).sum(axis=1)
            d = prod * scale_for(cols, op) + d
        else:
            d = layer_launch(w, d, layer=layer, cols=cols, form=form, op=op, io=io, block_cols=block_cols,
                             stages=stages)
    return d


def reference(w, d, *, layers: int, cols: int, op: str = "gemv", one_launch: bool = False):
    """numpy float64: the chain's exact values (one_launch: every block with the first x)."""
    w64 = np.asarray(w, np.float64)
    out = np.asarray(d, np.float64)
    scale = scale_for(cols, op)

    def product(layer, x):
        part = w64[:, layer * cols:(layer + 1) * cols]
        return part @ x if op == "gemv" else part.sum(axis=1)

    if one_launch:
        return sum(product(i, out[:cols]) for i in range(layers)) * scale + out
    for layer in range(layers):
        out = product(layer, out[:cols]) * scale + out
    return out


def jax_sets_pdl() -> list[str]:
    """Files of the installed jax package whose text names the PDL module attribute."""
    root = pathlib.Path(jax.__file__).parent
    hits = []
    for path in root.rglob("*.py"):
        if USES_PDL_ATTR in path.read_text(errors="ignore"):
            hits.append(str(path.relative_to(root)))
    return sorted(hits)


def lowered_text(form: str, *, rows: int = 256, cols: int = 256, layers: int = 2, op: str = "gemv",
                 io: str = "tma") -> str:
    """The chain lowered for CUDA on any machine: its StableHLO, whose Mosaic custom calls carry
    each kernel's module (bytecode, where the attribute's name appears when set)."""
    w = jax.ShapeDtypeStruct((rows, layers * cols), jnp.bfloat16)
    d = jax.ShapeDtypeStruct((rows,), jnp.float32)
    fn = jax.jit(functools.partial(chain, layers=layers, cols=cols, form=form, op=op, io=io))
    return fn.trace(w, d).lower(lowering_platforms=("cuda",)).as_text()


def per_layer_us(pairs, layers: int, base_layers: int) -> float:
    """Median over rounds of (long call - short call) / (layers - base_layers), in us: the time a
    layer adds, with the call's fixed cost cancelled. pairs: [(long s, short s)] of one round each.
    (ddtree_jax.bench.paired_marginal_ms times one program's pairs in a row; here every round
    visits every form, so the forms compare under the same conditions.)"""
    return statistics.median((a - b) / (layers - base_layers) for a, b in pairs) * 1e6


def _timed_pair(fa, fb, args):
    t0 = time.perf_counter()
    jax.block_until_ready(fa(*args))
    t1 = time.perf_counter()
    jax.block_until_ready(fb(*args))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def measure(rows: int, cols: int, layers: int, base_layers: int, forms, rounds: int, stages: int,
            block_cols: int, op: str = "gemv", io: str = "tma", seed: int = 0):
    key = jax.random.PRNGKey(seed)
    w = jax.random.normal(key, (rows, layers * cols), jnp.float32).astype(jnp.bfloat16)
    d0 = jax.random.normal(jax.random.fold_in(key, 1), (rows,), jnp.float32)
    fns = {}
    for form in forms:
        mk = functools.partial(chain, cols=cols, form=form, op=op, io=io, block_cols=block_cols, stages=stages)
        fns[form] = (jax.jit(functools.partial(mk, layers=layers)),
                     jax.jit(functools.partial(mk, layers=base_layers)))
    outs = {f: np.asarray(jax.block_until_ready(fns[f][0](w, d0))) for f in forms}
    refs = {False: reference(w, d0, layers=layers, cols=cols, op=op)}
    if "one_launch" in forms:
        refs[True] = reference(w, d0, layers=layers, cols=cols, op=op, one_launch=True)
    for f in forms:  # warm up both programs
        for _ in range(2):
            _timed_pair(*fns[f], (w, d0))
    samples = {f: [] for f in forms}
    for _ in range(rounds):
        for f in forms:
            t_long, t_short = _timed_pair(*fns[f], (w, d0))
            samples[f].append((t_long, t_short))
    layer_bytes = rows * cols * 2
    row = {"op": op, "io": io, "rows": rows, "cols": cols, "layer_mb": layer_bytes / 1e6, "layers": layers,
           "base_layers": base_layers, "rounds": rounds, "stages": stages, "block_cols": block_cols}
    for f in forms:
        us = per_layer_us(samples[f], layers, base_layers)
        row[f] = {"us_per_layer": us, "tb_per_s": layer_bytes / (us * 1e-6) / 1e12,
                  "call_ms": statistics.median(a for a, _ in samples[f]) * 1e3,
                  "max_abs_err_over_max": max_rel_err([refs[f == "one_launch"]], [outs[f]])}
    plain = outs.get("plain")
    if plain is not None:
        row["bit_equal_to_plain"] = {f: bool(np.array_equal(outs[f], plain))
                                     for f in forms if f in MOSAIC_FORMS}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192, help="rows of every layer's weight (64 a program)")
    ap.add_argument("--cols", default="256,1024,3072",
                    help="comma list: columns of a layer's weight (bytes a layer = rows x cols x 2)")
    ap.add_argument("--op", choices=OPS, default="gemv",
                    help="gemv: each launch a one-row product with x from the previous out; rowsum: the "
                         "same read summed, the previous out added at the end (no x)")
    ap.add_argument("--io", choices=IOS, default="tma",
                    help="how a launch reads the previous out's rows it adds and writes its own: tma (SMEM, a "
                         "barrier, a TMA store and its wait) or direct (the threads' own loads and stores)")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--base-layers", type=int, default=8)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--configs", default="128:4,128:8,256:4",
                    help="comma list of block_cols:stages (a weight tile's columns, tiles in flight a program)")
    ap.add_argument("--check-jax", action="store_true", help="also report the jax files naming the attribute")
    ap.add_argument("--smoke", action="store_true",
                    help="lower every Mosaic form for CUDA (any machine) and check the attribute; no timing")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    forms = tuple(f for f in args.forms.split(",") if f)
    bad = [f for f in forms if f not in FORMS]
    cols = [int(c) for c in args.cols.split(",") if c]
    errors = []
    try:
        configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",") if c]
        assert configs and all(len(c) == 2 and min(c) > 0 for c in configs)
    except (ValueError, AssertionError):
        configs = []
        errors.append(f"--configs {args.configs!r}: expected block_cols:stages[,...]")
    if bad:
        errors.append(f"unknown forms {bad} (known: {', '.join(FORMS)})")
    if args.rows % BLOCK_ROWS:
        errors.append(f"--rows {args.rows} must divide by {BLOCK_ROWS}")
    if any(c % bc for c in cols for bc, _ in configs):
        errors.append("every --cols must divide by every config's block_cols")
    if any(c > args.rows for c in cols):
        errors.append("every --cols must be at most --rows (x is the first cols of the previous out)")
    if not args.base_layers < args.layers:
        errors.append("--base-layers must be below --layers")
    if errors:
        ap.error("; ".join(errors))
    report = start_report("scripts.bench.mosaic_pdl", argv, rows=[])
    if args.check_jax:
        report["jax_files_naming_uses_pdl"] = jax_sets_pdl()
    if args.smoke:
        report["attribute_in_lowering"] = {f: USES_PDL_ATTR in lowered_text(f, op=args.op, io=args.io)
                                           for f in MOSAIC_FORMS}
        print(report["attribute_in_lowering"])
        write_report(args.out, report)
        return 0
    for (block_cols, stages), c in itertools.product(configs, cols):
        row = measure(args.rows, c, args.layers, args.base_layers, forms, args.rounds, stages, block_cols,
                      args.op, args.io)
        line = f"{block_cols}:{stages}, {row['layer_mb']:.1f} MB a layer: " + ", ".join(
            f"{f} {row[f]['us_per_layer']:.2f} us ({row[f]['tb_per_s']:.2f} TB/s)" for f in forms)
        record_row(report, row, args.out, f"{line}; bit-equal to plain: {row.get('bit_equal_to_plain')}")
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
