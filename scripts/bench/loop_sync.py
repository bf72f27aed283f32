"""What the generation loop's data-dependent predicate costs a step, on the demo pair.

The generation loop (`speculative.generate._advance`) is one `lax.while_loop` whose predicate
("any row not done and steps left") depends on the step's output; on a GPU XLA's runtime copies
that predicate to the host every iteration (the profile's one device-to-host copy a step) before it
launches the next. A loop with a static trip count needs no such read. This tool runs the same
steps three ways from one prefilled state, every row active for every step (no EOS, rows long
enough): `advance` (the while loop), `advance` with GenSpec.loop_chunk = --chunk (chunks of a
static step count, one predicate read a chunk: "chunked") and a jitted `lax.fori_loop` of `_step`
with the whole step count static ("fori", no read at all); per-step time = (T(long) - T(short)) /
(long - short) for each, medians of interleaved repeats, and the ratios to "fori"
(`while_over_fori`, `chunked_over_fori`). A while ratio well above 1 on a launch-bound target with
the chunked one near 1 says loop_chunk pays there.

    python -m scripts.bench.loop_sync --out $OUT/loop_sync.json          # on the H200
    python -m scripts.bench.loop_sync --smoke --out /tmp/loop_sync.json  # any device
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax import atomic
from ddtree_jax.engine import bucket
from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.sampling import Sampling


def measure(engine, mode: str, budget: int, batch: int, prompt_len: int, steps: tuple[int, int], repeats: int,
            chunk: int) -> dict:
    """Medians of the three loops at both step counts, the per-step times and their ratios to fori."""
    start, advance = gen.bind(engine.graphdef)
    params, dparams, graphdef = engine.params, engine.drafter_params, engine.graphdef
    max_new = 4 * steps[1] + 64  # every row active for every step of every call
    spec = engine.spec(mode, budget=budget, candidates=None, max_new_tokens=max_new, sampling=Sampling(),
                       prompt_bucket=bucket(prompt_len))
    rng = np.random.default_rng(batch)
    prompt = jnp.asarray(rng.integers(0, engine.cfg.vocab_size, (batch, prompt_len)), jnp.int32)
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    never = jnp.asarray([-1], jnp.int32)  # no EOS
    rows = gen.uniform_rows(Sampling(), batch, max_new, jax.random.PRNGKey(0))
    s0 = start(params, dparams, prompt, lens, never, None, spec=spec, rows=rows)
    single = dataclasses.replace(spec, loop_chunk=1)  # not the routes' default (a GPU's is > 1)

    @functools.partial(jax.jit, static_argnums=(3,))
    def fori(params, dparams, state, n):
        model = nnx.merge(graphdef, params)
        return jax.lax.fori_loop(0, n, lambda _, st: gen._step(model, dparams, st, never, single), state)

    chunked = dataclasses.replace(spec, loop_chunk=chunk)
    loops = {"while": lambda st, n: advance(params, dparams, st, never, jnp.int32(n), spec=single),
             "chunked": lambda st, n: advance(params, dparams, st, never, jnp.int32(n), spec=chunked),
             "fori": lambda st, n: fori(params, dparams, st, n)}
    for run in loops.values():  # compile and first runs
        for n in steps:
            jax.block_until_ready(run(jax.tree.map(jnp.copy, s0), n))
    samples = {(name, n): [] for name in loops for n in steps}
    for _ in range(repeats):
        for name, run in loops.items():  # interleaved: drifts of the machine hit both alike
            for n in steps:
                st = jax.tree.map(jnp.copy, s0)
                jax.block_until_ready(st)
                t0 = time.perf_counter()
                end = run(st, n)
                jax.device_get(end.done)
                samples[(name, n)].append(1e3 * (time.perf_counter() - t0))
                if int(end.i) - int(s0.i) != n:
                    raise SystemExit(f"{name}: {n} steps asked, {int(end.i) - int(s0.i)} run")
    med = {f"{name}_{n}_ms": statistics.median(v) for (name, n), v in samples.items()}
    step = {name: (med[f"{name}_{steps[1]}_ms"] - med[f"{name}_{steps[0]}_ms"]) / (steps[1] - steps[0])
            for name in loops}
    return {**med, "step_ms": step, "while_over_fori": step["while"] / step["fori"],
            "chunked_over_fori": step["chunked"] / step["fori"], "chunk": chunk}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON report")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--programs", default="ar,ddtree16", help="ar and / or ddtreeB (budget B)")
    p.add_argument("--steps", default="16,64", help="the short and the long call's steps")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--chunk", type=int, default=4, help="GenSpec.loop_chunk of the chunked loop (default 4)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="batch 1, ar and DDTree-4, 2 / 4 steps, 1 repeat")
    args = p.parse_args(argv)
    programs = ["ar", "ddtree4"] if args.smoke else args.programs.split(",")
    bad = [x for x in programs if x != "ar" and not (x.startswith("ddtree") and x[6:].isdigit())]
    steps = (2, 4) if args.smoke else tuple(int(x) for x in args.steps.split(","))
    chunk = 2 if args.smoke else args.chunk
    if bad or len(steps) != 2 or not 1 <= steps[0] < steps[1] or chunk < 2:
        p.error(f"--programs: ar or ddtreeB, got {bad}; --steps: two counts short < long, got {steps}; "
                f"--chunk >= 2, got {chunk}")
    batches = [1] if args.smoke else [int(b) for b in args.batches.split(",")]
    repeats = 1 if args.smoke else args.repeats
    from ddtree_jax.cli.common import load_engine

    engine = load_engine(None, None)  # the demo pair
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "args": vars(args), "results": {}}
    for batch in batches:
        for prog in programs:
            mode, budget = ("ar", 1) if prog == "ar" else ("ddtree", int(prog[6:]))
            row = measure(engine, mode, budget, batch, args.prompt_len, steps, repeats, chunk)
            report["results"][f"{prog}_b{batch}"] = row
            ms = row["step_ms"]
            print(f"[loop] {prog} batch {batch}: ms a step while {ms['while']:.4f} ({row['while_over_fori']:.3f}x), "
                  f"chunks of {chunk} {ms['chunked']:.4f} ({row['chunked_over_fori']:.3f}x), fori {ms['fori']:.4f}",
                  file=sys.stderr, flush=True)
            atomic.write_json(args.out, report)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
