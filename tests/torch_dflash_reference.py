"""A small PyTorch DFlash drafter, written from shared/specs/dflash_ddtree.md and the facts
confirmed in the public reference (z-lab/dflash `model/dflash.py`, `dflash/model.py`):

- target features -> fc (no bias) -> hidden_norm, once per context token; the fused context
  goes straight into every layer's k_proj / v_proj (no input_layernorm on it);
- block hidden -> input_layernorm -> q/k/v; keys = k_norm(cat(k_proj(ctx), k_proj(block)))
  with RoPE at absolute positions, queries = block only with the last positions;
- attention over [cached context ; new context ; block] without a causal mask (full layers),
  sliding layers mask |q - k| >= window, causal layers mask k > q;
- the cache keeps context K/V (after k_norm + RoPE) and drops the block after each call (crop);
- output = final norm; the target's lm_head (times output_multiplier, optional softcap) gives logits.

Works one sequence (or equal-length sequences) at a time, like the reference's generate loop.
`save_pretrained` writes the z-lab HF format: config.json with dflash_config + model.safetensors
(names without a `model.` prefix).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from torch import nn


def make_config(**overrides) -> dict:
    """A tiny z-lab style drafter config.json dict; `dflash_config` entries via overrides['dflash_config']."""
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "vocab_size": 97,
        "num_target_layers": 6,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "block_size": 4,
        "dflash_config": {"mask_token_id": 96, "target_layer_ids": [0, 2, 5]},
    }
    cfg.update(overrides)
    return cfg


def _dflash(cfg: dict, name: str, default=None):
    d = cfg.get("dflash_config") or {}
    if d.get(name) is not None:
        return d[name]
    return cfg.get(name, default) if cfg.get(name) is not None else default


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(positions: torch.Tensor, dim: int, theta: float):
    """positions [T] -> cos, sin [T, dim]."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    f = positions.float()[:, None] * inv[None]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, cfg: dict, window, causal: bool):
        super().__init__()
        h, nh, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        bias = cfg.get("attention_bias", False)
        self.nh, self.kv, self.hd = nh, kv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=bias)
        self.k_proj = nn.Linear(h, kv * hd, bias=bias)
        self.v_proj = nn.Linear(h, kv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=bias)
        self.q_norm = RMSNorm(hd, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, cfg["rms_norm_eps"])
        self.window, self.causal = window, causal

    def forward(self, x, ctx, cos, sin, past):
        """x [B, Tq, H] block (normed); ctx [B, Tc, H] new fused context; cos/sin over [Tc + Tq]
        positions (absolute); past = (k, v) [B, kv, P, hd] or None. Returns out, (k, v) incl. block."""
        b, tq, _ = x.shape
        tc = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, tq, self.nh, self.hd)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=1).view(b, tc + tq, self.kv, self.hd)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], dim=1).view(b, tc + tq, self.kv, self.hd)
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        q = q * cos[-tq:] + rotate_half(q) * sin[-tq:]
        k = k * cos + rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        s = k.shape[2]
        rep = self.nh // self.kv
        kr = k.repeat_interleave(rep, dim=1)
        vr = v.repeat_interleave(rep, dim=1)
        scores = (q @ kr.transpose(-1, -2)) * self.hd**-0.5
        qpos = s - tq + torch.arange(tq)[:, None]
        kpos = torch.arange(s)[None, :]
        visible = torch.ones(tq, s, dtype=torch.bool)
        if self.causal:
            visible &= kpos <= qpos
        if self.window is not None:
            visible &= qpos - kpos < self.window
            if not self.causal:
                visible &= kpos - qpos < self.window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(vr.dtype)
        out = (probs @ vr).transpose(1, 2).reshape(b, tq, self.nh * self.hd)
        return self.o_proj(out), (k, v)


class MLP(nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict, window, causal):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg, window, causal)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"])

    def forward(self, x, ctx, cos, sin, past):
        a, kv = self.self_attn(self.input_layernorm(x), ctx, cos, sin, past)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), kv


def layer_attention(cfg: dict):
    """Per-layer (window, causal), HF Qwen3Config semantics + the reference's is_causal rule."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    types = cfg.get("layer_types") or [
        "sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 28) else "full_attention"
        for i in range(n)
    ]
    is_causal = cfg.get("is_causal")
    out = []
    for t in types:
        sliding = t == "sliding_attention"
        out.append((window if sliding else None, sliding if is_causal is None else bool(is_causal)))
    return out


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        h = cfg["hidden_size"]
        self.target_layer_ids = list(_dflash(cfg, "target_layer_ids"))
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList([Layer(cfg, w, c) for w, c in layer_attention(cfg)])
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]

    def forward(self, noise_embedding, target_hidden, position_ids, cache=None):
        """noise_embedding [B, Tq, H]; target_hidden [B, Tc, K*H] (new context features);
        position_ids [Tc + Tq] absolute; cache: list of per-layer (k, v) or None.
        Returns (hidden [B, Tq, H], new cache including the block: crop it with `crop`)."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = rope(position_ids, self.cfg["head_dim"], self.theta)
        x = noise_embedding
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, ctx, cos, sin, None if cache is None else cache[i])
            new_cache.append(kv)
        return self.norm(x), new_cache

    @staticmethod
    def crop(cache, length: int):
        return [(k[:, :, :length], v[:, :, :length]) for k, v in cache]

    def logits(self, hidden, lm_head_weight):
        logits = hidden @ lm_head_weight.T
        logits = logits * float(_dflash(self.cfg, "output_multiplier", 1.0))
        cap = _dflash(self.cfg, "final_logit_softcapping")
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def randomize_(model: nn.Module, seed: int = 0, scale: float = 0.3) -> nn.Module:
    """Every parameter random, norms around 1 (so a wrong norm formula shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + scale * noise)
            else:
                fan_in = p.shape[-1] if p.ndim > 1 else 1
                p.copy_(noise * (fan_in**-0.5 if p.ndim > 1 else 0.1))
    return model


def save_pretrained(model: DFlashDrafter, directory: str, dtype: torch.dtype = torch.float32) -> None:
    """Write the z-lab HF layout: config.json + model.safetensors (no `model.` prefix)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model.cfg, f, indent=2)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
