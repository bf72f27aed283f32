"""Shared check of the DDTree build's GPU routes: the tree built with a GPU's routes (kernels
interpreted) must equal the reference's array for array, and every route from a kernel to an XLA
form must be announced by a warning."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.routes import Routes
from ddtree_jax.speculative.build import build_tree


GPU_INTERPRET = Routes.resolve(impl="pallas_interpret", platform="gpu")  # a GPU's routes, kernels interpreted


def assert_gpu_build_equals_cpu(logq, budget: int) -> list[str]:
    """Build the tree of logq [2, D, V] (roots 3 / 4, lengths 5 / 9) with the reference routes and
    with a GPU's routes (kernels interpreted); assert equality; return the warnings' texts."""
    args = (logq, jnp.array([3, 4], jnp.int32), jnp.array([5, 9], jnp.int32))
    want = jax.jit(lambda *a: build_tree(*a, budget=budget))(*args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jax.jit(lambda *a: build_tree(*a, budget=budget, routes=GPU_INTERPRET))(*args)
    for name, w, g in zip(want._fields, want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    return [str(w.message) for w in caught]
