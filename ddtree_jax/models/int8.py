"""int8 for the drafter: int8 kernels stored [out, in] with one float32 scale per output column,
and, for the wide products, int8 activations with one scale per row (W8A8).

Why: a DFlash step reads the drafter's weights and, for its draft head, the target's lm_head once
per step; those products have 15-16 rows a sequence, so they are bound by the bytes of their
weights, and int8 halves them. The [out, in] storage and the W8A8 threshold are what measured
fastest for XLA's int8 GEMMs (docs/decisions/0036-int8-drafter-w8a8.md).

Output is unchanged: the drafter only proposes; the target verifies every draft in its own dtype,
so greedy output stays identical to plain decoding and sampling keeps the target's distribution.
What int8 changes is the draft distributions, slightly (per-column absmax scaling, round to
nearest: each weight within half a step, |w| max / 254, of its value; W8A8 rounds each input row
the same way, to its |x| max / 254), and so, possibly, which drafts are proposed.

The target is never quantized: its products are the output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

QMAX = 127  # symmetric: -127..127, so negation is exact and the scale is |w| max / 127


@dataclasses.dataclass(frozen=True)
class Int8Scheme:
    """How an int8 drafter multiplies (part of its proposer, so of the jit key).

    w8a8: products whose weight has at least `w8a8_min_out` output columns quantize their input
    rows to int8 too and multiply int8 by int8 into int32; the others stay weight-only."""

    w8a8: bool = True
    w8a8_min_out: int = 2048

    def takes_w8a8(self, out_features: int) -> bool:
        return self.w8a8 and out_features >= self.w8a8_min_out

    def as_dict(self) -> dict:
        return {"layout": "out_in", **dataclasses.asdict(self)}


WEIGHT_ONLY = Int8Scheme(w8a8=False)
SCHEMES = {"w8a8": Int8Scheme(), "weight-only": WEIGHT_ONLY}  # the CLIs' --int8-drafter values


@jax.jit
def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [in, out] -> (q int8 [out, in], scale float32 [out]) with w ~= (q * scale[:, None]).T.

    A column of zeros gets scale 1 (and q 0), so the product never divides by zero."""
    w32 = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w32), axis=0)
    scale = jnp.where(absmax > 0, absmax / QMAX, 1.0)
    q = jnp.clip(jnp.round(w32 / scale), -QMAX, QMAX).astype(jnp.int8)
    return q.T, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The [in, out] weight q [out, in] stands for, in dtype (tests; readers of a quantized model)."""
    return (q.astype(jnp.float32) * scale[:, None]).T.astype(dtype)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] -> (int8 [..., K], float32 scale [..., 1]) per row: absmax / 127, round to
    nearest; a row of zeros gets scale 1."""
    x32 = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / QMAX, 1.0)
    return jnp.clip(jnp.round(x32 / scale), -QMAX, QMAX).astype(jnp.int8), scale


def w8a8_product(x: jax.Array, q: jax.Array, scale: jax.Array, out_dtype=None) -> jax.Array:
    """(quantized x @ q.T) * row scale * column scale in out_dtype (default x's): the int8 products
    are summed exactly in int32 (|sum| <= K * 127^2 < 2^31 for K < 133,000), then scaled in float32."""
    if x.shape[-1] * QMAX * QMAX >= 2**31:
        raise ValueError(f"W8A8 over {x.shape[-1]} inputs could overflow its int32 sums")
    xq, xs = quantize_rows(x)
    y = jax.lax.dot_general(xq, q, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return (y.astype(jnp.float32) * xs * scale).astype(out_dtype or x.dtype)


def weight_only_product(x: jax.Array, q: jax.Array, scale: jax.Array, out_dtype=None) -> jax.Array:
    """(x @ q.T) * scale: int8 -> x.dtype is exact (|q| <= 127); the product accumulates in float32
    and the column scale applies to the float32 sum before the one rounding. XLA fuses the convert
    of q into its GEMM, so the weight is read as int8."""
    y = jax.lax.dot_general(x, q.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return (y * scale).astype(out_dtype or x.dtype)


def product(x: jax.Array, q: jax.Array, scale: jax.Array, *, w8a8: bool, out_dtype=None) -> jax.Array:
    """x times the int8 weight q [out, in] with column scales: W8A8 or weight-only."""
    return (w8a8_product if w8a8 else weight_only_product)(x, q, scale, out_dtype)
