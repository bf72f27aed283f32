"""What a decode step of one NemotronH MoE block costs in its two exact forms (any device).

ddtree_jax/models/moe.py runs a block's experts either gathered (each token's top_k experts'
weights gathered, only those products: what the block picks while T * top_k < E, i.e. decoding)
or dense (every expert on every token: prefill, tree verify). A decode step is bound by the
expert weights it reads, top_k of E matrices per token against all E. This times both forms on
the same random bf16 weights (never zeros), T tokens, median of repeats after a warm-up, prints a
table and writes JSON.

    PYTHONPATH=. python3 scripts/moe_decode_cost.py --out $OUT/moe_decode.json
    PYTHONPATH=. python3 scripts/moe_decode_cost.py --smoke          # tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax import atomic
from ddtree_jax.bench import median_ms
from ddtree_jax.config import TargetConfig
from ddtree_jax.models.moe import RELU2, NemotronMoE, expert_mlp_dense, expert_mlp_gathered


def block_config(hidden: int, experts: int, top_k: int, inter: int, shared: int) -> TargetConfig:
    """A NemotronH config whose only interesting part is one MoE block of the given shape."""
    return TargetConfig.from_hf_dict({
        "model_type": "nemotron_h", "vocab_size": 128, "hidden_size": hidden, "intermediate_size": 64,
        "layers_block_type": ["moe"], "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
        "chunk_size": 8, "n_routed_experts": experts, "num_experts_per_tok": top_k,
        "moe_intermediate_size": inter, "moe_shared_expert_intermediate_size": shared,
    })


def random_block(cfg: TargetConfig, dtype):
    """(graphdef, params) of a MoE block with normal random weights (router float32)."""
    gd, abstract = nnx.split(nnx.eval_shape(lambda: NemotronMoE(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
    leaves, tree = jax.tree_util.tree_flatten(abstract)
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
    made = [(jax.random.normal(k, a.shape, jnp.float32) * a.shape[-2] ** -0.5 if len(a.shape) >= 2 else
             jax.random.normal(k, a.shape, jnp.float32) * 0.1).astype(a.dtype) for k, a in zip(keys, leaves)]
    return gd, jax.tree_util.tree_unflatten(tree, made)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--hidden", type=int, default=2688)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--inter", type=int, default=1856, help="expert width (moe_intermediate_size)")
    ap.add_argument("--shared", type=int, default=3712, help="shared expert width")
    ap.add_argument("--tokens", default="1,8", help="tokens per step (batch rows of a decode step)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe_decode.json"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.experts, args.top_k, args.inter, args.shared, args.repeats = 64, 16, 2, 32, 32, 3
    cfg = block_config(args.hidden, args.experts, args.top_k, args.inter, args.shared)
    gd, params = random_block(cfg, jnp.bfloat16)
    expert_bytes = 2 * args.hidden * args.inter * 2  # up + down of one expert, bf16

    route = jax.jit(lambda p, x: nnx.merge(gd, p).route(x))
    def form(products):
        def run(p, x, idx, w):
            m = nnx.merge(gd, p)
            return products(x, idx, w, m.up_proj[...], m.down_proj[...], act=RELU2)
        return jax.jit(run)

    gathered, dense = form(expert_mlp_gathered), form(expert_mlp_dense)
    rows = []
    for t in [int(v) for v in args.tokens.split(",")]:
        x = jax.random.normal(jax.random.PRNGKey(t), (t, args.hidden), jnp.float32).astype(jnp.bfloat16)
        idx, w = route(params, x)
        ms_g = median_ms(lambda: gathered(params, x, idx, w), args.repeats)
        ms_d = median_ms(lambda: dense(params, x, idx, w), args.repeats)
        row = {"tokens": t, "gathered_ms": ms_g, "dense_ms": ms_d, "dense_over_gathered": ms_d / ms_g,
               "gathered_expert_GB": t * args.top_k * expert_bytes / 1e9,
               "dense_expert_GB": args.experts * expert_bytes / 1e9,
               "block_picks": "gathered" if t * args.top_k < args.experts else "dense"}
        rows.append(row)
        print(f"[moe] {t} tokens: gathered {ms_g:.3f} ms, dense {ms_d:.3f} ms", flush=True)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["scripts/moe_decode_cost.py"] + (argv if argv is not None else sys.argv[1:])),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "shape": {"hidden": args.hidden, "experts": args.experts, "top_k": args.top_k, "inter": args.inter,
                        "shared": args.shared, "dtype": "bfloat16"}, "rows": rows}
    atomic.write_json(args.out, report)
    print("\ntokens  gathered_ms  dense_ms  dense/gathered  expert GB read (gathered / dense)  block picks")
    for r in rows:
        print(f"{r['tokens']:6d}  {r['gathered_ms']:11.3f}  {r['dense_ms']:8.3f}  {r['dense_over_gathered']:14.1f}"
              f"  {r['gathered_expert_GB']:8.3f} / {r['dense_expert_GB']:.3f}{'':14s}{r['block_picks']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
