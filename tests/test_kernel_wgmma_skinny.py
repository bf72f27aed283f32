"""The Mosaic GPU skinny matmul (pallas_kernels/wgmma_skinny.py) on a CPU machine: the reference
is jnp.matmul with float32 accumulation, bad configs and inputs are named, the split-K slice
choice fills the CTAs, and the kernel LOWERS for CUDA (Mosaic GPU's layout inference and dialect
lowering run in Python) at the 27B target's five projections at 65 and 16 rows. Running it needs
an H200: scripts/gpu_wgmma_skinny.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.wgmma_skinny import (WgmmaSkinnyConfig as C, auto_split_k, padded_rows, reference,
                                         smem_bytes, swizzle_for, wgmma_skinny)

TARGET_SHAPES = {  # (K, N)
    "mlp_down": (17408, 5120),
    "out_proj": (6144, 5120),
    "gdn_qkvzba": (5120, 16480),
    "mlp_gate_up": (5120, 34816),
    "attn_qkv": (5120, 14336),
}
LOWER_CONFIGS = {
    "default": C(),
    "bn256_s4": C(block_n=256, stages=4),
    "k128_s3": C(tile_k=128, stages=3),
    "split_k": C(schedule="split_k"),
}


def _bf16(rng, shape):
    return jnp.asarray(rng.normal(size=shape), jnp.bfloat16)


def test_reference_is_float32_accumulated_matmul():
    rng = np.random.default_rng(0)
    x, w = _bf16(rng, (65, 192)), _bf16(rng, (192, 256))
    want = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32)).astype(jnp.bfloat16)
    got = reference(x, w)
    assert got.dtype == jnp.bfloat16 and got.shape == (65, 256)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(wgmma_skinny(x, w, impl="xla"), np.float32),
                                  np.asarray(got, np.float32))


@pytest.mark.parametrize("cfg, word", [
    (C(tile_k=96), "tile_k"), (C(stages=1), "stages"), (C(num_ctas=200), "num_ctas"),
    (C(schedule="rows"), "schedule"), (C(split_k=4), "split_k"), (C(swizzle=48), "swizzle"),
    (C(block_n=64), "block_n"),
])
def test_bad_config_is_named(cfg, word):
    with pytest.raises(ValueError, match=word):
        cfg.check()


@pytest.mark.parametrize("xs, ws, word", [
    ((129, 128), (128, 256), "M = 129"),
    ((0, 128), (128, 256), "M = 0"),
    ((8, 96), (96, 256), "tile_k"),
    ((8, 128), (128, 100), "N = 100"),
    ((8, 128), (64, 256), "contraction"),
])
def test_bad_shapes_are_named(xs, ws, word):
    x, w = jnp.zeros(xs, jnp.bfloat16), jnp.zeros(ws, jnp.bfloat16)
    with pytest.raises(ValueError, match=word):
        wgmma_skinny(x, w, impl="mosaic")


def test_dtype_mismatch_and_impl_are_named():
    with pytest.raises(ValueError, match="dtype mismatch"):
        wgmma_skinny(jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((128, 256), jnp.float32))
    with pytest.raises(ValueError, match="bfloat16"):
        wgmma_skinny(jnp.zeros((8, 128), jnp.float32), jnp.zeros((128, 256), jnp.float32))
    with pytest.raises(ValueError, match="impl"):
        wgmma_skinny(jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((128, 256), jnp.bfloat16), impl="triton")


def test_shared_memory_overflow_is_named():
    with pytest.raises(ValueError, match="shared memory"):
        wgmma_skinny(jnp.zeros((65, 1024), jnp.bfloat16), jnp.zeros((1024, 256), jnp.bfloat16),
                     config=C(block_n=256, stages=8))


def test_helpers():
    assert padded_rows(65) == 72 and padded_rows(16) == 16 and padded_rows(1) == 8
    assert swizzle_for(16480, C()) == 64 and swizzle_for(5120, C()) == 128
    assert swizzle_for(16480, C(swizzle=128)) == 0
    assert smem_bytes(65, C()) <= 227 * 1024
    s = auto_split_k(40, 272, 128)  # mlp_down at tile_k 64: 40 n_tiles, 272 k steps
    units = 40 * s
    assert 272 % s == 0 and units / (-(-units // 128) * 128) > 0.9


def _lower(m, k, n, cfg):
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    f = jax.jit(lambda x, w: wgmma_skinny(x, w, impl="mosaic", config=cfg))
    return f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("m", [65, 16])
@pytest.mark.parametrize("shape", sorted(TARGET_SHAPES))
def test_kernel_lowers_for_cuda_at_target_shapes(shape, m):
    k, n = TARGET_SHAPES[shape]
    text = _lower(m, k, n, C())
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("name", sorted(LOWER_CONFIGS))
def test_every_benchmark_config_lowers(name):
    text = _lower(65, 5120, 16480, LOWER_CONFIGS[name])  # the ragged N (64-byte swizzle)
    assert "mosaic_gpu" in text


def test_model_route_lowers_for_cuda(monkeypatch):
    """models.layers.WGMMA_SKINNY (opt-in): a Linear of a measured shape at 65 rows with impl
    "pallas" lowers to the Mosaic GPU kernel for CUDA; other shapes, row counts and the
    interpreter keep XLA's dot."""
    from flax import nnx

    from ddtree_jax.models import layers

    monkeypatch.setattr(layers, "WGMMA_SKINNY", True)
    lin = layers.Linear(6144, 5120, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    with pytest.warns(UserWarning, match="not an sm_90 GPU"):  # this CPU: XLA's dot, announced
        assert "dot_general" in str(jax.make_jaxpr(lambda a: lin(a, "pallas"))(
            jax.ShapeDtypeStruct((1, 65, 6144), jnp.bfloat16)))
    monkeypatch.setattr(layers, "_hopper", lambda: True)  # lowering for an H200 from here
    x = jax.ShapeDtypeStruct((1, 65, 6144), jnp.bfloat16)
    assert layers.wgmma_route_takes(x, lin.kernel[...])
    assert not layers.wgmma_route_takes(jax.ShapeDtypeStruct((1, 1, 6144), jnp.bfloat16), lin.kernel[...])
    text = jax.jit(lambda a: lin(a, "pallas")).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "wgmma_skinny" in text
    interp = str(jax.make_jaxpr(lambda a: lin(a, "pallas_interpret"))(x))
    assert "wgmma_skinny" not in interp and "dot_general" in interp
