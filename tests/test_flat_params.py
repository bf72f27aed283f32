"""flat_params.FlatParams: parameters flattened once per object, one compilation per structure,
donation and static arguments as jax.jit's."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.flat_params import FlatParams


class Tiny(nnx.Module):
    def __init__(self, seed: int):
        self.w = nnx.Param(jax.random.normal(jax.random.PRNGKey(seed), (3, 3)))
        self.b = nnx.Param(jnp.full((3,), float(seed)))


def apply(params, extra, x, *, scale):
    return (x @ params["w"][...] + params["b"][...]) * scale + extra


def test_flattened_once_per_object_and_compiled_once_per_structure(monkeypatch):
    _, p1 = nnx.split(Tiny(1))
    _, p2 = nnx.split(Tiny(2))
    fn = FlatParams(apply, 1, static_argnames=("scale",), donate_argnums=(2,))
    x = jnp.ones((2, 3))
    want1 = apply(p1, 1.0, x, scale=2.0)
    flattens = []
    real = jax.tree.flatten
    monkeypatch.setattr(jax.tree, "flatten", lambda *a, **k: flattens.append(1) or real(*a, **k))
    np.testing.assert_allclose(fn(p1, 1.0, jnp.ones((2, 3)), scale=2.0), want1, rtol=1e-6)
    np.testing.assert_allclose(fn(p1, 1.0, jnp.ones((2, 3)), scale=2.0), want1, rtol=1e-6)
    assert len(flattens) == 1  # the second call reused the leaves
    got2 = fn(p2, 1.0, jnp.ones((2, 3)), scale=2.0)  # another object: flattened, same program
    np.testing.assert_allclose(got2, apply(p2, 1.0, x, scale=2.0), rtol=1e-6)
    assert len(flattens) == 2 and fn._cache_size() == 1
    fn(p2, 1.0, jnp.ones((2, 3)), scale=3.0)  # a static argument: another program
    assert fn._cache_size() == 2
    donated = jnp.ones((2, 3))
    fn(p1, 1.0, donated, scale=2.0)
    assert donated.is_deleted()
