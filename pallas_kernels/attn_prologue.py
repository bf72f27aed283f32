"""The inputs of an attention layer from its merged q | k | v product, in one kernel (Pallas /
Triton kernel + its pure-jnp reference).

    q, k, v = attn_prologue(proj, q_weight, k_weight, cos, sin, num_heads=, num_kv_heads=, head_dim=,
                            gated=, eps=, zero_centered=, impl="xla" | "pallas" | "pallas_interpret")
    q, k, v, k_cache, v_cache = attn_prologue(..., cache=(k_cache, v_cache), start=start)

Between the q | k | v projection and the attention kernel a Qwen3 / Qwen3.5 layer slices the
product into heads, RMS-normalizes q and k per head (`ref.norms.rms_norm`) and rotates their
first `rotary_dim` features (`apply_rope`, non-interleaved halves). XLA runs that as ~6 launches a
layer (two slices, two norms, two rope concatenations). Here it is one launch
(docs/decisions/0024-attention-prologue-kernel.md).

    proj [B, T, W]: per q head h the columns [h * hd, (h + 1) * hd) (gated: [2 h hd, 2 h hd + hd),
    the gate half after each head is left to the output), then kv heads of k, then of v.
    q = rope(rmsnorm(q_h) * w_q), k = rope(rmsnorm(k_j) * w_k), v = v_j        (float32 math)

Norm rounding follows `RMSNorm`: zero-centered weights scale in float32 (normed * (1 + w)), then
round; plain weights round the normed row to the model dtype first and multiply in it. RoPE takes
cos / sin rounded to the model dtype (as `apply_rope`) and rounds once after its float32 sum.

Kernel: one program per (batch row, head, block of up to 16 rows); heads are q heads, then k
heads, then v heads, each one hd-wide block of columns of the product (read in place: no slice
copies). 65 rows are 5 blocks of 16, the last masked: 160 programs for the 27B layer at batch 1
(one program per head, looping over its row blocks, was too few: docs/kernels_attention.md).
Larger blocks spill at hd 256. The rotation's partner features are a second, gathered load of the same row
(column c + rot/2 or c - rot/2). Given the layer's K / V cache and write offsets, the k and v
programs also write their rows into it in place (the cache aliased to an output): a decode step's
K / V write is then no launch of its own (XLA made it two a cache: the rows' cast and transpose,
and the update slice).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_impl, compiler_params, is_pow2, load, store
from pallas_kernels.ref.norms import rms_norm
from pallas_kernels.ref.rope import apply_rope


def reference(proj, q_weight, k_weight, cos, sin, *, num_heads: int, num_kv_heads: int, head_dim: int, gated: bool,
              eps: float, zero_centered: bool, cache=None, start=None):
    """(q [B, T, nh, hd], k, v [B, T, kv, hd]) in proj's dtype; cos / sin [B, T, rot] float32. With
    cache = (k_cache, v_cache) [B, kv, capacity, hd] and start [B]: also the caches with k / v
    written at rows start[b] .. start[b] + T - 1 (lax.dynamic_update_slice, which clamps the offset)."""
    b, t, _ = proj.shape
    nh, kv, hd = num_heads, num_kv_heads, head_dim
    nq = nh * hd * (2 if gated else 1)
    q = proj[..., :nq].reshape(b, t, nh, -1)[..., :hd]
    k = proj[..., nq : nq + kv * hd].reshape(b, t, kv, hd)
    v = proj[..., nq + kv * hd : nq + 2 * kv * hd].reshape(b, t, kv, hd)
    norm = lambda a, w: rms_norm(a, w, eps, zero_centered=zero_centered)
    q, k = apply_rope(norm(q, q_weight), cos, sin), apply_rope(norm(k, k_weight), cos, sin)
    if cache is None:
        return q, k, v
    return q, k, v, *written_cache(cache, k, v, start)


def written_cache(cache, k, v, start):
    """(k_cache, v_cache) [B, kv, capacity, hd] with k / v [B, T, kv, hd] written at rows start[b] ..
    (per sequence lax.dynamic_update_slice: an offset past capacity - T is clamped to it)."""

    def put(buf, new, s):
        return lax.dynamic_update_slice(buf, new.transpose(1, 0, 2).astype(buf.dtype), (0, s, 0))

    start = start.astype(jnp.int32)
    return jax.vmap(put)(cache[0], k, start), jax.vmap(put)(cache[1], v, start)


def kernel_problems(head_dim: int, rotary_dim: int) -> list[str]:
    """Why the kernel cannot take this layer (empty: it can)."""
    out = [] if is_pow2(head_dim) and head_dim >= 16 else [f"head_dim {head_dim} is not a power of two >= 16"]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        out.append(f"rotary_dim {rotary_dim} is not an even count within head_dim {head_dim}")
    return out


ROW_BLOCK = 16  # rows per program: six float32 [16, 256] values stay in registers (64-row blocks spilled)


def row_block(t: int) -> int:
    """Rows per program for T rows: a power of two, at most ROW_BLOCK (T = 1: one row)."""
    return min(ROW_BLOCK, 1 << max(0, (t - 1).bit_length()))


def _prologue_kernel(x_ref, wq_ref, wk_ref, cos_ref, sin_ref, *refs, num_heads: int, kv: int, rot: int, eps: float,
                     zero_centered: bool, t: int, rb: int, writes_cache: bool):
    """refs: q_ref, k_ref, v_ref; with writes_cache start_ref [B] and the caches first (inputs,
    aliased to the last two outputs: kc_ref, vc_ref [B, kv, capacity, hd])."""
    if writes_cache:
        start_ref, _, _, q_ref, k_ref, v_ref, kc_ref, vc_ref = refs
    else:
        q_ref, k_ref, v_ref = refs
    batch, head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hd = x_ref.shape[-1]
    f32 = jnp.float32
    dtype = q_ref.dtype
    half = rot // 2
    c = jnp.arange(hd, dtype=jnp.int32)
    partner = jnp.where(c < half, c + half, jnp.where(c < rot, c - half, c))
    sign = jnp.where(c < half, -1.0, 1.0).astype(f32)
    in_rot = c < rot
    tab = jnp.minimum(c, rot - 1)
    r = (block * rb + jnp.arange(rb, dtype=jnp.int32))[:, None]  # this program's rows
    ok = jnp.broadcast_to(r < t, (rb, hd))
    x_raw = load(x_ref, (r, c[None, :]), mask=ok, other=0)

    def roped(w_ref):
        """rope(norm(x)) [rb, hd] of the program's rows, with the partner features gathered."""
        x = x_raw.astype(f32)
        xp = load(x_ref, (r, partner[None, :]), mask=ok, other=0).astype(f32)
        inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
        w, wp = w_ref[...].astype(f32), load(w_ref, (partner,)).astype(f32)
        if zero_centered:
            y = (x * inv * (1.0 + w)[None, :]).astype(dtype).astype(f32)
            yp = (xp * inv * (1.0 + wp)[None, :]).astype(dtype).astype(f32)
        else:
            y = (w.astype(dtype)[None, :] * (x * inv).astype(dtype)).astype(f32)
            yp = (wp.astype(dtype)[None, :] * (xp * inv).astype(dtype)).astype(f32)
        cs = load(cos_ref, (r, tab[None, :]), mask=ok, other=0).astype(dtype).astype(f32)
        sn = load(sin_ref, (r, tab[None, :]), mask=ok, other=0).astype(dtype).astype(f32)
        return jnp.where(in_rot[None, :], y * cs + sign[None, :] * yp * sn, y).astype(dtype)

    def to_cache(c_ref, j, val):
        """The rows into cache c_ref at (batch, kv head j, write offset + row): the offset as
        lax.dynamic_update_slice clamps it (write_kv's form). Rows past T keep out-of-bounds
        positions, masked off (a clamped index would make the interpreter's scatter write a real
        row twice: _common.load_rows)."""
        cap = c_ref.shape[2]
        pos = jnp.clip(start_ref[batch], 0, cap - t) + r
        shape = (rb, hd)
        at = (jnp.full(shape, batch, jnp.int32), jnp.full(shape, j, jnp.int32), jnp.broadcast_to(pos, shape),
              jnp.broadcast_to(c[None, :], shape))
        store(c_ref, at, val.astype(c_ref.dtype), mask=ok)

    @pl.when(head < num_heads)
    def _():
        store(q_ref, (r, c[None, :]), roped(wq_ref), mask=ok)

    @pl.when((head >= num_heads) & (head < num_heads + kv))
    def _():
        k = roped(wk_ref)
        store(k_ref, (r, c[None, :]), k, mask=ok)
        if writes_cache:
            to_cache(kc_ref, head - num_heads, k)

    @pl.when(head >= num_heads + kv)
    def _():
        store(v_ref, (r, c[None, :]), x_raw, mask=ok)
        if writes_cache:
            to_cache(vc_ref, head - num_heads - kv, x_raw)


def attn_prologue(proj, q_weight, k_weight, cos, sin, *, num_heads: int, num_kv_heads: int, head_dim: int,
                  gated: bool, eps: float, zero_centered: bool, impl: str = "xla", num_warps: int = 4,
                  cache=None, start=None):
    """q [B, T, nh, hd] (normed, rotated), k [B, T, kv, hd] (likewise) and v [B, T, kv, hd] from the
    layer's q | k | v product proj [B, T, W] (module doc); cos / sin [B, T, rotary_dim] float32
    (`models.layers.rope_cos_sin`). impl "xla" | "pallas" | "pallas_interpret". With cache =
    (k_cache, v_cache) [B, kv, capacity, hd] and start [B] int: also the caches with k / v written at
    rows start[b] .. start[b] + T - 1 (`written_cache`'s form); the kernel's k / v programs write them
    in place (the caches aliased to its outputs), so no update-slice launches follow the kernel."""
    check_impl(impl)
    b, t, width = proj.shape
    nh, kv, hd = num_heads, num_kv_heads, head_dim
    nq = nh * hd * (2 if gated else 1)
    rot = cos.shape[-1]
    bad = [] if width >= nq + 2 * kv * hd else [f"proj has {width} columns, fewer than q | k | v's {nq + 2 * kv * hd}"]
    if cos.shape != (b, t, rot) or sin.shape != cos.shape:
        bad.append(f"cos / sin {cos.shape} / {sin.shape} are not [{b}, {t}, rotary_dim]")
    if q_weight.shape != (hd,) or k_weight.shape != (hd,):
        bad.append(f"q / k norm weights {q_weight.shape} / {k_weight.shape} are not [{hd}]")
    if cache is not None:
        want = (b, kv, None, hd)
        for name, c in zip(("k", "v"), cache):
            if c.ndim != 4 or any(w is not None and w != n for w, n in zip(want, c.shape)) or c.shape[2] < t:
                bad.append(f"{name} cache {tuple(c.shape)} is not [{b}, {kv}, capacity >= {t}, {hd}]")
        if cache[0].shape != cache[1].shape or cache[0].dtype != cache[1].dtype:
            bad.append(f"k / v caches differ: {cache[0].shape} {cache[0].dtype} / {cache[1].shape} {cache[1].dtype}")
        if start is None or jnp.shape(start) != (b,):
            bad.append(f"start must be [{b}] with a cache, got {None if start is None else jnp.shape(start)}")
    if impl != "xla":
        bad += kernel_problems(hd, rot)
    if bad:
        raise ValueError("attn_prologue: " + "; ".join(bad))
    if impl == "xla":
        return reference(proj, q_weight, k_weight, cos, sin, num_heads=nh, num_kv_heads=kv, head_dim=hd,
                         gated=gated, eps=eps, zero_centered=zero_centered, cache=cache, start=start)
    q_stride = 2 if gated else 1

    def col_block(j, h):  # the hd-wide column block of head h (q heads, then k heads, then v heads)
        return jnp.where(h < nh, h * q_stride, nq // hd + (h - nh))

    in_specs = [pl.BlockSpec((None, t, hd), lambda i, h, r: (i, 0, col_block(i, h))),
                pl.BlockSpec((hd,), lambda i, h, r: (0,)), pl.BlockSpec((hd,), lambda i, h, r: (0,)),
                pl.BlockSpec((None, t, rot), lambda i, h, r: (i, 0, 0)),
                pl.BlockSpec((None, t, rot), lambda i, h, r: (i, 0, 0))]
    clamp = lambda h, lo, n: jnp.clip(h - lo, 0, n - 1)
    out_specs = [pl.BlockSpec((None, t, None, hd), lambda i, h, r: (i, 0, clamp(h, 0, nh), 0)),
                 pl.BlockSpec((None, t, None, hd), lambda i, h, r: (i, 0, clamp(h, nh, kv), 0)),
                 pl.BlockSpec((None, t, None, hd), lambda i, h, r: (i, 0, clamp(h, nh + kv, kv), 0))]
    rb = row_block(t)
    out_shape = [jax.ShapeDtypeStruct((b, t, nh, hd), proj.dtype), jax.ShapeDtypeStruct((b, t, kv, hd), proj.dtype),
                 jax.ShapeDtypeStruct((b, t, kv, hd), proj.dtype)]
    operands = [proj, q_weight, k_weight, cos.astype(jnp.float32), sin.astype(jnp.float32)]
    aliases = {}
    if cache is not None:  # start, then the caches, whole (each program writes its own rows)
        full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
        operands += [start.astype(jnp.int32), *cache]
        in_specs += [full(a) for a in operands[-3:]]
        out_specs += [full(c) for c in cache]
        out_shape += [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in cache]
        aliases = {len(operands) - 2: 3, len(operands) - 1: 4}
    interpret = impl == "pallas_interpret"
    params = {} if interpret else {"compiler_params": compiler_params(num_warps, 1)}
    out = pl.pallas_call(
        functools.partial(_prologue_kernel, num_heads=nh, kv=kv, rot=rot, eps=eps, zero_centered=zero_centered,
                          t=t, rb=rb, writes_cache=cache is not None),
        grid=(b, nh + 2 * kv, -(-t // rb)), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases, interpret=interpret, name="attn_prologue", **params,
    )(*operands)
    return tuple(out)
