"""Byte-level BPE tokenizer for the demo pair, trained with the `tokenizers` library.

GPT-2 style: the ByteLevel pre-tokenizer (regex split + byte-to-unicode map, no prefix
space), a BPE model whose initial alphabet is all 256 bytes (so any text encodes, no <unk>),
and the ByteLevel decoder. Special tokens come first in the vocabulary:
    0 = "<|endoftext|>"  (document separator; EOS)
    1 = "<|MASK|>"       (the DFlash drafter's mask token; never produced by encoding text)
Saved as a single tokenizer.json that `tokenizers.Tokenizer.from_file` (and HF
`PreTrainedTokenizerFast(tokenizer_file=...)`) read.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)


def train_tokenizer(texts: Sequence[str], vocab_size: int = 8192, *, min_frequency: int = 2):
    """Train a byte-level BPE on `texts` (deterministic for a given input order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name!r} got id {tok.token_to_id(name)}, expected {i}")
    return tok


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def special_ids(tok) -> dict[str, int]:
    return {"eos": tok.token_to_id(EOS_TOKEN), "mask": tok.token_to_id(MASK_TOKEN)}


def encode_documents(tok, texts: Sequence[str]) -> np.ndarray:
    """Encode documents and concatenate them, each followed by <|endoftext|> (int32 1-D)."""
    eos = tok.token_to_id(EOS_TOKEN)
    if not texts:
        return np.zeros((0,), np.int32)
    encs = tok.encode_batch(list(texts), add_special_tokens=False)
    parts = []
    for enc in encs:
        parts.append(np.asarray(enc.ids, np.int32))
        parts.append(np.asarray([eos], np.int32))
    return np.concatenate(parts)
