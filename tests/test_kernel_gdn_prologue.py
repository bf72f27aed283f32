"""pallas_kernels/gdn_tree_prologue.py: the conv over each node's path, SiLU, head split, q / k
norms and casts of a GDN tree verify in one kernel, against its jnp reference (`impl`: the
interpreter, natively under -m gpu; -m gpu also at the 27B layer), its sm_90 lowering (offline, no
GPU), and the model route (`routes.gdn_tree_prologue_kernel`) against the XLA form it replaces."""

import functools
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax.tree import geometry, make_tree
from pallas_kernels.gdn_tree_prologue import gdn_tree_prologue, kernel_problems
from scripts.bench import kernels as bench
from scripts.bench.kernels_gdn import gdn_prologue_problem
from scripts.bench.common import max_rel_err
from scripts.bench.shapes import GDN_27B
from scripts.offline_triton_compile import capture_ttir, compile_ttir
from tests.tolerance import assert_scaled_close, by_impl

B, HK, HV, DK, DV, K = 2, 2, 6, 16, 16, 4
D = 2 * HK * DK + HV * DV


def _inputs(n, seed, dtype, extra=0):
    """A random tree of n nodes and its conv inputs; `extra` columns after the conv's (the z part of
    a merged qkv | z product) that the prologue must not read."""
    rng = np.random.default_rng(seed)
    parents = jnp.asarray(np.stack([[-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, n)]
                                    for _ in range(B)]), jnp.int32)
    tree = make_tree(jnp.zeros((B, n), jnp.int32), parents, jnp.ones((B, n), bool), jnp.zeros((B,), jnp.int32),
                     max_depth=n - 1)
    conv_src = geometry(tree, K).conv_src
    mixed = jnp.asarray(rng.normal(size=(B, n, D + extra)), dtype)
    window = jnp.asarray(rng.normal(size=(B, K - 1, D)), dtype)
    conv_w = jnp.asarray(rng.normal(size=(K, D)) * 0.5, dtype)
    return mixed, window, conv_w, conv_src


KW = dict(num_k_heads=HK, head_k_dim=DK, head_v_dim=DV)
IMPLS = ("xla", "pallas_interpret", "pallas")
# jitted once per impl: one compilation per (N, dtype) serves every drawn example
PROLOGUE = {impl: jax.jit(functools.partial(gdn_tree_prologue, impl=impl, **KW)) for impl in IMPLS}


@settings(max_examples=10, deadline=None)
@given(n=st.sampled_from([16, 17, 33]), seed=st.integers(0, 2**31 - 1), bf16=st.booleans(),
       extra=st.sampled_from([0, 3 * DV]))
def test_kernel_equals_reference(impl, n, seed, bf16, extra):
    """Random trees of 16 (one block), 17 and 33 nodes (root + a power-of-two block), conv inputs
    alone or with z columns after them: q, k, v and the float32 k agree (float32: to rounding;
    bf16: within a few bf16 ulps, the reference's conv runs in bf16 arithmetic, the kernel's in
    float32)."""
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    args = _inputs(n, seed, dtype, extra)
    want, got = PROLOGUE["xla"](*args), PROLOGUE[impl](*args)
    for name, w, g in zip(("q", "k", "v", "k32"), want, got):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        w32, g32 = np.asarray(w, np.float32), np.asarray(g, np.float32)
        if bf16:  # the reference rounds after each of the 4 taps: a few bf16 ulps of the value
            np.testing.assert_allclose(g32, w32, rtol=2**-5, atol=2**-6, err_msg=name)
        else:
            np.testing.assert_allclose(g32, w32, rtol=1e-5, atol=1e-5, err_msg=name)
    assert got[0].shape == (B, HK, n, DK) and got[2].shape == (B, HV, n, DV) and got[3].dtype == jnp.float32


GATED = {impl: jax.jit(functools.partial(gdn_tree_prologue, impl=impl, ba_col=D + HV * DV, **KW)) for impl in IMPLS}


@settings(max_examples=6, deadline=None)
@given(n=st.sampled_from([16, 17]), seed=st.integers(0, 2**31 - 1), bf16=st.booleans())
def test_kernel_gates_equal_reference(impl, n, seed, bf16):
    """gates=(A_log, dt_bias) on the whole qkv | z | b | a product (the models' layout): g and beta
    [B, Hv, N] equal gate_values of the b | a columns (the reference), heads first; q / k / v are
    those of the gate-less call."""
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    rng = np.random.default_rng(seed)
    mixed, window, conv_w, src = _inputs(n, seed, dtype, extra=HV * DV + 2 * HV)
    gates = (jnp.asarray(rng.normal(size=HV), dtype), jnp.asarray(rng.normal(size=HV), dtype))
    want = GATED["xla"](mixed, window, conv_w, src, gates=gates)
    got = GATED[impl](mixed, window, conv_w, src, gates=gates)
    plain = PROLOGUE[impl](mixed, window, conv_w, src)
    assert len(got) == 6 and got[4].shape == (B, HV, n) and got[5].dtype == jnp.float32
    # beta: the kernel rounds the float32 sigmoid(b) to the model dtype as the decode kernel does;
    # XLA:CPU's bf16 logistic rounds exp(-b) to bf16 and divides in float32: two bf16 ulps apart
    for name, w, g, tol in zip(("g", "beta"), want[4:], got[4:], (1e-5, 2**-7 if bf16 else 1e-5)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=1e-6, err_msg=name)
    for w, g in zip(plain, got[:4]):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    with pytest.raises(ValueError, match="b \\| a columns"):
        gdn_tree_prologue(mixed[..., : D + 1], window, conv_w, src, gates=gates, ba_col=D, impl=impl, **KW)


def test_shapes_the_kernel_refuses():
    assert kernel_problems(65, 16, 128, 48, 128) == [] and kernel_problems(16, 16, 128, 48, 128) == []
    problems = kernel_problems(24, 16, 96, 40, 128)
    assert any("24 nodes" in p for p in problems) and any("key head dim 96" in p for p in problems)
    assert any("do not divide" in p for p in problems)
    assert any("1-tap conv" in p for p in kernel_problems(17, 16, 128, 48, 128, taps=1))
    assert any("!= value head dim" in p for p in kernel_problems(17, 16, 64, 48, 128))
    mixed, window, conv_w, src = _inputs(17, 0, jnp.float32)
    with pytest.raises(ValueError, match="fewer than the conv"):
        gdn_tree_prologue(mixed[..., :-1], window, conv_w, src, impl="pallas_interpret", **KW)
    with pytest.raises(ValueError, match="24 nodes"):
        mixed, window, conv_w, _ = _inputs(16, 0, jnp.float32)
        gdn_tree_prologue(jnp.zeros((B, 24, D)), window, conv_w, jnp.zeros((B, 24, K), jnp.int32),
                          impl="pallas_interpret", **KW)


def test_lowers_for_sm90_at_the_27b_layer(sm90):
    """65 nodes (DDTree-64) of the 27B GDN layer lower to one Triton kernel for CUDA here; with
    pip's triton, compiled for sm_90 without spills at the default 8 warps."""
    hk, hv, dk, dv = 16, 48, 128, 128
    c = 2 * hk * dk + hv * dv
    shapes = (jax.ShapeDtypeStruct((1, 65, c), jnp.bfloat16), jax.ShapeDtypeStruct((1, 3, c), jnp.bfloat16),
              jax.ShapeDtypeStruct((4, c), jnp.bfloat16), jax.ShapeDtypeStruct((1, 65, 4), jnp.int32))
    fn = functools.partial(gdn_tree_prologue, num_k_heads=hk, head_k_dim=dk, head_v_dim=dv, impl="pallas")
    [(name, ttir)] = capture_ttir(fn, *shapes)
    assert "gdn_tree_prologue" in name
    # the default qkv | z | b | a product with the gates computed in the kernel
    wide = (jax.ShapeDtypeStruct((1, 65, c + hv * dv + 2 * hv), jnp.bfloat16), *shapes[1:])
    gated = lambda m, win, w, src: gdn_tree_prologue(
        m, win, w, src, num_k_heads=hk, head_k_dim=dk, head_v_dim=dv, impl="pallas",
        gates=(jnp.zeros((hv,), jnp.bfloat16), jnp.zeros((hv,), jnp.bfloat16)), ba_col=c + hv * dv)
    [(_, ttir_gated)] = capture_ttir(gated, *wide)
    if not sm90:  # the default run: the lowering above; -m triton: the sm_90 checks below
        return
    for text in (ttir, ttir_gated):
        res = compile_ttir(text, num_warps=8, num_stages=1)
        assert res["regs"] <= 255 and res["stack_bytes"] == 0, res


@pytest.mark.slow  # interpreted ~20-36 s (natively under -m gpu); the default run keeps the kernel's own tests and
# tests/test_kernels_in_model.py's generation with every kernel on, equal to plain greedy decoding
def test_model_route_gives_the_xla_forms_outputs(impl):
    """routes.gdn_tree_prologue_kernel on: a tiny hybrid target's tree verify + commit through the
    kernels gives the same logits and committed caches as with it off (the XLA prologue)."""
    from tests.tree_harness import kernel_route_case, routes_for, verify_and_commit

    cfg, gd, params, cache, tokens, parents, path, counts = kernel_route_case(41, 3)
    n = tokens.shape[1]
    assert not kernel_problems(n, cfg.gdn_num_k_heads, cfg.gdn_k_head_dim, cfg.gdn_num_v_heads, cfg.gdn_v_head_dim)

    def run(on):
        fn = verify_and_commit(gd, tokens, parents, path, counts, routes_for(impl).replace(gdn_tree_prologue_kernel=on))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # either route is taken silently: it was asked for
            text = str(jax.make_jaxpr(fn)(params, cache))
            out = jax.jit(fn)(params, cache)
        return out, text.count("name=gdn_tree_prologue")

    (want, want_count), (got, got_count) = run(False), run(True)
    gdn_layers = sum(kind == "gdn" for kind in cfg.layer_types)
    assert want_count == 0 and got_count == gdn_layers
    tol = by_impl(impl, 1e-4, 1e-2)  # a GPU runs float32 products in TF32
    for i, (w, g) in enumerate(zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got))):
        assert_scaled_close(g, w, tol, f"leaf {i}")


@pytest.mark.script
def test_bench_cpu_smoke(tmp_path):
    """scripts.bench.kernels gdn_prologue --cpu-smoke: checks and times both forms in the interpreter."""
    out = tmp_path / "p.json"
    assert bench.main(["gdn_prologue", "--cpu-smoke", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["float32_ok"] and row["bfloat16_ok"] and row["xla_us"] > 0 and row["kernel_us"] > 0


@pytest.mark.parametrize("nodes", [17, 33, 65])
@pytest.mark.parametrize("batch", [1, 8])
def test_native_at_the_27b_layer(gpu_impl, batch, nodes):
    """The 27B GDN layer (16 k / 48 v heads of 128, conv 4) on trees of DDTree budget + 1 nodes:
    q, k, v and the float32 k within 1e-5 of the reference in float32, 3e-2 in bf16 (the reference
    rounds after each conv tap)."""
    shape = {k: GDN_27B[k] for k in ("hk", "hv", "dk", "dv", "taps")}
    kw = dict(num_k_heads=shape["hk"], head_k_dim=shape["dk"], head_v_dim=shape["dv"])
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        args = gdn_prologue_problem(batch * 100 + nodes, batch, nodes, **shape, dtype=dtype)
        want = jax.jit(functools.partial(gdn_tree_prologue, impl="xla", **kw))(*args)
        got = jax.jit(functools.partial(gdn_tree_prologue, impl=gpu_impl, **kw))(*args)
        assert max_rel_err(want, got) <= tol, jnp.dtype(dtype).name
