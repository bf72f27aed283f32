"""Plain greedy decoding: ddtree-jax vs HF transformers' generate on the same random weights.

A Qwen3.5-shaped config small enough for both (bf16; scripts/bench/shapes.py HF_COMPARE). The HF
model is built in PyTorch with its own random init; its state dict is converted to our params with
the project's key maps, so both run the same weights. Reports tokens/s of each (after a warm-up
run) and how many greedy tokens agree (bf16 runs can part ways after a near tie).

    python -m scripts.bench.hf --out $OUT/hf_compare.json     # on the H200
    python -m scripts.bench.hf --smoke                        # tiny shapes, any device
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from converters.params import target_params_from_tensors
from ddtree_jax import atomic
from ddtree_jax.config import TargetConfig
from ddtree_jax.speculative.generate import generate
from scripts.bench.shapes import HF_COMPARE, HF_COMPARE_SMOKE


def main(argv=None) -> int:

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "hf_compare.json"))
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    raw = HF_COMPARE_SMOKE if args.smoke else HF_COMPARE
    new = 16 if args.smoke else args.new
    torch.manual_seed(0)
    hf_cfg = Qwen3_5TextConfig(**raw)
    model = Qwen3_5ForCausalLM(hf_cfg).to(dev, dtype).eval()
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    cfg_dict = hf_cfg.to_dict()
    cfg_dict["model_type"] = "qwen3_5_text"
    cfg = TargetConfig.from_hf_dict(cfg_dict).replace(dtype="bfloat16" if dev == "cuda" else "float32")
    graphdef, params = target_params_from_tensors(cfg, list(sd), sd.__getitem__, dtype=cfg.dtype)
    del sd
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, raw["vocab_size"], (1, args.prompt_len))

    # ours
    p, lens = jnp.asarray(prompt, jnp.int32), jnp.asarray([args.prompt_len], jnp.int32)
    run = lambda: generate(graphdef, params, p, lens, mode="ar", max_new_tokens=new)
    jax.block_until_ready(run().tokens)
    t0 = time.perf_counter()
    ours = run()
    jax.block_until_ready(ours.tokens)
    ours_s = time.perf_counter() - t0
    ours_tokens = np.asarray(ours.tokens[0]).tolist()

    # HF transformers generate (greedy, its default cache)
    ids = torch.tensor(prompt, device=dev)
    gen_kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **gen_kwargs)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **gen_kwargs)
        if dev == "cuda":
            torch.cuda.synchronize()
        hf_s = time.perf_counter() - t0
    hf_tokens = out[0, args.prompt_len:].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)) if a != b),
                 min(len(ours_tokens), len(hf_tokens)))
    try:
        import fla  # noqa: F401

        kernels = "flash-linear-attention present (HF uses its GDN kernels)"
    except ImportError:
        kernels = "no flash-linear-attention (HF uses its torch fallbacks)"
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m scripts.bench.hf"] + (argv if argv is not None else sys.argv[1:])),
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "transformers": transformers.__version__, "torch": torch.__version__, "jax": jax.__version__,
        "hf_kernels": kernels, "config": raw, "dtype": str(dtype), "prompt_len": args.prompt_len, "new_tokens": new,
        "ours_tokens_per_s": new / ours_s, "hf_tokens_per_s": new / hf_s, "ratio_ours_over_hf": hf_s / ours_s,
        "greedy_tokens_agree_prefix": agree,
    }
    atomic.write_json(args.out, report)
    print(f"ours {report['ours_tokens_per_s']:.1f} tok/s | HF generate {report['hf_tokens_per_s']:.1f} tok/s | "
          f"ratio {report['ratio_ours_over_hf']:.2f}x | greedy tokens agree for the first {agree}/{new} | {kernels}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
