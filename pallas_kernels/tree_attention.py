"""Tree attention: every draft-tree node attends to the committed KV cache and its tree ancestors.

    out = tree_attention(q, k_cache, v_cache, lengths, k_tree, v_tree, ancestor_bits,
                         scale=hd**-0.5, impl="xla" | "pallas" | "pallas_interpret")

Shapes: q [B, N, nh, hd] (nh = kv * group), k_cache / v_cache [B, kv, capacity, hd],
lengths [B] int32 (cache key s is visible iff s < lengths[b]), k_tree / v_tree [B, N, kv, hd],
ancestor_bits [B, N, W >= ceil(N/32)] uint32 (tree key j is visible to node i iff bit j % 32 of
word j // 32 of row i is set; see ddtree_jax.tree). Returns [B, N, nh, hd] in q's dtype. Softmax
and accumulation in float32. "xla" is the pure-jnp reference: the same function as
ddtree_jax.models.attention.attend over the parts [(cache, key_pos < lengths), (tree, bits)].

Pallas kernel (Triton lowering), flash-decoding shaped:
- rows: for one (batch, kv head) the N nodes x group query heads form R = N * group rows
  (row r = node r // group, head r % group), gathered straight from q [B, N, nh, hd]; they are
  cut into row blocks of block_r (a power of two, the last one masked).
- grid (row block, cache split, kv head, batch), row block fastest: the programs that share a
  cache split run side by side, so a K/V block comes from HBM once and from L2 for the other
  row blocks. Each program streams its split of the cache in block_k keys (one tl.dot for
  Q K^T of [block_r, hd] x [hd, block_k], one for P V), online softmax in base 2.
- split-K: split s of batch row b covers [s * L_b, min((s + 1) * L_b, lengths[b])) with
  L_b = round_up(cdiv(lengths[b] + T, S), block_k), so any mix of lengths spreads evenly and the
  loops skip everything past the length. The last split also runs the tree keys: N keys in
  blocks of block_t, visibility read from the compact bits (one 32-bit word per row per 32
  keys; no dense mask anywhere). T = the tree keys rounded up to block_t
  (`BALANCE_TREE_KEYS`), so the last split takes that many fewer cache keys (at 4k / 65 nodes:
  9 blocks on the longest split instead of 10).
- each program writes its normalised partial output (S x R x hd, in partial_dtype) and the
  row max / sum (float32); a small XLA epilogue merges the S partials and transposes the rows
  back to [B, N, nh, hd].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.tree_mask import bits_to_dense
from pallas_kernels._common import (
    H200_SMS,
    LOG2E,
    NEG,
    as_int32_bits,
    cdiv,
    check_impl,
    compiler_params,
    dot,
    dot_precision,
    is_pow2,
    load,
    next_pow2,
    store,
)

# The fewest cache keys (of capacity) a split gets when the split count is chosen: few programs
# (a decode step's kv heads) take at most capacity / MIN_SPLIT_KEYS splits. 128, measured on the
# H200 at the 35B-A3B layer (2 kv heads, 4k context; docs/decisions/0058-gdn-decode-split-and-attention-splits.md):
# a decode step 15.0 us with 32 splits against 17.1 with 16 (256 keys), a 9-node tree 22.0 against 25.2.
MIN_SPLIT_KEYS = 128
BALANCE_TREE_KEYS = True  # count the tree keys in the split length (module docstring, split-K)


# ---------------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------------
def reference(q, k_cache, v_cache, lengths, k_tree, v_tree, ancestor_bits, *, scale):
    """Pure-jnp reference: one joint float32 softmax over [visible cache keys, visible tree keys]."""
    b, n, nh, hd = q.shape
    kv, cap = k_cache.shape[1], k_cache.shape[2]
    g = nh // kv
    out_dtype = q.dtype
    prec = dot_precision(q.dtype)
    f32 = jnp.float32
    p_dtype = jnp.promote_types(v_cache.dtype, v_tree.dtype)  # probabilities rounded as attend() does
    if jax.default_backend() == "cpu" and q.dtype != f32:
        # XLA:CPU has no bf16 x bf16 -> f32 dot; upcasting is exact (same products and sums)
        q, k_cache, v_cache, k_tree, v_tree = (x.astype(f32) for x in (q, k_cache, v_cache, k_tree, v_tree))
    qg = q.reshape(b, n, kv, g, hd)
    s_c = jnp.einsum("bnkgd,bksd->bkgns", qg, k_cache.astype(q.dtype), precision=prec, preferred_element_type=f32)
    s_t = jnp.einsum("bnkgd,bmkd->bkgnm", qg, k_tree.astype(q.dtype), precision=prec, preferred_element_type=f32)
    committed = jnp.arange(cap, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]  # [B, cap]
    visible = bits_to_dense(ancestor_bits, n)  # [B, N, N]
    s_c = jnp.where(committed[:, None, None, None, :], s_c * scale, NEG)
    s_t = jnp.where(visible[:, None, None], s_t * scale, NEG)
    m = jnp.maximum(s_c.max(-1), s_t.max(-1))[..., None]
    p_c, p_t = jnp.exp(s_c - m), jnp.exp(s_t - m)
    denom = p_c.sum(-1, keepdims=True) + p_t.sum(-1, keepdims=True)
    p_c = (p_c / denom).astype(p_dtype).astype(v_cache.dtype)
    p_t = (p_t / denom).astype(p_dtype).astype(v_tree.dtype)
    out = jnp.einsum("bkgns,bksd->bnkgd", p_c, v_cache, precision=prec, preferred_element_type=f32)
    out = out + jnp.einsum("bkgnm,bmkd->bnkgd", p_t, v_tree, precision=prec, preferred_element_type=f32)
    return out.reshape(b, n, nh, hd).astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# launch configuration
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    block_r: int  # query rows (nodes x group heads) per program
    block_k: int  # cache keys per loop step
    block_t: int  # tree keys per loop step
    num_splits: int  # cache splits (split-K)
    num_warps: int
    num_stages: int


def _max_block_r(hd: int) -> int:
    """Largest row block: the float32 accumulator is block_r x hd, 128 registers per thread at
    128 x 256 with 8 warps (block_r > 64 gets 8 warps); the tile sweep put 128 rows x 64 keys x 8
    warps first for a 64-node tree at head_dim 256 (docs/decisions/0025-tree-attention-tiles-split-balance.md)."""
    return 128 if hd <= 256 else 64


def _default_tiles(hd: int, block_r: int, itemsize: int):
    """(block_k, num_warps, num_stages) for a row block; scripts/gpu_tree_attention.py sweeps them.

    Shared memory: each pipeline stage holds a K and a V block (2 x block_k x hd x itemsize, 64 KiB
    for 64 x 256 bf16) next to the q block; keep the stages within ~200 KiB minus q (H100/H200
    have 227 KiB per block), dropping a stage first, then halving block_k.
    """
    warps = 4 if block_r <= 64 else 8
    stages = 3
    bk = 64
    budget = 200 * 1024 - block_r * hd * itemsize  # decode (16 rows) keeps 3 stages: 18.1 vs 22.9 us at 8k
    while stages * 2 * bk * hd * itemsize > budget:
        if stages > 2:
            stages -= 1
        elif bk > 16:
            bk //= 2
        else:
            break
    return bk, warps, stages


def _choose_block_r(rows: int, max_block_r: int) -> int:
    """Fewest padded rows, charging each extra row block as 32 rows (a K/V re-read from L2)."""
    best, best_cost = 16, None
    br = max(16, min(max_block_r, next_pow2(rows)))
    while br >= 16:
        cost = cdiv(rows, br) * (br + 32)
        if best_cost is None or cost < best_cost:
            best, best_cost = br, cost
        br //= 2
    return best


def _choose_splits(programs: int, capacity: int, block_k: int, num_sms: int, min_split: int = MIN_SPLIT_KEYS) -> int:
    """Smallest split count that fills the GPU to >= 90% in whole waves (at most 64 splits,
    and at least min_split keys of capacity per split)."""
    s_max = max(1, min(64, capacity // max(min_split, block_k)))
    best, best_eff = 1, -1.0
    for s in range(1, s_max + 1):
        p = programs * s
        eff = p / num_sms if p < num_sms else (p / num_sms) / cdiv(p, num_sms)
        if eff >= 0.9:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def choose_config(batch, n_nodes, kv_heads, group, head_dim, capacity, *, itemsize=2, block_r=None, block_k=None,
                  block_t=None, num_splits=None, num_warps=None, num_stages=None, num_sms=H200_SMS,
                  min_split=MIN_SPLIT_KEYS) -> Config:
    """Tiles and split count for one call (explicit arguments override the choice); min_split:
    the fewest cache keys (of capacity) a split may get."""
    rows = n_nodes * group
    br = block_r or _choose_block_r(rows, _max_block_r(head_dim))
    bk, nw, ns = _default_tiles(head_dim, br, itemsize)
    bk = block_k or bk
    bt = block_t or max(16, min(64, bk, next_pow2(n_nodes)))  # tree K/V blocks share the stages' memory
    for name, v in (("block_r", br), ("block_k", bk), ("block_t", bt)):
        if not is_pow2(v) or v < 16:
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if bt > 32 and bt % 32:
        raise ValueError(f"block_t must be <= 32 or a multiple of 32, got {bt}")
    programs = cdiv(rows, br) * kv_heads * batch
    s = num_splits or _choose_splits(programs, capacity, bk, num_sms, min_split)
    return Config(br, bk, bt, max(1, int(s)), num_warps or nw, num_stages or ns)


# ---------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------
def split_bounds(length, split, n_splits: int, block_k: int, tree_keys: int):
    """[start, end) of the committed keys that cache split `split` runs (ints or traced int32).

    The last split also runs the tree keys (tree_keys = the node count rounded up to block_t):
    with BALANCE_TREE_KEYS they count in the split length, so the last split takes that many
    fewer cache keys and does not run ~2 blocks longer than the others (the kernel ends with its
    slowest program)."""
    extra = tree_keys if BALANCE_TREE_KEYS else 0
    split_len = ((length + extra + n_splits - 1) // n_splits + block_k - 1) // block_k * block_k
    start = split * split_len
    end = jnp.maximum(jnp.minimum(start + split_len, length), start)
    return start, end


def _online_update(carry, s2, mask, v, prec, guard):
    """One flash step in base 2: s2 [R, K] scores * scale * log2(e), mask [R, K], v [K, hd].

    guard: zero the masked probabilities explicitly (needed when a row may have seen no visible
    key yet, where NEG - NEG = 0; the cache loop has a visible key in every block it runs)."""
    acc, m, l = carry
    s2 = jnp.where(mask, s2, NEG)
    m_new = jnp.maximum(m, s2.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s2 - m_new[:, None])
    if guard:
        p = jnp.where(mask, p, 0.0)
    l = l * alpha + p.sum(axis=1)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, precision=prec)
    return acc, m_new, l


def _kernel(len_ref, q_ref, k_ref, v_ref, kt_ref, vt_ref, bits_ref, o_ref, m_ref, l_ref, *,
            scale2, group, n_nodes, n_words, cfg: Config, prec, row_gather):
    """row_gather: q_ref is [N, group, hd] and bits_ref [N, W] (rows gathered in the kernel);
    otherwise q_ref is [R_pad, hd] and bits_ref [R_pad, W], already in row order (XLA prologue)."""
    rb, split = pl.program_id(0), pl.program_id(1)
    br, bk, bt, n_splits = cfg.block_r, cfg.block_k, cfg.block_t, cfg.num_splits
    hd = q_ref.shape[-1]
    rows = n_nodes * group

    r = rb * br + jnp.arange(br, dtype=jnp.int32)
    row_ok = r < rows
    node = jnp.minimum(r // group, n_nodes - 1)
    head = r % group
    d = jnp.arange(hd, dtype=jnp.int32)
    row_mask = jnp.broadcast_to(row_ok[:, None], (br, hd))
    if row_gather:
        q = load(q_ref, (node[:, None], head[:, None], d[None, :]), mask=row_mask, other=0)
    else:
        q = load(q_ref, (pl.ds(rb * br, br), slice(None)), mask=row_mask, other=0)

    carry = (jnp.zeros((br, hd), jnp.float32), jnp.full((br,), NEG, jnp.float32), jnp.zeros((br,), jnp.float32))

    # ---- committed cache: this program's split of [0, length) ----
    length = len_ref[...]
    start, end = split_bounds(length, split, n_splits, bk, cdiv(n_nodes, bt) * bt)
    n_blocks = (end - start + bk - 1) // bk
    kcol = jnp.arange(bk, dtype=jnp.int32)

    def cache_step(i, carry):
        k0 = start + i * bk
        key_ok = (k0 + kcol) < end
        kv_mask = jnp.broadcast_to(key_ok[:, None], (bk, hd))
        k = load(k_ref, (pl.ds(k0, bk), slice(None)), mask=kv_mask, other=0)
        v = load(v_ref, (pl.ds(k0, bk), slice(None)), mask=kv_mask, other=0)
        s2 = dot(q, k, trans_b=True, precision=prec) * scale2
        return _online_update(carry, s2, jnp.broadcast_to(key_ok[None, :], (br, bk)), v, prec, False)

    carry = lax.fori_loop(0, n_blocks, cache_step, carry)

    # ---- tree keys, on the last split only: visibility from the ancestor bitsets ----
    # 1 on the last split, else 0, in integer arithmetic: a bool-derived bound lowered to an i1 loop
    # bound in Triton ("scf.for ... have same type" on the H200).
    is_last = 1 - jnp.minimum(jnp.int32(n_splits - 1) - split.astype(jnp.int32), 1)
    n_tree_blocks = is_last * jnp.int32(cdiv(n_nodes, bt))
    tcol = jnp.arange(bt, dtype=jnp.int32)
    words_per_block = max(1, bt // 32)

    def tree_step(i, carry):
        j = i * bt + tcol  # tree key index
        key_ok = j < n_nodes
        kv_mask = jnp.broadcast_to(key_ok[:, None], (bt, hd))
        k = load(kt_ref, (pl.ds(i * bt, bt), slice(None)), mask=kv_mask, other=0)
        v = load(vt_ref, (pl.ds(i * bt, bt), slice(None)), mask=kv_mask, other=0)
        w0 = (i * bt) // 32
        slot = j // 32 - w0  # which of this block's words holds bit j
        shift = j % 32
        word = jnp.zeros((br, bt), jnp.int32)
        for c in range(words_per_block):
            w = w0 + c
            w_safe = jnp.minimum(w, n_words - 1)
            if row_gather:
                wc = load(bits_ref, (node, w_safe), mask=row_ok & (w < n_words), other=0)
            else:
                wc = load(bits_ref, (pl.ds(rb * br, br), w_safe), mask=row_ok & (w < n_words), other=0)
            word = jnp.where((slot == c)[None, :], wc[:, None], word)
        visible = ((word >> shift[None, :]) & 1) == 1
        mask = visible & key_ok[None, :] & row_ok[:, None]
        s2 = dot(q, k, trans_b=True, precision=prec) * scale2
        return _online_update(carry, s2, mask, v, prec, True)

    acc, m, l = lax.fori_loop(0, n_tree_blocks, tree_step, carry)

    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    store(o_ref, (pl.ds(0, br), slice(None)), out.astype(o_ref.dtype), mask=row_mask)
    store(m_ref, (pl.ds(0, br),), m, mask=row_ok)
    store(l_ref, (pl.ds(0, br),), l, mask=row_ok)


def _combine(o, m, l, rows):
    """Merge split partials: o [B, kv, S, Rp, hd] (normalised per split), m, l [B, kv, S, Rp]."""
    o, m, l = o[:, :, :, :rows], m[:, :, :, :rows], l[:, :, :, :rows]
    m_max = m.max(axis=2, keepdims=True)
    w = jnp.exp2(m - m_max) * l  # [B, kv, S, R]
    denom = w.sum(axis=2)
    out = (o.astype(jnp.float32) * w[..., None]).sum(axis=2)
    return out / jnp.where(denom > 0, denom, 1.0)[..., None]  # [B, kv, R, hd]


def tree_attention_pallas(q, k_cache, v_cache, lengths, k_tree, v_tree, ancestor_bits, *, scale,
                          interpret=False, partial_dtype=None, row_gather=True, **tuning):
    b, n, nh, hd = q.shape
    _, kv, cap, _ = k_cache.shape
    if nh % kv:
        raise ValueError(f"{nh} query heads are not a multiple of {kv} kv heads")
    if not is_pow2(hd) or hd < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the Pallas kernel, got {hd}")
    if k_tree.shape != (b, n, kv, hd) or v_tree.shape != (b, n, kv, hd):
        raise ValueError(f"tree K/V must be {(b, n, kv, hd)}, got {k_tree.shape} / {v_tree.shape}")
    group = nh // kv
    words = ancestor_bits.shape[-1]
    if ancestor_bits.shape[:2] != (b, n) or words * 32 < n:
        raise ValueError(f"ancestor_bits must be [{b}, {n}, >= {cdiv(n, 32)}], got {ancestor_bits.shape}")
    cfg = choose_config(b, n, kv, group, hd, cap, itemsize=jnp.dtype(q.dtype).itemsize, **tuning)
    rows = n * group
    rb = cdiv(rows, cfg.block_r)
    rows_pad = rb * cfg.block_r
    s = cfg.num_splits
    if partial_dtype is None:
        partial_dtype = jnp.float32 if q.dtype == jnp.float32 else q.dtype
    dtype = q.dtype
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, cap)
    bits = as_int32_bits(ancestor_bits)

    kernel = functools.partial(
        _kernel, scale2=float(scale) * LOG2E, group=group, n_nodes=n, n_words=words, cfg=cfg,
        prec=dot_precision(dtype), row_gather=row_gather,
    )
    if row_gather:  # rows gathered in the kernel from q [B, N, kv, group, hd] and bits [B, N, W]
        q_in = q.reshape(b, n, kv, group, hd)
        q_spec = pl.BlockSpec((None, n, None, group, hd), lambda r, sp, h, bb: (bb, 0, h, 0, 0))
        bits_spec = pl.BlockSpec((None, n, words), lambda r, sp, h, bb: (bb, 0, 0))
    else:  # fallback: an XLA prologue lays the rows out ([B, kv, R_pad, hd], bits [B, R_pad, W])
        q_in = q.reshape(b, n, kv, group, hd).transpose(0, 2, 1, 3, 4).reshape(b, kv, rows, hd)
        q_in = jnp.pad(q_in, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
        bits = jnp.pad(jnp.repeat(bits, group, axis=1), ((0, 0), (0, rows_pad - rows), (0, 0)))
        q_spec = pl.BlockSpec((None, None, rows_pad, hd), lambda r, sp, h, bb: (bb, h, 0, 0))
        bits_spec = pl.BlockSpec((None, rows_pad, words), lambda r, sp, h, bb: (bb, 0, 0))
    grid = (rb, s, kv, b)
    o, m, l = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None,), lambda r, sp, h, bb: (bb,)),
            q_spec,
            pl.BlockSpec((None, None, cap, hd), lambda r, sp, h, bb: (bb, h, 0, 0)),
            pl.BlockSpec((None, None, cap, hd), lambda r, sp, h, bb: (bb, h, 0, 0)),
            pl.BlockSpec((None, n, None, hd), lambda r, sp, h, bb: (bb, 0, h, 0)),
            pl.BlockSpec((None, n, None, hd), lambda r, sp, h, bb: (bb, 0, h, 0)),
            bits_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, cfg.block_r, hd), lambda r, sp, h, bb: (bb, h, sp, r, 0)),
            pl.BlockSpec((None, None, None, cfg.block_r), lambda r, sp, h, bb: (bb, h, sp, r)),
            pl.BlockSpec((None, None, None, cfg.block_r), lambda r, sp, h, bb: (bb, h, sp, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kv, s, rows_pad, hd), partial_dtype),
            jax.ShapeDtypeStruct((b, kv, s, rows_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, kv, s, rows_pad), jnp.float32),
        ],
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="tree_attention",
    )(lengths, q_in, k_cache, v_cache, k_tree, v_tree, bits)
    out = _combine(o, m, l, rows)  # [B, kv, N * group, hd]
    out = out.reshape(b, kv, n, group, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, n, nh, hd).astype(dtype)


def tree_attention(q, k_cache, v_cache, lengths, k_tree, v_tree, ancestor_bits, *, scale, impl="xla",
                   block_r=None, block_k=None, block_t=None, num_splits=None, num_warps=None,
                   num_stages=None, num_sms=H200_SMS, partial_dtype=None, row_gather=True,
                   min_split=MIN_SPLIT_KEYS):
    """Attention of N tree nodes over the committed cache (< lengths[b]) and their tree ancestors.

    q [B, N, nh, hd]; k_cache, v_cache [B, kv, capacity, hd]; lengths [B] int32;
    k_tree, v_tree [B, N, kv, hd]; ancestor_bits [B, N, ceil(N/32)] uint32 (bit j of node i set
    iff j is i or an ancestor). Returns [B, N, nh, hd] in q.dtype.
    impl: "xla" (pure-jnp reference), "pallas" (Triton kernel), "pallas_interpret" (the same
    kernel through Pallas' interpreter, CPU). Tuning arguments apply to the Pallas kernel only
    (None = chosen from the shapes, see choose_config). row_gather=False lays the query rows and
    their bit rows out with a small XLA prologue instead of gathering them in the kernel (a
    fallback should a Triton build reject the gather loads). Jit-compatible; call under jax.jit.
    """
    check_impl(impl)
    if impl == "xla":
        return reference(q, k_cache, v_cache, lengths, k_tree, v_tree, ancestor_bits, scale=scale)
    dtypes = {x.dtype for x in (q, k_cache, v_cache, k_tree, v_tree)}
    if len(dtypes) != 1:
        # the kernel reads everything in q's dtype; converting would copy the cache
        raise ValueError(f"q, cache and tree K/V must share a dtype, got {sorted(map(str, dtypes))}")
    return tree_attention_pallas(
        q, k_cache, v_cache, lengths, k_tree, v_tree, ancestor_bits, scale=scale,
        interpret=impl == "pallas_interpret", partial_dtype=partial_dtype, row_gather=row_gather,
        block_r=block_r, block_k=block_k,
        block_t=block_t, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, num_sms=num_sms,
        min_split=min_split,
    )
