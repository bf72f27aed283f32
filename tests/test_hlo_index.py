"""scripts/bench/hlo_index.py: each instruction of an optimized HLO module -> shape, op and the lines
of our code that emitted it (what scripts.bench.profile --sources prints beside every GPU kernel)."""

import jax
import jax.numpy as jnp
import numpy as np

from scripts.bench import hlo_index
from tests.tiny_models import HYBRID, make_target

TEXT = """HloModule m

FileNames
1 "/src/ddtree_jax/models/gdn.py"
2 "/site/jax/_src/numpy/einsum.py"

FunctionNames
1 "project"
2 "einsum"

FileLocations
1 {file_name_id=1 function_name_id=1 line=112 end_line=112 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=40 end_line=40 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}

ENTRY %main (p: bf16[65,5120]) -> (bf16[65,16384], f32[65]) {
  %gemm_fusion_dot.610 = bf16[65,16384]{1,0} fusion(%p, %w), kind=kCustom, metadata={op_name="jit(f)/while/body/dot_general" stack_frame_id=2}
  %tuple_out = (bf16[65,16384]{1,0}, f32[65]{0}) custom-call(%p), custom_call_target="x", metadata={op_name="jit(f)/pallas_call" source_file="/src/pallas_kernels/gdn_tree.py" source_line=9}
  ROOT %r = (bf16[65,16384]{1,0}, f32[65]{0}) tuple(%gemm_fusion_dot.610, %x)
}
"""  # noqa: E501 (XLA prints each HLO instruction on one line)


def test_index_reads_frames_shapes_and_kernel_spellings():
    idx = hlo_index.index_hlo(TEXT)
    dot = hlo_index.lookup(idx, "gemm_fusion_dot_610")  # a kernel name writes '.' as '_'
    assert dot is hlo_index.lookup(idx, "gemm_fusion_dot.610")
    assert dot.shape == "bf16[65,16384]" and dot.opcode == "fusion"
    assert dot.frames == ("ddtree_jax/models/gdn.py:112 project",)  # jax's own frame dropped
    assert hlo_index.describe(dot) == "bf16[65,16384] body/dot_general @ gdn.py:112 project"
    tup = idx["tuple_out"]  # tuple shape, source_file / source_line metadata (older form)
    assert tup.opcode == "custom-call" and tup.shape.startswith("(bf16[65,16384]")
    assert tup.frames == ("pallas_kernels/gdn_tree.py:9",)
    assert hlo_index.lookup(idx, "no_such_kernel") is None and hlo_index.describe(None) == "?"


def test_model_products_trace_back_to_the_model_code():
    """A tiny hybrid target's prefill, compiled here: its products and fusions name the model's
    files (the GDN and attention layers, the Linear projections) through the HLO's stack frames."""
    from ddtree_jax import decode
    from ddtree_jax.cache import init_target_cache

    cfg, gd, params = make_target(dict(HYBRID), seed=3)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 6)), jnp.int32)
    lens = jnp.asarray([6], jnp.int32)
    cache = init_target_cache(cfg, 1, 16)
    text = jax.jit(lambda p, t: decode.prefill(gd, p, cache, t, lens).cache).lower(params, tokens).compile().as_text()
    idx = hlo_index.index_hlo(text)
    files = {fr.split(":")[0] for inst in idx.values() for fr in inst.frames}
    assert {"ddtree_jax/models/gdn.py", "ddtree_jax/models/layers.py"} <= files, sorted(files)
    dots = [i for i in idx.values() if i.op_name.endswith("dot_general") and i.frames]
    assert dots and all(i.shape.startswith("f32[") for i in dots)
    assert any("layers.py" in hlo_index.describe(i) for i in dots)
