"""Programmatic dependent launch (PDL) for Pallas Mosaic GPU kernels.

A kernel whose module carries the attribute `mosaic_gpu.uses_pdl` is launched by jaxlib with
programmatic stream serialization (its launch lowering reads the attribute): the kernel may start
while its predecessor in the stream drains, and must call `plgpu.griddepcontrol_wait()` before it
reads anything that predecessor (or any earlier kernel) writes. Loads of program inputs that no
kernel writes (weights) may be issued before the wait; that overlap is the point.

jax 0.11.x sets the attribute itself on a kernel that uses either griddepcontrol instruction (a PDL
effect on the kernel's jaxpr); jax 0.10.2 sets it on no kernel, so there the instructions do nothing
(docs/decisions/0077-programmatic-dependent-launch-of-mosaic-gpu-kernels.md). `PdlCompilerParams`
asks for it on both: Pallas picks a pallas_call's GPU lowering by the exact type of its compiler
params, so a subclass of `plgpu.CompilerParams` with a rule of its own changes only the kernels that
pass it. The rule is the Mosaic GPU pallas_call lowering with the attribute added to the module; it
uses jax-private functions (`lower_pipelined_jaxpr_to_module`, `_mosaic_gpu_lowering_rule`), so a
jax release that moves them fails here, at lowering, by name. Kernels with GMEM scratch or the
in-kernel profiler are refused rather than half supported.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax._src.pallas import core as pallas_core
from jax._src.pallas.mosaic_gpu import core as gpu_core
from jax._src.pallas.mosaic_gpu import lowering as gpu_lowering
from jax._src.lib.mlir import ir
from jax._src import core as jax_core
from jax._src import sharding_impls
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

USES_PDL_ATTR = "mosaic_gpu.uses_pdl"


@dataclasses.dataclass(frozen=True)
class PdlCompilerParams(plgpu.CompilerParams):
    """plgpu.CompilerParams for a kernel launched with programmatic dependent launch. The kernel
    body must call plgpu.griddepcontrol_wait() before reading any value an earlier kernel of the
    program writes (including its own outputs' buffers); it may call
    plgpu.griddepcontrol_launch_dependents() to let the next kernel start early."""


def _pdl_pallas_call_lowering(ctx, *args, jaxpr, interpret, debug, input_output_aliases, grid_mapping,
                              mesh, compiler_params, cost_estimate, out_avals, metadata, name):
    del interpret, debug, out_avals, metadata, name
    if grid_mapping.num_dynamic_grid_bounds:
        raise NotImplementedError("PDL kernels: dynamic grid bounds are not supported by Mosaic GPU")
    if mesh is not None and not isinstance(mesh, gpu_core.Mesh):
        raise NotImplementedError(f"PDL kernels: mesh {mesh} is not a Mosaic GPU mesh")
    mgpu.dialect.register_dialect(ctx.module_context.context)
    jax_mesh = None
    if isinstance(ctx.module_context.axis_context, sharding_impls.SPMDAxisContext):
        jax_mesh = ctx.module_context.axis_context.mesh
    result = gpu_lowering.lower_pipelined_jaxpr_to_module(
        grid_mapping, mesh, jax_mesh, jaxpr, compiler_params, cost_estimate,
        outer_traceback=ctx.traceback)
    if result.gmem_scratch_shapes or result.profiler_spec is not None:
        raise NotImplementedError("PDL kernels: GMEM scratch and the in-kernel profiler are not supported")
    module = result.module
    with module.context:
        module.operation.attributes[USES_PDL_ATTR] = ir.UnitAttr.get()
    return mgpu.core._mosaic_gpu_lowering_rule(
        ctx.replace(avals_out=[jax_core.ShapedArray(s.shape, np.dtype(s.dtype)) for s in result.new_out_shapes]),
        *args, module=module, out_types=result.new_out_shapes, inout_types=(),
        input_output_aliases=input_output_aliases, use_custom_barrier=False)


pallas_core.register_lowering_rule(PdlCompilerParams, _pdl_pallas_call_lowering, "gpu")
