"""Shared check of the DDTree build's GPU routes: the tree built with kernels on a backend
reported as a GPU must equal the CPU's array for array, and every route from a kernel to an XLA
form must be announced by a warning."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.speculative.build import build_tree


def assert_gpu_build_equals_cpu(logq, budget: int, monkeypatch) -> list[str]:
    """Build the tree of logq [2, D, V] (roots 3 / 4, lengths 5 / 9) on the CPU and with
    impl="pallas_interpret" on a reported GPU; assert equality; return the warnings' texts."""
    args = (logq, jnp.array([3, 4], jnp.int32), jnp.array([5, 9], jnp.int32))
    want = jax.jit(lambda *a: build_tree(*a, budget=budget))(*args)
    with monkeypatch.context() as m, warnings.catch_warnings(record=True) as caught:
        m.setattr(jax, "default_backend", lambda: "gpu")
        warnings.simplefilter("always")
        got = jax.jit(lambda *a: build_tree(*a, budget=budget, impl="pallas_interpret"))(*args)
    for name, w, g in zip(want._fields, want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    return [str(w.message) for w in caught]
