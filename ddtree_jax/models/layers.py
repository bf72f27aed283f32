"""Small building blocks shared by the target and the drafter: linear, norms, SwiGLU, embedding.

Parameters use the layouts the converters write: linear kernels [in, out] (int8 kernels
[out, in]: models/int8.py), embeddings [vocab, hidden]. Norms compute in float32 and cast back,
as the HF models do (pallas_kernels/ref/norms.py).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.models import int8
from ddtree_jax.models.mixer import StatelessMixer
from ddtree_jax.routes import REFERENCE, Routes
from pallas_kernels import row_product
from pallas_kernels._common import summed_partials
from pallas_kernels.ref.norms import gated_rms_norm, rms_norm


def _init(rngs: nnx.Rngs, shape, dtype, scale: float):
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype)


def split_k_count(rows: int, k: int, routes: Routes) -> int:
    """Contraction slices of a `split_k_out` product of `rows` rows and contraction k (1: none):
    at a tree verify's row counts (routes.split_k_rows), the split XLA's autotuner chose for its own
    GEMM there (docs/decisions/0014-split-k-partials-add-rms-norm.md)."""
    lo, hi = routes.split_k_rows
    if not (routes.kernels and routes.split_k_parts and lo <= rows <= hi):
        return 1
    s = 8 if k >= 16384 else 4
    while s > 1 and k % s:
        s //= 2
    return s


def _padded_row_product(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel for x of one row ([..., K], every leading dim 1): the row and a zero row as a
    [2, K] operand, row 0 of the product kept. XLA GPU turns a dot whose lhs is a vector (a single
    row, once unit dims are dropped) and whose operands hold fewer than 10M elements into a multiply
    over the whole weight and a reduce, slower than its GEMM; two rows are no vector
    (routes.row_pad_weights; docs/decisions/0049-single-row-products.md)."""
    k, n = kernel.shape
    two = jnp.pad(x.reshape(1, k), ((0, 1), (0, 0)))
    return jnp.einsum("ri,io->ro", two, kernel)[0].reshape(*x.shape[:-1], n)


def _row_kernel_takes(kernel: jax.Array, dtype) -> bool:
    """Whether the row-product kernel takes this weight for a row of `dtype`; a weight in the
    route's window that it cannot take is announced when traced (and runs XLA's product)."""
    bad = row_product.problems(*kernel.shape, dtype)
    if jnp.dtype(dtype) != kernel.dtype:
        bad.append(f"the row is {jnp.dtype(dtype).name}, the weight {kernel.dtype.name} (the kernel takes one dtype)")
    if bad:
        warnings.warn(f"a one-row product of a {tuple(kernel.shape)} weight uses XLA, not the row-product kernel: "
                      + "; ".join(bad), stacklevel=3)
    return not bad


class SplitKParts(NamedTuple):
    """x @ kernel as float32 partial products over S slices of the contraction, parts [S, ..., N].
    pallas_kernels.add_rms_norm adds them (and rounds to the stream's dtype) in its own launch."""

    parts: jax.Array

    def total(self, dtype) -> jax.Array:
        """The product: the partials added in float32 and rounded to dtype once."""
        return summed_partials(self.parts, dtype)


def dense(y, dtype=None) -> jax.Array:
    """y as one array: SplitKParts summed and rounded to dtype; anything else as it is."""
    return y.total(dtype) if isinstance(y, SplitKParts) else y


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out]. After `quantize_linears` the kernel
    is int8 [out, in] with a float32 column scale, and `w8a8` says whether its products quantize
    the activations too (int8.product).

    `split_k_out` (set by the layer that owns it, where an add + RMSNorm kernel consumes the
    output): at a verify's row counts, with kernels on, the product returns SplitKParts.

    A product of one row (a decode step at batch 1) whose weight size is in routes.row_pad_weights
    (kernels on) is made over the row and a zero row, so that XLA keeps it a GEMM rather than
    strength-reducing the vector product to multiply + reduce (_padded_row_product); a weight of
    one column is a vector itself and is left alone. Split-K partials, where they apply, come
    first. With routes.row_product_weights holding the weight's size, a one-row product runs as the
    row-product kernel instead (pallas_kernels/row_product.py: the row read in place; a
    `split_k_out` product returns its float32 partials as SplitKParts)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, dtype="float32", rngs: nnx.Rngs):
        self.kernel = nnx.Param(_init(rngs, (d_in, d_out), dtype, d_in**-0.5))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
        self.scale = None  # [out] float32 when the kernel is int8 (models/int8.py)
        self.w8a8 = False  # an int8 kernel's products quantize the activations too
        self.split_k_out = False

    def __call__(self, x: jax.Array | row_product.NormedRow, routes: Routes = REFERENCE, *,
                 one_row_parts: bool = False) -> jax.Array | SplitKParts:
        """x @ kernel (+ bias). one_row_parts: the caller takes SplitKParts where the row-product
        kernel runs a one-row product (the MoE router: softmax_top_k sums them in its launch).
        x may be a row_product.NormedRow (a row still to be gated-normed): the row-product kernel
        norms it as it loads it where that kernel runs this product, else its XLA form first."""
        row = x  # what the row-product kernel reads: x, or the NormedRow it norms as it loads it
        if isinstance(x, row_product.NormedRow):
            bad = x.problems()
            if bad:
                warnings.warn("a row's gated norm runs in XLA, not in the row-product kernel: " + "; ".join(bad),
                              stacklevel=2)
            if bad or not self._row_kernel_runs(x.x, routes, one_row_parts):
                x = row = x.value()  # XLA's norm, then the product as for any row
            else:
                x = x.x  # the kernel below norms `row` as it loads it
        kernel = self.kernel[...]
        if self.scale is not None:
            y = int8.product(x, kernel, self.scale[...], w8a8=self.w8a8)
            return y + self.bias[...].astype(y.dtype) if self.bias is not None else y
        rows = 1
        for d in x.shape[:-1]:
            rows *= d
        s = split_k_count(rows, kernel.shape[0], routes) if (
            self.split_k_out and self.bias is None and x.dtype == kernel.dtype) else 1
        if s > 1:
            k, n = kernel.shape
            lead = x.ndim - 1
            parts = jax.lax.dot_general(  # [S, ..., N]: batch over the slices, x read in place
                x.reshape(*x.shape[:-1], s, k // s), kernel.reshape(s, k // s, n),
                (((lead + 1,), (1,)), ((lead,), (0,))), preferred_element_type=jnp.float32)
            return SplitKParts(parts)
        if self._row_kernel_runs(x, routes, one_row_parts):
            if (self.split_k_out or one_row_parts) and self.bias is None:
                return SplitKParts(row_product.row_product(row, kernel, partials=True, impl=routes.impl))
            y = row_product.row_product(row, kernel, impl=routes.impl)
        elif rows == 1 and kernel.shape[1] > 1 and routes.pads_row(kernel.size):
            y = _padded_row_product(x, kernel)
        else:
            y = jnp.einsum("...i,io->...o", x, kernel)
        if self.bias is not None:
            y = y + self.bias[...]
        return y

    def _row_kernel_runs(self, x: jax.Array, routes: Routes, one_row_parts: bool = False) -> bool:
        """Whether a product of x runs as the row-product kernel: one row, a float kernel of more
        than one column in routes.row_product_weights' window that the kernel takes, no split-K
        partials at this row count (they come first), and one of the forms the kernel was measured
        to win in (decision 0054): a narrow output (a router) or float32 partials for their
        consumer. A wide output wanted whole stays XLA's GEMM: the kernel's unsplit form has one
        program per 64 columns (a Nemotron-H 8B k / v projection, 4096 x 1024: 16 programs, 96 us a
        call on the H200; docs/decisions/0070-ssd-tree-masked-rows-and-a-mamba2-hybrid-shape.md)."""
        kernel = self.kernel[...]
        rows = 1
        for d in x.shape[:-1]:
            rows *= d
        if self.scale is not None or rows != 1 or kernel.shape[1] <= 1 or not routes.row_product_kernel(kernel.size):
            return False
        parts = (self.split_k_out or one_row_parts) and self.bias is None
        if kernel.shape[1] >= row_product.NARROW and not parts:
            return False
        if self.split_k_out and self.bias is None and x.dtype == kernel.dtype and split_k_count(
                rows, kernel.shape[0], routes) > 1:
            return False
        return _row_kernel_takes(kernel, x.dtype)


def quantize_linears(module, scheme: int8.Int8Scheme) -> int:
    """Quantize every Linear inside `module` in place (kernel -> int8 [out, in], scale set, W8A8
    where `scheme` takes it; models/int8.py); returns how many. Biases and norms stay as they are."""
    linears = [node for _, node in nnx.iter_graph(module) if isinstance(node, Linear) and node.scale is None]
    for node in linears:  # collected first: the loop rewrites the graph it walked
        q, scale = int8.quantize(node.kernel[...])
        node.kernel = nnx.Param(q)
        node.w8a8 = scheme.takes_w8a8(q.shape[0])
        node.scale = nnx.data(nnx.Param(scale))  # was a static None
    return len(linears)


def distinct_operands(x: jax.Array, *groups: tuple[Linear, ...]) -> tuple[jax.Array, ...]:
    """One handle on x per group of projections, that XLA cannot see as one shared operand.

    XLA's dot merger joins projections of the same input into one GEMM over the concatenated
    weights: a concatenation copied on every call where the weights are separate parameters (the
    drafter's context K / V of all layers; docs/decisions/0008-unmerged-verify-inputs.md). An optimization
    barrier of x together with each group's first kernel gives every group a distinct operand,
    without a copy."""
    if len(groups) < 2:
        return (x,) * len(groups)
    return tuple(jax.lax.optimization_barrier((x, g[0].kernel[...]))[0] for g in groups)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; `zero_centered` gives out = norm(x) * (1 + w) (Qwen3.5);
    `weight_fp32` scales in float32 before casting back (NemotronH)."""

    def __init__(
        self, dim: int, eps: float, *, zero_centered: bool, dtype="float32", rngs: nnx.Rngs, weight_fp32: bool = False
    ):
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight_fp32 = weight_fp32
        self.weight = nnx.Param(jnp.zeros((dim,), dtype) if zero_centered else jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, zero_centered=self.zero_centered, weight_fp32=self.weight_fp32)


class GatedRMSNorm(nnx.Module):
    """Gated DeltaNet output norm: w * rmsnorm(o) * silu(z), per head over the value dim."""

    def __init__(self, dim: int, eps: float, *, dtype="float32", rngs: nnx.Rngs):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, o: jax.Array, z: jax.Array) -> jax.Array:
        return gated_rms_norm(o, z, self.weight[...], self.eps)


class SwiGLU(StatelessMixer, nnx.Module):
    """down(silu(gate(x)) * up(x)), gate and up held as one [hidden, 2 * inter] weight (gate
    columns first): one product where HF's separate weights make two (docs/decisions/0005-merged-projection-layouts.md
    ; the converters join HF's weights)."""

    def __init__(self, hidden: int, inter: int, *, dtype="float32", rngs: nnx.Rngs, bias: bool = False):
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, hidden, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, routes: Routes = REFERENCE) -> jax.Array:
        gate, up = jnp.split(self.gate_up_proj(x, routes), 2, axis=-1)
        return self.down_proj(jax.nn.silu(gate) * up, routes)


def relu2(x: jax.Array) -> jax.Array:
    """Squared ReLU (HF "relu2")."""
    r = jax.nn.relu(x)
    return r * r


class Relu2MLP(StatelessMixer, nnx.Module):
    """down(relu(up(x))^2): the NemotronH MLP (no gate)."""

    def __init__(self, hidden: int, inter: int, *, dtype="float32", rngs: nnx.Rngs, bias: bool = False):
        self.up_proj = Linear(hidden, inter, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, hidden, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, routes: Routes = REFERENCE) -> jax.Array:
        return self.down_proj(relu2(self.up_proj(x, routes)), routes)


class Embedding(nnx.Module):
    """Token embedding [vocab, hidden]; `attend` reuses it as a tied LM head."""

    def __init__(self, vocab: int, hidden: int, *, dtype="float32", rngs: nnx.Rngs):
        self.embedding = nnx.Param(_init(rngs, (vocab, hidden), dtype, 1.0))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...h,vh->...v", x, self.embedding[...])
