"""Jitted functions whose leading arguments are parameters that stay the same between calls: the
host flattens them once, and the compiled function takes their leaves.

jit flattens every argument on every call. An nnx.State flattens through Python (one flatten
function per Variable): on the H200's host, ~0.3 ms of an advance call's ~1 ms dispatch for the
demo pair's 101 parameter arrays (docs/decisions/0045-adaptive-budget-per-chunk.md), paid per
chunk of a streamed or adaptive generation and per server chunk. A list of arrays flattens in C++.
"""

from __future__ import annotations

import threading
from typing import Callable

import jax

from ddtree_jax.compiled import ArgPicker, options_of

_KEEP = 8  # parameter sets remembered per function (an engine has one; tests make several)


class FlatParams:
    """fn(p_1, ..., p_n, *rest, **kw) called as fn's jit with p_1..p_n flattened once per object.

    A parameter object is recognised by identity: replace it (not its arrays in place) to change
    it. jit_kwargs: jax.jit's (donate_argnums count the n parameter sets as one argument each).
    options_arg: the static argument whose routes give the XLA compiler options (ddtree_jax/compiled.py).
    Safe to call from several threads (a server's warm-up compiles programs concurrently): one
    jitted function per parameter structure, so concurrent first calls share its compilations."""

    def __init__(self, fn: Callable, n: int, *, options_arg: str | None = None, **jit_kwargs):
        self._fn, self._n, self._jit_kwargs = fn, n, jit_kwargs
        self._pick = ArgPicker(fn, options_arg) if options_arg else None
        self._by_defs: dict = {}  # (the parameters' treedefs, compiler options) -> jitted function
        self._hits: dict = {}  # ids of the parameter objects -> (objects, leaves, jitted)
        self._lock = threading.Lock()

    def _bind(self, params: tuple, options: tuple):
        key = (tuple(map(id, params)), options)
        hit = self._hits.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], params)):
            return hit
        with self._lock:
            return self._bind_locked(key, params, options)

    def _bind_locked(self, key: tuple, params: tuple, options: tuple):
        hit = self._hits.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], params)):
            return hit
        flat = [jax.tree.flatten(p) for p in params]
        defs = tuple(d for _, d in flat)
        jitted = self._by_defs.get((defs, options))
        if jitted is None:
            fn = self._fn

            def call(*args, **kw):
                trees = [jax.tree.unflatten(d, leaves) for d, leaves in zip(defs, args[: len(defs)])]
                return fn(*trees, *args[len(defs):], **kw)

            jitted = self._by_defs[(defs, options)] = jax.jit(call, compiler_options=dict(options) or None,
                                                              **self._jit_kwargs)
        if len(self._hits) >= _KEEP:
            self._hits.clear()
        hit = self._hits[key] = (params, [leaves for leaves, _ in flat], jitted)
        return hit

    def __call__(self, *args, **kw):
        options = options_of(self._pick(args, kw)) if self._pick else ()
        _, leaves, jitted = self._bind(args[: self._n], options)
        return jitted(*leaves, *args[self._n:], **kw)

    def _cache_size(self) -> int:
        return sum(j._cache_size() for j in self._by_defs.values())
