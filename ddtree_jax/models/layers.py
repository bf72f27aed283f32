"""Small building blocks shared by the target and the drafter: linear, norms, RoPE, SwiGLU.

Parameters use the layouts the converters write: linear kernels [in, out], embeddings
[vocab, hidden]. Norms and RoPE compute in float32 and cast back, as the HF models do.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.models import int8
from pallas_kernels._common import summed_partials
from pallas_kernels.skinny_matmul import skinny_matmul


def _init(rngs: nnx.Rngs, shape, dtype, scale: float):
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype)


# The skinny matmul route (pallas_kernels/skinny_matmul.py), opt-in: products of SKINNY_MIN_ROWS..
# SKINNY_MAX_ROWS rows (a DDTree verify's 65 nodes) with 16-bit weights of the shapes where the kernel
# beat XLA's cuBLAS GEMM in isolation on the H200 (kernel time, scripts/gpu_skinny_matmul.py --trace,
# session 7): 4096..11264 outputs from <= 8192 inputs (27B GDN in_proj qkv 34.4 vs 37.0 us, z 23.2
# vs 26.7, out_proj 25.0 vs 27.2). Inside the 27B verify cuBLAS ran those products faster than in
# isolation (out_proj 21.8 us against the kernel's 26.2; qkv 30.9 vs ~32, z 22.4 vs 21.1) and the
# DDTree step did not move (22.41 vs 22.39 ms), so the route is off: True sends those products
# through the kernel (`--override ddtree_jax.models.layers.SKINNY_MATMUL=True`).
SKINNY_MATMUL = False
SKINNY_MIN_ROWS, SKINNY_MAX_ROWS = 17, 128
SKINNY_MAX_IN, SKINNY_OUT = 8192, (4096, 11264)


def skinny_route_takes(x: jax.Array, kernel: jax.Array) -> bool:
    """Whether x @ kernel is a product the skinny matmul route is measured to win."""
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    k, n = kernel.shape
    return (x.dtype == kernel.dtype and jnp.dtype(x.dtype).itemsize == 2
            and SKINNY_MIN_ROWS <= rows <= SKINNY_MAX_ROWS and k <= SKINNY_MAX_IN
            and SKINNY_OUT[0] <= n <= SKINNY_OUT[1])


# The Mosaic GPU skinny matmul route (pallas_kernels/wgmma_skinny.py: TMA weight streaming, wgmma
# with the tokens on its N side, stream-K / split-K over all SMs), opt-in: the products that beat
# XLA's dot in isolation on the H200 (2026-11-30, scripts/gpu_wgmma_skinny.py, docs/kernels_dense.md;
# 65 rows, same harness for both): the 27B's MLP down (17408 x 5120) 58.3 vs 60.3 us and the out / o
# projections (6144 x 5120) 25.5 vs 29.0 us; it lost the wide products (gate | up 114 vs 95 us).
# In the 27B model (same session, batch 1, bench_e2e): DDTree-64 18.60 ms with it against 18.80
# without (the two GPUs of one machine), 18.90 against 19.07 (one GPU). Off: the kernel-time
# profile (2026-11-30 session 11, docs/benchmarks.md) has the verify at 16.93 ms of kernels with
# it against 16.69-16.80 without. Its 128 launches (36.4 us each, down + out) take 4.66 ms against
# XLA's 4.48 ms of GEMMs + 0.32 ms of split-K reduces, but the pad of x to 72 rows, the zeroed
# output and the transpose back add 0.72 ms (112 more launches).
# impl "pallas" on sm_90 GPUs only (elsewhere a warning, and XLA's dot).
WGMMA_SKINNY = False
WGMMA_ROWS = (17, 128)
WGMMA_SHAPES = {(17408, 5120): "stream_k", (6144, 5120): "split_k"}  # (K, N) -> schedule measured best


def wgmma_route_takes(x: jax.Array, kernel: jax.Array) -> bool:
    """Whether x @ kernel is a product the Mosaic GPU route is measured to win."""
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    return (x.dtype == kernel.dtype == jnp.bfloat16 and WGMMA_ROWS[0] <= rows <= WGMMA_ROWS[1]
            and tuple(kernel.shape) in WGMMA_SHAPES)


def _hopper() -> bool:
    """Whether the default device is an sm_90 GPU (the Mosaic GPU kernel's wgmma / TMA target)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def _wgmma_product(x: jax.Array, kernel: jax.Array) -> jax.Array:
    from pallas_kernels.wgmma_skinny import WgmmaSkinnyConfig, wgmma_skinny

    config = (WgmmaSkinnyConfig(tile_k=128, stages=3) if WGMMA_SHAPES[tuple(kernel.shape)] == "stream_k"
              else WgmmaSkinnyConfig(schedule="split_k"))
    y = wgmma_skinny(x.reshape(-1, x.shape[-1]), kernel, impl="mosaic", config=config)
    return y.reshape(*x.shape[:-1], kernel.shape[1])


# Split-K partial sums handed to the add + RMSNorm kernel, at a tree verify's row counts. On the
# H200 XLA runs the products that feed the residual stream (MLP down, attention o_proj, GDN
# out_proj) at 65 rows as split-K GEMMs: S float32 partial products, then a reduce fusion that adds
# them and rounds (2.3-3.9 us a launch, 128 a 27B verify: ~0.4 ms; docs/benchmarks.md sessions 12,
# 13). A Linear marked `split_k_out` (the DecoderLayer marks them where its norms run as
# add_rms_norm kernels) returns the S partial products instead (SplitKParts: one batched
# dot_general, the GEMM XLA ran for its own split) and the kernel adds them. Rows
# SPLIT_K_MIN_ROWS..SPLIT_K_MAX_ROWS only: at one row (decode) XLA rewrote the batched product as
# float32 weight transposes (session 12: 13.2 -> 18.3 ms a decode step). S as XLA's autotuner chose
# it for its own split at 65 rows (optimized HLO of the 27B DDTree loop, session 12).
# False: XLA's dot (and its own split and reduce); `--override ddtree_jax.models.layers.SPLIT_K_PARTS=False`.
SPLIT_K_PARTS = True
SPLIT_K_MIN_ROWS, SPLIT_K_MAX_ROWS = 32, 128


def split_k_count(rows: int, k: int) -> int:
    """Contraction slices for a `split_k_out` product of `rows` rows and contraction k (1: none)."""
    if not SPLIT_K_MIN_ROWS <= rows <= SPLIT_K_MAX_ROWS:
        return 1
    s = 8 if k >= 16384 else 4
    while s > 1 and k % s:
        s //= 2
    return s


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
    """y = x @ kernel (+ bias); kernel is [in, out]. impl != "xla" with SKINNY_MATMUL on sends the
    products of the skinny matmul's window through it (`skinny_route_takes`); impl "pallas" with
    WGMMA_SKINNY on those of the Mosaic GPU kernel's (`wgmma_route_takes`). After
    models.int8.quantize_linears the kernel is int8 with a float32 column scale, stored as
    `int8_layout` says (int8.product: weight-only, or W8A8 for wide outputs).
    `split_k_out` (set by the layer that owns it): with impl != "xla" and SPLIT_K_PARTS, products of
    a verify's row count return SplitKParts."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, dtype="float32", rngs: nnx.Rngs):
        self.kernel = nnx.Param(_init(rngs, (d_in, d_out), dtype, d_in**-0.5))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
        self.scale = None  # [out] float32 when the kernel is int8 (models/int8.py)
        self.int8_layout = "in_out"  # an int8 kernel's storage: [in, out] or [out, in] (int8.LAYOUT)
        self.split_k_out = False

    def _split_k(self, x: jax.Array, kernel: jax.Array, impl: str, slices: int | None) -> int:
        if not ((self.split_k_out or slices) and impl != "xla" and SPLIT_K_PARTS and self.bias is None
                and self.scale is None and x.dtype == kernel.dtype):
            return 1
        rows = 1
        for d in x.shape[:-1]:
            rows *= d
        s = split_k_count(rows, kernel.shape[0])
        return s if s == 1 or not slices else (slices if kernel.shape[0] % slices == 0 else 1)

    def __call__(self, x: jax.Array, impl: str = "xla", split_k: int | None = None) -> jax.Array | SplitKParts:
        """split_k: ask for SplitKParts over that many slices (a consumer that adds them itself),
        under the same conditions as `split_k_out` (rows in the window, SPLIT_K_PARTS, impl)."""
        kernel = self.kernel[...]
        if self.scale is not None:
            y = int8.product(x, kernel, self.scale[...], impl, layout=self.int8_layout)
            return y + self.bias[...].astype(y.dtype) if self.bias is not None else y
        s = self._split_k(x, kernel, impl, split_k)
        if s > 1 and not (impl == "pallas" and WGMMA_SKINNY and wgmma_route_takes(x, kernel)) and not (
                SKINNY_MATMUL and skinny_route_takes(x, kernel)):
            k, n = kernel.shape
            lead = x.ndim - 1
            parts = jax.lax.dot_general(  # [S, ..., N]: batch over the slices, x read in place
                x.reshape(*x.shape[:-1], s, k // s), kernel.reshape(s, k // s, n),
                (((lead + 1,), (1,)), ((lead,), (0,))), preferred_element_type=jnp.float32)
            return SplitKParts(parts)
        if impl == "pallas" and WGMMA_SKINNY and wgmma_route_takes(x, kernel) and not _hopper():
            warnings.warn("models.layers.WGMMA_SKINNY is on but the device is not an sm_90 GPU: XLA's dot "
                          "runs the skinny products", stacklevel=2)
        if impl == "pallas" and WGMMA_SKINNY and wgmma_route_takes(x, kernel) and _hopper():
            y = _wgmma_product(x, kernel)
        elif impl != "xla" and SKINNY_MATMUL and skinny_route_takes(x, kernel):
            y = skinny_matmul(x, kernel, impl=impl)
        else:
            y = jnp.einsum("...i,io->...o", x, kernel)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


UNMERGED_MIN_ROWS = 32  # projections of at least this many rows keep their own GEMM


def unmerged_inputs(x: jax.Array, *groups: tuple[Linear, ...], min_rows: int | None = None) -> tuple[jax.Array, ...]:
    """One copy of x per group of projections, that XLA cannot see as one shared operand.

    XLA's dot merger joins projections of the same input into one GEMM over the concatenated
    weights (a concatenate inside a Triton GEMM fusion, which rules out cuBLAS). At one row per
    sequence (decode) the merged GEMV is the faster form and x is returned as is; at a DDTree
    verify's 65 rows XLA's Triton GEMM read those weights at 2.0-3.0 TB/s where cuBLAS reads the
    separate ones at ~3.7 (H200, 27B shape, docs/benchmarks.md section 1). An optimization barrier
    of x together with each group's first kernel gives every group a distinct operand (no copy);
    projections inside one group may still merge. min_rows (default UNMERGED_MIN_ROWS): 0 where
    a merge would concatenate the weights as a copy every call (the drafter's context K / V of
    all layers: a 73 MB concatenation, 45 us a DDTree step on the H200, session 9)."""
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    if rows < (UNMERGED_MIN_ROWS if min_rows is None else min_rows) or len(groups) < 2:
        return (x,) * len(groups)
    return tuple(jax.lax.optimization_barrier((x, g[0].kernel[...]))[0] for g in groups)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


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


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, zero_centered: bool,
             weight_fp32: bool = False) -> jax.Array:
    """RMSNorm of x over the last axis with `RMSNorm`'s roundings (also the reference of kernels that
    fuse it, e.g. pallas_kernels/attn_prologue.py)."""
    normed = rms_normalize(x, eps)
    w = weight.astype(jnp.float32)
    if zero_centered:
        return (normed * (1.0 + w)).astype(x.dtype)
    if weight_fp32:
        return (w * normed).astype(x.dtype)
    # Plain Qwen3 / Llama order: cast to the input dtype first, then scale.
    return w.astype(x.dtype) * normed.astype(x.dtype)


def gated_rms_norm(o: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """w * rmsnorm(o) * silu(z) over the last axis, rounded as HF's Gated DeltaNet norm rounds."""
    normed = rms_normalize(o, eps).astype(o.dtype)
    return (weight * normed * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


class GatedRMSNorm(nnx.Module):
    """Gated DeltaNet output norm: w * rmsnorm(o) * silu(z), per head over the value dim."""

    def __init__(self, dim: int, eps: float, *, dtype="float32", rngs: nnx.Rngs):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, o: jax.Array, z: jax.Array) -> jax.Array:
        return gated_rms_norm(o, z, self.weight[...], self.eps)


# Layout switch (on): SwiGLU modules built while it is True hold one [hidden, 2 * inter] gate | up
# weight (`gate_up_proj`) and make one product where the separate layout makes two. On the H200
# (scripts/gpu_skinny_matmul.py --trace, session 7) XLA's product over the 27B's merged 5120 x 34816
# weight took 80.2 us at 1 row against 2 x 42.8 for the two 5120 x 17408 ones, and 87.6 us at 65
# rows against 2 x 51.9 (the 17408-wide products fill the GPU's 132 SMs unevenly). The four layout
# switches (this one, attention.MERGED_QKV, gdn.MERGED_QKV_Z, gdn.MERGED_BA; converters.layout.SWITCHES)
# measured together in the 27B model on the H200 (session 8, docs/benchmarks.md section 1): decode
# step 14.32 -> 13.47 ms, verify kernels 19.07 -> 17.32 ms, DDTree-64 step ~22.4 -> 19.96 ms.
# HF checkpoints and converted ones in either layout load into either (converters/layout.py joins
# / splits the weights); False builds HF's separate layout.
MERGED_GATE_UP = True


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)); gate and up as two weights, or as one [hidden, 2 * inter]
    weight (gate columns first) when built under MERGED_GATE_UP."""

    def __init__(self, hidden: int, inter: int, *, dtype="float32", rngs: nnx.Rngs, bias: bool = False):
        if MERGED_GATE_UP:
            self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias, dtype=dtype, rngs=rngs)
        else:
            self.gate_proj = Linear(hidden, inter, bias=bias, dtype=dtype, rngs=rngs)
            self.up_proj = Linear(hidden, inter, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, hidden, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, impl: str = "xla") -> jax.Array:
        merged = getattr(self, "gate_up_proj", None)
        if merged is not None:
            gate, up = jnp.split(merged(x, impl), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x, impl), self.up_proj(x, impl)
        return self.down_proj(jax.nn.silu(gate) * up, impl)


def relu2(x: jax.Array) -> jax.Array:
    """Squared ReLU (HF "relu2")."""
    r = jax.nn.relu(x)
    return r * r


class Relu2MLP(nnx.Module):
    """down(relu(up(x))^2): the NemotronH MLP (no gate)."""

    def __init__(self, hidden: int, inter: int, *, dtype="float32", rngs: nnx.Rngs, bias: bool = False):
        self.up_proj = Linear(hidden, inter, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, hidden, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, impl: str = "xla") -> jax.Array:
        return self.down_proj(relu2(self.up_proj(x, impl)), impl)


class Embedding(nnx.Module):
    """Token embedding [vocab, hidden]; `attend` reuses it as a tied LM head."""

    def __init__(self, vocab: int, hidden: int, *, dtype="float32", rngs: nnx.Rngs):
        self.embedding = nnx.Param(_init(rngs, (vocab, hidden), dtype, 1.0))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...h,vh->...v", x, self.embedding[...])


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [..., rotary_dim] for integer positions (non-interleaved halves)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first rotary_dim features of x [..., T, heads, hd]; cos/sin are [..., T, rot]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    c = cos[..., None, :].astype(x.dtype)
    s = sin[..., None, :].astype(x.dtype)
    out = x_rot * c + rotated * s
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out
