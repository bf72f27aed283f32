"""Tiny on-disk checkpoints for CLI tests: a HF Qwen3.5 target with a character tokenizer and
a z-lab format DFlash drafter built for it (and one that does not fit it)."""

from __future__ import annotations

import json
import os

import torch
from tokenizers import Tokenizer, decoders, models

import torch_dflash_reference as dref

VOCAB = 128
EOS = 1


def char_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "<eos>": EOS}
    for c in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab[c] = len(vocab)
    for i in range(len(vocab), VOCAB - 1):
        vocab[f"<extra_{i}>"] = i
    vocab["<|MASK|>"] = VOCAB - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return tok


def write_target(directory: str, seed: int = 0, max_position_embeddings: int = 512) -> str:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2, eos_token_id=EOS,
        max_position_embeddings=max_position_embeddings,
    )
    model = Qwen3_5ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name:
                p.uniform_(-1.0, 1.0)
            elif "norm" in name:
                p.normal_(1.0 if "linear_attn.norm" in name else 0.0, 0.3)
            else:
                p.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    char_tokenizer().save(os.path.join(directory, "tokenizer.json"))
    return directory


def write_drafter(directory: str, seed: int = 0, **overrides) -> str:
    fields = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, num_target_layers=4, block_size=5,
        dflash_config={"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2]},
    )
    fields.update(overrides)
    cfg = dref.make_config(**fields)
    model = dref.randomize_(dref.DFlashDrafter(cfg), seed)
    dref.save_pretrained(model, directory)
    return directory


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
