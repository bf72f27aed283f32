"""jax.jit with the XLA compiler options a static argument's `Routes` name.

jax.jit takes compiler options when the jitted function is made, not per call. A program's routes
travel as a static argument (a GenSpec, or Routes itself), so `RoutedJit` keeps one jitted
function per option set and picks it from that argument on every call: the options are part of
the program's key like every other route, and no process-wide XLA_FLAGS changes a compiled
program behind the caller's back.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable

import jax

from ddtree_jax.routes import Routes

Options = tuple[tuple[str, Any], ...]


def options_of(value) -> Options:
    """The compiler options of a static argument: a Routes, or anything with a `routes` field
    (GenSpec); () for anything else (None: the reference routes)."""
    routes = value if isinstance(value, Routes) else getattr(value, "routes", None)
    return routes.compiler_options() if isinstance(routes, Routes) else ()


class ArgPicker:
    """Reads one named argument of fn from a call's (args, kwargs) without binding the whole
    signature (a chunked generation calls its program per chunk)."""

    def __init__(self, fn: Callable, name: str, skip: int = 0):
        params = list(inspect.signature(fn).parameters.values())
        names = [p.name for p in params]
        if name not in names:
            raise ValueError(f"{getattr(fn, '__name__', fn)!r} has no argument {name!r}")
        self.name, self.index = name, names.index(name) - skip
        self.default = params[names.index(name)].default
        if self.default is inspect.Parameter.empty:
            self.default = None

    def __call__(self, args: tuple, kw: dict):
        if self.name in kw:
            return kw[self.name]
        return args[self.index] if 0 <= self.index < len(args) else self.default


class RoutedJit:
    """jax.jit(fn, **jit_kwargs) compiled with the options of its argument `options_arg`
    (`options_of`): one jitted function per option set. Call it and `.lower` it as the jit."""

    def __init__(self, fn: Callable, *, options_arg: str = "spec", **jit_kwargs):
        self._fn, self._jit_kwargs = fn, jit_kwargs
        self._pick = ArgPicker(fn, options_arg)
        self._by_options: dict[Options, Any] = {}
        self._lock = threading.Lock()
        self.__wrapped__ = fn

    def jitted(self, options: Options):
        hit = self._by_options.get(options)
        if hit is None:
            with self._lock:
                hit = self._by_options.get(options)
                if hit is None:
                    hit = self._by_options[options] = jax.jit(
                        self._fn, compiler_options=dict(options) or None, **self._jit_kwargs)
        return hit

    def __call__(self, *args, **kw):
        return self.jitted(options_of(self._pick(args, kw)))(*args, **kw)

    def lower(self, *args, **kw):
        return self.jitted(options_of(self._pick(args, kw))).lower(*args, **kw)

    def _cache_size(self) -> int:
        return sum(j._cache_size() for j in self._by_options.values())


def routed_jit(fn: Callable | None = None, *, options_arg: str = "spec", **jit_kwargs):
    """Decorator form of RoutedJit: @routed_jit(static_argnames=("spec",))."""
    if fn is None:
        return lambda f: RoutedJit(f, options_arg=options_arg, **jit_kwargs)
    return RoutedJit(fn, options_arg=options_arg, **jit_kwargs)
