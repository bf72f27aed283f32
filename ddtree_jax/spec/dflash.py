"""The DFlash drafter as a Proposer for the generation loop."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from ddtree_jax.drafter_config import DrafterConfig, validate_against_target
from ddtree_jax.models.drafter import DrafterCache, init_drafter_cache


@dataclasses.dataclass(frozen=True)
class DFlashProposer:
    """Static description of a DFlash drafter (its graphdef and config); params travel separately."""

    graphdef: nnx.GraphDef
    cfg: DrafterConfig

    def __hash__(self) -> int:
        # jit hashes its static GenSpec, and so this, on every call; a GraphDef's hash walks the
        # whole graph (0.2 ms for a 5-layer 27B-width drafter: scripts/dispatch_cost.py), so it is computed once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.graphdef, self.cfg))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def hidden_ids(self) -> tuple[int, ...]:
        return self.cfg.target_hidden_ids

    def check_target(self, target_cfg) -> None:
        """Refuse a target this drafter was not built for (layer ids, hidden size, vocab, mask id)."""
        validate_against_target(self.cfg, target_cfg)

    def init_state(self, params, batch: int, capacity: int) -> DrafterCache:
        return init_drafter_cache(self.cfg, batch, capacity)

    def extend(self, params, state: DrafterCache, features, n_valid) -> DrafterCache:
        return nnx.merge(self.graphdef, params).extend(state, features, n_valid)

    def propose(self, params, state: DrafterCache, target, bonus, start, impl: str = "xla"):
        logits = nnx.merge(self.graphdef, params).draft(target, bonus, state, impl=impl)
        return jax.nn.log_softmax(logits, axis=-1)
