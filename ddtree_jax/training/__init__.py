"""Training of the demo pair (see docs/demo_pair.md and scripts/build_demo_pair.py).

    corpus.py          permissively licensed Python source from the machine, manifest, split
    tokenizer.py       byte-level BPE with <|endoftext|> and <|MASK|>
    target_trainer.py  a small Qwen3.5-style hybrid target from scratch (optax AdamW)
    drafter_trainer.py a DFlash drafter on the frozen target (random anchors, decay-weighted loss)
    export.py          HF directories (qwen3_5_text target, z-lab DFlashDraftModel drafter)

Needs `optax` and `tokenizers` besides the package's own dependencies.
"""
