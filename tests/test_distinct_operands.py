"""distinct_operands: one handle per projection group on a shared input (so XLA keeps separate
GEMMs and never concatenates their weights), the same values, and differentiable (the trainers
use the same model)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.models.layers import Linear, distinct_operands


def _projections(rows):
    rngs = nnx.Rngs(0)
    a, b, c = (Linear(16, d, rngs=rngs) for d in (8, 4, 4))
    x = jax.random.normal(jax.random.PRNGKey(1), (1, rows, 16))

    def f(x):
        xa, xbc = distinct_operands(x, (a,), (b, c))
        return jnp.concatenate([a(xa), b(xbc), c(xbc)], axis=-1)

    want = jnp.concatenate([a(x), b(x), c(x)], axis=-1)
    return f, x, want


def test_values_and_one_barrier_per_group():
    for rows in (1, 65):
        f, x, want = _projections(rows)
        np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), np.asarray(want))
        assert jax.jit(f).lower(x).as_text().count("optimization_barrier") == 2, rows


def test_one_group_is_left_alone():
    a = Linear(16, 8, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 3, 16))
    (h,) = distinct_operands(x, (a,))
    assert h is x


def test_gradient_passes_through():
    f, x, _ = _projections(32)
    g = jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)
    rngs = nnx.Rngs(0)
    a, b, c = (Linear(16, d, rngs=rngs) for d in (8, 4, 4))
    want = jax.grad(lambda x: jnp.sum(jnp.concatenate([a(x), b(x), c(x)], axis=-1) ** 2))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_drafter_context_projections_stay_apart():
    """DrafterModel.extend: every layer's k and v projection of the shared context gets its own
    handle (XLA's dot merger would otherwise concatenate all their weights every call); the cache
    it writes is unchanged."""
    from ddtree_jax.models.drafter import init_drafter_cache
    from tests.test_dflash_generate import drafter_for
    from tests.tiny_models import make_target

    cfg, _, _ = make_target()
    proposer, dparams = drafter_for(cfg, seed=3)
    dcfg, dgd = proposer.cfg, proposer.graphdef

    cache = init_drafter_cache(dcfg, 2, 32)
    feats = jax.random.normal(jax.random.PRNGKey(2), (2, 5, dcfg.fc_in_dim)).astype(jnp.dtype(dcfg.dtype))
    n_valid = jnp.asarray([5, 3], jnp.int32)

    def extend(p, c):
        model = nnx.merge(dgd, p)
        return model.extend(c, feats, n_valid)

    hlo = jax.jit(extend).lower(dparams, cache).as_text()
    assert hlo.count("optimization_barrier") == 2 * dcfg.num_layers
    got = jax.jit(extend)(dparams, cache)
    model = nnx.merge(dgd, dparams)  # the same arithmetic by hand, one shared ctx
    ctx = model.hidden_norm(model.fc(feats))
    pos = jnp.arange(5, dtype=jnp.int32)[None].repeat(2, 0)
    cos, sin = model._rope(pos)
    for layer, lc in zip(model.layers, got.layers):
        k, v = layer.self_attn.kv(ctx, cos, sin)
        np.testing.assert_allclose(np.asarray(lc.k[0, :, :5], np.float32),
                                   np.asarray(k[0].transpose(1, 0, 2), np.float32), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lc.v[1, :, :3], np.float32),
                                   np.asarray(v[1, :3].transpose(1, 0, 2), np.float32), rtol=1e-6, atol=1e-6)
