"""The drafter side of a speculative step, as the generation loop sees it.

A proposer is a frozen (hashable, jit-static) object with pure methods over its own state
pytree. The DFlash drafter is one; tests plug in scripted proposers (random, or the target's
own continuation with injected errors) through the same interface.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from ddtree_jax.routes import REFERENCE, Routes


class Proposer(Protocol):
    block_size: int  # the block is [bonus, MASK x (block_size - 1)]: block_size - 1 draft depths
    hidden_ids: tuple[int, ...]  # HF hidden_states indices of the target features it reads

    def init_state(self, params: Any, batch: int, capacity: int) -> Any:
        """Empty drafter state for `batch` sequences of up to `capacity` committed tokens."""

    def extend(self, params: Any, state: Any, features: jax.Array | None, n_valid: jax.Array,
               routes: Routes = REFERENCE) -> Any:
        """Append the target features [B, T, F] of newly committed tokens (first n_valid[b] real);
        routes as for `propose`."""

    def propose(self, params: Any, state: Any, target, bonus: jax.Array, start: jax.Array,
                routes: Routes = REFERENCE) -> jax.Array:
        """Log-probs [B, block_size - 1, V] of the draft tokens at positions start+1 .. start+block_size-1,
        given the bonus token at position `start`. `target` is the merged target model (embedding, head);
        routes: the generation's kernel routes (ddtree_jax/routes.py), for drafters that have kernels."""
