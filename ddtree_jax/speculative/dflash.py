"""The DFlash drafter as a Proposer for the generation loop."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from ddtree_jax.drafter_config import DrafterConfig, validate_against_target
from ddtree_jax.models import int8 as quant
from ddtree_jax.models.drafter import DrafterCache, finish_logits, init_drafter_cache
from ddtree_jax.models.layers import quantize_linears
from ddtree_jax.routes import REFERENCE, Routes
from ddtree_jax.speculative.draft_vocab import HotParams, head_logits, int8_draft_head, make_draft_vocab


@dataclasses.dataclass(frozen=True)
class DFlashProposer:
    """Static description of a DFlash drafter (its graphdef and config); params travel separately."""

    graphdef: nnx.GraphDef
    cfg: DrafterConfig
    draft_vocab: int = 0  # N > 0: drafts come from N chosen ids (speculative/draft_vocab.py); params are HotParams
    int8: quant.Int8Scheme | None = None  # int8 drafter and draft head (models/int8.py); params are HotParams

    def __hash__(self) -> int:
        # jit hashes its static GenSpec, and so this, on every call; a GraphDef's hash walks the
        # whole graph (0.2 ms for a 5-layer 27B-width drafter), so it is computed once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.graphdef, self.cfg, self.draft_vocab, self.int8))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def own_head(self) -> bool:
        """Whether drafts come from a head of the proposer's own (HotParams) rather than the target's."""
        return bool(self.draft_vocab) or self.int8 is not None

    def with_draft_vocab(self, params, target, ids) -> tuple["DFlashProposer", HotParams]:
        """(proposer, params) that draft from the token ids `ids` only; `target` is the merged
        target model (its head's columns are sliced here, once; quantized too for an int8 drafter)."""
        drafter = params.drafter if isinstance(params, HotParams) else params
        vocab = make_draft_vocab(target, ids)
        if self.int8 is not None:
            vocab = int8_draft_head(target, vocab)
        return dataclasses.replace(self, draft_vocab=int(vocab.ids.shape[0])), HotParams(drafter, vocab)

    def with_int8(self, params, target, scheme: quant.Int8Scheme = quant.Int8Scheme()
                  ) -> tuple["DFlashProposer", HotParams]:
        """(proposer, params) of the same drafter with int8 weights (every Linear, per-column
        scales) and an int8 copy of the draft head: the target's whole head, or the draft
        vocabulary's columns, multiplied as `scheme` says. Drafts change slightly; output does not
        (models/int8.py)."""
        if self.int8 is not None:
            raise ValueError("this drafter is int8 already")
        drafter = params.drafter if isinstance(params, HotParams) else params
        model = nnx.merge(self.graphdef, drafter)
        quantize_linears(model, scheme)
        graphdef, qparams = nnx.split(model)
        vocab = int8_draft_head(target, params.vocab if isinstance(params, HotParams) else None)
        return dataclasses.replace(self, graphdef=graphdef, int8=scheme), HotParams(qparams, vocab)

    def vocab_ids(self, params):
        """Token ids of the draft indices ([N] int32), or None when drafts span the whole vocabulary."""
        return params.vocab.ids if self.own_head else None

    def _drafter(self, params):
        if self.own_head and not isinstance(params, HotParams):
            raise ValueError("this proposer drafts from a head of its own (a draft vocabulary or int8): its params "
                             "must be HotParams (DFlashProposer.with_draft_vocab / with_int8)")
        return params.drafter if self.own_head else params

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

    def extend(self, params, state: DrafterCache, features, n_valid, routes: Routes = REFERENCE) -> DrafterCache:
        return nnx.merge(self.graphdef, self._drafter(params)).extend(state, features, n_valid, routes)

    def propose(self, params, state: DrafterCache, target, bonus, start, routes: Routes = REFERENCE):
        """Draft log-probs [B, Bs-1, V], or [B, Bs-1, N] over the draft vocabulary (renormalised
        over its ids; `vocab_ids` maps index i to its token)."""
        model = nnx.merge(self.graphdef, self._drafter(params))
        if not self.own_head:
            return jax.nn.log_softmax(model.draft(target, bonus, state, routes=routes), axis=-1)
        hidden = model.draft_hidden(target, bonus, state, routes=routes)
        return jax.nn.log_softmax(finish_logits(self.cfg, head_logits(params.vocab, hidden, self.int8)), axis=-1)
