"""Skinny matmuls (1..128 rows, large weights) as a Pallas Mosaic GPU kernel for Hopper (sm_90):
TMA weight streaming, wgmma with the tokens on wgmma's N side, split-K / stream-K over all SMs.

    y = wgmma_skinny(x, w, impl="xla" | "mosaic", config=None)

x [M, K] @ w [K, N] -> y [M, N] in x's dtype (bf16 in, bf16 out) with float32 accumulation: what
`reference` (jnp.matmul) returns. impl="mosaic" runs only on an sm_90 GPU; on any machine it
lowers for CUDA (`jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",))`).

Why: a DDTree verify multiplies 65 rows (budget 64 + the root) by every weight of the 27B target.
Such a product is bound by reading the weight once, like a decode GEMV, but cuBLAS tiles 65 rows
as 72/128-row GEMM tiles and reads the weights at ~3.7 TB/s where GEMVs reach ~4.3 TB/s.

Design: the transposed problem y^T [N, M] = w^T [N, K] @ x^T [K, M], so the weight is wgmma's
M side (64 weight columns per warpgroup) and the few tokens its N side (M rounded up to Mp, a
multiple of 8: 65 -> 72; the caller's x is zero-padded, which XLA fuses into x's producer).
- A CTA has two consumer warpgroups (block_n = 128 or 256 weight columns, an f32 accumulator
  [block_n / 2, Mp] each) and one producer warpgroup that streams TMA tiles `stages` deep
  (plgpu.emit_pipeline_warp_specialized): per step a weight tile w[k0:k0+tile_k, n0:n0+block_n]
  (swizzled along N) and the x tile x[0:Mp, k0:k0+tile_k] (same swizzle, along K). wgmma reads
  both transposed from SMEM (bf16 wgmma takes MN-major operands): A = w_tile^T, B = x_tile^T.
- Work split ("schedule"): the iteration space is (n_tile, k_step), n_tile over N / block_n,
  k_step over K / tile_k. "stream_k": a persistent grid of `num_ctas` CTAs, each takes an equal
  contiguous range of that space (n-major order) and runs one pipeline (dynamic length) per
  n_tile its range touches, so every SM streams the same number of weight bytes. "split_k":
  fixed units (n_tile, K slice) of K / split_k rows each, handed out round-robin over the
  persistent grid by plgpu.nd_loop (static pipeline length; split_k=0 picks the slice count).
- N need not be a multiple of block_n (gdn_qkvzba: 16480): the last n_tile's weight loads run
  past N and TMA fills the missing columns with zeros; the output buffer has whole tiles of
  rows. Mosaic's TMA wants N a multiple of the swizzle tile width, so 16480 (32 * 515) takes a
  64-byte swizzle (32-column tiles) instead of 128.
- Epilogue per (CTA, n_tile) segment: each consumer warpgroup writes its f32 partial sum, 64
  rows [64, Mp] at a time, to SMEM and TMA reduce-adds it (copy_smem_to_gmem(reduction_op=
  "add")) into a float32 y^T [N, Mp] buffer that starts as zeros (a jax Ref handed to the
  kernel: updated in place). XLA then slices, transposes and casts it to y [M, N] bf16.

Measured by scripts/gpu_wgmma_skinny.py (H200, 2026-11-30, session 10; docs/kernels_dense.md):
correct at every 27B shape (relative error 0.3 %, bf16 rounding); at 65 rows, in the script's
harness, faster than XLA's dot on the MLP down product (58.3 vs 60.3 us, stream-K, tile_k 128) and
the out projections (25.5 vs 29.0 us, split-K), slower on the wide ones (gate | up 114 vs 95 us,
qkv | z | b | a 65 vs 52): 2.3-3.1 TB/s of weights, short of the decode GEMVs' ~4.2. In the model
behind the opt-in `models.layers.WGMMA_SKINNY` for the two shapes it won.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

IMPLS = ("xla", "mosaic")
SCHEDULES = ("stream_k", "split_k")
MAX_ROWS = 128  # the accumulator [64, Mp] f32 per warpgroup: Mp <= 128 keeps it in registers
BLOCK_NS = (128, 256)  # weight columns per CTA step: 2 consumer warpgroups x 64 or 128
SWIZZLES = (128, 64, 32)  # bytes (64 / 32 / 16 bf16 elements): both wgmma operands share one
NUM_SMS_H200 = 132
SMEM_BYTES = 227 * 1024  # Hopper's opt-in shared memory per block


@dataclasses.dataclass(frozen=True)
class WgmmaSkinnyConfig:
    """Tiling and work split of one skinny matmul kernel.

    tile_k: K rows of one pipeline step (multiple of 64: one 128-byte swizzle row of bf16).
    block_n: weight columns of one CTA step, half per consumer warpgroup (128 or 256). Every
      CTA step also loads the x tile (Mp rows) from L2: 256 halves that traffic per weight byte
      (72 / 256 instead of 72 / 128) at twice the accumulator registers (72 a thread at Mp 72).
    stages: TMA steps in flight per CTA (weight bytes in flight = stages * tile_k * 256).
    num_ctas: persistent CTAs (<= the SM count, 132 on an H200).
    schedule: "stream_k" (equal contiguous share of (n_tile, k_step) per CTA) or "split_k"
      (units (n_tile, K slice) handed out round-robin).
    split_k: K slices of the "split_k" schedule (0: chosen so the units fill the CTAs evenly).
    swizzle: SMEM swizzle in bytes of both operands (0: the largest that N allows). The weight's
      SMEM tiles are swizzle / 2 columns wide and TMA wants N a multiple of that, so
      N = 16480 (a multiple of 32, not 64) takes 64.
    """

    tile_k: int = 64
    block_n: int = 128
    stages: int = 6
    num_ctas: int = 128
    schedule: str = "stream_k"
    split_k: int = 0
    swizzle: int = 0

    def check(self) -> None:
        bad = []
        if self.tile_k < 64 or self.tile_k % 64:
            bad.append(f"tile_k = {self.tile_k} (a positive multiple of 64)")
        if self.block_n not in BLOCK_NS:
            bad.append(f"block_n = {self.block_n} (one of {BLOCK_NS})")
        if not 2 <= self.stages <= 16:
            bad.append(f"stages = {self.stages} (2..16)")
        if not 1 <= self.num_ctas <= NUM_SMS_H200:
            bad.append(f"num_ctas = {self.num_ctas} (1..{NUM_SMS_H200})")
        if self.schedule not in SCHEDULES:
            bad.append(f"schedule = {self.schedule!r} (one of {SCHEDULES})")
        if self.split_k < 0:
            bad.append(f"split_k = {self.split_k} (>= 0; 0 picks one)")
        if self.split_k and self.schedule != "split_k":
            bad.append(f"split_k = {self.split_k} needs schedule='split_k'")
        if self.swizzle not in (0, *SWIZZLES):
            bad.append(f"swizzle = {self.swizzle} (0 or one of {SWIZZLES})")
        if bad:
            raise ValueError("invalid wgmma skinny config: " + ", ".join(bad))


DEFAULT_CONFIG = WgmmaSkinnyConfig()


def padded_rows(m: int) -> int:
    """Rows of the wgmma N side: m rounded up to a multiple of 8 (65 -> 72)."""
    return -(-m // 8) * 8


def smem_bytes(m: int, config: WgmmaSkinnyConfig) -> int:
    """Shared memory of one CTA: the pipeline's weight and x tiles plus the f32 epilogue tiles."""
    mp = padded_rows(m)
    per_stage = config.tile_k * config.block_n * 2 + mp * config.tile_k * 2
    return config.stages * per_stage + 2 * 64 * mp * 4


def auto_split_k(n_tiles: int, k_steps: int, num_ctas: int, unit_overhead: int = 4) -> int:
    """K slices S (a divisor of k_steps) with the least modelled time: a CTA runs
    ceil(n_tiles * S / num_ctas) units of k_steps / S steps, each costing `unit_overhead` more
    steps (pipeline fill + epilogue). Ties go to fewer slices (fewer partial sums)."""
    best, best_cost = 1, None
    for s in range(1, k_steps + 1):
        if k_steps % s:
            continue
        cost = -(-n_tiles * s // num_ctas) * (k_steps // s + unit_overhead)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def swizzle_for(n: int, config: WgmmaSkinnyConfig) -> int:
    """The swizzle (bytes) of the kernel for N weight columns: the config's, or the largest whose
    tile width (swizzle / 2 bf16 columns) divides N; 0 when none does."""
    if config.swizzle:
        return config.swizzle if n % (config.swizzle // 2) == 0 else 0
    return next((sw for sw in SWIZZLES if n % (sw // 2) == 0), 0)


def reference(x, w):
    """x @ w with float32 accumulation, in x's dtype."""
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def check_inputs(x, w, config: WgmmaSkinnyConfig) -> None:
    """Name what the kernel cannot take (before any tracing of the kernel)."""
    config.check()
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"wgmma_skinny takes x [M, K] and w [K, N], got x {x.shape}, w {w.shape}")
    m, k = x.shape
    k2, n = w.shape
    if k != k2:
        raise ValueError(f"contraction mismatch: x {x.shape} @ w {w.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"dtype mismatch: x {x.dtype}, w {w.dtype} (both bfloat16)")
    if jnp.dtype(x.dtype) != jnp.bfloat16:
        raise ValueError(f"wgmma_skinny takes bfloat16 inputs, got {x.dtype}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"M = {m} rows: the kernel takes 1..{MAX_ROWS} (beyond that use XLA's dot)")
    if k % config.tile_k:
        raise ValueError(f"K = {k} is not a multiple of tile_k = {config.tile_k}")
    if not swizzle_for(n, config):
        need = config.swizzle // 2 if config.swizzle else min(SWIZZLES) // 2
        raise ValueError(f"N = {n} is not a multiple of {need} (the weight's swizzled SMEM tile "
                         f"width; a last partial tile of {config.block_n} columns is fine)")
    if smem_bytes(m, config) > SMEM_BYTES:
        raise ValueError(f"shared memory {smem_bytes(m, config)} B > {SMEM_BYTES} B for M = {m}: "
                         f"lower stages ({config.stages}) or tile_k ({config.tile_k})")


def wgmma_skinny(x, w, *, impl: str = "mosaic", config: WgmmaSkinnyConfig | None = None):
    """y = x @ w (bf16, float32 accumulation) for x with 1..128 rows; see the module docstring."""
    if impl not in IMPLS:
        raise ValueError(f"impl = {impl!r}: one of {IMPLS}")
    config = DEFAULT_CONFIG if config is None else config
    check_inputs(x, w, config)
    if impl == "xla":
        return reference(x, w)
    m = x.shape[0]
    mp = padded_rows(m)
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    yt = _mosaic_yt(xp, w, config)  # [N, Mp] float32
    return yt[:, :m].T.astype(x.dtype)


def _mosaic_yt(xp, w, config: WgmmaSkinnyConfig):
    """y^T [N, Mp] float32 = w^T @ xp^T via the Mosaic GPU kernel (reduce-added into zeros)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    mp, k = xp.shape
    n = w.shape[1]
    tk, stages = config.tile_k, config.stages
    bn = config.block_n
    wn = bn // 2  # weight columns (wgmma M) per consumer warpgroup
    n_tiles, k_steps = -(-n // bn), k // tk  # a partial last n_tile: TMA zero-fills, out padded
    num_ctas = config.num_ctas
    split = 0
    if config.schedule == "split_k":
        split = config.split_k or auto_split_k(n_tiles, k_steps, num_ctas)
        if k_steps % split:
            raise ValueError(f"split_k = {split} does not divide K / tile_k = {k_steps}")
        num_ctas = min(num_ctas, n_tiles * split)
    else:
        num_ctas = min(num_ctas, n_tiles * k_steps)
    swizzle = swizzle_for(n, config)
    transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

    def body(x_gmem, w_gmem, out_gmem):
        def make_pipeline(steps, k_base, n_idx, mma_body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                mma_body,
                grid=(steps,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((tk, bn), lambda s: (k_base + s, n_idx),
                                    transforms=transforms, memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((mp, tk), lambda s: (0, k_base + s),
                                    transforms=transforms, memory_space=plgpu.SMEM),
                ],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=stages,
                compute_context=compute_context,
            )

        # Static steps for split-K (the pipeline shrinks its slots to the steps), dynamic for
        # stream-K: the allocation pipeline must see the same kind of grid.
        alloc_steps = k_steps // split if split else jnp.int32(k_steps)
        ignore = lambda *_, **__: None
        allocs = make_pipeline(alloc_steps, 0, 0, ignore, ignore).get_allocations(w_gmem, x_gmem)

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=allocs,
            out_smem=plgpu.SMEM((2, 64, mp), jnp.float32),
            collective_axes="wg",
        )
        def _scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")

            def segment(n_idx, k_base, steps):
                """Stream w[k_base*tk : (k_base+steps)*tk, n_idx*bn : +bn] and reduce-add the
                partial y^T rows into out."""

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wn, mp), jnp.float32))
                    def _acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...]
                        for i in range(wn // 64):  # 64 rows at a time through one SMEM tile
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # its last copy read
                            out_smem[wg] = acc[i * 64:(i + 1) * 64]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                out_smem.at[wg],
                                out_gmem.at[pl.ds(n_idx * bn + wg * wn + i * 64, 64), :],
                                reduction_op="add",
                            )

                def mma_body(_, w_smem, x_smem, acc_ref):
                    a = plgpu.transpose_ref(w_smem.at[:, pl.ds(wg * wn, wn)], (1, 0))  # [wn, tk]
                    b = plgpu.transpose_ref(x_smem, (1, 0))  # [tk, Mp]
                    plgpu.wgmma(acc_ref, a, b)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                make_pipeline(steps, k_base, n_idx, mma_body, compute_context)(
                    w_gmem, x_gmem, allocations=pipeline_allocs)

            if split:
                k_len = k_steps // split

                @plgpu.nd_loop((n_tiles * split,), collective_axes="sm")
                def _units(info):
                    (u,) = info.index
                    segment(u // split, (u % split) * k_len, k_len)
            else:
                cta = lax.axis_index("sm")
                total = n_tiles * k_steps
                begin = cta * total // num_ctas
                end = (cta + 1) * total // num_ctas

                @pl.loop(begin // k_steps, (end - 1) // k_steps + 1)
                def _tiles(n_idx):
                    lo = jnp.maximum(begin, n_idx * k_steps) - n_idx * k_steps
                    hi = jnp.minimum(end, (n_idx + 1) * k_steps) - n_idx * k_steps
                    segment(n_idx, lo, hi - lo)

        plgpu.wait_smem_to_gmem(0)  # every reduce-add landed before the CTA exits

    mesh = plgpu.Mesh(grid=(num_ctas,), grid_names=("sm",), num_threads=3, thread_name="wg")
    kernel = pl.kernel(
        body,
        out_type=(),
        mesh=mesh,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        name="wgmma_skinny",
    )
    out = jax.new_ref(jnp.zeros((n_tiles * bn, mp), jnp.float32))
    kernel(xp, w, out)
    return jax.freeze(out)[:n]
