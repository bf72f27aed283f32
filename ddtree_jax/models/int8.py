"""int8 for the drafter: int8 kernels with one float32 scale per output column (and, for the wide
products, int8 activations with one scale per row: W8A8, ACT_INT8 below).

Why: a DFlash step reads the drafter's weights and, for its draft head, the target's lm_head once
per step. At the Qwen3.6-27B shape that is 3.46 GB of drafter layers and the 2.54 GB head in bf16,
~1.5 ms of a ~18.6 ms DDTree step on the H200, at the HBM read rate (docs/benchmarks.md section 1).
Those products have 15-16 rows, so they are bound by the bytes of their weights: int8 halves them.

Output is unchanged: the drafter only proposes; the target verifies every draft in its own dtype,
so greedy output stays identical to plain decoding and sampling keeps the target's distribution.
What int8 changes is the draft distributions, slightly (per-column absmax scaling, round to
nearest: each weight within half a step, |w| max / 254, of its value; W8A8 rounds each input row
the same way, to its |x| max / 254), and so, possibly, which drafts are proposed;
docs/benchmarks.md records what it costs in acceptance on the demo pair (sessions 13-15: within 1 %).

The target is never quantized: its products are the output.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

QMAX = 127  # symmetric: -127..127, so negation is exact and the scale is |w| max / 127

# Linear attribute names `quantize_linears` leaves in their float dtype ("lm_head": the draft head,
# speculative/draft_vocab.int8_draft_head): products where XLA's int8 GEMM is not faster than its bf16
# one. On the H200 (session 13, profile_step --int8-drafter, 27B-width drafter, 16 rows, weights
# stored [in, out]) XLA's int8 GEMMs took: the merged gate | up (5120 x 34816) 94.6 us against ~83
# in bf16, the draft head (5120 x 248320, 15 rows) 402 us against ~560, down 41 against 43,
# q | k | v 16 against 21, o 14.6 against 13. A/B with `--override 'ddtree_jax.models.int8.KEEP_FLOAT=("gate_up_proj",)'`.
# Session 14 (scripts/gpu_int8_matmul.py, gpu_weight_layout.py --int8; H200, 16 rows): stored
# [out, in] (LAYOUT "out_in", each output's inputs contiguous) XLA's int8 GEMM took gate | up 70.5
# us of kernel time against 95.9 stored [in, out] and ~81 in bf16, so with that layout nothing
# needs to stay float.
KEEP_FLOAT: tuple[str, ...] = ()

# How quantize_linears and the int8 draft head store the int8 weights: "out_in" ([out, in], what
# XLA's int8 GEMM streams fastest at 16 rows: the draft head 368 against 406 us of kernel time, MLP
# down 39 against 44, gate | up above; q | k | v 15.3 against 14.6) or "in_out" ([in, out], like the
# float Linears). Read when the weights are quantized; each Linear and proposer records its own.
LAYOUT = "out_in"
LAYOUTS = ("in_out", "out_in")


def stored(q: jax.Array, layout: str | None = None) -> jax.Array:
    """q [in, out] in the storage `layout` (default LAYOUT): as is, or transposed (materialized)."""
    layout = layout or LAYOUT
    if layout not in LAYOUTS:
        raise ValueError(f"int8 layout must be one of {LAYOUTS}, got {layout!r}")
    return q if layout == "in_out" else jnp.asarray(q.T)


@jax.jit
def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [in, out] -> (q int8 [in, out], scale float32 [out]) with w ~= q * scale per column.

    A column of zeros gets scale 1 (and q 0), so the product never divides by zero."""
    w32 = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w32), axis=0)
    scale = jnp.where(absmax > 0, absmax / QMAX, 1.0)
    q = jnp.clip(jnp.round(w32 / scale), -QMAX, QMAX).astype(jnp.int8)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """q * scale in dtype (tests, and what a reader of a quantized checkpoint would compare)."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


# Opt-in: with kernels on (impl "pallas" / "pallas_interpret"), weight-only products (those ACT_INT8
# leaves) of 1..KERNEL_MAX_ROWS rows go through the skinny matmul kernel (pallas_kernels/skinny_matmul.py: int8 tiles widened in
# registers, streamed once) instead of XLA's int8 GEMM. Same values up to accumulation order. It
# lost on the H200 (session 14, scripts/gpu_int8_matmul.py, 16 rows, wall us in an on-device loop):
# its best tiling (64 columns, 128-deep K tiles, weight stored [out, in]) took gate | up 81.2 against
# XLA's 72.9 on the same layout, down 44.6 / 40.7, the draft head 466 / 404, fc 64.8 / 53.7; it won
# only the drafter's small context K / V (6.9 / 9.3). In the model (bench_e2e, stored [in, out], its
# default tiling) the draft phase went from 1.36 to 2.07 ms. True: `--override ddtree_jax.models.int8.KERNEL=True`.
KERNEL = False
KERNEL_MAX_ROWS = 128  # a batch-8 DFlash block (8 x 16); more rows are no longer weight-bound


# W8A8: products whose weight has at least ACT_INT8_MIN_OUT output columns also quantize their
# activations, per row (absmax / 127, on the fly), and multiply int8 by int8 into int32 (cuBLAS's
# IMMA kernels on Hopper: no widening of the weight in the GEMM's loop), the row and column scales
# applied to the int32 sums in float32. The weights are the same as weight-only's; only the product
# differs, so this is a route like KERNEL, read when a product is traced. H200, session 15
# (scripts/gpu_int8_matmul.py --xla-only, wall us in an on-device loop, 16 rows; weight-only stored
# [out, in] -> W8A8): gate | up 74.9 -> 50.8, down 41.2 -> 29.3, q | k | v 15.7 -> 11.5, o 11.1 ->
# 7.9, fc 54.2 -> 45.5, the draft head (15 rows) 397 -> 377; at 128 rows (batch 8) gate | up 139 ->
# 84 (bf16: 104). The 1024-column context K / V lost (9.3 -> 22.8): hence the threshold. What the
# activations' rounding costs in acceptance: docs/benchmarks.md (the demo pair, every product W8A8).
# Off: `--override ddtree_jax.models.int8.ACT_INT8=False` (weight-only, as before session 15).
ACT_INT8 = True
ACT_INT8_MIN_OUT = 2048


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] -> (int8 [..., K], float32 scale [..., 1]) per row: absmax / 127, round to
    nearest; a row of zeros gets scale 1."""
    x32 = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / QMAX, 1.0)
    return jnp.clip(jnp.round(x32 / scale), -QMAX, QMAX).astype(jnp.int8), scale


def w8a8_product(x: jax.Array, q: jax.Array, scale: jax.Array, out_dtype=None, layout: str = "in_out") -> jax.Array:
    """(quantized x @ q) * row scale * column scale in out_dtype (default x's): the int8 products
    are summed exactly in int32 (|sum| <= K * 127^2 < 2^31 for K < 133,000), then scaled in float32."""
    if x.shape[-1] * QMAX * QMAX >= 2**31:
        raise ValueError(f"W8A8 over {x.shape[-1]} inputs could overflow its int32 sums")
    xq, xs = quantize_rows(x)
    w_in = 0 if layout == "in_out" else 1
    y = jax.lax.dot_general(xq, q, (((x.ndim - 1,), (w_in,)), ((), ())), preferred_element_type=jnp.int32)
    return (y.astype(jnp.float32) * xs * scale).astype(out_dtype or x.dtype)


def takes_w8a8(q: jax.Array, layout: str = "in_out") -> bool:
    """Whether a product with the int8 weight q (stored as `layout` says) quantizes its activations."""
    return ACT_INT8 and q.shape[1 if layout == "in_out" else 0] >= ACT_INT8_MIN_OUT


def product(x: jax.Array, q: jax.Array, scale: jax.Array, impl: str = "xla", out_dtype=None,
            layout: str = "in_out") -> jax.Array:
    """(x @ q) * scale in out_dtype (default x's). Weights wide enough for ACT_INT8 take the W8A8
    product (w8a8_product). Otherwise weight-only: int8 -> x.dtype is exact (|q| <= 127), the
    product accumulates in float32 and the column scale applies to the float32 sum before the one
    rounding; XLA (impl "xla", or rows past KERNEL_MAX_ROWS) fuses the convert of q into its GEMM,
    so the weight is read as int8 there too, and with KERNEL on the skinny matmul kernel takes it.
    layout: how q is stored (q [in, out] or [out, in])."""
    from pallas_kernels.skinny_matmul import reference, skinny_matmul

    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    kernel_asked = impl != "xla" and KERNEL and 1 <= rows <= KERNEL_MAX_ROWS
    if takes_w8a8(q, layout):
        if kernel_asked:
            warnings.warn("models.int8.KERNEL is on but this product is W8A8 (ACT_INT8): XLA's int8 x int8 GEMM "
                          "runs it, not the weight-only kernel; ACT_INT8=False sends it to the kernel", stacklevel=2)
        return w8a8_product(x, q, scale, out_dtype, layout)
    if kernel_asked:
        return skinny_matmul(x, q, scale, impl=impl, out_dtype=out_dtype, w_layout=layout)
    return reference(x, q, scale, out_dtype, layout)


def scheme() -> dict:
    """The route constants an int8 drafter's products run under, for reports (ddtree-bench,
    bench_e2e.py, profile_step.py): read when the products are traced, so a report of an int8 run
    says which int8 it measured."""
    return {"layout": LAYOUT, "keep_float": list(KEEP_FLOAT), "act_int8": ACT_INT8,
            "act_int8_min_out": ACT_INT8_MIN_OUT, "kernel": KERNEL}


def quantize_linears(module) -> int:
    """Quantize every models.layers.Linear inside `module` in place (kernel -> int8 stored as
    LAYOUT says, scale set), but those named in KEEP_FLOAT; returns how many. Biases and norms stay
    as they are."""
    from flax import nnx

    from ddtree_jax.models.layers import Linear

    linears = [node for path, node in nnx.iter_graph(module)
               if isinstance(node, Linear) and node.scale is None and not (path and path[-1] in KEEP_FLOAT)]
    for node in linears:  # collected first: the loop rewrites the graph it walked
        q, scale = quantize(node.kernel[...])
        node.kernel = nnx.Param(stored(q))
        node.int8_layout = LAYOUT
        node.scale = nnx.data(nnx.Param(scale))  # was a static None
    return len(linears)
