"""Kernel-by-kernel profile of one step of a real target + drafter pair (default: the demo pair).

A small model's step is bound by kernel count, not bytes: this shows, per mode and phase, how many
kernels run and what they cost, on the state reached after a few real generation steps of a
prompt. Each phase runs `--inner` times inside one on-device loop under `jax.profiler.trace`
(scripts/profile_step.py's reader sums the trace's GPU kernels by name and kind).

    PYTHONPATH=. python3 scripts/profile_pair.py --out $OUT/profile_pair.json     # on the H200
    PYTHONPATH=. python3 scripts/profile_pair.py --budgets 16 --smoke             # any device
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax import atomic, overrides
from ddtree_jax import bench as B
from ddtree_jax.cli.common import load_engine
from ddtree_jax.engine import bucket
from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.sampling import Sampling
from scripts.profile_step import profile


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _step_loop(graphdef, params, dparams, s, eos, spec, n):
    """n whole steps from the same state (the bonus token bumped by the loop index so nothing is
    hoisted), each kept alive by a checksum of its output."""
    model = nnx.merge(graphdef, params)
    vocab = model.cfg.vocab_size

    def body(i, acc):
        st = s._replace(bonus=(s.bonus + i) % vocab, i=s.i + i)
        return acc + B._checksum(gen._step(model, dparams, st, eos, spec))

    return jax.lax.fori_loop(0, n, body, jnp.float32(0))


def first_prompt(engine, path: str) -> list[int]:
    with open(path) as f:
        for line in f:
            if line.strip():
                obj = json.loads(line) if line.lstrip().startswith("{") else {"prompt": line.rstrip("\n")}
                return [int(t) for t in obj["prompt_ids"]] if "prompt_ids" in obj else engine.encode(obj["prompt"])
    raise SystemExit(f"no prompt in {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target directory (default: the embedded demo pair)")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--prompts", default="docs/demo_heldout_prompts.jsonl")
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--kernels", default=None)
    ap.add_argument("--inner", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="fewer repeats (CPU check of the script)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile_pair.json"))
    overrides.add_argument(ap)
    args = ap.parse_args(argv)
    applied = overrides.apply_from_args(ap, args)
    if args.smoke:
        args.inner, args.iters = 2, 1

    engine = load_engine(args.target, args.drafter, None, kernels=args.kernels)
    prompt_ids = first_prompt(engine, args.prompts)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["scripts/profile_pair.py"] + (argv if argv is not None else sys.argv[1:])),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, "kernels": engine.kernels,
              "overrides": applied, "runs": {}}
    g, p, dp = engine.graphdef, engine.params, engine.drafter_params
    eos = jnp.zeros((0,), jnp.int32)
    key = jax.random.PRNGKey(0)
    t = bucket(len(prompt_ids))
    prompt = np.zeros((1, t), np.int32)
    prompt[0, : len(prompt_ids)] = prompt_ids
    runs = [("ar", 1), ("dflash", 1)] + [("ddtree", int(b)) for b in args.budgets.split(",") if b]
    for mode, budget in runs:
        spec = engine.spec(mode, budget=budget, candidates=None, max_new_tokens=128, sampling=Sampling(),
                           prompt_bucket=t)
        s = gen.start(g, p, dp, jnp.asarray(prompt), jnp.asarray([len(prompt_ids)], jnp.int32), eos, key, spec)
        s = gen.advance(g, p, dp, s, eos, jnp.int32(4), spec)
        s = s._replace(done=jnp.zeros_like(s.done), out=jnp.full_like(s.out, -1), n_out=jnp.zeros_like(s.n_out))
        label = mode if mode != "ddtree" else f"ddtree{budget}"
        entry = {}
        phases = [("step", lambda: _step_loop(g, p, dp, s, eos, spec, jnp.int32(args.inner)))]
        if mode != "ar":
            logq = B._propose(g, p, dp, s, spec)
            tree = B._build(logq, s, spec, gen.vocab_ids(spec, dp))
            res = B._verify(g, p, s, tree, spec, key)
            for ph in ("draft", "build", "verify", "commit"):
                phases.append((ph, functools.partial(B._phase_loop, g, p, dp, s, logq, tree, res, eos, key, spec, ph,
                                                     jnp.int32(args.inner))))
        for ph, fn in phases:
            t0 = time.time()
            r = profile(fn, args.iters, f"{label}_{ph}", args.top)
            r = {"wall_ms": r["wall_ms"] / args.inner, "gpu_busy_ms": r["gpu_busy_ms"] / args.inner,
                 "kernels": r["kernels_per_call"] / args.inner,
                 "by_kind_ms": {k: v / args.inner for k, v in r["by_kind_ms"].items()},
                 "top": [{**x, "calls": x["calls"] / args.inner, "ms": x["ms"] / args.inner} for x in r["top"]],
                 "seconds": time.time() - t0}
            entry[ph] = r
            report["runs"][label] = entry
            atomic.write_json(args.out, report)
            print(f"== {label} {ph}: {r['wall_ms']:.3f} ms wall/iter, {r['gpu_busy_ms']:.3f} ms kernels, "
                  f"{r['kernels']:.0f} kernels", flush=True)
            for x in r["top"][:12]:
                print(f"     {1e3 * x['ms']:8.1f} us {x['calls']:6.1f}x  {x['kernel']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
