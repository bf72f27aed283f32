"""unmerged_inputs: distinct operands for many-row projections (so XLA keeps separate GEMMs), the
same values, a no-op at decode's few rows, and differentiable (the trainers use the same model)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.models.layers import UNMERGED_MIN_ROWS, Linear, unmerged_inputs


def _projections(rows):
    rngs = nnx.Rngs(0)
    a, b, c = (Linear(16, d, rngs=rngs) for d in (8, 4, 4))
    x = jax.random.normal(jax.random.PRNGKey(1), (1, rows, 16))

    def f(x):
        xa, xbc = unmerged_inputs(x, (a,), (b, c))
        return jnp.concatenate([a(xa), b(xbc), c(xbc)], axis=-1)

    want = jnp.concatenate([a(x), b(x), c(x)], axis=-1)
    return f, x, want


def test_values_and_barrier_only_for_many_rows():
    for rows in (1, UNMERGED_MIN_ROWS - 1, UNMERGED_MIN_ROWS, 65):
        f, x, want = _projections(rows)
        np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), np.asarray(want))
        hlo = jax.jit(f).lower(x).as_text()
        assert hlo.count("optimization_barrier") == (2 if rows >= UNMERGED_MIN_ROWS else 0), rows


def test_gradient_passes_through():
    f, x, _ = _projections(UNMERGED_MIN_ROWS)
    g = jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)
    rngs = nnx.Rngs(0)
    a, b, c = (Linear(16, d, rngs=rngs) for d in (8, 4, 4))
    want = jax.grad(lambda x: jnp.sum(jnp.concatenate([a(x), b(x), c(x)], axis=-1) ** 2))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6, atol=1e-6)
