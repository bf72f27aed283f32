"""Tree verification and path commit for one Mamba2 (SSD) layer: Pallas / Triton kernels next
to their pure-jnp references (pallas_kernels/ref/ssd.py), chosen with `impl=`.

Per head h (scalar decay a = dt * A_h, group g = h // (H / G); nodes in topological order,
M = ancestor-or-self from the 32-bit ancestor words, committed state h0 [P, Ns]):
    Acs_i = sum_{j in M_i} a_j                                           (path sums)
    y_i   = exp(Acs_i) C_i . h0 + sum_{j in M_i} exp(Acs_i - Acs_j) (C_i . B_j) dt_j x_j + D_h x_i
    commit: h <- h exp(a_t) + dt_t x_t B_t^T along the accepted path (t < count)

Verify kernel: one program per (batch, head, head_dim tile). Rows are cut into blocks of C nodes;
block r builds its mask tiles M_rs (s <= r: ancestors precede their descendants) from the
ancestor words, its path sums, then
    y_r = exp(Acs_r) (C_r h0^T) + D x_r + sum_{s <= r} [(C_r B_s^T) * exp(mask(Acs_r - Acs_s)) * dt_s] x_s
with the mask applied BEFORE exp (non-ancestor exponents can be large and positive). The state
tile is read once per program; nothing per node is ever materialised beyond [C, C] tiles.
Commit kernel: one program per (batch, head, head_dim tile); the state tile stays on chip for
the whole path (read once, written once) while the path's rows (gathered by XLA: P <= 16-32 rows)
are applied with exactly the arithmetic of ssd.step, so a commit equals sequential decoding.

Root peel (as in gdn_tree.py): node 0 has no ancestors, so its output comes first from its own
refs, y_0 = exp(a_0) C_0 . h0 + (D + (C_0 . B_0) dt_0) x_0, and every other row i adds
exp(Acs_i - a_0) (C_i . B_0) dt_0 x_0 where bit 0 of its ancestor word is set (its path sum
includes a_0 there); nodes 1.. run through the blocks above with the words shifted by one bit.

impl="xla": the reference; "pallas": the Triton-lowered kernel (GPU); "pallas_interpret": the
same kernel run by the Pallas interpreter (CPU tests). Kernel constraints: head_dim and state
size powers of two (>= 16 for the verify kernel's matmuls); N is padded to a power of two (by
XLA, or with `masked_rows` by the kernel's masked loads of the N rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.ref import ssd
from pallas_kernels.tree_mask import WORD, bits_to_dense

try:  # Triton compiler params; present in jax 0.10 - 0.12
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None

from pallas_kernels._common import (  # noqa: E402
    SCALAR_LANES, check_impl, is_pow2, join_root, load_rows, pack_scalars, pow2_at_least, shift_bits, store_rows,
    unpack_scalars,
)

PRECISIONS = ("ieee", "tf32x3", "tf32", "bf16x3")




def _precision(name: str, interpret: bool):
    if interpret:  # the CPU interpreter: exact float32
        return lax.Precision.HIGHEST
    return {
        "ieee": lax.Precision.HIGHEST,
        "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
        "tf32": lax.Precision.DEFAULT,
        "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    }[name]


def _dot(a, b, precision, trans_b=False):
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _check(impl, precision=None):
    check_impl(impl)
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def _pad(a, axis, to, value=0):
    if a.shape[axis] == to:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, to - a.shape[axis])
    return jnp.pad(a, widths, constant_values=value)


# ------------------------------------------------------------------------------------------------
# references (the model's own math)
# ------------------------------------------------------------------------------------------------
def visibility(ancestor_bits, n: int):
    """[B, N, W] uint32 -> [B, N, N] bool ancestor-or-self (self forced, as the kernel does)."""
    return bits_to_dense(ancestor_bits, n) | jnp.eye(n, dtype=bool)


def ssd_tree_verify_reference(x, dt, A, B, C, D, state, ancestor_bits):
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    visible = visibility(ancestor_bits, x.shape[1])
    acs = ssd.path_sums(f32(dt), f32(A), visible)
    return ssd.block(f32(x), f32(dt), f32(A), f32(B), f32(C), f32(D), f32(state), visible, acs)


def _gather_path(x, dt, B, path, count):
    """Rows of the accepted path (x [B, P, H, Hd], dt [B, P, H] zero from count on, B [B, P, G, Ns])."""
    n, p = x.shape[1], path.shape[1]
    path = jnp.clip(path.astype(jnp.int32), 0, n - 1)
    on = jnp.arange(p)[None, :] < count[:, None]
    take = lambda a: jnp.take_along_axis(a, path.reshape(*path.shape, *([1] * (a.ndim - 2))), axis=1)
    return (take(x).astype(jnp.float32), jnp.where(on[..., None], take(dt).astype(jnp.float32), 0.0),
            take(B).astype(jnp.float32))


def ssd_path_commit_reference(x, dt, A, B, state, path, count):
    xp, dtp, bp = _gather_path(x, dt, B, path, count)
    return ssd.path_state(xp, dtp, jnp.asarray(A, jnp.float32), bp, jnp.asarray(state, jnp.float32))


# ------------------------------------------------------------------------------------------------
# tree verify kernel
# ------------------------------------------------------------------------------------------------
def _verify_kernel(*refs, n, c, prec, peel, n_valid=None):
    """n_valid (unpeeled only): the node refs hold that many rows, fewer than the n the blocks
    cover; rows past them load as zeros (what padding nodes hold) and are not stored."""
    if peel:
        (x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, s_ref, bits_ref, x0_ref, b0_ref, c0_ref, da0_ref, m0_ref,
         y_ref, y0_ref) = refs
    else:
        x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, s_ref, bits_ref, y_ref = refs
    nb = n // c
    f32 = jnp.float32
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye = row == col

    def mask(r, s):
        """M_rs [c, c]: column node s*c + j is an ancestor-or-self of row node r*c + i."""
        if c <= WORD:  # the block's columns sit in one word
            word = bits_ref[pl.ds(((s * c) // WORD) * n + r * c, c)]
            m = (jnp.right_shift(word[:, None], col + (s * c) % WORD) & 1) == 1
        else:  # c // 32 words side by side
            lane, which = col & (WORD - 1), jnp.right_shift(col, 5)
            bits = None
            for w in range(c // WORD):
                word = bits_ref[pl.ds((s * c // WORD + w) * n + r * c, c)]
                part = jnp.right_shift(word[:, None], lane) & 1
                bits = part if bits is None else jnp.where(which == w, part, bits)
            m = bits == 1
        return (m | eye) if s == r else m

    state = s_ref[...].astype(f32)  # [bp, Ns], read once
    dvec = d_ref[...].astype(f32)  # [bp] = D_h
    if peel:  # node 0 on its own (module docstring: "Root peel")
        dt0, a0 = unpack_scalars(da0_ref, 2)
        x0, b0, c0 = x0_ref[...].astype(f32), b0_ref[...].astype(f32), c0_ref[...].astype(f32)
        y0 = jnp.exp(a0) * jnp.sum(c0[None, :] * state, axis=1) + (dvec + jnp.sum(c0 * b0) * dt0) * x0
        y0_ref[...] = y0.astype(y0_ref.dtype)
    rows = lambda ref, r: load_rows(ref, r * c, c, n_valid)  # block r's rows of a node ref
    a_blk = [rows(a_ref, s) for s in range(nb)]
    dt_blk = [rows(dt_ref, s) for s in range(nb)]
    acs_blk = []
    for r in range(nb):
        masks = [mask(r, s) for s in range(r + 1)]
        acs = 0.0
        for s, m in enumerate(masks):
            acs = acs + jnp.sum(jnp.where(m, a_blk[s][None, :], 0.0), axis=1)
        c_r = rows(c_ref, r).astype(f32)
        if peel:
            under0 = m0_ref[pl.ds(r * c, c)] > 0  # row descends from node 0
            acs = acs + jnp.where(under0, a0, 0.0)
        y = jnp.exp(acs)[:, None] * _dot(c_r, state, prec, trans_b=True) + dvec[None, :] * rows(x_ref, r).astype(f32)
        if peel:  # node 0's term, masked before exp
            w0 = jnp.exp(jnp.where(under0, acs - a0, -jnp.inf)) * jnp.sum(c_r * b0[None, :], axis=1) * dt0
            y = y + w0[:, None] * x0[None, :]
        for s, m in enumerate(masks):
            acs_s = acs if s == r else acs_blk[s]
            decay = jnp.exp(jnp.where(m, acs[:, None] - acs_s[None, :], -jnp.inf))  # mask BEFORE exp
            cb = _dot(c_r, rows(b_ref, s).astype(f32), prec, trans_b=True)
            y = y + _dot(cb * decay * dt_blk[s][None, :], rows(x_ref, s).astype(f32), prec)
        store_rows(y_ref, r * c, y.astype(y_ref.dtype), n_valid)
        acs_blk.append(acs)


def verify_kernel_problems(head_dim: int, state_size: int, *, interpret: bool = False) -> list[str]:
    """Why the verify kernel cannot take a layer of these sizes (empty: it can): powers of two, at
    least 16 natively (tl.dot's smallest side)."""
    return [f"{name}={val} must be a power of two (>= 16 on GPU) for the Pallas SSD kernel"
            for name, val in (("head_dim", head_dim), ("state size", state_size))
            if not is_pow2(val) or (val < 16 and not interpret)]


def commit_kernel_problems(head_dim: int, state_size: int) -> list[str]:
    """Why the path-commit kernel cannot take a layer of these sizes (empty: it can)."""
    return [f"{name}={val} must be a power of two for the Pallas SSD commit"
            for name, val in (("head_dim", head_dim), ("state size", state_size)) if not is_pow2(val)]


def _verify_pallas(x, dt, A, B, C, D, state, ancestor_bits, *, interpret, block_n, block_p, num_warps, num_stages,
                   precision, out_dtype, peel_root, masked_rows):
    b, n, h, hd = x.shape
    g, ns = B.shape[2], B.shape[3]
    if h % g:
        raise ValueError(f"{h} heads do not divide into {g} groups")
    rep = h // g
    bad = verify_kernel_problems(hd, ns, interpret=interpret)
    if bad:
        raise ValueError("; ".join(bad))
    peel = bool(n > 1 and pow2_at_least(n - 1) < pow2_at_least(n)) if peel_root is None else bool(peel_root)
    if peel and n < 2:
        raise ValueError("peel_root needs at least 2 nodes")
    if peel:  # node 0 through its own refs; nodes 1.. form the blocked tree
        x0, b0, c0 = x[:, 0], B[:, 0], C[:, 0]
        dt0 = dt[:, 0].astype(jnp.float32)
        da0 = pack_scalars(dt0, dt0 * A.astype(jnp.float32)[None, :])  # dt and a = dt * A of node 0
        ancestor_bits, m0 = shift_bits(ancestor_bits)
        x, dt, B, C = x[:, 1:], dt[:, 1:], B[:, 1:], C[:, 1:]
        n = n - 1
    n_pad = pow2_at_least(n)
    if masked_rows is None:
        masked_rows = not peel and n < n_pad
    elif masked_rows and peel:
        raise ValueError("masked_rows is the unpeeled form: pass peel_root=False with it")
    masked_rows = bool(masked_rows) and n < n_pad
    rows = n if masked_rows else n_pad  # the node refs' rows
    # Defaults from ptxas (scripts/offline_triton_compile.py ssd, 128 heads x 64, state 128): 64-row
    # blocks x 32-wide tiles x 8 warps compile without spills at 64 nodes (32-row blocks x 64-wide
    # tiles spilled); 16 nodes keep 16 x 64 x 4-warp tiles (docs/decisions/0027-ssd-kernel-max-nodes.md).
    small = n_pad <= 16
    bn = min(n_pad, block_n or (16 if small else 64))
    bp = min(hd, block_p or (min(hd, 64) if small else min(hd, 32)))
    warps = num_warps or (4 if small else 8)
    if not is_pow2(bn) or bn < 16 or not is_pow2(bp) or hd % bp:
        raise ValueError(f"block_n={bn} must be a power of two >= 16 and block_p={bp} a power of two dividing {hd}")
    words = max(1, n_pad // WORD)
    f32 = jnp.float32
    dtf = _pad(dt.astype(f32), 1, rows)  # padding nodes: dt = 0
    a = dtf * A.astype(f32)[None, None, :]
    x = _pad(x, 1, rows)
    B, C = _pad(B, 1, rows), _pad(C, 1, rows)
    d = jnp.broadcast_to(D.astype(f32)[:, None], (h, hd))
    bits = lax.bitcast_convert_type(ancestor_bits.astype(jnp.uint32), jnp.int32)
    bits = _pad(_pad(bits[:, :, :words], 1, n_pad), 2, words)  # padding rows: the kernel forces self
    bits = jnp.swapaxes(bits, 1, 2).reshape(b, words * n_pad)  # word-major: [w * n_pad + row]
    if precision is None:  # 16-bit x / B / C are exact in TF32; the float32 operands' TF32 rounding
        precision = "tf32x3" if x.dtype == jnp.float32 else "tf32"  # stays below y's bf16 rounding
    prec = _precision(precision, interpret)
    params = {}
    if pltriton is not None and not interpret:
        params["compiler_params"] = pltriton.CompilerParams(num_warps=warps, num_stages=num_stages)
    node_tile = pl.BlockSpec((None, rows, None, bp), lambda i, j, t: (i, 0, j, t))
    per_node = pl.BlockSpec((None, rows, None), lambda i, j, t: (i, 0, j))
    grouped = pl.BlockSpec((None, rows, None, ns), lambda i, j, t: (i, 0, j // rep, 0))
    in_specs = [
        node_tile,
        per_node,
        per_node,
        grouped,
        grouped,
        pl.BlockSpec((None, bp), lambda i, j, t: (j, t)),
        pl.BlockSpec((None, None, bp, ns), lambda i, j, t: (i, j, t, 0)),
        pl.BlockSpec((None, words * n_pad), lambda i, j, t: (i, 0)),
    ]
    args = [x, dtf, a, B, C, d, state.astype(f32), bits]
    out_specs = node_tile
    out_shape = jax.ShapeDtypeStruct((b, rows, h, hd), out_dtype)
    if peel:
        head_tile = pl.BlockSpec((None, None, bp), lambda i, j, t: (i, j, t))
        group_row = pl.BlockSpec((None, None, ns), lambda i, j, t: (i, j // rep, 0))
        in_specs += [head_tile, group_row, group_row,
                     pl.BlockSpec((None, None, SCALAR_LANES), lambda i, j, t: (i, j, 0)),
                     pl.BlockSpec((None, n_pad), lambda i, j, t: (i, 0))]
        args += [x0, b0, c0, da0, _pad(m0, 1, n_pad)]
        out_specs = [out_specs, head_tile]
        out_shape = [out_shape, jax.ShapeDtypeStruct((b, h, hd), out_dtype)]
    y = pl.pallas_call(
        functools.partial(_verify_kernel, n=n_pad, c=bn, prec=prec, peel=peel,
                          n_valid=n if masked_rows else None),
        grid=(b, h, hd // bp),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="ssd_tree_verify",
        **params,
    )(*args)
    if peel:
        y_rest, y0 = y
        return join_root(y_rest, y0, n, axis=1)
    return y[:, :n]  # masked rows: y has n rows already


def ssd_tree_verify(x, dt, A, B, C, D, state, ancestor_bits, *, impl: str = "xla", block_n: int | None = None,
                    block_p: int | None = None, num_warps: int | None = None, num_stages: int = 1,
                    precision: str | None = None, out_dtype=jnp.float32, peel_root: bool | None = None,
                    masked_rows: bool | None = None):
    """Outputs y [B, N, H, Hd] of all N tree nodes of one Mamba2 layer (before the gate / norm).

    x [B, N, H, Hd] SSM inputs (after conv + silu); dt [B, N, H] float32 per node (softplus'ed and
    clipped; 0 for padding nodes); A [H] (= -exp(A_log)); B, C [B, N, G, Ns] (head h reads group
    h // (H / G)); D [H]; state [B, H, Hd, Ns] float32 (the committed state); ancestor_bits
    [B, N, W] uint32 (bit j of node i set iff j is i or an ancestor; self is forced).
    Pallas options: block_n (nodes per row block, power of two >= 16), block_p (head_dim tile, one
    program each), num_warps / num_stages (Triton), precision of the float32 matmuls on GPU:
    "tf32x3" (~fp32, the default for float32 x), "tf32" (the default for bf16 / fp16 x: their
    products are exact in TF32 and the rest stays below y's 16-bit rounding), "ieee" (exact),
    "bf16x3". The interpreter is exact. peel_root: node 0 on its own first (None: when N - 1 is
    a power of two, e.g. DDTree's root + 64 drafts fill 64 rows instead of 128). Exact either way.
    masked_rows (unpeeled trees whose N is not a power of two >= 16, e.g. DDTree-8's 9 nodes): the
    kernel reads the N rows with masked loads instead of XLA padding x / dt / B / C to the blocks'
    rows (None: when it applies; False: the padded form; the GDN tree kernel's form, decision 0068;
    timed here in docs/decisions/0070-ssd-tree-masked-rows-and-a-mamba2-hybrid-shape.md). Same
    arithmetic either way.
    """
    _check(impl, precision)
    if impl == "xla":
        return ssd_tree_verify_reference(x, dt, A, B, C, D, state, ancestor_bits).astype(out_dtype)
    return _verify_pallas(
        x, dt, A, B, C, D, state, ancestor_bits, interpret=impl == "pallas_interpret", block_n=block_n,
        block_p=block_p, num_warps=num_warps, num_stages=num_stages, precision=precision, out_dtype=out_dtype,
        peel_root=peel_root, masked_rows=masked_rows,
    )


# ------------------------------------------------------------------------------------------------
# path commit kernel
# ------------------------------------------------------------------------------------------------
def _commit_kernel(x_ref, dt_ref, a_ref, b_ref, s_ref, o_ref, *, p):
    f32 = jnp.float32
    s = s_ref[...].astype(f32)  # [bp, Ns] stays on chip for the whole path
    for t in range(p):  # P <= 16-32 accepted nodes: unrolled; steps past count have dt = a = 0
        xt = dt_ref[t] * x_ref[t, :].astype(f32)  # [bp]
        s = s * jnp.exp(a_ref[t]) + xt[:, None] * b_ref[t, :].astype(f32)[None, :]
    o_ref[...] = s


def _commit_pallas(x, dt, A, B, state, path, count, *, interpret, block_p, num_warps, num_stages):
    b, n, h, hd = x.shape
    g, ns = B.shape[2], B.shape[3]
    if h % g:
        raise ValueError(f"{h} heads do not divide into {g} groups")
    rep = h // g
    bad = commit_kernel_problems(hd, ns)
    if bad:
        raise ValueError("; ".join(bad))
    bp = min(hd, block_p or 16)
    if not is_pow2(bp) or hd % bp:
        raise ValueError(f"block_p={bp} must be a power of two dividing head_dim={hd}")
    xp, dtp, bm = _gather_path(x, dt, B, path, count)  # [B, P, ...]: a few rows, gathered by XLA
    p = path.shape[1]
    p_pad = pow2_at_least(p, lo=1)
    xp, dtp, bm = _pad(xp, 1, p_pad), _pad(dtp, 1, p_pad), _pad(bm, 1, p_pad)
    a = dtp * jnp.asarray(A, jnp.float32)[None, None, :]  # the same product as ssd.step's dt * A
    params = {}
    if pltriton is not None and not interpret:
        params["compiler_params"] = pltriton.CompilerParams(num_warps=num_warps or 2, num_stages=num_stages)
    per_node = pl.BlockSpec((None, p_pad, None), lambda i, j, t: (i, 0, j))
    tile = pl.BlockSpec((None, None, bp, ns), lambda i, j, t: (i, j, t, 0))
    return pl.pallas_call(
        functools.partial(_commit_kernel, p=p_pad),
        grid=(b, h, hd // bp),
        in_specs=[
            pl.BlockSpec((None, p_pad, None, bp), lambda i, j, t: (i, 0, j, t)),
            per_node,
            per_node,
            pl.BlockSpec((None, p_pad, None, ns), lambda i, j, t: (i, 0, j // rep, 0)),
            tile,
        ],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(state.shape, jnp.float32),
        input_output_aliases={4: 0},  # in place, as gdn_path_commit: each program owns its tile
        interpret=interpret,
        name="ssd_path_commit",
        **params,
    )(xp, dtp, a, bm, state.astype(jnp.float32))


def ssd_path_commit(x, dt, A, B, state, path, count, *, impl: str = "xla", block_p: int | None = None,
                    num_warps: int | None = None, num_stages: int = 1):
    """New state [B, H, Hd, Ns] float32: `state` advanced along path[b, :count[b]].

    x [B, N, H, Hd], dt [B, N, H], B [B, N, G, Ns]: the tree's per-node inputs (Mamba2Pending);
    A [H]; state [B, H, Hd, Ns] float32; path [B, P] node indices (root first; entries at or
    beyond count are ignored); count [B] in 0..P. The recurrence runs in float32 with the
    arithmetic of ssd.step, so the result equals sequential decoding of the accepted tokens.
    Pallas options: block_p (head_dim tile per program, default 16), num_warps, num_stages.
    """
    _check(impl)
    if impl == "xla":
        return ssd_path_commit_reference(x, dt, A, B, state, path, count)
    return _commit_pallas(
        x, dt, A, B, state, path, count, interpret=impl == "pallas_interpret", block_p=block_p,
        num_warps=num_warps, num_stages=num_stages,
    )
