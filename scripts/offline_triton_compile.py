"""Compile the Pallas Triton kernels for sm_90 on a machine without a GPU and report registers
and spills (the first thing to check when a kernel is slow on the H200, at no device time).

jax lowers a pallas_call for "cuda" on the CPU (it assumes sm_90 when no GPU is visible); the
Triton module it builds is captured from `lower_jaxpr_to_triton_module`, written as TTIR text, and
compiled by pip's triton (ptxas included) for GPUTarget("cuda", 90, 32); `cuobjdump
--dump-resource-usage` on the cubin gives registers per thread and the spill stack.

    pip install triton==3.6.0          # the H200 image's version (TRITON_VERSION)
    python -m scripts.offline_triton_compile ssd --nodes 64 --out ssd_regs.json
    python -m scripts.offline_triton_compile gdn --nodes 65
    python -m scripts.offline_triton_compile select --nodes 16    # budget 16
    python -m scripts.offline_triton_compile topk --nodes 8192    # rows of 8192
    python -m scripts.offline_triton_compile gdn_decode --nodes 1 # batch 1
    python -m scripts.offline_triton_compile mamba2_decode --nodes 1 # batch 1
    python -m scripts.offline_triton_compile gdn_prologue --nodes 65
    python -m scripts.offline_triton_compile attention --nodes 65 # 4k cache
    python -m scripts.offline_triton_compile gdn_commit --nodes 65
    python -m scripts.offline_triton_compile add_rms_norm --nodes 65
    python -m scripts.offline_triton_compile moe_decode --nodes 1   # tokens (8 pairs at top-8)
    python -m scripts.offline_triton_compile moe_grouped --nodes 65
    python -m scripts.offline_triton_compile row_product        # the 35B-A3B one-row products

Kernels: "ssd" (pallas_kernels/ssd_tree.py verify, NemotronH-8B-like layer: 128 heads x 64,
8 groups, state 128), "gdn" (pallas_kernels/gdn_tree.py, Qwen3.6-27B layer: 16 k / 48 v heads
of 128) "select" (pallas_kernels/tree_select.py, 15 draft depths, --nodes = the budget) and "topk"
(pallas_kernels/row_top_k.py, --nodes = the row length, k = 16 and 32), "gdn_decode"
(pallas_kernels/gdn_decode.py at the 27B GDN layer, --nodes = the batch), "mamba2_decode"
(pallas_kernels/mamba2_decode.py at the Nemotron-H-8B Mamba2 layer, --nodes = the batch), "gdn_prologue"
(pallas_kernels/gdn_tree_prologue.py at the 27B GDN layer, batch 1), "attention"
(pallas_kernels/tree_attention.py at the 27B attention layer, 4k context, batch 1), "gdn_commit"
(pallas_kernels/gdn_commit.py at the 27B GDN layer, --nodes tree nodes, with and without the conv
window slide), "add_rms_norm" (pallas_kernels/add_rms_norm.py on --nodes rows of the 27B stream,
5120 wide, bf16, zero_centered: delta plain at its default warps, then float32 split-K partial
sums S = 4 / 8 at a few PARTS_CHUNK / warp settings and the defaults), "moe_decode" (the expert
kernel's decode path at the Qwen3.6-35B-A3B expert layer, --nodes = the tokens: its default and
the variants scripts.bench.moe_experts times, both launches each), "moe_grouped" (the grouped
expert kernel's default tiling at --nodes tokens, both launches). Each sweeps a few block /
warp settings and prints one row per setting (per launch where a case has several). Registers
and spills depend on the Triton version: figures recorded with one (the offline-compile tests'
limits) hold for that version only.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering

from ddtree_jax import atomic
from pallas_kernels import add_rms_norm as arn
from pallas_kernels._common import is_pow2, pow2_at_least
from scripts.bench.kernels_harness import masked_rows_apply
from pallas_kernels.gdn_commit import gdn_path_commit
from pallas_kernels.gdn_decode import gdn_decode, gdn_decode_packed
from pallas_kernels.gdn_tree import default_blocks, gdn_tree_verify
from pallas_kernels import moe_experts as moe
from pallas_kernels.gdn_tree_prologue import gdn_tree_prologue
from pallas_kernels.row_top_k import row_top_k
from pallas_kernels.ssd_tree import ssd_tree_verify
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_select import select_nodes

TRITON_VERSION = "3.6"  # the H200 image's triton: what the recorded register / spill figures were compiled with


def installed_triton() -> str | None:
    """pip's triton version, or None when it is not installed."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def capture_ttir(fn, *args) -> list[tuple[str, str]]:
    """(kernel name, TTIR text) of every pallas_call in fn(*args) lowered for CUDA."""
    seen = []
    original = lowering.lower_jaxpr_to_triton_module

    def spy(*a, **k):
        result = original(*a, **k)
        seen.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = spy
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    names = [re.search(r"tt\.func (?:public )?@(\w+)", t) for t in seen]
    return [(m.group(1) if m else "kernel", t) for m, t in zip(names, seen)]


def compile_ttir(ttir: str, num_warps: int, num_stages: int) -> dict:
    """Registers, spill stack (bytes), shared memory and the SASS size (instructions, shuffles,
    barriers) of the kernel compiled for sm_90: an issue-bound kernel's first proxy."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
        cubin = os.path.join(d, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return {"regs": int(regs.group(1)) if regs else None, "stack_bytes": int(stack.group(1)) if stack else None,
            "shared_bytes": compiled.metadata.shared,
            "sass_instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M)),
            "shfl": sass.count("SHFL"), "bar_sync": sass.count("BAR.SYNC"),
            # conversions and the MMA form: what a product spends widening its tiles
            "i2f": sass.count(" I2F"), "f2fp": sass.count(" F2FP"), "prmt": sass.count(" PRMT"),
            "hgmma": sass.count(" HGMMA"), "hmma": sass.count(" HMMA"), "ldgsts": sass.count(" LDGSTS"),
            # global loads straight to registers, and their widest form (16-byte vectors)
            "ldg": sass.count(" LDG."), "ldg_128": sass.count(".128 R")}


def ssd_cases(nodes: int):
    b, h, hd, g, ns = 1, 128, 64, 8, 128
    shapes = (
        jax.ShapeDtypeStruct((b, nodes, h, hd), jnp.bfloat16), jax.ShapeDtypeStruct((b, nodes, h), jnp.float32),
        jax.ShapeDtypeStruct((h,), jnp.float32), jax.ShapeDtypeStruct((b, nodes, g, ns), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, nodes, g, ns), jnp.bfloat16), jax.ShapeDtypeStruct((h,), jnp.float32),
        jax.ShapeDtypeStruct((b, h, hd, ns), jnp.float32),
        jax.ShapeDtypeStruct((b, nodes, max(1, -(-nodes // 32))), jnp.uint32),
    )
    for bn in (None, 16, 64):
        for bp in (None, 32, 16):
            for warps in (4, 8):
                for prec in ("tf32x3", "tf32"):
                    opts = dict(block_n=bn, block_p=bp, num_warps=warps, precision=prec)
                    yield opts, warps, functools.partial(ssd_tree_verify, impl="pallas", **opts), shapes
    if masked_rows_apply(nodes):  # neither peeled nor a power of two (9 nodes): the padded form too
        opts = dict(num_warps=4, masked_rows=False)
        yield opts, 4, functools.partial(ssd_tree_verify, impl="pallas", **opts), shapes


def gdn_cases(nodes: int):
    b, hk, h, dk, dv = 1, 16, 48, 128, 128
    blocked = nodes - 1 if nodes > 1 and is_pow2(nodes - 1) else nodes  # the root peel's blocked rows
    default_warps = default_blocks(pow2_at_least(blocked), dk, dv, b * h)[3]
    for dtype in (jnp.bfloat16, jnp.float32):
        shapes = (
            jax.ShapeDtypeStruct((b, hk, nodes, dk), dtype), jax.ShapeDtypeStruct((b, hk, nodes, dk), dtype),
            jax.ShapeDtypeStruct((b, h, nodes, dv), dtype), jax.ShapeDtypeStruct((b, h, nodes), jnp.float32),
            jax.ShapeDtypeStruct((b, h, nodes), jnp.float32), jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32),
            jax.ShapeDtypeStruct((b, nodes, max(1, -(-nodes // 32))), jnp.uint32),
        )
        variants = [dict(block_dv=None), dict(block_dv=32)]
        if dtype == jnp.bfloat16:  # 16 warps (registers capped at 128), Triton's 3-pass bf16 products
            variants += [dict(block_dv=None, num_warps=16), dict(block_dv=32, num_warps=16),
                         dict(block_dv=None, precision="bf16x3")]
        for opts in variants:
            label = dict(opts, inputs=jnp.dtype(dtype).name)
            fn = functools.partial(gdn_tree_verify, impl="pallas", **opts)
            yield label, opts.get("num_warps") or default_warps, fn, shapes


def select_cases(budget: int):
    shapes = (jax.ShapeDtypeStruct((1, 15, budget), jnp.float32),)  # 15 draft depths, k = budget
    for warps in (1, 2, 4, 8):
        opts = dict(num_warps=warps)
        yield opts, warps, functools.partial(select_nodes, budget=budget, impl="pallas", **opts), shapes
    opts = dict(num_warps=1, with_scores=True)  # budget "auto": the node scores as a fifth output
    yield opts, 1, functools.partial(select_nodes, budget=budget, impl="pallas", **opts), shapes


def top_k_cases(n: int):
    shapes = (jax.ShapeDtypeStruct((1, 15, n), jnp.float32),)  # 15 draft depths' rows of n entries
    for k in (16, 32):
        for warps in (4, 8, 16):
            opts = dict(num_warps=warps)
            yield dict(opts, k=k), warps, functools.partial(row_top_k, k=k, impl="pallas", **opts), shapes


def gdn_decode_cases(batch: int):
    hk, hv, dk, dv, taps, hidden = 16, 48, 128, 128, 4, 5120  # Qwen3.6-27B GDN layer
    c = 2 * hk * dk + hv * dv
    bf, f32 = jnp.bfloat16, jnp.float32
    shapes = (jax.ShapeDtypeStruct((batch, c), bf), jax.ShapeDtypeStruct((batch, hv, dv), bf),
              jax.ShapeDtypeStruct((batch, hidden), bf), jax.ShapeDtypeStruct((hidden, hv), bf),
              jax.ShapeDtypeStruct((hidden, hv), bf), jax.ShapeDtypeStruct((hv,), bf), jax.ShapeDtypeStruct((hv,), bf),
              jax.ShapeDtypeStruct((batch, taps - 1, c), bf), jax.ShapeDtypeStruct((taps, c), bf),
              jax.ShapeDtypeStruct((batch, hv, dk, dv), f32), jax.ShapeDtypeStruct((dv,), bf),
              jax.ShapeDtypeStruct((batch,), jnp.int32))
    for warps in (4, 8, 16):
        opts = dict(num_warps=warps)
        yield opts, warps, functools.partial(gdn_decode, num_k_heads=hk, eps=1e-6, impl="pallas", **opts), shapes
    # the models' one product qkv | z | b | a, read in place (gdn_decode_packed)
    packed_shapes = (jax.ShapeDtypeStruct((batch, c + hv * dv + 2 * hv), bf),) + shapes[5:]
    for warps, dv_block, dv_split in ((4, None, 1), (4, 64, 1), (4, 32, 1), (8, 64, 1), (8, 32, 1), (4, None, 2),
                                      (4, None, 4), (2, None, 4), (4, 32, 2)):
        opts = dict(num_warps=warps, dv_block=dv_block, dv_split=dv_split)
        yield dict(opts, packed=True), warps, functools.partial(
            gdn_decode_packed, num_k_heads=hk, head_v_dim=dv, eps=1e-6, impl="pallas", **opts), packed_shapes


def mamba2_decode_cases(batch: int):
    from pallas_kernels.mamba2_decode import mamba2_decode

    h, p, g, n, taps = 128, 64, 8, 128, 4  # Nemotron-H-8B Mamba2 layer
    inter, c = h * p, h * p + 2 * g * n
    bf, f32 = jnp.bfloat16, jnp.float32
    shapes = (jax.ShapeDtypeStruct((batch, inter + c + h), bf), jax.ShapeDtypeStruct((batch, taps - 1, c), bf),
              jax.ShapeDtypeStruct((taps, c), bf), jax.ShapeDtypeStruct((c,), bf),
              *(jax.ShapeDtypeStruct((h,), bf) for _ in range(3)), jax.ShapeDtypeStruct((batch, h, p, n), f32),
              jax.ShapeDtypeStruct((inter,), bf), jax.ShapeDtypeStruct((batch,), jnp.int32))
    for warps, p_split, norm in ((2, 1, False), (4, 1, False), (8, 1, False), (2, 2, False), (4, 2, False),
                                 (2, 4, False), (4, 4, False), (2, 1, True), (4, 4, True)):
        opts = dict(num_warps=warps, p_split=p_split, norm_in_kernel=norm)
        yield opts, warps, functools.partial(mamba2_decode, num_heads=h, groups=g, eps=1e-5,
                                             dt_limit=(0.001, float("inf")), impl="pallas", **opts), shapes


def gdn_commit_cases(nodes: int):
    hk, hv, dk, dv, taps, p = 16, 48, 128, 128, 4, 16  # Qwen3.6-27B GDN layer, a 16-node path
    c = 2 * hk * dk + hv * dv
    bf, f32 = jnp.bfloat16, jnp.float32
    shapes = (jax.ShapeDtypeStruct((1, hk, nodes, dk), bf), jax.ShapeDtypeStruct((1, hv, nodes, dv), bf),
              jax.ShapeDtypeStruct((1, hv, nodes), f32), jax.ShapeDtypeStruct((1, hv, nodes), f32),
              jax.ShapeDtypeStruct((1, hv, dk, dv), f32), jax.ShapeDtypeStruct((1, p), jnp.int32),
              jax.ShapeDtypeStruct((1,), jnp.int32))
    window = (jax.ShapeDtypeStruct((1, taps - 1, c), bf), jax.ShapeDtypeStruct((1, nodes, c + hv * dv + 2 * hv), bf))
    for warps in (1, 2):
        opts = dict(num_warps=warps)
        yield dict(opts, window=False), warps, functools.partial(gdn_path_commit, impl="pallas", **opts), shapes
        yield (dict(opts, window=True), warps,
               lambda *a, o=opts: gdn_path_commit(*a[:7], window=a[7], conv_in=a[8], impl="pallas", **o),
               shapes + window)


def gdn_prologue_cases(nodes: int):
    hk, hv, dk, dv, taps = 16, 48, 128, 128, 4  # Qwen3.6-27B GDN layer
    c = 2 * hk * dk + hv * dv
    bf = jnp.bfloat16
    shapes = (jax.ShapeDtypeStruct((1, nodes, c), bf), jax.ShapeDtypeStruct((1, taps - 1, c), bf),
              jax.ShapeDtypeStruct((taps, c), bf), jax.ShapeDtypeStruct((1, nodes, taps), jnp.int32))
    for warps in (2, 4, 8):
        opts = dict(num_warps=warps)
        yield opts, warps, functools.partial(gdn_tree_prologue, num_k_heads=hk, head_k_dim=dk, head_v_dim=dv,
                                             impl="pallas", **opts), shapes
    # the model's form: the whole qkv | z | b | a product with the gates computed in the kernel
    gates = (jax.ShapeDtypeStruct((hv,), bf), jax.ShapeDtypeStruct((hv,), bf))
    mixed = jax.ShapeDtypeStruct((1, nodes, c + hv * dv + 2 * hv), bf)
    fn = functools.partial(gdn_tree_prologue, num_k_heads=hk, head_k_dim=dk, head_v_dim=dv, impl="pallas",
                           out_dtype=bf, ba_col=c + hv * dv)
    yield dict(num_warps=8, gated=True), 8, (lambda f: lambda m, w, cw, s, a, d: f(m, w, cw, s, gates=(a, d)))(
        fn), (mixed, *shapes[1:], *gates)


def attention_cases(nodes: int):
    b, nh, kv, hd, cap = 1, 24, 4, 256, 4096 + 64  # Qwen3.6-27B attention layer, 4k context
    bf = jnp.bfloat16
    shapes = (jax.ShapeDtypeStruct((b, nodes, nh, hd), bf), jax.ShapeDtypeStruct((b, kv, cap, hd), bf),
              jax.ShapeDtypeStruct((b, kv, cap, hd), bf), jax.ShapeDtypeStruct((b,), jnp.int32),
              jax.ShapeDtypeStruct((b, nodes, kv, hd), bf), jax.ShapeDtypeStruct((b, nodes, kv, hd), bf),
              jax.ShapeDtypeStruct((b, nodes, max(1, -(-nodes // 32))), jnp.uint32))
    # the defaults at 65 nodes (128 rows x 64 keys, 8 warps, 2 stages), 16 warps, 64-row blocks
    for br, bk, warps, stages in ((128, 64, 8, 2), (128, 64, 16, 2), (64, 64, 8, 2), (128, 64, 8, 1)):
        opts = dict(block_r=br, block_k=bk, num_warps=warps, num_stages=stages)
        yield opts, warps, functools.partial(tree_attention, scale=hd**-0.5, impl="pallas", **opts), shapes


def add_rms_norm_cases(rows: int):
    h, bf = 5120, jnp.bfloat16  # the 27B residual stream
    x, w = jax.ShapeDtypeStruct((rows, h), bf), jax.ShapeDtypeStruct((h,), bf)

    def traced(chunk, warps):
        return lambda *a: arn.add_rms_norm(*a, eps=1e-6, mode="zero_centered", impl="pallas", num_warps=warps,
                                           parts_chunk=chunk)

    yield (dict(parts=0, num_warps=arn.DEFAULT_WARPS), arn.DEFAULT_WARPS,
           traced(arn.PARTS_CHUNK, arn.DEFAULT_WARPS), (x, x, w))
    for parts in (4, 8):  # the output projections' S, then the MLP down's
        partials = jax.ShapeDtypeStruct((parts, rows, h), jnp.float32)
        sweep = ((1024, 4), (1024, 8), (1024, 16), (2048, 8), (2048, 16), (4096, 16), (4096, 32), (8192, 32))
        default = (arn.PARTS_CHUNK, arn.PARTS_WARPS)
        for chunk, warps in sweep + ((default,) if default not in sweep else ()):
            yield dict(parts=parts, chunk=chunk, num_warps=warps), warps, traced(chunk, warps), (x, partials, w)


MOE_35B_A3B = dict(hidden=2048, experts=256, top_k=8, inter=512)  # one Qwen3.6-35B-A3B expert layer


def _moe_shapes(tokens: int, w_layout: str):
    h, e, k, i = (MOE_35B_A3B[f] for f in ("hidden", "experts", "top_k", "inter"))
    bf = jnp.bfloat16
    w_in, w_out = ((e, h, 2 * i), (e, i, h)) if w_layout == "in_out" else ((e, 2 * i, h), (e, h, i))
    return (jax.ShapeDtypeStruct((tokens, h), bf), jax.ShapeDtypeStruct((tokens, k), jnp.int32),
            jax.ShapeDtypeStruct((tokens, k), jnp.float32), jax.ShapeDtypeStruct(w_in, bf),
            jax.ShapeDtypeStruct(w_out, bf))


def _launch_settings(cfg) -> dict:
    """{kernel name prefix: (warps, stages)} of an expert-kernel config's two launches."""
    if isinstance(cfg, moe.DecodeConfig) and cfg.combine == "fused":
        return {"moe_decode_fused": (cfg.up.num_warps, cfg.up.num_stages)}
    up, down = ("moe_decode_up", "moe_decode_down") if isinstance(cfg, moe.DecodeConfig) else (
        "moe_experts_up", "moe_experts_down")
    return {up: (cfg.up.num_warps, cfg.up.num_stages), down: (cfg.down.num_warps, cfg.down.num_stages)}


def moe_decode_cases(tokens: int):
    from scripts.bench.moe_experts import decode_sweep, fused_sweep  # the tilings the GPU bench times

    h, e, k, i = (MOE_35B_A3B[f] for f in ("hidden", "experts", "top_k", "inter"))
    default = moe.default_decode_config(tokens, k, e, h, i)
    fused = moe.default_fused_config(tokens, k, e, h, i)
    for name, (cfg, layout) in {**decode_sweep(default, "small"), **fused_sweep(fused, "small")}.items():
        fn = functools.partial(moe.expert_mlp, act="silu_glu", impl="pallas", config=cfg, w_layout=layout)
        yield (dict(variant=name, w_layout=layout, up_layout=cfg.up.layout, down_layout=cfg.down.layout),
               _launch_settings(cfg), fn, _moe_shapes(tokens, layout))

    # the model's decode step: the shared expert and its gate in the launches, weighted parts out
    shapes = _moe_shapes(tokens, "in_out")
    one = lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype)
    cols = moe.kernel_config(tokens, k, e, h, i, moe.KernelForm(rows=False))  # Routes.moe_decode_rows=false
    for name, cfg in (("default", default), ("cols", cols), ("fused", fused)):
        def shared_gate_parts(x, ids, w, w_in, w_out, s_in, s_out, gate_w, cfg=cfg):
            return moe.expert_mlp(x, ids, w, w_in, w_out, act="silu_glu", impl="pallas", config=cfg,
                                  shared=moe.Shared(s_in, s_out, gate_w=gate_w), parts=True)

        yield (dict(variant=f"{name}_shared_gate_parts", w_layout="in_out", up_layout=cfg.up.layout,
                    down_layout=cfg.down.layout), _launch_settings(cfg), shared_gate_parts,
               (*shapes, one(shapes[3]), one(shapes[4]), jax.ShapeDtypeStruct((h,), jnp.bfloat16)))

    # ... and with the router's choice made in the first launch from its split-K partial sums (decision 0071)
    def choice_shared_gate_parts(x, logits, w_in, w_out, s_in, s_out, gate_w):
        choice = moe.Choice(logits, k, True, jnp.bfloat16, logits_dtype=jnp.bfloat16)
        return moe.chosen_expert_mlp(x, choice, w_in, w_out, act="silu_glu", impl="pallas", config=default,
                                     shared=moe.Shared(s_in, s_out, gate_w=gate_w), parts=True)

    yield (dict(variant="choice_shared_gate_parts", w_layout="in_out", up_layout=default.up.layout,
                down_layout=default.down.layout), _launch_settings(default), choice_shared_gate_parts,
           (shapes[0], jax.ShapeDtypeStruct((8, tokens, e), jnp.float32), shapes[3], shapes[4], one(shapes[3]),
            one(shapes[4]), jax.ShapeDtypeStruct((h,), jnp.bfloat16)))


def moe_grouped_cases(tokens: int):
    h, e, k, i = (MOE_35B_A3B[f] for f in ("hidden", "experts", "top_k", "inter"))
    cfg = moe.default_config(tokens, k, e, h, i)
    fn = functools.partial(moe.expert_mlp, act="silu_glu", impl="pallas", config=cfg)
    yield dict(variant="default", w_layout="in_out"), _launch_settings(cfg), fn, _moe_shapes(tokens, "in_out")


def pair_groups_cases(tokens: int):
    """The grouping kernel (pallas_kernels/pair_groups.py) at the 35B-A3B router (256 experts, top-8)
    for `tokens` tokens (--nodes) and for the largest pair count it takes, at 1, 4 and 8 warps."""
    from pallas_kernels.pair_groups import PAIR_GROUPS_MAX_PAIRS, pair_groups

    e, k = MOE_35B_A3B["experts"], MOE_35B_A3B["top_k"]
    for t in (tokens, PAIR_GROUPS_MAX_PAIRS // k):
        for warps in (1, 4, 8):
            fn = functools.partial(pair_groups, num_experts=e, block_m=16, impl="pallas", num_warps=warps)
            yield dict(tokens=t, num_warps=warps), warps, fn, (jax.ShapeDtypeStruct((t, k), jnp.int32),)


def row_product_cases(nodes: int):
    """The one-row product (pallas_kernels/row_product.py) at the 35B-A3B shapes the GPU bench
    times (--nodes unused), each of its variants at its own warps and stages."""
    del nodes
    from pallas_kernels import row_product as rp
    from scripts.bench.kernels_dense import ROW_PRODUCT_SHAPES, row_product_variants

    for shape, k, n, partials in ROW_PRODUCT_SHAPES[:4]:
        x, w = jax.ShapeDtypeStruct((1, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
        for name, cfg in row_product_variants(k, n, partials, smoke=False).items():
            fn = functools.partial(rp.row_product, config=cfg, partials=partials, impl="pallas")
            yield (dict(shape=shape, variant=name, num_stages=cfg.num_stages), {"row_product": (cfg.num_warps,
                                                                                                 cfg.num_stages)},
                   fn, (x, w))
    # the GDN output projection with the split decode kernel's gated norm applied as it loads the
    # row (NormedRow: 32 heads of 128, sums of squares from 4 splits, z in the 12352-wide product)
    k, n, group, width, offset = 4096, 2048, 128, 12352, 8192
    cfg = rp.default_config(k, n, partials=True)

    def normed(x, w, squares, gate, weight):
        return rp.row_product(rp.NormedRow(x, squares, gate, weight, group, offset, 1e-6), w, partials=True,
                              impl="pallas")

    bf = jnp.bfloat16
    yield (dict(shape="out_proj_normed", variant="default", num_stages=cfg.num_stages),
           {"row_product": (cfg.num_warps, cfg.num_stages)}, normed,
           (jax.ShapeDtypeStruct((1, k), bf), jax.ShapeDtypeStruct((k, n), bf),
            jax.ShapeDtypeStruct((k // group, 4), jnp.float32), jax.ShapeDtypeStruct((1, width), bf),
            jax.ShapeDtypeStruct((group,), bf)))


def compile_case(kernels, warps, stages: int) -> list[dict]:
    """Registers etc. of a case's kernels: the first one at `warps`, or, where warps is a dict
    {kernel name prefix: (warps, stages)}, every kernel at its own settings (named)."""
    if not isinstance(warps, dict):
        return [compile_ttir(kernels[0][1], warps, stages)]
    out = []
    for name, ttir in kernels:
        w, st = next(v for prefix, v in warps.items() if name.startswith(prefix))
        out.append({"launch": name, "num_warps": w, "num_stages": st, **compile_ttir(ttir, w, st)})
    return out


CASES = {"ssd": ssd_cases, "gdn": gdn_cases, "select": select_cases, "topk": top_k_cases,
         "gdn_decode": gdn_decode_cases, "mamba2_decode": mamba2_decode_cases, "gdn_prologue": gdn_prologue_cases,
         "attention": attention_cases,
         "gdn_commit": gdn_commit_cases, "add_rms_norm": add_rms_norm_cases, "moe_decode": moe_decode_cases,
         "moe_grouped": moe_grouped_cases, "row_product": row_product_cases, "pair_groups": pair_groups_cases}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=tuple(CASES))
    ap.add_argument("--nodes", type=int, default=64,
                    help="tree nodes (ssd, gdn), the budget (select), the row length (topk) or the batch (gdn_decode)")
    ap.add_argument("--num-stages", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")  # lowering for CUDA needs no GPU: never take one
    version = installed_triton()
    if version is None or not version.startswith(TRITON_VERSION + "."):
        print(f"note: triton {version or '(not installed)'} here; the recorded figures are for {TRITON_VERSION}.x",
              file=sys.stderr)
    cases = CASES[args.kernel](args.nodes)
    rows = []
    for opts, warps, fn, shapes in cases:
        row = {"kernel": args.kernel, "nodes": args.nodes, "triton": version,
               **{k: str(v) if v is None else v for k, v in opts.items()}}
        try:
            kernels = capture_ttir(fn, *shapes)
            if not kernels:
                raise RuntimeError("no pallas_call found")
            warps = opts.get("num_warps") or warps
            found = [{**row, **res} for res in compile_case(kernels, warps, opts.get("num_stages") or args.num_stages)]
        except Exception as e:  # one failing setting never hides the others
            found = [{**row, "error": f"{type(e).__name__}: {str(e)[:300]}"}]
        for r in found:
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.out:
        atomic.write_json(args.out, rows, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
