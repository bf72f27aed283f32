"""Tree verification for one Gated DeltaNet layer: every node's output from the committed state,
without a per-node state anywhere (Pallas / Triton kernel + its pure-jnp reference).

Per value head (S0 = committed state [dk, dv], nodes in topological order, M = ancestor-or-self):
    G_i   = sum_{j <= i} g_j                                        (path sums, from the bits)
    D_ij  = exp(G_i - G_j) if j <= i else 0                         (mask BEFORE exp)
    A_ij  = beta_i D_ij (k_i . k_j)  for strict ancestors j
    (I + A) U = beta (V - exp(G) K S0)
    O     = exp(G) Q S0 + ((Q K^T) * D) U

Kernel (one program per (batch, value head, dv tile)): rows are cut into blocks of C nodes.
Block r first builds its mask tiles M_rs (s <= r) from the 32-bit ancestor words, then its
path sums and depths; the right-hand side and the S0 part of the output come from the state
tile (read from HBM once; its dk chunks are re-read from cache per row block); the solved
U_s of earlier blocks are subtracted block by block (blocked forward substitution, A_rs and
(Q K^T * D)_rs rebuilt on the fly from k/q tiles); the
diagonal block is solved level by level (depth t = popcount - 1): the rows of depth t are
final once every shallower row was subtracted, so one C x C x dv_tile matmul per depth level
present in the block. Every U_s stays on chip (register values); outputs are written once.
The dv split makes programs independent (the solve is column-wise), which fills the SMs at
batch 1 (48 heads x 2..4 tiles).

Root peel: DDTree verifies budget + 1 nodes (root + 2^k drafts: 17, 65, 129 ...), which would pad
to twice the rows. Node 0 has no ancestors (topological order), so it is solved first as a
one-node block: u_0 = beta_0 (v_0 - e^{g_0} k_0 S0), o_0 = e^{g_0} q_0 S0 + (q_0 . k_0) u_0,
and every later row i subtracts its rank-1 part, masked by bit 0 of its ancestor word:
beta_i (k_i . k_0) e^{G_i - g_0} u_0 from its right-hand side, and adds (q_i . k_0) e^{G_i - g_0}
u_0 to its output; the other N - 1 nodes run through the blocked solve above with the ancestor
words shifted by one. Exact for any tree; taken when it halves the padded size (N - 1 a power
of two) or when asked (`peel_root=True`).

Masked rows: an unpeeled tree of N nodes, N not a power of two >= 16 (DDTree-4 / -8: 5 / 9
nodes), runs in blocks covering the padded row count, but q / k / v / g / beta stay N rows: the
kernel loads each block's rows with a mask (rows past N read as zeros, which is what padding rows
held) and stores only the N real rows, so XLA pads nothing before it (five pads a layer otherwise).

impl="xla" is the reference (dense visibility + delta_rule.block), "pallas" the Triton kernel,
"pallas_interpret" the same kernel run by the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.ref import delta_rule
from pallas_kernels.tree_mask import WORD, bits_to_dense

try:  # the Triton compiler params; present in jax 0.10 - 0.12
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None

from pallas_kernels._common import (  # noqa: E402
    SCALAR_LANES, check_impl, expand_heads, join_root, load_rows, pack_scalars, pow2_at_least, shift_bits, store,
    store_rows, unpack_scalars,
)

PRECISIONS = ("ieee", "tf32x3", "tf32", "bf16x3")
ROOT_ROWS = 16  # the peeled root's tiles: node 0 in row 0 (a tl.dot operand needs >= 16 rows)
# 16-bit q / k: the products with the float32 state as two 16-bit passes, S0 = hi + lo (q / k are
# exact in 16 bits, each product exact, float32 sums: ~16 mantissa bits against TF32's 10), so q / k
# stay 16-bit in shared memory and are not widened to float32 first (docs/decisions/0021-gdn-tree-split-state.md).
SPLIT_STATE = True




def visibility(ancestor_bits, n: int):
    """[B, N, W] uint32 -> [B, N, N] bool ancestor-or-self (self forced, as the kernel does)."""
    return bits_to_dense(ancestor_bits, n) | jnp.eye(n, dtype=bool)


def reference(q, k, v, g, beta, state, ancestor_bits):
    """Pure-jnp tree verify with the kernel's signature (float32, HIGHEST matmuls)."""
    h, n = v.shape[1], v.shape[2]
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    q, k = f32(expand_heads(q, h)), f32(expand_heads(k, h))
    visible = visibility(ancestor_bits, n)
    path_g = jnp.einsum("bij,bhj->bhi", visible.astype(jnp.float32), f32(g), precision=delta_rule.HIGHEST)
    o, _ = delta_rule.block(q, k, f32(v), path_g, f32(beta), f32(state), visible)
    return o


# ------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------
def _dot(a, b, precision, trans_b=False):
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _fp32_precision(name: str, interpret: bool):
    if interpret:  # the CPU interpreter: exact float32
        return lax.Precision.HIGHEST
    return {
        "ieee": lax.Precision.HIGHEST,
        "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
        "tf32": lax.Precision.DEFAULT,
        "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    }[name]


def _state_products(xs, s_c, p32, split: bool):
    """[x @ s_c for x in xs] (s_c the float32 state chunk): TF32 (x widened to float32), or with
    `split` two passes over the 16-bit x: s_c = hi + lo, both in x's dtype (SPLIT_STATE)."""
    if not split:
        return [_dot(x.astype(jnp.float32), s_c, p32) for x in xs]
    hi = s_c.astype(xs[0].dtype)
    lo = (s_c - hi.astype(jnp.float32)).astype(xs[0].dtype)
    return [_dot(x, hi, None) + _dot(x, lo, None) for x in xs]


def _tree_kernel(*refs, n, c, bk, p_in, p32, peel, in_place=False, split_state=False, root_tiles=False,
                 n_valid=None):
    """in_place (root peel only): q / k / v / g / beta / o hold all N + 1 rows, node 0 first, and
    the blocked tree reads and writes rows 1.. (no slices of the inputs, no packed root scalars,
    no concatenation of the outputs outside the kernel). n_valid (unpeeled only): the row refs hold
    that many rows, fewer than the n the blocks cover; rows past them load as zeros (what padding
    rows hold) and are not stored ("Masked rows" in the module docstring)."""
    if in_place:
        q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, bits_ref, m0_ref, o_ref = refs
    elif peel:
        (q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, bits_ref, q0_ref, k0_ref, v0_ref, gb0_ref, m0_ref, o_ref,
         o0_ref) = refs
    else:
        q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, bits_ref, o_ref = refs
    off = 1 if in_place else 0  # row of node-relative row 0 in the row refs
    nb, dk = n // c, q_ref.shape[-1]
    f32 = jnp.float32
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye = row == col
    kchunks = [pl.ds(i * bk, bk) for i in range(dk // bk)]

    def rows(ref, r, cols=None):  # block r's rows of a row ref (q, k, v, g, beta)
        return load_rows(ref, off + r * c, c, n_valid, cols)

    g_blk = [rows(g_ref, s) for s in range(nb)]

    def mask(r, s):
        """M_rs [c, c] bool: column node s*c + j is an ancestor-or-self of row node r*c + i."""
        if c <= WORD:  # the block's columns sit in one word
            word = bits_ref[pl.ds(((s * c) // WORD) * n + r * c, c)]
            bits = jnp.right_shift(word[:, None], col + (s * c) % WORD) & 1
        else:  # c // 32 words side by side
            lane, which = col & (WORD - 1), jnp.right_shift(col, 5)
            bits = None
            for w in range(c // WORD):
                word = bits_ref[pl.ds((s * c // WORD + w) * n + r * c, c)]
                part = jnp.right_shift(word[:, None], lane) & 1
                bits = part if bits is None else jnp.where(which == w, part, bits)
        m = bits == 1
        return (m | eye) if s == r else m

    def row_depths(r):
        """[c] depths of block r's rows (ancestor count - 1): popcounts of their ancestor words
        with self forced (padding rows have none and sit at depth 0), not a sum over mask tiles."""
        node = r * c + lax.broadcasted_iota(jnp.int32, (c,), 0)
        count = 0
        for w in range(max(1, n // WORD)):
            word = bits_ref[pl.ds(w * n + r * c, c)]
            word = jnp.where(node // WORD == w, word | jnp.left_shift(jnp.int32(1), node % WORD), word)
            count = count + lax.population_count(word)
        return count - 1

    def gram(ra, rb):
        """(K_a K_b^T, Q_a K_b^T) [c, c] of row blocks ra, rb, contracted over dk in chunks of bk."""
        kk = qk = None
        for kc in kchunks:
            k_b = rows(k_ref, rb, kc)
            kk_c = _dot(rows(k_ref, ra, kc), k_b, p_in, trans_b=True)
            qk_c = _dot(rows(q_ref, ra, kc), k_b, p_in, trans_b=True)
            kk, qk = (kk_c, qk_c) if kk is None else (kk + kk_c, qk + qk_c)
        return kk, qk

    if peel:  # node 0 as a one-node block solved first (module docstring: "Root peel")
        # 16-bit inputs (root_tiles): node 0 travels as row 0 of 16-row tiles (zeros below), so its
        # products with the state and with the block rows run as small matmuls; as row reductions
        # over dk across the threads they were much of the kernel's shuffle / shared-memory traffic
        # (offline compile and Nsight Compute: docs/kernels_gdn.md). float32 inputs keep
        # the reductions: their 3-pass TF32 tile products spilled far more (offline compile).
        top = lax.broadcasted_iota(jnp.int32, (ROOT_ROWS, 1), 0) == 0
        first_row = lambda x: jnp.where(top, x[None, :], jnp.zeros((), x.dtype))  # [ROOT_ROWS, w]
        as_root = first_row if root_tiles else (lambda x: x.astype(f32))
        if in_place:
            lane = lax.broadcasted_iota(jnp.int32, (SCALAR_LANES,), 0)
            first = lambda ref: jnp.sum(jnp.where(lane == 0, ref[pl.ds(0, SCALAR_LANES)].astype(f32), 0.0))
            g0, beta0 = first(g_ref), first(beta_ref)
            k0 = [as_root(k_ref[0, kc]) for kc in kchunks]
            q0 = [as_root(q_ref[0, kc]) for kc in kchunks]
            v0 = as_root(v_ref[0, :].astype(f32))
        else:
            g0, beta0 = unpack_scalars(gb0_ref, 2)
            k0 = [as_root(k0_ref[kc]) for kc in kchunks]
            q0 = [as_root(q0_ref[kc]) for kc in kchunks]
            v0 = as_root(v0_ref[...].astype(f32))
        ks0 = qs0 = qk00 = None  # k_0 S0, q_0 S0, q_0 . k_0 (tiles: in row 0, the other rows zero)
        for i, kc in enumerate(kchunks):
            s_c = s_ref[kc, :].astype(f32)
            if root_tiles:
                parts = (*_state_products((k0[i], q0[i]), s_c, p32, split_state),
                         _dot(q0[i], k0[i], p_in, trans_b=True))
            else:
                parts = (jnp.sum(k0[i][:, None] * s_c, axis=0), jnp.sum(q0[i][:, None] * s_c, axis=0),
                         jnp.sum(q0[i] * k0[i]))
            ks0, qs0, qk00 = parts if ks0 is None else (ks0 + parts[0], qs0 + parts[1], qk00 + parts[2])
        e0 = jnp.exp(g0)
        u0 = beta0 * (v0 - e0 * ks0)  # tiles: [ROOT_ROWS, dv], u_0 in row 0; else [dv]
        if root_tiles:
            o0 = e0 * qs0 + _dot(qk00, u0, p32)
            if in_place:
                store(o_ref, (pl.ds(0, ROOT_ROWS), slice(None)), o0.astype(o_ref.dtype),
                      mask=jnp.broadcast_to(top, o0.shape))
            else:
                o0_ref[...] = jnp.sum(jnp.where(top, o0, 0.0), axis=0).astype(o0_ref.dtype)
        else:
            o0 = e0 * qs0 + qk00 * u0
            if in_place:
                o_ref[0, :] = o0.astype(o_ref.dtype)
            else:
                o0_ref[...] = o0.astype(o0_ref.dtype)

    big_g, big_u = [], []
    for r in range(nb):
        g_r = 0.0  # path sums of the block's rows
        for s in range(r + 1):
            g_r = g_r + jnp.sum(jnp.where(mask(r, s), g_blk[s][None, :], 0.0), axis=1)
        depth = row_depths(r)
        if peel:
            under0 = m0_ref[pl.ds(r * c, c)] > 0  # row descends from node 0 (node-relative rows)
            g_r = g_r + jnp.where(under0, g0, 0.0)
        beta_r = rows(beta_ref, r)
        eg = jnp.exp(g_r)
        ks = qs = None  # K_r S0 and Q_r S0, contracted over dk in chunks (state chunks reloaded)
        kk0 = qk0 = None  # K_r k_0 and Q_r k_0 (peel only; tiles: [c, ROOT_ROWS], column 0)
        for i, kc in enumerate(kchunks):
            s_c = s_ref[kc, :].astype(f32)
            k_in, q_in = rows(k_ref, r, kc), rows(q_ref, r, kc)
            ks_c, qs_c = _state_products((k_in, q_in), s_c, p32, split_state)
            ks, qs = (ks_c, qs_c) if ks is None else (ks + ks_c, qs + qs_c)
            if peel and root_tiles:
                kk_c, qk_c = _dot(k_in, k0[i], p_in, trans_b=True), _dot(q_in, k0[i], p_in, trans_b=True)
            elif peel:
                kk_c = jnp.sum(k_in.astype(f32) * k0[i][None, :], axis=1)
                qk_c = jnp.sum(q_in.astype(f32) * k0[i][None, :], axis=1)
            if peel:
                kk0, qk0 = (kk_c, qk_c) if kk0 is None else (kk0 + kk_c, qk0 + qk_c)
        rhs = beta_r[:, None] * (rows(v_ref, r).astype(f32) - eg[:, None] * ks)
        o = eg[:, None] * qs
        if peel:  # node 0's rank-1 parts (tiles: [c, ROOT_ROWS] x [ROOT_ROWS, dv]); mask before exp
            d0 = jnp.exp(jnp.where(under0, g_r - g0, -jnp.inf))
            if root_tiles:
                rhs = rhs - _dot((beta_r * d0)[:, None] * kk0, u0, p32)
                o = o + _dot(d0[:, None] * qk0, u0, p32)
            else:
                rhs = rhs - (beta_r * kk0 * d0)[:, None] * u0[None, :]
                o = o + (qk0 * d0)[:, None] * u0[None, :]
        for s in range(r + 1):
            # Mask BEFORE exp: non-ancestor pairs can carry large positive exponents.
            decay = jnp.exp(jnp.where(mask(r, s), g_r[:, None] - (g_r if s == r else big_g[s])[None, :], -jnp.inf))
            kk, qk = gram(r, s)
            if s < r:
                rhs = rhs - _dot(beta_r[:, None] * kk * decay, big_u[s], p32)
                o = o + _dot(qk * decay, big_u[s], p32)
            else:
                a = jnp.where(eye, 0.0, beta_r[:, None] * kk * decay)

                def level(t, x, a=a, depth=depth):
                    # rows of depth t are final: remove their contribution from deeper rows
                    return x - _dot(a, jnp.where((depth == t)[:, None], x, 0.0), p32)

                u = lax.fori_loop(jnp.min(depth), jnp.max(depth), level, rhs)
                o = o + _dot(qk * decay, u, p32)
        store_rows(o_ref, off + r * c, o.astype(o_ref.dtype), n_valid)
        big_g.append(g_r)
        big_u.append(u)


def default_blocks(n_pad: int, dk_pad: int, dv_pad: int, programs: int = 1):
    """(block_n, block_dv, block_k, num_warps) by padded tree size and B * H.

    Chosen from offline Triton 3.6 compiles for sm_90 (registers / spills, see
    docs/kernels_gdn.md) at dk = dv = 128: every U_s stays in registers, so the dv tile
    shrinks as N grows; the kernel is latency-bound (one small matmul per depth level), so
    at small B * H a smaller dv tile buys more programs in flight, at large B * H a wider tile
    avoids recomputing K K^T / Q K^T per tile. scripts/gpu_gdn.py sweeps the alternatives.
    """
    block_n = min(n_pad, 64)
    block_k = min(dk_pad, 128)
    num_warps = 4 if block_n <= 32 else 8
    if n_pad <= 64:
        block_dv = 128 if programs >= 256 else 64
    elif n_pad <= 128:
        block_dv = 64
    else:
        block_dv = 32
    return block_n, min(block_dv, dv_pad), block_k, num_warps


def _pallas(q, k, v, g, beta, state, ancestor_bits, *, interpret, block_n, block_dv, block_k, num_warps,
            num_stages, precision, out_dtype, peel_root, masked_rows):
    b, h, n, dv = v.shape
    hk, dk = q.shape[1], q.shape[3]
    if h % hk:
        raise ValueError(f"{h} value heads do not divide into {hk} key heads")
    rep = h // hk
    peel = bool(n > 1 and pow2_at_least(n - 1) < pow2_at_least(n)) if peel_root is None else bool(peel_root)
    if peel and n < 2:
        raise ValueError("peel_root needs at least 2 nodes")
    # In place: DDTree's root + 2^j drafts with power-of-two head dims need no padding, so the
    # kernel reads node 0 and rows 1.. from the same arrays and writes all N outputs (no slices,
    # no packed root scalars, no concatenation: ~3 fewer launches per GDN layer).
    in_place = peel and pow2_at_least(n - 1) == n - 1 and pow2_at_least(dk) == dk and pow2_at_least(dv) == dv
    if in_place:
        ancestor_bits, m0 = shift_bits(ancestor_bits)
        n_rows = n
        n = n - 1
    elif peel:  # node 0 goes in through its own refs; nodes 1.. form the blocked tree
        root = lambda a: a[:, :, 0]
        q0, k0, v0 = root(q), root(k), root(v)
        gb0 = pack_scalars(root(g), root(beta))
        ancestor_bits, m0 = shift_bits(ancestor_bits)
        q, k, v, g, beta = (a[:, :, 1:] for a in (q, k, v, g, beta))
        n = n - 1
    n_pad, dk_pad, dv_pad = pow2_at_least(n), pow2_at_least(dk), pow2_at_least(dv)
    if masked_rows is None:
        masked_rows = not peel and n < n_pad
    elif masked_rows and peel:
        raise ValueError("masked_rows is the unpeeled form: pass peel_root=False with it")
    bn, bdv, bk, nw = default_blocks(n_pad, dk_pad, dv_pad, b * h)
    bn = min(n_pad, block_n or bn)
    bdv = min(dv_pad, block_dv or bdv)
    bk = min(dk_pad, block_k or bk)
    nw = num_warps or nw
    for name, val in (("block_n", bn), ("block_dv", bdv), ("block_k", bk)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name}={val} must be a power of two >= 16")
    words = max(1, n_pad // WORD)

    def pad(a, axis, to, value=0):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, to - a.shape[axis])
        return a if to == a.shape[axis] else jnp.pad(a, widths, constant_values=value)

    in_dtype = jnp.promote_types(q.dtype, k.dtype)
    if in_dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        in_dtype = jnp.float32
    rows = n_rows if in_place else n if masked_rows else n_pad  # rows of the q / k / v / g / beta / o blocks
    q = pad(pad(q.astype(in_dtype), 2, rows), 3, dk_pad)
    k = pad(pad(k.astype(in_dtype), 2, rows), 3, dk_pad)
    v = pad(pad(v, 2, rows), 3, dv_pad)
    g = pad(g.astype(jnp.float32), 2, rows)
    beta = pad(beta.astype(jnp.float32), 2, rows)
    state = pad(pad(state.astype(jnp.float32), 2, dk_pad), 3, dv_pad)
    bits = lax.bitcast_convert_type(ancestor_bits.astype(jnp.uint32), jnp.int32)
    bits = pad(pad(bits[:, :, :words], 1, n_pad), 2, words)  # padding rows: kernel forces self
    bits = jnp.swapaxes(bits, 1, 2).reshape(b, words * n_pad)  # word-major: [w * n_pad + row]

    if precision is None:  # bf16 models: TF32 errors stay below the bf16 rounding of o
        precision = "tf32x3" if in_dtype == jnp.float32 else "tf32"
    p32 = _fp32_precision(precision, interpret)
    p_in = p32 if in_dtype == jnp.float32 else None
    sixteen_bit = in_dtype in (jnp.bfloat16, jnp.float16)
    kernel = functools.partial(_tree_kernel, n=n_pad, c=bn, bk=bk, p_in=p_in, p32=p32, peel=peel, in_place=in_place,
                               split_state=SPLIT_STATE and sixteen_bit, root_tiles=sixteen_bit,
                               n_valid=n if masked_rows else None)
    qk_spec = pl.BlockSpec((None, None, rows, dk_pad), lambda i, j, t: (i, j // rep, 0, 0))
    vec_spec = pl.BlockSpec((None, None, rows), lambda i, j, t: (i, j, 0))
    tile_spec = lambda nr: pl.BlockSpec((None, None, nr, bdv), lambda i, j, t: (i, j, 0, t))
    row_tile_spec = pl.BlockSpec((None, None, bdv), lambda i, j, t: (i, j, t))
    in_specs = [qk_spec, qk_spec, tile_spec(rows), vec_spec, vec_spec, tile_spec(dk_pad),
                pl.BlockSpec((None, words * n_pad), lambda i, j, t: (i, 0))]
    args = [q, k, v, g, beta, state, bits]
    out_specs = tile_spec(rows)
    out_shape = jax.ShapeDtypeStruct((b, h, rows, dv_pad), out_dtype)
    if in_place:
        in_specs.append(pl.BlockSpec((None, n_pad), lambda i, j, t: (i, 0)))
        args.append(pad(m0, 1, n_pad))
    elif peel:
        key_row = pl.BlockSpec((None, None, dk_pad), lambda i, j, t: (i, j // rep, 0))
        in_specs += [key_row, key_row, row_tile_spec,
                     pl.BlockSpec((None, None, SCALAR_LANES), lambda i, j, t: (i, j, 0)),
                     pl.BlockSpec((None, n_pad), lambda i, j, t: (i, 0))]
        args += [pad(q0.astype(in_dtype), 2, dk_pad), pad(k0.astype(in_dtype), 2, dk_pad), pad(v0, 2, dv_pad),
                 gb0, pad(m0, 1, n_pad)]
        out_specs = [out_specs, row_tile_spec]
        out_shape = [out_shape, jax.ShapeDtypeStruct((b, h, dv_pad), out_dtype)]
    params = {}
    if pltriton is not None and not interpret:
        params["compiler_params"] = pltriton.CompilerParams(num_warps=nw, num_stages=num_stages)
    o = pl.pallas_call(
        kernel,
        grid=(b, h, dv_pad // bdv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="gdn_tree_verify",
        **params,
    )(*args)
    if in_place:
        return o
    if peel:
        o_rest, o0 = o
        return join_root(o_rest[..., :dv], o0[..., :dv], n, axis=2)
    return o[:, :, :n, :dv]  # masked rows: o has n rows already


def gdn_tree_verify(
    q,
    k,
    v,
    g,
    beta,
    state,
    ancestor_bits,
    *,
    impl: str = "xla",
    block_n: int | None = None,
    block_dv: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 1,
    precision: str | None = None,
    out_dtype=jnp.float32,
    peel_root: bool | None = None,
    masked_rows: bool | None = None,
):
    """Outputs o [B, H, N, dv] of all N tree nodes of one GDN layer, from the state before the step.

    q, k [B, Hk, N, dk] (q l2-normed and scaled, k l2-normed; Hk divides H, value head j reads
    key head j // (H // Hk)); v [B, H, N, dv]; g, beta [B, H, N] float32 per node (not path
    sums); state [B, H, dk, dv] float32; ancestor_bits [B, N, W] uint32 (bit j of node i set iff
    j is i or an ancestor; self is forced). Inputs bf16 or float32; math in float32.
    Pallas options: block_n (nodes per row block, power of two >= 16), block_dv (dv tile, one
    program each), block_k (dk chunk of every contraction over dk), num_warps / num_stages
    (Triton), precision of the float32 matmuls on GPU: "tf32x3" (~fp32, the default for float32
    inputs), "ieee" (exact, CUDA cores), "tf32" (default for bf16 inputs: its ~5e-4 relative
    error is below the bf16 rounding the layer applies to o), "bf16x3". The interpreter is exact.
    peel_root: solve node 0 on its own first (None: when N - 1 is a power of two, e.g. DDTree's
    root + 64 drafts, so the other nodes fill 64 rows instead of padding to 128). Exact either way.
    masked_rows (unpeeled trees whose N is not a power of two >= 16): the kernel reads the N rows
    with masked loads instead of XLA padding q / k / v / g / beta to the blocks' rows (None: when
    it applies; False: the padded form). Same arithmetic either way.
    """
    if impl == "xla":
        return reference(q, k, v, g, beta, state, ancestor_bits).astype(out_dtype)
    check_impl(impl)
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return _pallas(
        q, k, v, g, beta, state, ancestor_bits,
        interpret=impl == "pallas_interpret", block_n=block_n, block_dv=block_dv, block_k=block_k,
        num_warps=num_warps, num_stages=num_stages, precision=precision, out_dtype=out_dtype, peel_root=peel_root,
        masked_rows=masked_rows,
    )
