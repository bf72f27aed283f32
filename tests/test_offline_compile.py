"""scripts/offline_triton_compile.py: the Pallas kernels lower for CUDA on a CPU-only machine and
their Triton module is captured (the default run); the register / spill checks (-m triton: the
`sm90` fixture) need pip's triton of the version the limits were measured with
(tests/triton_limits.py) and fail without it."""

import functools

import jax
import jax.numpy as jnp
import pytest

from scripts.offline_triton_compile import capture_ttir, compile_ttir, gdn_cases, gdn_commit_cases, gdn_decode_cases
from tests.triton_limits import require_recorded_triton

def _ssd_shapes(nodes=16, h=4, hd=16, g=2, ns=16):
    return (jax.ShapeDtypeStruct((1, nodes, h, hd), jnp.bfloat16), jax.ShapeDtypeStruct((1, nodes, h), jnp.float32),
            jax.ShapeDtypeStruct((h,), jnp.float32), jax.ShapeDtypeStruct((1, nodes, g, ns), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, nodes, g, ns), jnp.bfloat16), jax.ShapeDtypeStruct((h,), jnp.float32),
            jax.ShapeDtypeStruct((1, h, hd, ns), jnp.float32), jax.ShapeDtypeStruct((1, nodes, 1), jnp.uint32))


def test_capture_ttir_finds_the_kernel():
    from pallas_kernels.ssd_tree import ssd_tree_verify

    kernels = capture_ttir(functools.partial(ssd_tree_verify, impl="pallas"), *_ssd_shapes())
    assert len(kernels) == 1
    name, ttir = kernels[0]
    assert "ssd_tree_verify" in name and "tt.func" in ttir and "tt.dot" in ttir


@pytest.mark.triton
def test_compile_reports_registers():
    require_recorded_triton()
    from pallas_kernels.ssd_tree import ssd_tree_verify

    [(_, ttir)] = capture_ttir(functools.partial(ssd_tree_verify, impl="pallas"), *_ssd_shapes())
    res = compile_ttir(ttir, num_warps=4, num_stages=1)
    assert 0 < res["regs"] <= 255 and res["stack_bytes"] is not None
    assert res["sass_instructions"] > 100 and res["bar_sync"] >= 0 and res["shfl"] >= 0


def test_tree_select_lowers_for_cuda_without_spills(sm90):
    """The one-launch node selection lowers to Triton for CUDA here (no GPU); where pip's triton
    is installed, budgets 16 / 32 compile for sm_90 at the default warps without spilling (58 / 126
    registers at one warp when written), and budget 32 with the node scores (budget "auto")."""
    from pallas_kernels.tree_select import DEFAULT_WARPS, select_nodes

    ttirs = {}
    for budget, scores in ((16, False), (32, False), (32, True)):
        [(name, ttirs[budget, scores])] = capture_ttir(
            functools.partial(select_nodes, budget=budget, impl="pallas", with_scores=scores),
            jax.ShapeDtypeStruct((1, 15, budget), jnp.float32))
        assert "tree_select" in name and "scf.for" in ttirs[budget, scores]  # the pops: a loop, not unrolled
    if not sm90:  # the default run: the lowering above; -m triton: the sm_90 checks below
        return
    for budget, ttir in ttirs.items():
        res = compile_ttir(ttir, num_warps=DEFAULT_WARPS, num_stages=1)
        assert res["regs"] <= 255 and res["stack_bytes"] == 0, (budget, res)


def test_pair_groups_lowers_for_cuda_without_spills(sm90):
    """The one-launch grouping of an MoE verify's pairs lowers to Triton for CUDA here; where pip's
    triton is installed it compiles for sm_90 without spilling at its default warps, for a 35B-A3B
    DDTree-8 verify (9 tokens) and for the most pairs it takes."""
    from scripts.offline_triton_compile import pair_groups_cases
    from pallas_kernels.pair_groups import DEFAULT_WARPS

    captured = []
    for opts, warps, fn, shapes in pair_groups_cases(9):
        [(name, ttir)] = capture_ttir(fn, *shapes)
        assert "pair_groups" in name and "scf.for" in ttir  # the comparison chunks: a loop
        captured.append((opts, warps, ttir))
    if not sm90:  # the default run: the lowering above; -m triton: the sm_90 checks below
        return
    for opts, warps, ttir in captured:
        res = compile_ttir(ttir, num_warps=warps, num_stages=1)
        assert res["regs"] <= 255, (opts, res)
        if warps == DEFAULT_WARPS:
            assert res["stack_bytes"] == 0, (opts, res)


def test_row_top_k_lowers_for_cuda_without_spills(sm90):
    """The row top-k kernel lowers to Triton for CUDA here; where pip's triton is installed, the
    demo's rows (8192 entries, k = 16) compile for sm_90 at the default warps without spilling
    (4 warps, the fastest on the H200: 156 registers, 88 at 8 warps)."""
    from pallas_kernels.row_top_k import DEFAULT_WARPS, row_top_k

    [(name, ttir)] = capture_ttir(functools.partial(row_top_k, k=16, impl="pallas"),
                                  jax.ShapeDtypeStruct((1, 15, 8192), jnp.float32))
    assert "row_top_k" in name and "scf.for" in ttir  # the k picks run as a loop
    if not sm90:  # the default run: the lowering above; -m triton: the sm_90 checks below
        return
    res = compile_ttir(ttir, num_warps=DEFAULT_WARPS, num_stages=1)
    assert res["regs"] <= 255 and res["stack_bytes"] == 0, res


def test_gdn_decode_lowers_for_cuda_without_spills(sm90):
    """The GDN decode kernel at the 27B layer (hidden 5120, 16 k / 48 v heads of 128) lowers to
    Triton for CUDA here; where pip's triton is installed it compiles for sm_90 at the default warps
    without spilling (4 warps, the fastest on the H200: 251 registers; 177 at 8 warps), as do the
    packed product form and its split (dv_split, the GPU default 4: 95 registers) and blocked forms."""
    from pallas_kernels.gdn_decode import DEFAULT_WARPS
    from ddtree_jax.routes import GDN_DECODE_DV_SPLIT_GPU
    cases = [c for c in gdn_decode_cases(1) if c[1] == DEFAULT_WARPS]
    assert [c[0].get("packed", False) for c in cases][:2] == [False, True]  # also the packed product form
    assert {c[0].get("dv_split", 1) for c in cases} >= {1, GDN_DECODE_DV_SPLIT_GPU}
    ttirs = []
    for _, _, fn, shapes in cases:
        [(name, ttir)] = capture_ttir(fn, *shapes)
        assert "gdn_decode" in name
        ttirs.append(ttir)
    if not sm90:  # the default run: the lowering above; -m triton: the sm_90 checks below
        return
    for ttir in ttirs:
        res = compile_ttir(ttir, num_warps=DEFAULT_WARPS, num_stages=1)
        assert res["regs"] <= 255 and res["stack_bytes"] == 0, res


def test_gdn_tree_kernel_spills_no_more_than_before(sm90):
    """The GDN tree kernel at the 27B layer (16 k / 48 v heads of 128), default tiles and warps:
    bf16 at 65 nodes (the root peel on 16-row tiles, SPLIT_STATE) compiles for sm_90 without
    spilling (64 B before SPLIT_STATE); float32 keeps the peel's reductions (its tile form had
    spilled 8.8 KB at 17 nodes, 3.9 KB at 65) and spills no more than before them (1776 / 2240 B)."""
    picked = {}
    for nodes in (65, 17):
        for label, warps, fn, shapes in gdn_cases(nodes):
            if set(label) == {"block_dv", "inputs"} and label["block_dv"] is None:
                [(name, ttir)] = capture_ttir(fn, *shapes)
                assert "gdn_tree_verify" in name
                picked[(nodes, label["inputs"])] = (ttir, warps)
    assert set(picked) == {(65, "bfloat16"), (65, "float32"), (17, "bfloat16"), (17, "float32")}
    if not sm90:  # the default run: the lowering above; -m triton: the sm_90 checks below
        return
    limits = {(65, "bfloat16"): 0, (17, "bfloat16"): 0, (65, "float32"): 2240, (17, "float32"): 1776}
    for key, limit in limits.items():
        ttir, warps = picked[key]
        res = compile_ttir(ttir, num_warps=warps, num_stages=1)
        assert res["stack_bytes"] <= limit, (key, res)


def test_gdn_commit_lowers_for_cuda_with_and_without_the_window(sm90):
    """Both forms of the path commit (the conv window slide on programs of its own) lower for CUDA
    at the 27B layer; where triton is installed they compile without spills."""
    cases = list(gdn_commit_cases(65))
    assert {c[0]["window"] for c in cases} == {False, True}
    ttirs = []
    for opts, warps, fn, shapes in cases[:2]:
        [(name, ttir)] = capture_ttir(fn, *shapes)
        assert "gdn_path_commit" in name and "tt.func" in ttir
        ttirs.append((opts, warps, ttir))
    if not sm90:  # the default run: the lowering above; -m triton: the sm_90 checks below
        return
    for opts, warps, ttir in ttirs:
        res = compile_ttir(ttir, num_warps=warps, num_stages=1)
        assert res["stack_bytes"] == 0 and res["regs"] <= 255, (opts, res)


def test_moe_decode_path_lowers_for_cuda_without_spills(sm90):
    """The expert kernel's decode path at the Qwen3.6-35B-A3B expert layer, one token: both launches
    of every variant scripts.bench.moe_experts times lower for CUDA here; where triton 3.6 is
    installed they compile for sm_90 without spilling, and their weight loads are pipelined
    (cp.async, LDGSTS in the SASS: the column blocks under 64 with the weight on the MMA's M side
    were not, so the sweep runs those in the "rows" form). The "fma" form has no MMA and Triton
    gives its loads no cp.async: its launches load straight to registers in 16-byte vectors. The
    model's form (the shared expert and its gate in the launches, weighted parts out; with the
    router's choice made in the first launch) too, and the one-launch form's variants (combine
    "fused": one kernel)."""
    from scripts.offline_triton_compile import compile_case, moe_decode_cases

    captured = []
    for opts, settings, fn, shapes in moe_decode_cases(1):
        kernels = capture_ttir(fn, *shapes)
        want = [["moe", "decode", "fused"]] if opts["variant"].startswith("fused") else [
            ["moe", "decode", "up"], ["moe", "decode", "down"]]
        assert [name.split("_")[:3] for name, _ in kernels] == want, opts
        captured.append((opts, settings, kernels))
    assert {o["variant"] for o, _, _ in captured} >= {"decode", "decode_out_in", "decode_n16_kernel",
                                                      "decode_padded_row", "default_shared_gate_parts",
                                                      "cols_shared_gate_parts", "fused", "fused_out_in",
                                                      "fused_shared_gate_parts", "choice_shared_gate_parts"}
    if not sm90:  # the default run: the lowering above; -m triton: the sm_90 checks below
        return
    up_loads = {}
    for opts, settings, kernels in captured:
        for res in compile_case(kernels, settings, 1):
            layout = opts["down_layout" if "_down" in res["launch"] else "up_layout"]
            loads = res["ldg_128"] > 0 if layout == "fma" else res["ldgsts"] > 0
            assert res["stack_bytes"] == 0 and res["regs"] <= 255 and loads, (opts, res)
            if "_up" in res["launch"]:
                up_loads[opts["variant"]] = res
    # the masked row operand (decisions 0063, 0064; the default): the row's register loads become
    # cp.async beside the weights'
    assert up_loads["decode"]["ldg"] < up_loads["decode_padded_row"]["ldg"]
    assert up_loads["decode"]["ldgsts"] > up_loads["decode_padded_row"]["ldgsts"]


def test_row_product_lowers_for_cuda_without_spills(sm90):
    """The one-row product at the 35B-A3B shapes, every variant scripts.bench.kernels row_product
    times, and the GDN output projection norming its row as it loads it: it lowers for CUDA here;
    where triton 3.6 is installed every variant compiles for sm_90, and the default tiling of each
    shape loads the weight in 16-byte vectors without spilling (swept
    variants need not: 32-column blocks at K steps of 128 on the input projections keep 24 bytes
    of stack, 8 warps on the router's 32-column blocks load 8 bytes a thread)."""
    from scripts.offline_triton_compile import compile_case, row_product_cases

    captured = []
    for opts, settings, fn, shapes in row_product_cases(0):
        kernels = capture_ttir(fn, *shapes)
        assert [name.split("_")[:2] for name, _ in kernels] == [["row", "product"]], opts
        captured.append((opts, settings, kernels))
    # out_proj_normed: the GDN output projection norming its row as it loads it (row_product.NormedRow)
    assert {o["shape"] for o, _, _ in captured} == {"router", "gdn_in", "attn_in", "out_proj", "out_proj_normed"}
    if not sm90:  # the default run: the lowering above; -m triton: the sm_90 checks below
        return
    for opts, settings, kernels in captured:
        [res] = compile_case(kernels, settings, opts["num_stages"])
        assert res["regs"] and res["sass_instructions"] > 0, (opts, res)
        if opts["variant"] == "kernel" or opts["shape"] == "out_proj_normed":
            assert res["stack_bytes"] == 0 and res["ldg_128"] > 0, (opts, res)
