"""scripts/bench/grid_barrier.py: the launch-per-product forms equal each other bit for bit and jnp
within rounding (on a CPU, interpret mode); the barrier forms equal them natively (-m gpu, where
every program is resident at once: interpret mode runs programs one after another, so a program
waiting at the barrier would wait for ever)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.mark.script
def test_smoke(tmp_path):
    from scripts.bench import grid_barrier

    out = tmp_path / "gb.json"
    assert grid_barrier.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for r in rows:
        assert r["bit_equal_to_grid"]["persistent"]
        assert r["bit_equal_to_grid"]["grid_vs_jnp_max_abs"] < 0.05
        assert r["grid"]["us_per_layer"] > 0 and r["floor"]["us_per_layer"] > 0


def test_weights_are_bfloat16():
    from scripts.bench import grid_barrier

    for w in grid_barrier.make_weights(2, 256, 128, 128)[1]:
        assert w.dtype == jnp.bfloat16  # what layer_bytes counts


def test_chain_dimensions_are_checked():
    from scripts.bench import grid_barrier

    with pytest.raises(SystemExit):
        grid_barrier.main(["--n2", "64", "--out", "x.json"])
    with pytest.raises(SystemExit):
        grid_barrier.main(["--configs", "48:256:16:512:132:4:3", "--out", "x.json"])  # not a power of two
    with pytest.raises(SystemExit):
        grid_barrier.main(["--n1", "1024", "--configs", "32:256:16:1024:132:4:3", "--out", "x.json"])  # > K2
    with pytest.raises(SystemExit):
        grid_barrier.main(["--forms", "grid,megakernel", "--out", "x.json"])


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["barrier", "barrier_prefetch"])
def test_barrier_forms_equal_the_launch_per_product_form(form):
    from scripts.bench import grid_barrier as gb

    sms = jax.devices()[0].core_count
    cfg = dict(bn1=32, bk1=256, bn2=16, bk2=256, programs=min(sms, 64), warps=4, stages=3)
    weights = gb.make_weights(3, 1024, 512, 512)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 512), jnp.float32).astype(jnp.bfloat16)
    sync = jnp.zeros((2,), jnp.int32)
    want, _ = gb.chain("grid", cfg, interpret=False)(x, weights, sync)
    got, s = gb.chain(form, cfg, interpret=False)(x, weights, sync)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert list(np.asarray(s)) == [0, 3]  # every barrier left the count at 0; one generation a layer
