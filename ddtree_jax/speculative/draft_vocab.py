"""A restricted draft vocabulary: the drafter scores only N chosen token ids ("hot tokens").

Why: a DFlash drafter scores its block with the target's lm_head over the whole vocabulary. At
the Qwen3.6-27B shape that is 15 draft positions x 248,320 ids: the 2.54 GB head is read once
per step, 0.57 ms of an ~18.6 ms DDTree step on the H200 (docs/decisions/0038-draft-vocabulary.md). With
N ids the draft head is the [H, N] slice of those columns (0.34 GB at N = 32768), sliced once
when the generation is set up, never inside the loop. This is FR-Spec's frequency-ranked draft
vocabulary (Zhao et al., 2025) and what SGLang loads with `--speculative-token-map`.

Output is unchanged: the target verifies every draft against its full vocabulary, so greedy
output stays identical to plain decoding and sampling keeps the target's distribution. What
changes is the drafts: the tree's tokens come from the N ids only (the draft log-probs are
renormalised over them), so text that needs other tokens accepts fewer drafts: on the demo pair
the 2048 most frequent of its 8192 ids accepted 2.76 tokens a step against 3.07 (-10 %), ids
0..2047 2.63, while the 27B step gets ~2 % shorter with 32k of
248k ids. An option for vocabularies a small share of which covers the text. Choose the ids
by frequency on text like the workload's (`scripts/hot_tokens.py` counts them with the target's
tokenizer); `first_ids(N)` (ids 0 .. N-1: byte-level BPE vocabularies number their tokens in
merge order, roughly by frequency) is the fallback and what the random-weight benchmark uses.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.models import int8


class DraftVocab(NamedTuple):
    """The draft head as data (a pytree that travels with the drafter's params): the target
    lm_head's columns of the draft ids, in its dtype, or int8 with a column scale (an int8 drafter,
    models/int8.py; then ids may be None: the whole vocabulary)."""

    ids: jax.Array | None  # [N] int32, ascending, unique: draft index i is token ids[i]; None: i is token i
    head: jax.Array  # [H, N]; int8: [N, H] (models/int8.py stores int8 weights [out, in])
    scale: jax.Array | None = None  # [N] float32 when head is int8


class HotParams(NamedTuple):
    """Drafter params of a proposer with a draft head of its own (a draft vocabulary, an int8
    drafter, or both): the drafter's own params, and the head."""

    drafter: object
    vocab: DraftVocab


def check_ids(ids, vocab_size: int) -> np.ndarray:
    """The ids as a sorted int32 array; every problem named at once."""
    arr = np.asarray(ids)
    problems = []
    if arr.ndim != 1 or arr.size == 0:
        problems.append(f"the draft vocabulary must be a non-empty list of token ids, got shape {arr.shape}")
    elif not np.issubdtype(arr.dtype, np.integer):
        problems.append(f"draft vocabulary ids must be integers, got {arr.dtype}")
    else:
        bad = arr[(arr < 0) | (arr >= vocab_size)]
        if bad.size:
            problems.append(f"{bad.size} draft vocabulary ids outside the target's vocabulary [0, {vocab_size}): "
                            f"{bad[:5].tolist()}")
        uniq, counts = np.unique(arr, return_counts=True)
        if (counts > 1).any():
            problems.append(f"repeated draft vocabulary ids: {uniq[counts > 1][:5].tolist()}")
    if problems:
        raise ValueError("invalid draft vocabulary: " + "; ".join(problems))
    return np.sort(arr).astype(np.int32)


def first_ids(n: int, vocab_size: int) -> np.ndarray:
    """Ids 0 .. n-1 (the fallback choice; see the module docstring)."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not 1 <= n <= vocab_size:
        raise ValueError(f"the draft vocabulary size must be an integer in [1, {vocab_size}], got {n!r}")
    return np.arange(n, dtype=np.int32)


def load_ids(spec: str | int, vocab_size: int) -> np.ndarray:
    """A draft vocabulary from the command line: a size N (ids 0 .. N-1), or a JSON file holding a
    list of token ids (or {"ids": [...]}, what scripts/hot_tokens.py writes)."""
    if isinstance(spec, (int, np.integer)) or (isinstance(spec, str) and spec.strip().isdigit()):
        return first_ids(int(spec), vocab_size)
    if not os.path.isfile(spec):
        raise ValueError(f"--draft-vocab: {spec!r} is neither a size nor a JSON file of token ids")
    try:
        with open(spec) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--draft-vocab: cannot read {spec}: {e}") from e
    ids = data.get("ids") if isinstance(data, dict) else data
    if not isinstance(ids, list):
        raise ValueError(f"--draft-vocab: {spec} holds no list of token ids (a JSON list, or an object with 'ids')")
    return check_ids(np.asarray(ids), vocab_size)


def _target_head(target_model) -> jax.Array:
    """The target's head as [H, V]: its lm_head, or its tied embedding transposed (a view for XLA)."""
    if target_model.lm_head is None:
        return target_model.embed_tokens.embedding[...].T
    return target_model.lm_head.kernel[...]


def make_draft_vocab(target_model, ids) -> DraftVocab:
    """The draft head for `ids` from the target (its lm_head, or its tied embedding)."""
    ids = check_ids(ids, target_model.cfg.vocab_size)
    idx = jnp.asarray(ids)
    return DraftVocab(idx, jnp.take(_target_head(target_model), idx, axis=1))


def int8_draft_head(target_model, vocab: DraftVocab | None = None) -> DraftVocab:
    """An int8 draft head: `vocab`'s columns quantized, or (None) the target's whole head, ids None.
    A head that is int8 already is returned as it is."""
    if vocab is None:
        vocab = DraftVocab(None, _target_head(target_model))
    if vocab.scale is not None:
        return vocab
    q, scale = int8.quantize(vocab.head)
    return DraftVocab(vocab.ids, q, scale)


def head_logits(vocab: DraftVocab, hidden: jax.Array, scheme: int8.Int8Scheme | None = None) -> jax.Array:
    """Float32 logits [..., N] of the draft ids: the target head's arithmetic (a product in the
    head's dtype, then float32), so they equal the full head's logits at those ids; an int8 head
    (scale set): models.int8.product under `scheme` (its W8A8 rule), scaled in float32."""
    if vocab.scale is not None:
        w8a8 = (scheme or int8.Int8Scheme()).takes_w8a8(vocab.head.shape[0])
        return int8.product(hidden, vocab.head, vocab.scale, w8a8=w8a8, out_dtype=jnp.float32)
    return jnp.einsum("...h,hn->...n", hidden.astype(vocab.head.dtype), vocab.head).astype(jnp.float32)
