"""pallas_kernels/attn_prologue.py: the q / k norms and RoPE of an attention layer from its merged
q | k | v product in one kernel, and its K / V written into the cache in place, against its jnp
reference (`impl`: the interpreter, natively under -m gpu), its sm_90 lowering (offline, no GPU),
and the model routes (routes.attention_prologue_kernel, attention_prologue_writes_kv) against the
XLA forms."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.ref.rope import rope_cos_sin
from pallas_kernels.attn_prologue import attn_prologue, kernel_problems, row_block, written_cache
from scripts.offline_triton_compile import capture_ttir, compile_ttir

B, NH, KV, HD, ROT = 2, 4, 2, 32, 8


def _inputs(t, seed, dtype, gated):
    rng = np.random.default_rng(seed)
    width = NH * HD * (2 if gated else 1) + 2 * KV * HD + 3  # extra columns the kernel must not read
    proj = jnp.asarray(rng.normal(size=(B, t, width)), dtype)
    qw, kw = (jnp.asarray(rng.normal(size=HD) * 0.3, dtype) for _ in range(2))
    cos, sin = rope_cos_sin(jnp.asarray(rng.integers(0, 4096, (B, t))), ROT, 10000.0)
    return proj, qw, kw, cos, sin


PROLOGUE = {(impl, gated, zc): jax.jit(functools.partial(attn_prologue, impl=impl, num_heads=NH, num_kv_heads=KV,
                                                         head_dim=HD, gated=gated, eps=1e-6, zero_centered=zc))
            for impl in ("xla", "pallas_interpret", "pallas") for gated in (False, True) for zc in (False, True)}


@settings(max_examples=12, deadline=None)
@given(t=st.sampled_from([1, 3, 16, 17]), seed=st.integers(0, 2**31 - 1), bf16=st.booleans(), gated=st.booleans(),
       zc=st.booleans())
def test_kernel_equals_reference(impl, t, seed, bf16, gated, zc):
    """One token (decode), 3, 16 and 17 rows (a DFlash block, a DDTree-16 verify: a masked last row block),
    gated (Qwen3.5: a gate half after each q head) or not, zero-centered norm weights or plain:
    q, k, v agree (float32 to rounding; bf16 within one ulp of the value: the reference's RoPE
    rounds each product)."""
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    args = _inputs(t, seed, dtype, gated)
    want, got = PROLOGUE[("xla", gated, zc)](*args), PROLOGUE[(impl, gated, zc)](*args)
    for name, w, g in zip("qkv", want, got):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        w32, g32 = np.asarray(w, np.float32), np.asarray(g, np.float32)
        if bf16:
            np.testing.assert_allclose(g32, w32, rtol=2**-7, atol=2**-7, err_msg=name)
        else:
            np.testing.assert_allclose(g32, w32, rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))  # v: a copy


CAP = 24
CACHED = {(impl, cache_f32): jax.jit(lambda p, qw, kw, c, s, kc, vc, st, impl=impl: attn_prologue(
    p, qw, kw, c, s, num_heads=NH, num_kv_heads=KV, head_dim=HD, gated=True, eps=1e-6, zero_centered=True,
    impl=impl, cache=(kc, vc), start=st)) for impl in ("xla", "pallas_interpret", "pallas") for cache_f32 in (0, 1)}


@settings(max_examples=10, deadline=None)
@given(t=st.sampled_from([1, 3, 17]), seed=st.integers(0, 2**31 - 1), bf16=st.booleans(), cache_f32=st.booleans(),
       starts=st.tuples(st.integers(0, CAP + 4), st.integers(0, CAP + 4)))
def test_kernel_writes_the_cache_in_place(impl, t, seed, bf16, cache_f32, starts):
    """Given a K / V cache and offsets, the kernel's k / v programs write their rows into it
    (aliased): q / k / v bit-equal to the kernel without a cache, and the caches equal to the
    reference's write (lax.dynamic_update_slice, offsets past capacity - T clamped) of those k / v,
    every other row untouched; a float32 cache takes the rows cast. The XLA form does the same."""
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    proj, qw, kw, cos, sin = _inputs(t, seed, dtype, True)
    rng = np.random.default_rng(seed + 1)
    cdt = jnp.float32 if cache_f32 else dtype
    kc, vc = (jnp.asarray(rng.normal(size=(B, KV, CAP, HD)), cdt) for _ in range(2))
    start = jnp.asarray(starts, jnp.int32)
    plain = PROLOGUE[(impl, True, True)](proj, qw, kw, cos, sin)
    for form in dict.fromkeys(("xla", impl)):
        q, k, v, kc2, vc2 = CACHED[(form, int(cache_f32))](proj, qw, kw, cos, sin, kc, vc, start)
        if form == impl:
            for name, a, b in zip("qkv", (q, k, v), plain):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        want_k, want_v = written_cache((kc, vc), k, v, start)
        assert kc2.dtype == cdt and kc2.shape == kc.shape
        np.testing.assert_array_equal(np.asarray(kc2), np.asarray(want_k))
        np.testing.assert_array_equal(np.asarray(vc2), np.asarray(want_v))


def test_row_blocks_and_refusals():
    assert [row_block(t) for t in (1, 2, 3, 13, 16, 17, 65)] == [1, 2, 4, 16, 16, 16, 16]
    assert kernel_problems(256, 64) == [] and "power of two" in kernel_problems(96, 32)[0]
    assert "rotary_dim" in kernel_problems(128, 0)[0]
    proj, qw, kw, cos, sin = _inputs(3, 0, jnp.float32, False)
    with pytest.raises(ValueError, match="fewer than q \\| k \\| v"):
        attn_prologue(proj[..., :10], qw, kw, cos, sin, num_heads=NH, num_kv_heads=KV, head_dim=HD, gated=False,
                      eps=1e-6, zero_centered=False, impl="pallas_interpret")
    kc = jnp.zeros((B, KV, 2, HD))
    with pytest.raises(ValueError, match=r"k cache \(2, 2, 2, 32\) is not .*capacity >= 3.*start must be \[2\]"):
        attn_prologue(proj, qw, kw, cos, sin, num_heads=NH, num_kv_heads=KV, head_dim=HD, gated=False,
                      eps=1e-6, zero_centered=False, impl="pallas_interpret", cache=(kc, kc))
    with pytest.raises(ValueError, match="cos / sin"):
        attn_prologue(proj, qw, kw, cos[:, :2], sin, num_heads=NH, num_kv_heads=KV, head_dim=HD, gated=False,
                      eps=1e-6, zero_centered=False, impl="pallas_interpret")


@pytest.mark.parametrize("t, cached", [(65, False), (1, False), (1, True)])
def test_lowers_for_sm90_at_the_27b_layer(t, cached, sm90):
    """The 27B attention layer (24 q heads gated, 4 kv heads of 256, rotary 64) at a DDTree-64
    verify's 65 rows and a decode step's 1 (also writing a 4k cache) lowers to one Triton kernel;
    with pip's triton, compiled for sm_90 without spills."""
    nh, kv, hd, rot = 24, 4, 256, 64
    shapes = (jax.ShapeDtypeStruct((1, t, 2 * nh * hd + 2 * kv * hd), jnp.bfloat16),
              jax.ShapeDtypeStruct((hd,), jnp.bfloat16), jax.ShapeDtypeStruct((hd,), jnp.bfloat16),
              jax.ShapeDtypeStruct((1, t, rot), jnp.float32), jax.ShapeDtypeStruct((1, t, rot), jnp.float32))
    kw = dict(num_heads=nh, num_kv_heads=kv, head_dim=hd, gated=True, eps=1e-6, zero_centered=True, impl="pallas")
    fn = functools.partial(attn_prologue, **kw)
    if cached:
        cache = jax.ShapeDtypeStruct((1, kv, 4160, hd), jnp.bfloat16)
        shapes += (cache, cache, jax.ShapeDtypeStruct((1,), jnp.int32))
        fn = lambda p, qw, kw_, c, s, kc, vc, st: attn_prologue(p, qw, kw_, c, s, cache=(kc, vc), start=st, **kw)
    [(name, ttir)] = capture_ttir(fn, *shapes)
    assert "attn_prologue" in name
    if not sm90:  # the default run: the lowering above; -m triton: the sm_90 checks below
        return
    res = compile_ttir(ttir, num_warps=4, num_stages=1)
    assert res["regs"] <= 255 and res["stack_bytes"] == 0, res


def test_decode_step_with_the_cache_written_by_the_prologue(impl):
    """routes.attention_prologue_writes_kv on: a tiny hybrid target's decode step gives the same
    logits and caches, bit for bit, as with XLA's write after the prologue, and its attention layers
    write K / V with no update slice of their own."""
    from flax import nnx

    from tests.jaxpr_eqns import equations
    from tests.tree_harness import kernel_route_case, routes_for

    cfg, gd, params, cache, *_ = kernel_route_case(43, 4)
    tok = jnp.asarray([3, 7], jnp.int32)

    def run(on):
        routes = routes_for(impl).replace(attention_prologue_writes_kv=on)

        def fn(p, c):
            h, _, c = nnx.merge(gd, p)(tok[:, None], c, jnp.ones((B,), jnp.int32), chunked=False, routes=routes)
            return h, c

        eqns = equations(jax.make_jaxpr(fn)(params, cache).jaxpr)
        writes = sum(e.primitive.name in ("scatter", "dynamic_update_slice") and e.outvars[0].aval.ndim == 4
                     for e in eqns)  # a [B, kv, capacity, hd] cache written outside a kernel
        return jax.jit(fn)(params, cache), writes

    (want, n_off), (got, n_on) = run(False), run(True)
    attn_layers = sum(kind == "attention" for kind in cfg.layer_types)
    assert (n_off, n_on) == (2 * attn_layers, 0)  # each layer's k and v update slices, then none
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.slow  # interpreted ~20-36 s (natively under -m gpu); the default run keeps the kernel's own tests and
# tests/test_kernels_in_model.py's generation with every kernel on, equal to plain greedy decoding
def test_model_route_gives_the_xla_forms_outputs(impl):
    """routes.attention_prologue_kernel on: a tiny hybrid target's decode step and tree verify +
    commit through the kernels give the XLA prologue's logits and caches, one kernel per attention
    layer and call."""
    from flax import nnx

    from tests.tree_harness import kernel_route_case, routes_for, verify_and_commit

    cfg, gd, params, cache, tokens, parents, path, counts = kernel_route_case(43, 4)
    tok = jnp.asarray([3, 7], jnp.int32)

    def run(on):
        routes = routes_for(impl).replace(attention_prologue_kernel=on)
        tree_pass = verify_and_commit(gd, tokens, parents, path, counts, routes)

        def fn(p, c):
            step = nnx.merge(gd, p)(tok[:, None], c, jnp.ones((B,), jnp.int32), chunked=False, routes=routes)
            return (*tree_pass(p, c), step)

        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # the kernel route takes these layers silently
            text = str(jax.make_jaxpr(fn)(params, cache))
        return jax.jit(fn)(params, cache), text.count("name=attn_prologue")

    (want, n_off), (got, n_on) = run(False), run(True)
    attn_layers = sum(kind == "attention" for kind in cfg.layer_types)
    assert n_off == 0 and n_on == 2 * attn_layers  # the verify's and the decode step's
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-4, atol=1e-4)
