"""scripts/bench/l2_prefetch.py (decision 0074): the lead launch's norm equals jnp's with and
without prefetch programs (interpret mode), a chain's output does not depend on the prefetch, and
bad options are refused."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _norm_ref(y, r, nw, k):
    n = y.shape[-1]
    h = jnp.sum(y.reshape(-1, n).astype(jnp.float32), axis=0)[jnp.arange(k) % n] + r.astype(jnp.float32)
    return (h * jax.lax.rsqrt(jnp.mean(h * h) + 1e-6) * nw.astype(jnp.float32)).astype(r.dtype)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("k,n,rows", [(128, 64, 4), (64, 96, 1)])
def test_lead_norm_equals_jnp(fraction, k, n, rows):
    from scripts.bench import l2_prefetch

    rng = np.random.default_rng(k + n)
    y = jnp.asarray(rng.standard_normal((rows, 1, n)), jnp.float32)
    r = jnp.asarray(rng.standard_normal(k), jnp.bfloat16)
    nw = jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    x = l2_prefetch.lead(y, r, nw, w, fraction=fraction, programs=3, unroll=2, warps=4, gpu=False)
    np.testing.assert_allclose(np.asarray(x[0], np.float32), np.asarray(_norm_ref(y, r, nw, k), np.float32),
                               rtol=2e-2, atol=2e-2)


def test_bad_options_are_refused():
    from scripts.bench import l2_prefetch

    with pytest.raises(SystemExit):
        l2_prefetch.main(["--shapes", "lm_head", "--out", "x.json"])
    with pytest.raises(SystemExit):
        l2_prefetch.main(["--fractions", "0,1.5", "--out", "x.json"])


@pytest.mark.script
def test_smoke(tmp_path):
    from scripts.bench import l2_prefetch

    out = tmp_path / "l2.json"
    assert l2_prefetch.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == ["out_proj", "in_proj"]
    for r in rows:
        assert all(r["equal_to_f0"].values()) and len(r["us_per_unit"]) == 4
