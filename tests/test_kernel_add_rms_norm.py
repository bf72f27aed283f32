"""The residual add + RMSNorm kernel (`impl`: interpret mode, natively under -m gpu) computes what
models.layers.RMSNorm computes on x + delta, in each norm mode and dtype, for rows that are not a
power of two wide; with delta as float32 split-K partial sums it adds them (in index order), rounds
to x's dtype, then adds x, in column chunks with a masked tail; bad inputs are named; the partials
form lowers for sm_90 without spills; a decode step and a verify with kernels route every add +
norm of a Qwen3.5-style stack through it (A/B switch announced when off) and keep the DFlash
features exact; (-m gpu) the 27B stream at a verify's 65 rows."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from ddtree_jax.models.layers import RMSNorm
from pallas_kernels.add_rms_norm import DEFAULT_WARPS, MODES, PARTS_CHUNK, PARTS_WARPS, add_rms_norm, reference
from scripts.bench import kernels as bench
from scripts.bench.shapes import GDN_27B
from scripts.offline_triton_compile import add_rms_norm_cases, capture_ttir, compile_ttir


@functools.partial(jax.jit, static_argnames=("mode", "impl"))
def _run(x, d, w, mode, impl):
    return add_rms_norm(x, d, w, eps=1e-6, mode=mode, impl=impl)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_add_rms_norm_matches_the_module(impl, mode, dtype, seed, scale):
    rng = np.random.default_rng(seed)
    h = 80  # not a power of two: the kernel pads to 128 and masks
    x = jnp.asarray(rng.normal(size=(2, 3, h)) * scale, dtype)
    d = jnp.asarray(rng.normal(size=(2, 3, h)) * scale, dtype)
    w = jnp.asarray(rng.normal(size=(h,)) * 0.5, dtype)
    norm = RMSNorm(h, 1e-6, zero_centered=mode == "zero_centered", dtype=dtype, rngs=nnx.Rngs(0),
                   weight_fp32=mode == "fp32_weight")
    norm.weight[...] = w
    want_stream = x + d
    want = norm(want_stream)
    stream, normed = _run(x, d, w, mode, impl)
    np.testing.assert_array_equal(np.asarray(stream), np.asarray(want_stream))  # one rounding of the sum
    assert normed.dtype == want.dtype
    tol = 1e-5 if dtype == "float32" else 1e-2  # bf16: one rounding step at most (sum order of the mean)
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    ref_stream, ref_normed = _run(x, d, w, mode, "xla")
    np.testing.assert_array_equal(np.asarray(ref_stream), np.asarray(want_stream))
    np.testing.assert_allclose(np.asarray(ref_normed, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def _fresh(mode, impl, parts_chunk=None):
    return jax.jit(functools.partial(add_rms_norm, eps=1e-6, mode=mode, impl=impl, parts_chunk=parts_chunk))


@pytest.mark.parametrize("parts,dtype,h,chunk", [
    *[(parts, dtype, 90, 32) for parts in (1, 3, 4, 8) for dtype in ("float32", "bfloat16")],
    (3, "bfloat16", 80, 32), (8, "float32", 80, 32),  # 2 blocks of 32 and one of 16
    (3, "bfloat16", 90, None), (8, "float32", 90, None)])  # one 128-wide block masked at 90
def test_add_rms_norm_sums_split_k_partials(impl, parts, dtype, h, chunk):
    """delta as float32 split-K partial sums [S, ..., H]: the stream equals the reference's (sum of
    the partials in float32, rounded to x's dtype, added to x, rounded) bit for bit; the partials
    are multiples of 2^-8 below 2^3, so their float32 sum is exact in any order (XLA's CPU reduce
    does not add 8 wide partials in index order) yet needs the rounding to bf16. 90 columns in
    blocks of 32: two, then a 32-wide block ending at column 90 that keeps its last 26."""
    rng = np.random.default_rng(parts)
    x = jnp.asarray(rng.normal(size=(2, 3, h)), dtype)
    d = jnp.asarray(rng.integers(-2**11, 2**11, size=(parts, 2, 3, h)) / 2**8, jnp.float32)
    w = jnp.asarray(rng.normal(size=(h,)) * 0.5, dtype)
    exact = jnp.sum(d, axis=0)
    if dtype == "bfloat16" and parts > 1:  # rounding the sum first is visible: the test can tell
        assert not np.array_equal(np.asarray((x + exact.astype(dtype)).astype(dtype)),
                                  np.asarray((x.astype(jnp.float32) + exact).astype(dtype)))
    for mode in MODES:
        want_stream, want = reference(x, exact.astype(dtype), w, eps=1e-6, mode=mode)
        for form in ("xla", impl):
            stream, normed = _fresh(mode, form, chunk)(x, d, w)
            assert stream.dtype == normed.dtype == x.dtype
            np.testing.assert_array_equal(np.asarray(stream), np.asarray(want_stream))
            tol = 1e-5 if dtype == "float32" else 1e-2
            np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("h", [5120, 6000])  # default blocks: 4096 + 1024; 4096 + 2048 ending at 6000
def test_add_rms_norm_partials_add_in_index_order(impl, h):
    """Generic partials at the 27B width and wider (default blocks), float32 x so that every bit of
    the sum shows: the stream is x + ((d0 + d1) + d2) + ... bit for bit, and close to `reference`
    (jnp.sum, whose order XLA's CPU backend picks: not index order for 8 partials 5120 wide)."""
    rng = np.random.default_rng(h)
    parts = 8
    x = jnp.asarray(rng.normal(size=(2, 3, h)), jnp.float32)
    d = jnp.asarray(rng.normal(size=(parts, 2, 3, h)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(h,)) * 0.5, jnp.float32)
    summed = d[0]
    for p in range(1, parts):
        summed = summed + d[p]
    in_order, _ = reference(x, summed, w, eps=1e-6, mode="zero_centered")
    stream, normed = _fresh("zero_centered", impl)(x, d, w)
    np.testing.assert_array_equal(np.asarray(stream), np.asarray(in_order))
    want_stream, want = reference(x, d, w, eps=1e-6, mode="zero_centered")
    np.testing.assert_allclose(np.asarray(stream), np.asarray(want_stream), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(normed), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_add_rms_norm_names_bad_inputs():
    x = jnp.zeros((2, 8))
    with pytest.raises(ValueError, match="mode must be one of"):
        add_rms_norm(x, x, jnp.zeros(8), eps=1e-6, mode="layer")
    with pytest.raises(ValueError, match="do not match"):
        add_rms_norm(x, x[:, :4], jnp.zeros(8), eps=1e-6, mode="plain")
    with pytest.raises(ValueError, match=r"partial sums delta \(3, 2, 8\) must be float32, got bfloat16"):
        add_rms_norm(x, jnp.zeros((3, 2, 8), jnp.bfloat16), jnp.zeros(8), eps=1e-6, mode="plain")
    with pytest.raises(ValueError, match=r"delta \(3, 2, 4\) .* do not match .*split-K partial sums"):
        add_rms_norm(x, jnp.zeros((3, 2, 4)), jnp.zeros(8), eps=1e-6, mode="plain")
    with pytest.raises(ValueError, match="do not match"):  # no partial sums at all
        add_rms_norm(x, jnp.zeros((0, 2, 8)), jnp.zeros(8), eps=1e-6, mode="plain")
    with pytest.raises(ValueError, match="impl must be one of"):
        add_rms_norm(x, x, jnp.zeros(8), eps=1e-6, mode="plain", impl="cuda")


def test_partials_lower_for_sm90_without_spills(sm90):
    """The 27B stream (5120 wide, bf16, zero_centered) with plain delta and S = 4 / 8 float32 partial
    sums lowers for CUDA here; with pip's triton it compiles for sm_90 at the default warps and
    PARTS_CHUNK without spilling (scripts/offline_triton_compile.py add_rms_norm sweeps the rest)."""
    picked = [(label, warps, fn, shapes) for label, warps, fn, shapes in add_rms_norm_cases(65)
              if (label["parts"], label.get("chunk"), warps) in
              {(0, None, DEFAULT_WARPS), (4, PARTS_CHUNK, PARTS_WARPS), (8, PARTS_CHUNK, PARTS_WARPS)}]
    assert [label["parts"] for label, *_ in picked] == [0, 4, 8]
    ttirs = []
    for label, warps, fn, shapes in picked:
        [(name, ttir)] = capture_ttir(fn, *shapes)
        assert "add_rms_norm" in name
        ttirs.append((label, warps, ttir))
    if not sm90:  # the default run: the lowering above; -m triton: the sm_90 checks below
        return
    for label, warps, ttir in ttirs:
        res = compile_ttir(ttir, num_warps=warps, num_stages=1)
        assert res["regs"] <= 255 and res["stack_bytes"] == 0, (label, res)


def test_model_routes_add_and_norm_through_the_kernel(impl):
    """With kernels a Qwen3.5-style decode step traces one add_rms_norm launch per norm after a
    residual add (2 per layer + the final norm - the first input norm); hidden states for the drafter
    (hidden_ids) equal the XLA path's; routes.add_norm_kernel off takes the route out."""
    import warnings

    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.routes import REFERENCE
    from tests.tiny_models import HYBRID, make_target
    from tests.tree_harness import routes_for

    cfg, gd, params = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16),
                                  seed=33, base=HYBRID)
    cache = init_target_cache(cfg, 2, 32)
    ids = (1, 2, cfg.num_layers)

    def step(c, t, routes):
        return nnx.merge(gd, params)(t[:, None], c, jnp.ones((2,), jnp.int32), chunked=False, routes=routes,
                                     hidden_ids=ids)

    tok = jnp.asarray([3, 7], jnp.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = str(jax.make_jaxpr(functools.partial(step, routes=routes_for(impl)))(cache, tok))
    # every norm but the first layer's input norm (nothing to add to the embeddings yet)
    assert text.count("name=add_rms_norm") == 2 * cfg.num_layers
    h_ref, f_ref, _ = jax.jit(step, static_argnums=2)(cache, tok, REFERENCE)
    h_got, f_got, _ = jax.jit(step, static_argnums=2)(cache, tok, routes_for(impl))
    np.testing.assert_allclose(np.asarray(f_got), np.asarray(f_ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(h_got), np.asarray(h_ref), rtol=1e-4, atol=1e-4)
    no_kernel = routes_for(impl).replace(add_norm_kernel=False)
    text = str(jax.make_jaxpr(functools.partial(step, routes=no_kernel))(cache, tok))
    assert "add_rms_norm" not in text


def test_model_hands_split_k_partials_to_the_kernel_at_verify_rows(impl):
    """At a tree verify's row count the products that feed the residual stream (mixer output and
    MLP down projections, 2 a layer) reach the add + norm kernels as split-K partial sums
    (models.layers.SplitKParts: one batched dot_general each, no reduce of their own), and the
    verify's results equal the unsplit route's; a decode step (rows below routes.split_k_rows)
    keeps plain products; split_k_parts off gives plain products; with add_norm_kernel off XLA adds
    the partials and the results are the same."""
    from ddtree_jax.cache import init_target_cache
    from ddtree_jax.tree import make_tree
    from tests.tiny_models import HYBRID, make_target
    from tests.tree_harness import batched_dot_count, routes_for

    routes = routes_for(impl).replace(split_k_rows=(8, 128))  # the tiny verify: 2 x 5 nodes; a decode step: 2 rows
    cfg, gd, params = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16),
                                  seed=34, base=HYBRID)
    cache = init_target_cache(cfg, 2, 32)
    tok = jnp.asarray([3, 7], jnp.int32)

    def step(c, t, routes=routes):
        return nnx.merge(gd, params)(t[:, None], c, jnp.ones((2,), jnp.int32), chunked=False, routes=routes,
                                     hidden_ids=(1, cfg.num_layers))[:2]

    parents = jnp.asarray([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 2]], jnp.int32)
    tree = make_tree(jnp.asarray([[3, 4, 5, 6, 7], [7, 1, 2, 3, 4]], jnp.int32), parents, jnp.ones((2, 5), bool),
                     cache.lengths, 4)

    def verify(c, routes=routes):
        return nnx.merge(gd, params).verify(tree.tokens, c, tree, hidden_ids=(1, cfg.num_layers), routes=routes)[:2]

    def batched_dots(fn, *args):  # dot_generals with batch dimensions; a fresh trace (no cache hit)
        return batched_dot_count(str(jax.make_jaxpr(lambda *a: fn(*a))(*args)))

    split_dots = batched_dots(step, cache, tok), batched_dots(verify, cache)
    split = jax.jit(lambda c: verify(c))(cache)
    unsplit = routes.replace(split_k_parts=False)  # attention's own batched dots stay
    assert split_dots[0] == batched_dots(lambda c, t: step(c, t, unsplit), cache, tok)  # decode rows: never split
    assert split_dots[1] - batched_dots(lambda c: verify(c, unsplit), cache) == 2 * cfg.num_layers
    whole = jax.jit(lambda c: verify(c, unsplit))(cache)
    for got, want in zip(jax.tree_util.tree_leaves(split), jax.tree_util.tree_leaves(whole)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    xla_adds = routes.replace(add_norm_kernel=False)
    assert batched_dots(lambda c: verify(c, xla_adds), cache) == split_dots[1]  # still split: XLA adds the partials
    plain = jax.jit(lambda c: verify(c, xla_adds))(cache)
    for got, want in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(whole)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.script
def test_bench_cpu_smoke(tmp_path):
    """scripts.bench.kernels add_rms_norm --cpu-smoke: both forms (XLA's reduce + the plain kernel,
    the partials path) agree with the reference in the interpreter and land in the report."""
    out = tmp_path / "arn.json"
    assert bench.main(["add_rms_norm", "--cpu-smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["parts"] for r in rows] == [4, 8] and all(r["xla_ok"] and r["c32w4_ok"] for r in rows)


@pytest.mark.parametrize("parts", [0, 4, 8])
def test_native_at_the_27b_stream(gpu_impl, parts):
    """The 27B residual stream (5120 wide, bf16, zero_centered) at a DDTree-64 verify's 65 rows,
    delta plain or as S = 4 / 8 float32 split-K partials: the stream equals the XLA reference's bit
    for bit, the normed rows are within a bf16 rounding step of it."""
    h, rows = GDN_27B["hidden"], 65
    key = jax.random.PRNGKey(parts)
    x = jax.random.normal(key, (rows, h), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (h,), jnp.float32) * 0.1).astype(jnp.bfloat16)
    shape = (parts, rows, h) if parts else (rows, h)
    d = jax.random.normal(jax.random.fold_in(key, 2), shape, jnp.float32)
    d = d if parts else d.astype(jnp.bfloat16)
    want = _fresh("zero_centered", "xla")(x, d, w)
    got = _fresh("zero_centered", gpu_impl)(x, d, w)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    normed = np.asarray(want[1], np.float32)
    err = float(np.max(np.abs(np.asarray(got[1], np.float32) - normed)))
    assert err <= 2**-6 * max(1.0, float(np.max(np.abs(normed)))), err
