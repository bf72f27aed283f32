"""Tree attention: the Pallas kernel (`impl`: interpret mode on CPU, native under -m gpu; -m gpu
also at the 27B attention layer) against the pure-jnp reference, and the reference against the
model's attend() with dense masks.

Every kernel configuration below has fixed (padded) shapes so one compilation serves all the
hypothesis examples drawn for it: tree shapes (chain, star, random, single node, padding), cache
lengths (0, full, not a multiple of the block, different per batch row), GQA groups 1 / 2 / 4,
head_dim 16 / 32 / 64, float32 and bfloat16.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ddtree_jax.models.attention import attend
from ddtree_jax.tree import ancestor_bits_from_parents, bits_to_dense
from pallas_kernels.tree_attention import choose_config, tree_attention
from scripts.bench.kernels_attention import attention_lengths, attention_problem
from scripts.bench.shapes import ATTENTION_27B

KINDS = ("chain", "star", "random", "padded", "forest")


def make_parents(rng, b, n, kind):
    par = np.full((b, n), -1, np.int32)
    for bb in range(b):
        k = kind if kind != "mixed" else KINDS[bb % len(KINDS)]
        valid = n if k != "padded" else int(rng.integers(1, n + 1))
        for i in range(1, valid):
            if k == "chain":
                par[bb, i] = i - 1
            elif k == "star":
                par[bb, i] = 0
            elif k == "forest":  # some nodes with no parent (see only themselves in the tree)
                par[bb, i] = rng.integers(-1, i)
            else:
                par[bb, i] = rng.integers(0, i)
    return par


def make_inputs(seed, b, n, kv, group, hd, cap, lengths, kind, dtype):
    rng = np.random.default_rng(seed)

    def rand(*shape):
        x = rng.standard_normal(shape).astype(np.float32)
        x = np.where(np.abs(x) < 1e-3, 1e-3, x)  # no exact zeros
        return jnp.asarray(x, dtype)

    q = rand(b, n, kv * group, hd) * 2.0  # sharper softmax than unit scores
    kc, vc = rand(b, kv, cap, hd), rand(b, kv, cap, hd)
    kt, vt = rand(b, n, kv, hd), rand(b, n, kv, hd)
    parents = make_parents(rng, b, n, kind)
    bits = ancestor_bits_from_parents(jnp.asarray(parents), max(n - 1, 0))
    return q, kc, vc, jnp.asarray(lengths, jnp.int32), kt, vt, bits


@functools.lru_cache(maxsize=None)
def kernel_fn(impl, **tuning):
    hd_scale = tuning.pop("scale")
    return jax.jit(lambda *a: tree_attention(*a, scale=hd_scale, impl=impl, **tuning))


@functools.lru_cache(maxsize=None)
def ref_fn(scale):
    return jax.jit(lambda *a: tree_attention(*a, scale=scale, impl="xla"))


@functools.lru_cache(maxsize=None)
def attend_fn(scale):
    return jax.jit(lambda q, kc, vc, cm, kt, vt, vis: attend(q, [(kc, vc, cm), (kt, vt, vis)], scale))


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def check(impl, inputs, tol, **tuning):
    hd = inputs[0].shape[-1]
    scale = hd**-0.5
    out = kernel_fn(impl, scale=scale, **tuning)(*inputs)
    assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype
    assert not np.isnan(np.asarray(out, np.float32)).any()
    f32 = [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in inputs]
    ref = ref_fn(scale)(*f32)  # float32 math on the same (rounded) inputs
    err = rel_err(out, ref)
    assert err <= tol, err
    return out


lengths_st = lambda b, cap: st.lists(st.integers(0, cap), min_size=b, max_size=b)


# ---- float32: several splits, blocks smaller than the cache, N not a power of two ----------
B1, N1, KV1, G1, HD1, CAP1 = 3, 7, 2, 2, 32, 50


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31), lengths=lengths_st(B1, CAP1), kind=st.sampled_from(KINDS + ("mixed",)))
def test_fp32_splits_and_lengths(impl, seed, lengths, kind):
    inputs = make_inputs(seed, B1, N1, KV1, G1, HD1, CAP1, lengths, kind, jnp.float32)
    check(impl, inputs, 1e-5, block_k=16, block_r=16, block_t=16, num_splits=3)


def test_fp32_edge_lengths(impl):
    """Length 0 (tree only), full capacity, one key, a block boundary +- 1."""
    inputs = make_inputs(1, B1, N1, KV1, G1, HD1, CAP1, [0, CAP1, 1], "mixed", jnp.float32)
    check(impl, inputs, 1e-5, block_k=16, block_r=16, block_t=16, num_splits=3)
    inputs = make_inputs(2, B1, N1, KV1, G1, HD1, CAP1, [15, 16, 17], "random", jnp.float32)
    check(impl, inputs, 1e-5, block_k=16, block_r=16, block_t=16, num_splits=3)


# ---- group 1, head_dim 16, a single node (decode shape) -----------------------------------
@settings(max_examples=6)
@given(seed=st.integers(0, 2**31), lengths=lengths_st(2, 40))
def test_fp32_single_node_group1(impl, seed, lengths):
    inputs = make_inputs(seed, 2, 1, 2, 1, 16, 40, lengths, "chain", jnp.float32)
    check(impl, inputs, 1e-5, block_k=16, num_splits=2)


# ---- group 4, head_dim 64, N = 40 (two bit words, tree blocks of 32 and 64) -----------------
@settings(max_examples=5)
@given(seed=st.integers(0, 2**31), lengths=lengths_st(2, 70), kind=st.sampled_from(KINDS + ("mixed",)))
def test_fp32_two_words_group4(impl, seed, lengths, kind):
    inputs = make_inputs(seed, 2, 40, 1, 4, 64, 70, lengths, kind, jnp.float32)
    check(impl, inputs, 1e-5, block_k=32, block_r=64, block_t=64, num_splits=2)


def test_fp32_tree_block_32(impl):
    inputs = make_inputs(3, 2, 40, 1, 4, 64, 70, [70, 33], "random", jnp.float32)
    check(impl, inputs, 1e-5, block_k=32, block_r=64, block_t=32, num_splits=2)


# ---- bfloat16 (bf16 partials), default configuration chosen from the shapes -----------------
@settings(max_examples=4)
@given(seed=st.integers(0, 2**31), lengths=lengths_st(2, 96), kind=st.sampled_from(KINDS + ("mixed",)))
def test_bf16_default_config(impl, seed, lengths, kind):
    inputs = make_inputs(seed, 2, 12, 2, 2, 32, 96, lengths, kind, jnp.bfloat16)
    check(impl, inputs, 1e-2)


def test_bf16_matches_xla_bf16(impl):
    inputs = make_inputs(5, 2, 12, 2, 2, 32, 96, [96, 40], "random", jnp.bfloat16)
    out = check(impl, inputs, 1e-2)
    ref = ref_fn(32**-0.5)(*inputs)
    assert rel_err(out, ref) <= 1e-2


# ---- the reference is the model's attention ---------------------------------------------
@settings(max_examples=8)
@given(seed=st.integers(0, 2**31), lengths=lengths_st(2, 24), kind=st.sampled_from(KINDS + ("mixed",)),
       group=st.sampled_from([1, 3]))
def test_reference_equals_attend(seed, lengths, kind, group):
    b, n, kv, hd, cap = 2, 9, 2, 16, 24
    q, kc, vc, lens, kt, vt, bits = make_inputs(seed, b, n, kv, group, hd, cap, lengths, kind, jnp.float32)
    committed = jnp.broadcast_to(jnp.arange(cap)[None, None, :] < lens[:, None, None], (b, n, cap))
    visible = bits_to_dense(bits, n)
    want = attend_fn(hd**-0.5)(q, kc, vc, committed, jnp.swapaxes(kt, 1, 2), jnp.swapaxes(vt, 1, 2), visible)
    got = ref_fn(hd**-0.5)(q, kc, vc, lens, kt, vt, bits)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# ---- configuration choice -----------------------------------------------------------------
def test_choose_config_fills_the_gpu():
    # Qwen3.6-27B layer: 24 q / 4 kv heads, head_dim 256; batch 1, 64 nodes, 8k cache
    cfg = choose_config(1, 64, 4, 6, 256, 8192)
    programs = -(-64 * 6 // cfg.block_r) * 4 * cfg.num_splits
    assert programs >= 0.9 * 132 and cfg.block_r in (16, 32, 64, 128)
    # decode (one node): all splits, one row block
    cfg = choose_config(1, 1, 4, 6, 256, 32768)
    assert cfg.block_r == 16 and cfg.num_splits >= 30
    # batch 8: few splits
    assert choose_config(8, 64, 4, 6, 256, 8192).num_splits <= 4
    # a 35B-A3B decode step (2 kv heads, 4k): splits of >= min_split keys of capacity bound the count
    assert choose_config(1, 1, 2, 8, 256, 4160).num_splits == 32  # MIN_SPLIT_KEYS 128
    assert choose_config(1, 1, 2, 8, 256, 4160, min_split=256).num_splits == 16
    assert choose_config(1, 1, 2, 8, 256, 4160, min_split=64).num_splits == 60  # 120 programs: 91 % of 132


def test_rejects_bad_arguments():
    inputs = make_inputs(0, 1, 3, 1, 2, 16, 16, [4], "chain", jnp.float32)
    with pytest.raises(ValueError):
        tree_attention(*inputs, scale=0.25, impl="cuda")
    with pytest.raises(ValueError):
        tree_attention(*inputs, scale=0.25, impl="pallas_interpret", block_k=24)
    q, kc, vc, lens, kt, vt, bits = inputs
    with pytest.raises(ValueError):
        tree_attention(q, kc.astype(jnp.bfloat16), vc, lens, kt, vt, bits, scale=0.25, impl="pallas_interpret")


def test_row_layout_fallback(impl):
    """row_gather=False (rows laid out by an XLA prologue) gives the same result."""
    inputs = make_inputs(11, B1, N1, KV1, G1, HD1, CAP1, [50, 0, 23], "mixed", jnp.float32)
    a = check(impl, inputs, 1e-5, block_k=16, block_r=16, block_t=16, num_splits=3)
    b = check(impl, inputs, 1e-5, block_k=16, block_r=16, block_t=16, num_splits=3, row_gather=False)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@settings(max_examples=200, deadline=None)
@given(length=st.integers(0, 9000), splits=st.integers(1, 16), block_k=st.sampled_from([16, 32, 64]),
       nodes=st.integers(1, 300), block_t=st.sampled_from([16, 32, 64]))
def test_split_bounds_cover_the_cache_and_balance_the_tree_keys(length, splits, block_k, nodes, block_t):
    """The splits cover [0, length) once, in order; the last one (which also runs the tree keys)
    is no longer than the split length, and no split runs more than the balanced share."""
    from pallas_kernels.tree_attention import split_bounds

    tree_keys = -(-nodes // block_t) * block_t
    bounds = [tuple(int(x) for x in split_bounds(length, s, splits, block_k, tree_keys)) for s in range(splits)]
    covered = [k for a, e in bounds for k in range(a, e)]
    assert covered == list(range(length))
    # round_up(cdiv(L + T, S), block_k); B002 misreads the ceil division -(-a // b) as a decrement
    share = -(-(-(-(length + tree_keys) // splits)) // block_k) * block_k  # noqa: B002
    work = [e - a for a, e in bounds]
    work[-1] += tree_keys
    assert max(work[:-1] + [0]) <= share
    assert work[-1] <= max(share, tree_keys)


@pytest.mark.parametrize("b, n, cap, dtype, tol", [
    (1, 64, 8192, jnp.bfloat16, 1e-2), (8, 256, 2048, jnp.bfloat16, 1e-2), (1, 1, 8192, jnp.bfloat16, 1e-2),
    (1, 64, 8192, jnp.float32, 1e-5), (8, 16, 4096, jnp.float32, 1e-5), (2, 256, 1024, jnp.float32, 1e-5)])
def test_native_at_the_27b_layer(gpu_impl, b, n, cap, dtype, tol):
    """The 27B attention layer (24 q / 4 kv heads of 256) on DDTree-like trees, a decode step (one
    node) and ragged cache lengths at batch 8: relative error against the float32 reference on the
    same inputs within 1e-5 for float32, 1e-2 for bf16."""
    dims = dict(nq=ATTENTION_27B["heads"], nkv=ATTENTION_27B["kv_heads"], hd=ATTENTION_27B["head_dim"])
    [inputs] = attention_problem(jax.random.PRNGKey(10 + n + b), b, n, cap, attention_lengths(b, cap),
                                 dtype, **dims)
    check(gpu_impl, inputs, tol)
