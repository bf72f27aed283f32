"""Kernel launches a step of the plain-decoding generation loop (`generate._advance`) makes, by
kernel name, for each loop chunk (decision 0075): single steps copy every buffer a kernel wrote
anew back into the loop's carry (at the 35B-A3B shape the 30 GDN conv windows, `memcpy32_post`)
and read the predicate on the host every step (`MemcpyD2H`); unrolled pairs should do neither
between their two steps. One profiler trace of a call of --steps steps per chunk, counts / steps.

    python -m scripts.bench.loop_launches --shape 35b-a3b --out $OUT/loop_launches.json   # on the H200
    python -m scripts.bench.loop_launches --smoke --out /tmp/loop_launches.json           # any device
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.sampling import Sampling
from scripts.bench.common import (add_model_options, add_route_options, apply_route_options, model_configs,
                                  model_setup, record_row, start_report, trace_kernels, write_report)
from scripts.bench.e2e import loop_state
from scripts.bench.shapes import filled_caches


def launches(graphdef, params, s, spec, steps: int) -> dict[str, float]:
    """{kernel name: launches a step} over one traced call of `steps` steps (after a warm call)."""
    eos = jnp.zeros((0,), jnp.int32)
    run = jax.jit(lambda p, st, n: gen._advance(nnx.merge(graphdef, p), None, st, eos, spec, n))
    jax.block_until_ready(run(params, s, jnp.int32(steps)))
    trace_dir = tempfile.mkdtemp(prefix="loop_launches_")
    with jax.profiler.trace(trace_dir):
        jax.block_until_ready(run(params, s, jnp.int32(steps)))
    count = collections.Counter(name for name, _, _ in trace_kernels(trace_dir))
    return {name: round(n / steps, 2) for name, n in count.most_common()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_options(p)
    add_route_options(p)
    p.add_argument("--chunks", default="1,2", help="loop chunks (GenSpec.loop_chunk) to count")
    p.add_argument("--steps", type=int, default=16, help="steps a traced call (a multiple of every chunk)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",") if c]
    bad = [c for c in chunks if c < 1 or args.steps % c]
    if bad or args.steps < 1:
        p.error(f"--chunks {bad}: positive divisors of --steps ({args.steps})")
    route_fields = apply_route_options(p, args)
    shape, cfg, dcfg, context = model_configs(args)
    graphdef, params, _, _, _ = model_setup(args, cfg, dcfg)
    capacity = context + 64
    cache, dcache = filled_caches(cfg, dcfg, 1, context, capacity, seed=1)
    s = loop_state(cache, dcache, 1, jax.random.PRNGKey(0))._replace(dstate=None, hist=jnp.zeros((2,), jnp.int32))
    report = start_report("scripts.bench.loop_launches", argv, **route_fields, shape=shape, context=context, rows=[])
    for chunk in chunks:
        spec = gen.GenSpec("ar", 1, None, 10**6, Sampling(), capacity, None, args.routes, loop_chunk=chunk)
        per_step = launches(graphdef, params, s, spec, args.steps)
        copies = {k: v for k, v in per_step.items() if "memcpy" in k.lower()}
        record_row(report, {"chunk": chunk, "steps": args.steps, "launches_a_step": round(sum(per_step.values()), 2),
                            "by_kernel": per_step}, args.out,
                   f"chunk {chunk}: {sum(per_step.values()):.1f} launches a step; copies {copies}")
    write_report(args.out, report)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
