"""Per-call host cost of the generation loop's calls (any machine; the GPU host's own figure is
bench_e2e.py's `*_dispatch_ms`).

What a streamed generation pays per chunk before the device runs anything: jit's hashing of its
static arguments and the dispatch of the params pytree. Times, as medians:
  - hash() of the 27B-shaped target's GraphDef (abstract: no weights) and of the GenSpec holding
    its DFlash drafter (a DFlashProposer caches its hash after the first call);
  - one `advance` call of 0 steps on a model with the 27B's layer pattern (`--layers`, tiny widths)
    through `generate.advance` (graphdef as a static jit argument) and through `generate.bind`
    (graphdef bound once: what the engine uses).
Prints a table and writes JSON.

    PYTHONPATH=. python3 scripts/dispatch_cost.py --out $OUT/dispatch.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from ddtree_jax import atomic  # noqa: E402
from ddtree_jax.bench import median_ms  # noqa: E402
from ddtree_jax.config import TargetConfig  # noqa: E402
from ddtree_jax.models.drafter import DrafterModel  # noqa: E402
from ddtree_jax.models.target import TargetModel  # noqa: E402
from ddtree_jax.speculative import generate as gen  # noqa: E402
from ddtree_jax.speculative.dflash import DFlashProposer  # noqa: E402
from ddtree_jax.speculative.sampling import Sampling  # noqa: E402
from bench_e2e import QWEN36_27B, drafter_config  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=64, help="layers of the tiny model timed in `advance`")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "dispatch.json"))
    args = ap.parse_args(argv)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["scripts/dispatch_cost.py"] + (argv if argv is not None else sys.argv[1:])),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": args.layers}

    cfg27 = TargetConfig.from_hf_dict(QWEN36_27B)
    graph27, _ = nnx.split(nnx.eval_shape(lambda: TargetModel(cfg27, rngs=nnx.Rngs(0))))
    dcfg = drafter_config(cfg27, 5, 32, 8, 128, 16)
    dgraph, _ = nnx.split(nnx.eval_shape(lambda: DrafterModel(dcfg, rngs=nnx.Rngs(0))))
    spec27 = gen.GenSpec("ddtree", 64, None, 128, Sampling(), 4160, DFlashProposer(dgraph, dcfg), "xla")
    report["hash_target_graphdef_ms"] = median_ms(lambda: hash(graph27), args.repeats)
    report["hash_spec_first_ms"] = median_ms(lambda: hash(gen.GenSpec(
        "ddtree", 64, None, 128, Sampling(), 4160, DFlashProposer(dgraph, dcfg), "xla")), args.repeats)
    report["hash_spec_cached_ms"] = median_ms(lambda: hash(spec27), args.repeats)

    raw = dict(QWEN36_27B, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=args.layers,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, dtype="float32")
    cfg = TargetConfig.from_hf_dict(raw)
    graphdef, params = nnx.split(TargetModel(cfg, rngs=nnx.Rngs(0)))
    report["param_leaves"] = len(jax.tree.leaves(params))
    spec = gen.GenSpec("ar", 16, None, 64, Sampling(), 128, None, "xla")
    eos = jnp.zeros((0,), jnp.int32)
    box = [gen.start(graphdef, params, None, jnp.ones((1, 8), jnp.int32), jnp.asarray([8], jnp.int32), eos,
                     jax.random.PRNGKey(0), spec)]
    _, advance = gen.bind(graphdef)
    zero = jnp.int32(0)

    def static():
        box[0] = gen.advance(graphdef, params, None, box[0], eos, zero, spec)
        return box[0]

    def bound():
        box[0] = advance(params, None, box[0], eos, zero, spec=spec)
        return box[0]

    report["advance_static_graphdef_ms"] = median_ms(static, args.repeats)
    report["advance_bound_ms"] = median_ms(bound, args.repeats)
    atomic.write_json(args.out, report)
    print(f"device {report['device']}, jax {report['jax']}")
    for key in ("hash_target_graphdef_ms", "hash_spec_first_ms", "hash_spec_cached_ms"):
        print(f"  {key:34s} {report[key]:8.3f} ms")
    print(f"  advance, 0 steps, {args.layers}-layer model ({report['param_leaves']} param leaves):")
    print(f"    graphdef static (generate.advance)  {report['advance_static_graphdef_ms']:8.3f} ms")
    print(f"    graphdef bound (generate.bind)      {report['advance_bound_ms']:8.3f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
