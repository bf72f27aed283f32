"""pallas_kernels/_mosaic_pdl.py and scripts/bench/mosaic_pdl.py: a Mosaic GPU kernel whose compiler
params are PdlCompilerParams is lowered with the module attribute that makes jaxlib launch it with
programmatic dependent launch, and only such a kernel (checked by lowering for CUDA, which works on
any machine). The chain's numbers are checked natively (-m gpu): the Mosaic forms' outputs equal
each other bit for bit and a float64 reference within float32 rounding."""

import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._mosaic_pdl import USES_PDL_ATTR
from scripts.bench.common import max_rel_err


def test_only_pdl_params_carry_the_attribute():
    from scripts.bench import mosaic_pdl

    for op, io in itertools.product(mosaic_pdl.OPS, mosaic_pdl.IOS):
        for form in mosaic_pdl.MOSAIC_FORMS:
            text = mosaic_pdl.lowered_text(form, rows=256, cols=256, layers=2, op=op, io=io)
            assert "mosaic_gpu_v2" in text
            assert (USES_PDL_ATTR in text) == (form in mosaic_pdl.PDL_FORMS), (op, io, form)


def test_smoke_report(tmp_path):
    from scripts.bench import mosaic_pdl

    out = tmp_path / "pdl.json"
    assert mosaic_pdl.main(["--smoke", "--check-jax", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["attribute_in_lowering"] == {"plain": False, "pdl_start": True, "pdl_prefetch": True,
                                               "pdl_nowait": True}
    assert isinstance(report["jax_files_naming_uses_pdl"], list)


def test_reference_and_xla_chain_agree():
    from scripts.bench import mosaic_pdl

    w = jax.random.normal(jax.random.PRNGKey(0), (256, 3 * 128), jnp.float32).astype(jnp.bfloat16)
    d = jax.random.normal(jax.random.PRNGKey(1), (256,), jnp.float32)
    out = np.asarray(mosaic_pdl.chain(w, d, layers=3, cols=128, form="xla"))
    ref = mosaic_pdl.reference(w, d, layers=3, cols=128)
    assert max_rel_err([ref], [out]) < 4e-3  # x rounded to bfloat16 for XLA's product
    # one launch over three layers' columns with the first x: the sum of the three products
    one = mosaic_pdl.reference(w, d, layers=3, cols=128, one_launch=True)
    w64, d64 = np.asarray(w, np.float64), np.asarray(d, np.float64)
    expect = (w64 @ np.tile(d64[:128], 3)) * mosaic_pdl.scale_for(128) + d64
    np.testing.assert_allclose(one, expect, rtol=1e-12)
    # rowsum: the row sums scaled, no x
    rs = mosaic_pdl.reference(w, d, layers=1, cols=128, op="rowsum")
    np.testing.assert_allclose(rs, w64[:, :128].sum(axis=1) / 64 + d64, rtol=1e-12)


def test_per_layer_time_cancels_the_call_fixed_cost():
    """Every form, one_launch included, is timed as (long - short) / layers between: a call of
    200 us fixed cost and 5 us a layer gives 5 us, whatever the rounds' noise in the fixed cost."""
    from scripts.bench import mosaic_pdl

    pairs = [((fixed + 40 * 5) * 1e-6, (fixed + 8 * 5) * 1e-6) for fixed in (180, 200, 260)]
    assert mosaic_pdl.per_layer_us(pairs, 40, 8) == pytest.approx(5.0)
    assert mosaic_pdl.per_layer_us([(1e-3, 0.5e-3)], 40, 8) == pytest.approx(500 / 32)


@pytest.mark.parametrize("argv", [
    ["--forms", "plain,megakernel"],
    ["--rows", "100"],
    ["--cols", "200"],  # not a multiple of a config's block_cols
    ["--cols", "16384"],  # more than --rows
    ["--configs", "128"],
    ["--io", "ldg"],
    ["--base-layers", "40"],
])
def test_arguments_are_checked(argv):
    from scripts.bench import mosaic_pdl

    with pytest.raises(SystemExit):
        mosaic_pdl.main(argv + ["--out", "x.json"])


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gemv", "rowsum"])
@pytest.mark.parametrize("io", ["tma", "direct"])
def test_mosaic_forms_equal_plain_and_the_reference(op, io):
    from scripts.bench import mosaic_pdl

    w = jax.random.normal(jax.random.PRNGKey(0), (1024, 6 * 512), jnp.float32).astype(jnp.bfloat16)
    d = jax.random.normal(jax.random.PRNGKey(1), (1024,), jnp.float32)
    ref = mosaic_pdl.reference(w, d, layers=6, cols=512, op=op)
    outs = {f: np.asarray(jax.jit(functools.partial(mosaic_pdl.chain, layers=6, cols=512, form=f, op=op,
                                                    io=io))(w, d))
            for f in ("plain", "pdl_start", "pdl_prefetch")}
    for f, out in outs.items():
        assert max_rel_err([ref], [out]) < 1e-5, f
        assert np.array_equal(out, outs["plain"]), f
