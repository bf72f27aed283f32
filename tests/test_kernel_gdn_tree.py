"""gdn_tree_verify: the Pallas kernel (`impl`: interpreted on CPU, native under -m gpu) against the
jnp reference, the reference against a float64 per-path sequential oracle, and (-m gpu) the kernel
at the 27B GDN layer.

Shapes are fixed per configuration so one compilation serves every hypothesis example. The
interpreter fills outputs with NaN before the kernel runs, so an unwritten output fails the
NaN checks (poisoned outputs). On the GPU, bf16 inputs take TF32 products: 1e-2 there.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ddtree_jax.tree import ancestor_bits_from_parents, root_path
from pallas_kernels.gdn_tree import gdn_tree_verify
from scripts.bench.kernels_gdn import gdn_args, gdn_problem
from tests.jaxpr_eqns import equations
from tests.tolerance import by_impl

B, HK, H = 2, 2, 4  # two value heads per key head
SHAPES = ("random", "chain", "star", "deep", "bushy", "two_chains")


# ---- trees and inputs ----------------------------------------------------------------------
def make_parents(kind, n, rng):
    """Parent array of an n-node tree in topological order (parent[i] < i, root = 0)."""
    parents = [-1]
    for i in range(1, n):
        if kind == "chain":
            p = i - 1
        elif kind == "star":
            p = 0
        elif kind == "deep":
            p = i - 1 if rng.random() < 0.8 else int(rng.integers(0, i))
        elif kind == "bushy":
            p = int(rng.integers(max(0, i - 4), i))
        elif kind == "two_chains":
            p = 0 if i <= 2 else i - 2
        else:
            p = int(rng.integers(0, i))
        parents.append(p)
    return parents




def pack_bits(parents, n_slots, zero_padding_rows=False):
    """[n_slots, ceil(n_slots/32)] uint32 ancestor-or-self words; slots past the tree are padding
    that sees only itself (or nothing at all: the kernel then forces self)."""
    words = np.zeros((n_slots, -(-n_slots // 32)), np.uint32)
    for i in range(n_slots):
        members = root_path(parents, i) if i < len(parents) else ([] if zero_padding_rows else [i])
        for j in members:
            words[i, j // 32] |= np.uint32(1 << (j % 32))
    return words


def draw_inputs(seed, n, dk, dv, hk=HK, h=H, g_scale=2.0):
    rng = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(B, hk, n, dk))) * dk**-0.5
    k = unit(rng.normal(size=(B, hk, n, dk)))
    v = rng.normal(size=(B, h, n, dv))
    g = -rng.uniform(0.01, g_scale, size=(B, h, n))
    beta = rng.uniform(0.05, 1.0, size=(B, h, n))
    state = rng.normal(size=(B, h, dk, dv))
    return q, k, v, g, beta, state


def tree_case(seed, kind, n_nodes, n_slots, zero_padding_rows=False):
    rng = np.random.default_rng(seed + 1)
    trees = [make_parents(kind, n_nodes, rng) for _ in range(B)]
    bits = np.stack([pack_bits(p, n_slots, zero_padding_rows) for p in trees])
    return trees, jnp.asarray(bits)


def oracle(q, k, v, g, beta, state, path, rep):
    """float64 recurrence over one root->node path; returns the last node's output."""
    s = np.array(state, np.float64)
    kh = lambda a, i: np.repeat(a[:, :, i], rep, axis=1)
    for i in path:
        s = s * np.exp(g[..., i])[..., None, None]
        mem = np.einsum("bhkv,bhk->bhv", s, kh(k, i))
        u = beta[..., i][..., None] * (v[:, :, i] - mem)
        s = s + kh(k, i)[..., :, None] * u[..., None, :]
    return np.einsum("bhkv,bhk->bhv", s, kh(q, path[-1]))


def assert_close(out, ref, tol):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(out).any(), "NaN in output (unwritten or masked after exp)"
    assert np.abs(ref).max() > 0
    err = np.abs(out - ref).max() / max(1.0, np.abs(ref).max())
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


f32 = lambda *xs: [jnp.asarray(x, jnp.float32) for x in xs]


@functools.cache
def kernel(impl, **kw):
    return jax.jit(functools.partial(gdn_tree_verify, impl=impl, **kw))


@functools.cache
def ref_fn():
    return jax.jit(functools.partial(gdn_tree_verify, impl="xla"))


# ---- the kernel against the reference --------------------------------------------------------
N64, DK, DV = 64, 16, 32


@settings(max_examples=12)
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(SHAPES),
    n=st.integers(1, N64),
    zero_pad=st.booleans(),
)
def test_kernel_matches_reference_multi_block(impl, seed, kind, n, zero_pad):
    """64 slots in 4 row blocks of 16 (blocked substitution across blocks, 2 bit words, the
    16-bit half-word offsets) and 2 dv tiles; trees of every shape with padding slots."""
    _, bits = tree_case(seed, kind, n, N64, zero_pad)
    args = (*f32(*draw_inputs(seed, N64, DK, DV)), bits)
    out = kernel(impl, block_n=16, block_dv=16)(*args)
    assert_close(out, ref_fn()(*args), 1e-5)


@settings(max_examples=4)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(SHAPES))
def test_kernel_matches_reference_wide_blocks(impl, seed, kind):
    """128 slots in 2 row blocks of 64: each mask tile spans two 32-bit words; dk chunked."""
    _, bits = tree_case(seed, kind, 128, 128)
    args = (*f32(*draw_inputs(seed, 128, 32, 16)), bits)
    out = kernel(impl, block_n=64, block_dv=16, block_k=16)(*args)
    assert_close(out, ref_fn()(*args), 1e-5)


@settings(max_examples=5)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(SHAPES), n=st.integers(1, 32))
def test_kernel_bf16_inputs(impl, seed, kind, n):
    """bf16 q, k, v (float32 math inside): both sides see the same rounded inputs."""
    _, bits = tree_case(seed, kind, n, 32)
    q, k, v, g, beta, state = draw_inputs(seed, 32, DK, DV)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (bf(q), bf(k), bf(v), *f32(g, beta, state), bits)
    out = kernel(impl)(*args)
    assert out.dtype == jnp.float32
    assert_close(out, ref_fn()(*args), by_impl(impl, 1e-5, 1e-2))
    out16 = kernel(impl, out_dtype=jnp.bfloat16)(*args)
    assert out16.dtype == jnp.bfloat16
    assert_close(out16, ref_fn()(*args), 1e-2)


@settings(max_examples=4)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(SHAPES), n=st.integers(1, 23))
def test_kernel_pads_odd_shapes(impl, seed, kind, n):
    """N = 23, dk = 12, dv = 20 and no head grouping: padded to 32 / 16 / 32 inside."""
    _, bits = tree_case(seed, kind, n, 23)
    args = (*f32(*draw_inputs(seed, 23, 12, 20, hk=H)), bits)
    out = kernel(impl)(*args)
    assert out.shape == (B, H, 23, 20)
    assert_close(out, ref_fn()(*args), 1e-5)


@settings(max_examples=6)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(SHAPES), n=st.sampled_from([1, 5, 9, 13, 23, 40]),
       bf16=st.booleans())
def test_masked_rows_equal_the_padded_form(impl, seed, kind, n, bf16):
    """An unpeeled tree of N nodes, N not a power of two >= 16 (DDTree-4 / -8: 5 / 9): the kernel
    reads the N rows masked (no XLA pads before it, N output rows) and gives the padded form's
    outputs (40 nodes in blocks of 16: the last block holds no node at all). The same arithmetic,
    but not bit for bit: the two programs' products are compiled apart (differences of float32
    rounding, ~3e-8, on the CPU)."""
    _, bits = tree_case(seed, kind, n, n)
    q, k, v, g, beta, state = draw_inputs(seed, n, DK, DV)
    cast = (lambda a: jnp.asarray(a, jnp.bfloat16)) if bf16 else (lambda a: jnp.asarray(a, jnp.float32))
    args = (cast(q), cast(k), cast(v), *f32(g, beta, state), bits)
    tiles = dict(block_n=16, block_dv=16) if n == 40 else {}
    masked = kernel(impl, **tiles)(*args)
    padded = kernel(impl, masked_rows=False, **tiles)(*args)
    assert masked.shape == (B, H, n, DV)
    assert_close(masked, padded, 1e-6)
    assert_close(masked, ref_fn()(*args), by_impl(impl, 1e-5, 1e-2) if bf16 else 1e-5)


def test_masked_rows_take_the_arrays_unpadded():
    """The masked form's kernel gets q / k / v / g / beta of N rows and writes N rows: no pad of
    them, no slice after it (the padded form pads all five); a peel refuses it."""
    def program(n, **kw):
        _, bits = tree_case(0, "random", n, n)
        args = (*f32(*draw_inputs(0, n, DK, DV)), bits)
        fn = functools.partial(gdn_tree_verify, impl="pallas_interpret", **kw)
        return jax.make_jaxpr(fn)(*args).jaxpr, args

    jaxpr, args = program(9)
    [eqn] = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert [v.aval.shape for v in eqn.invars[:5]] == [(B, HK, 9, DK)] * 2 + [(B, H, 9, DV), (B, H, 9), (B, H, 9)]
    assert [v.aval.shape for v in eqn.outvars] == [(B, H, 9, DV)]
    pads = lambda jx: sum(e.primitive.name == "pad" for e in equations(jx))
    assert pads(program(9, masked_rows=False)[0]) - pads(jaxpr) == 5
    with pytest.raises(ValueError, match="masked_rows is the unpeeled form"):
        gdn_tree_verify(*args, impl="pallas_interpret", masked_rows=True, peel_root=True)


def test_single_node_and_all_padding(impl):
    q, k, v, g, beta, state = f32(*draw_inputs(3, 16, DK, DV))
    for parents in ([-1], [-1, 0]):
        bits = jnp.asarray(np.stack([pack_bits(parents, 16)] * B))
        out = kernel(impl)(q, k, v, g, beta, state, bits)
        assert_close(out, ref_fn()(q, k, v, g, beta, state, bits), 1e-5)
    # A lone node is one recurrent step from the committed state.
    bits = jnp.asarray(np.stack([pack_bits([-1], 16)] * B))
    out = np.asarray(kernel(impl)(q, k, v, g, beta, state, bits))
    one = oracle(*map(np.asarray, (q, k, v, g, beta, state)), [0], H // HK)
    np.testing.assert_allclose(out[:, :, 0], one, rtol=1e-5, atol=1e-5)


def test_strong_decay_needs_mask_before_exp(impl):
    """g down to -40 per node: non-ancestor exponents G_i - G_j reach +1000s (exp overflows),
    so masking after exp would give inf * 0 = NaN."""
    rng = np.random.default_rng(7)
    n = N64
    parents = make_parents("two_chains", n, rng)
    bits = jnp.asarray(np.stack([pack_bits(parents, n)] * B))
    q, k, v, g, beta, state = draw_inputs(7, n, DK, DV, g_scale=40.0)
    args = (*f32(q, k, v, g, beta, state), bits)
    out = kernel(impl, block_n=16, block_dv=16)(*args)
    ref = ref_fn()(*args)
    assert_close(out, ref, 1e-5)
    for i in (1, 2, 17, n - 1):
        np.testing.assert_allclose(
            np.asarray(out)[:, :, i], oracle(q, k, v, g, beta, state, root_path(parents, i), H // HK),
            rtol=1e-4, atol=1e-6
        )


def test_bits_from_tree_module(impl):
    """The kernel reads Tree.ancestor_bits as built on device by ddtree_jax.tree."""
    rng = np.random.default_rng(11)
    parents = np.array([make_parents("random", 40, rng) + [-1] * 24 for _ in range(B)], np.int32)
    bits = ancestor_bits_from_parents(jnp.asarray(parents), max_depth=39)
    args = (*f32(*draw_inputs(11, N64, DK, DV)), bits)
    assert_close(kernel(impl, block_n=16, block_dv=16)(*args), ref_fn()(*args), 1e-5)


# ---- the reference against the float64 per-path oracle ---------------------------------------
N_ORACLE = 24


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(SHAPES), n=st.integers(1, N_ORACLE))
def test_reference_equals_each_path_run_sequentially(seed, kind, n):
    trees, bits = tree_case(seed, kind, n, N_ORACLE)
    q, k, v, g, beta, state = draw_inputs(seed, N_ORACLE, DK, DV)
    out = np.asarray(ref_fn()(*f32(q, k, v, g, beta, state), bits))
    for i in range(n):
        for b in range(B):
            path = root_path(trees[b], i)
            sl = lambda a: a[b : b + 1]
            want = oracle(*map(sl, (q, k, v, g, beta, state)), path, H // HK)
            np.testing.assert_allclose(out[b : b + 1, :, i], want, rtol=1e-5, atol=1e-5)


def test_impl_switch_validation():
    args = (*f32(*draw_inputs(0, 16, DK, DV)), jnp.asarray(np.stack([pack_bits([-1], 16)] * B)))
    with pytest.raises(ValueError):
        gdn_tree_verify(*args, impl="cuda")
    with pytest.raises(ValueError):
        gdn_tree_verify(*args, impl="pallas_interpret", block_n=8)


# ---- root peel: node 0 solved on its own, the rest as an (N - 1)-node blocked tree ------------
@settings(max_examples=8)
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(SHAPES),
    n=st.integers(2, 33),
    zero_pad=st.booleans(),
)
def test_kernel_root_peel_matches_reference(impl, seed, kind, n, zero_pad):
    """Forced peel on 33 slots (32 left after the root: 2 row blocks of 16, 1 bit word after the
    shift across the 32-bit boundary); padding slots do not descend from node 0."""
    _, bits = tree_case(seed, kind, n, 33, zero_pad)
    args = (*f32(*draw_inputs(seed, 33, DK, DV)), bits)
    out = kernel(impl, block_n=16, block_dv=16, peel_root=True)(*args)
    assert out.shape == (B, H, 33, DV)
    assert_close(out, ref_fn()(*args), 1e-5)


@settings(max_examples=6)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(SHAPES), n=st.integers(2, 30), zero_pad=st.booleans())
def test_kernel_root_peel_with_padded_rows(impl, seed, kind, n, zero_pad):
    """Forced peel where N - 1 is not a power of two (30 slots: 29 rows padded to 32): the form
    with the root in its own refs and the rows sliced and padded (not the in-place form)."""
    _, bits = tree_case(seed, kind, n, 30, zero_pad)
    args = (*f32(*draw_inputs(seed, 30, DK, DV)), bits)
    out = kernel(impl, block_n=16, block_dv=16, peel_root=True)(*args)
    assert out.shape == (B, H, 30, DV)
    assert_close(out, ref_fn()(*args), 1e-5)


def test_in_place_peel_reads_whole_arrays():
    """Root + 2^j nodes with power-of-two head dims: the kernel gets q / k / v / g / beta whole
    (node 0 included) and writes all N outputs, so no slice before it and no concatenation after
    it; a 30-node peel still passes the root and the padded rows apart."""
    import functools as ft

    def kernel_call(n):
        _, bits = tree_case(0, SHAPES[0], n, n)
        args = (*f32(*draw_inputs(0, n, DK, DV)), bits)
        fn = ft.partial(gdn_tree_verify, impl="pallas_interpret", peel_root=True, block_n=16, block_dv=16)
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
        [eqn] = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        return [v.aval.shape for v in eqn.invars], [v.aval.shape for v in eqn.outvars]

    ins, outs = kernel_call(17)
    assert ins[0] == (B, HK, 17, DK) and ins[2] == (B, H, 17, DV) and outs == [(B, H, 17, DV)]
    ins, outs = kernel_call(30)
    assert ins[0] == (B, HK, 32, DK) and len(outs) == 2  # rows 1.. padded to 32, the root apart


@settings(max_examples=3)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(SHAPES))
def test_kernel_root_peel_auto_at_budget_plus_one(impl, seed, kind):
    """N = 17 (root + 16 drafts) peels by default (16 rows instead of 32); bf16 inputs."""
    _, bits = tree_case(seed, kind, 17, 17)
    q, k, v, g, beta, state = draw_inputs(seed, 17, DK, DV)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (bf(q), bf(k), bf(v), *f32(g, beta, state), bits)
    tol = by_impl(impl, 1e-5, 1e-2)
    assert_close(kernel(impl)(*args), ref_fn()(*args), tol)
    assert_close(kernel(impl, peel_root=False)(*args), ref_fn()(*args), tol)


def test_shift_bits_drops_node_zero():
    from pallas_kernels._common import shift_bits

    rng = np.random.default_rng(5)
    parents = make_parents("random", 70, rng)
    words = pack_bits(parents, 70)  # 3 words
    shifted, bit0 = shift_bits(jnp.asarray(words[None]))
    shifted, bit0 = np.asarray(shifted[0]), np.asarray(bit0[0])
    for i in range(1, 70):
        want = {j - 1 for j in root_path(parents, i) if j > 0}
        got = {j for j in range(69) if (int(shifted[i - 1, j // 32]) >> (j % 32)) & 1}
        assert got == want
        assert bit0[i - 1] == 1.0


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(SHAPES), n=st.sampled_from([17, 30]))
def test_split_state_products(impl, seed, kind, n):
    """SPLIT_STATE: the products with the float32 state as two bf16 passes (S0 = hi + lo) keep ~16
    mantissa bits (bf16 inputs, in place and sliced root peels; on the GPU the other products
    stay TF32); float32 inputs ignore it."""
    import pallas_kernels.gdn_tree as gt

    _, bits = tree_case(seed, kind, n, n)
    q, k, v, g, beta, state = draw_inputs(seed, n, DK, DV)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (bf(q), bf(k), bf(v), *f32(g, beta, state), bits)
    f32_args = (*f32(q, k, v, g, beta, state), bits)
    # a new partial per call: jax caches traces by function, and the switch is read when tracing
    run = lambda *a: jax.jit(functools.partial(gdn_tree_verify, impl=impl, block_n=16, block_dv=16))(*a)
    old = gt.SPLIT_STATE
    try:
        gt.SPLIT_STATE = True
        split, split32 = run(*args), run(*f32_args)
        gt.SPLIT_STATE = False
        exact, exact32 = run(*args), run(*f32_args)  # interpreted: exact float32 products; native: TF32
    finally:
        gt.SPLIT_STATE = old
    assert_close(split, ref_fn()(*args), by_impl(impl, 1e-4, 1e-2))
    assert_close(split32, ref_fn()(*f32_args), 1e-5)
    assert not np.array_equal(np.asarray(split), np.asarray(exact))  # the split path did run
    assert np.array_equal(np.asarray(split32), np.asarray(exact32))  # float32 inputs: untouched


# ---- -m gpu: the 27B GDN layer (16 k / 48 v heads of 128) --------------------------------------
@pytest.mark.parametrize("n, kind", [(9, "ddtree"), (16, "ddtree"), (64, "ddtree"), (128, "ddtree"), (256, "ddtree"),
                                     (16, "chain")])
@pytest.mark.parametrize("b", [1, 8])
def test_native_at_the_27b_layer(gpu_impl, n, kind, b):
    """DDTree-like trees (depth <= 15, a different tree per sequence; 9 nodes: the masked rows) and
    a 16-chain (linear DFlash), batch 1 and 8: bf16 q / k / v (TF32 products) within 1e-2 of the
    float32 reference, float32 inputs (tf32x3 products) within 1e-5; the bf16 form also writes bf16
    outputs."""
    pb = gdn_problem(1000 + n + b, b, n, kind)
    for dtype, tol in ((jnp.bfloat16, 1e-2), (jnp.float32, 1e-5)):
        args = gdn_args(pb, dtype)
        assert_close(kernel(gpu_impl)(*args), ref_fn()(*args), tol)
    args = gdn_args(pb, jnp.bfloat16)
    assert_close(kernel(gpu_impl, out_dtype=jnp.bfloat16)(*args), ref_fn()(*args), 2e-2)
