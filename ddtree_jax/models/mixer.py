"""The one interface every token mixer offers, so a decoder layer and the speculative code drive
attention, Gated DeltaNet, Mamba2 and stateless feed-forward blocks alike:

    append(x, cache, step, routes) -> (y, cache)        append tokens: a prefill chunk or a decode step
    tree(x, cache, geo, start, routes) -> (y, pending)  outputs of every draft node from its own path;
                                                        writes nothing committed
    commit(pending, path, count, cache, start, routes) -> cache
                                                        the accepted path's K/V or state, after the prefix

`pending` holds per-node inputs (tree K/V, recurrent inputs), never per-node states
(docs/tree_state.md). Blocks without a cache take and return cache None and pending None.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax

from ddtree_jax.routes import REFERENCE, Routes
from ddtree_jax.tree import TreeGeometry


class Step(NamedTuple):
    """Where an append pass puts its T tokens per sequence."""

    start: jax.Array  # [B] committed lengths: the tokens go at positions start + t
    n_valid: jax.Array  # [B] how many of the T tokens are real (padding after them leaves state alone)
    chunked: bool  # static: a prefill chunk (chunked recurrences) rather than one-token steps


class TokenMixer(Protocol):
    def append(self, x: jax.Array, cache: Any, step: Step, routes: Routes = REFERENCE) -> tuple[jax.Array, Any]: ...

    def tree(self, x: jax.Array, cache: Any, geo: TreeGeometry, start: jax.Array, routes: Routes = REFERENCE
             ) -> tuple[jax.Array, Any]: ...

    def commit(self, pending: Any, path: jax.Array, count: jax.Array, cache: Any, start: jax.Array,
               routes: Routes = REFERENCE) -> Any: ...


class StatelessMixer:
    """The mixer entry points of a feed-forward block in the mixer slot (NemotronH "mlp" / "moe"):
    no cache, nothing pending; the block's own `__call__(x, routes)` does the work."""

    def append(self, x, cache, step: Step, routes: Routes = REFERENCE):
        return self(x, routes), cache

    def tree(self, x, cache, geo: TreeGeometry, start, routes: Routes = REFERENCE):
        return self(x, routes), None

    def commit(self, pending, path, count, cache, start, routes: Routes = REFERENCE):
        return cache
