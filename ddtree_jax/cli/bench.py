"""ddtree-bench: AR, DFlash linear and DDTree side by side on a prompt set, sweeping budgets."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys

from ddtree_jax import atomic
from ddtree_jax.cli import progress
from ddtree_jax.cli.common import (EXIT_STATUS_HELP, MAX_BUDGET, add_auto_budget_arguments,
                                   add_autotune_cache_argument, add_draft_vocab_argument, add_int8_drafter_argument,
                                   add_routes_arguments, add_tokenizer_argument, decide_on_problem, die,
                                   model_paths, non_negative_int, note, positive_int,
                                   read_text_file, routes_from, run, tokenizer_source, use_autotune_cache,
                                   use_tokenizer)

PROG = "ddtree-bench"
EPILOG = """\
examples:
  ddtree-bench --prompts prompts.txt --out results/                 # the embedded demo pair
  ddtree-bench --target T --drafter D --prompts p.jsonl --budgets 16,64,256 --max-new-tokens 256
  ddtree-bench --prompts p.jsonl --budgets auto,4,8,16,32,64 --batch 8 --cost-table costs.json
  ddtree-bench --step-times e2e_35b.json --acceptance demo          # which budget pays, no model run

Prompts: a UTF-8 text file with one prompt per line ("\\n" inside a line is a newline), or JSONL
with {"prompt": "..."} or {"prompt_ids": [...]} per line. Writes bench.json and, with matplotlib
installed (pip install 'ddtree-jax[bench]'), bench.png in --out (and auto_choices.png: the choice
of every step of --budget auto's first generation).

--step-times REPORT... ranks plain decoding, DFlash and every budget by tokens per second from
step times measured by `python -m scripts.bench.e2e` (e.g. at the Qwen3.6-35B-A3B MoE shape, where
a tree reads many more experts than a decode step; with the correlated-routing bracket) and an
acceptance curve (--acceptance: 'demo', the demo pair's measured one, or a JSON file
{"ar": 1, "dflash": 2.5, "16": 3.1, ...}, e.g. the acceptance lengths a ddtree-bench run of your
drafter reported), and exits without loading a model.

--budgets auto runs the adaptive budget with a step-time table measured here (each choice forced
in the compiled auto program, on the first batch of prompts) and, with --cost-table FILE, writes
that table into FILE for this batch (ddtree-generate --cost-table FILE and
Engine.generate(cost_table=FILE) read it); --cost-table-in FILE uses a table from FILE instead.

""" + EXIT_STATUS_HELP.format(extra="; also: some outputs differ from plain decoding\n       away "
                              "from any near-tie of the target's top two logits")


def budgets(text: str) -> tuple[int | str, ...]:
    try:
        values = tuple(x.strip() if x.strip() == "auto" else int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated budgets like auto,16,64,256, got {text!r}"
                                         ) from None
    if not values or any(v != "auto" and not 1 <= v <= MAX_BUDGET for v in values):
        raise argparse.ArgumentTypeError(f"budgets must be 'auto' or in [1, {MAX_BUDGET}], got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target directory (default: the embedded demo pair)")
    p.add_argument("--drafter", default=None, help="DFlash drafter directory")
    add_tokenizer_argument(p)
    p.add_argument("--prompts", default=None, help="prompt file (text lines or JSONL; required unless --step-times)")
    p.add_argument("--step-times", nargs="+", default=None, metavar="REPORT",
                   help="rank the choices by tokens/s from scripts.bench.e2e reports' step times and --acceptance, "
                   "then exit (no model is run)")
    p.add_argument("--acceptance", default="demo", metavar="demo|FILE",
                   help="--step-times: tokens a step per choice: 'demo' (the demo pair's curve) or a JSON file")
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N prompts")
    p.add_argument("--modes", default="ar,dflash,ddtree", help="comma-separated modes (default ar,dflash,ddtree)")
    p.add_argument("--budgets", type=budgets, default=("auto", 16, 32, 64, 128, 256),
                   help="DDTree budgets to sweep; 'auto' = the adaptive budget (default auto,16,32,64,128,256)")
    add_auto_budget_arguments(p, "write the step-time table measured for --budgets auto into FILE (this batch's entry; "
                              "other batches already in FILE are kept)")
    p.add_argument("--cost-table-in", default=None, metavar="FILE",
                   help="--budgets auto: use the step-time table in FILE for this batch instead of measuring one")
    p.add_argument("--cost-repeats", type=positive_int, default=None,
                   help="--budgets auto: interleaved repeats of the step-time measurement (default 7 on a GPU, "
                        "3 on a CPU, with calls of 16 / 32 and 8 / 16 steps)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--batch", type=positive_int, default=1, help="prompts per batch (default 1)")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="timed passes over the prompts per mode / budget, interleaved pass by pass; tokens/s "
                        "is the median, every pass in bench.json (default 1)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None)
    add_draft_vocab_argument(p)
    add_int8_drafter_argument(p)
    add_autotune_cache_argument(p)  # e.g. the one scripts/pick_autotune_cache.py installs
    add_routes_arguments(p)
    p.add_argument("--phase-repeats", type=non_negative_int, default=10,
                   help="repeats for per-phase timing medians; 0 skips the phase split (faster: no extra compiles)")
    p.add_argument("--out", default="bench_out", help="output directory for bench.json and bench.png")
    return p


def budget_tables(args) -> int:
    """--step-times: the tokens/s tables of ddtree_jax.budget_table, every input problem named first."""
    from ddtree_jax import budget_table

    report, acceptance, estimated, problems = budget_table.load_inputs(args.step_times, args.acceptance)
    if problems:
        die("; ".join(problems))
    budget_table.print_tables(report, acceptance, estimated)
    return 0


def read_prompts(path: str) -> list[tuple[int, str | list[int]]]:
    """(line number, text or token ids) of every prompt in the file; every error names the line."""
    prompts = []
    for n, line in enumerate(read_text_file(path, "prompt file").split("\n"), 1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                die(f"{path}:{n}: invalid JSON ({e})")
            if not isinstance(obj, dict):
                die(f"{path}:{n}: expected an object with 'prompt' or 'prompt_ids'")
            if "prompt_ids" in obj:
                ids = obj["prompt_ids"]
                if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                    die(f"{path}:{n}: 'prompt_ids' must be a non-empty list of token ids (integers >= 0)")
                prompts.append((n, ids))
                continue
            line = obj.get("prompt", "")
            if not isinstance(line, str) or not line:
                die(f"{path}:{n}: 'prompt' must be a non-empty string")
        else:
            line = line.replace("\\n", "\n")
        prompts.append((n, line))
    if not prompts:
        die(f"no prompts in {path}")
    return prompts


def encode_prompts(path: str, prompts, engine, max_new_tokens: int) -> list[list[int]]:
    """Token ids of every prompt, checked against the vocabulary and the context limit (by line)."""
    out = []
    for n, p in prompts:
        try:
            ids = engine.encode(p) if isinstance(p, str) else p
        except ValueError as e:
            die(f"{path}:{n}: {e}")
        bad = [t for t in ids if t >= engine.cfg.vocab_size]
        if bad:
            die(f"{path}:{n}: token ids outside the vocabulary [0, {engine.cfg.vocab_size}): {bad[:5]}")
        if len(ids) + max_new_tokens > engine.max_context:
            die(f"{path}:{n}: the prompt has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} it needs "
                f"{len(ids) + max_new_tokens} positions but the model's context limit is {engine.max_context}")
        out.append(ids)
    return out


def main(argv=None) -> int:
    """ddtree-bench; Ctrl-C / SIGTERM at any moment end it on one line (exit 130 / 143), bench.json
    keeping the runs that finished."""
    return run(PROG, bench_main, argv)


def bench_main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.step_times:
        return budget_tables(args)
    if args.prompts is None:
        parser.error("the following arguments are required: --prompts (or --step-times REPORT)")
    use_autotune_cache(args)  # before the backend starts
    routes = routes_from(args)
    if args.cost_table and args.cost_table_in:
        die("give --cost-table FILE (write the table measured here) or --cost-table-in FILE (use one), not both")
    given = [flag for flag, v in (("--auto-budgets", args.auto_budgets), ("--cost-table", args.cost_table),
                                  ("--cost-table-in", args.cost_table_in),
                                  ("--decide-every", args.decide_every is not None),
                                  ("--decide-on", args.decide_on is not None)) if v]
    if given and "auto" not in args.budgets:
        die(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --budgets auto only")
    problem = decide_on_problem(args)
    if problem:
        die(problem)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("ar", "dflash", "ddtree")]
    if bad:
        die(f"unknown mode(s) {bad}: choose from ar, dflash, ddtree")
    texts = read_prompts(args.prompts)[: args.limit]
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        die(f"--out {args.out} is a file, expected a directory")
    target, drafter = model_paths(args.target, args.drafter)
    if drafter is None and any(m != "ar" for m in modes):
        die("dflash / ddtree modes need a drafter: pass --drafter DIR (or --modes ar)")
    tokenizer = tokenizer_source(args.tokenizer, target, needed=any(isinstance(p, str) for _, p in texts))
    from tqdm.auto import tqdm

    from ddtree_jax import bench
    from ddtree_jax.cli.common import load_engine

    engine = load_engine(args.target, args.drafter, args.dtype, routes=routes, draft_vocab=args.draft_vocab,
                         int8_drafter=args.int8_drafter)
    if args.tokenizer is not None:
        use_tokenizer(engine, tokenizer)
    prompts = encode_prompts(args.prompts, texts, engine, args.max_new_tokens)
    engine.on_first_run = progress.compiling
    runs = [(m, None) for m in modes if m != "ddtree"] + [("ddtree", b) for b in args.budgets if "ddtree" in modes]
    table = None  # --budgets auto's step-time table: measured when its first run comes, or read now
    if args.cost_table_in and ("ddtree", "auto") in runs:
        try:
            table = bench.auto_cost_table(engine, prompts, args)
        except ValueError as e:
            die(str(e))
        print(f"step-time table for --budgets auto (batch {table.batch}): {table.source}", file=sys.stderr)
    if "ar" not in modes:
        runs.insert(0, ("ar", None))  # the reference for speedups and output identity
    results, outputs = [], {}
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench.json")
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["ddtree-bench"] + (argv if argv is not None else sys.argv[1:])),
        "device": str(__import__("jax").devices()[0].device_kind),
        "backend": __import__("jax").default_backend(),
        "host": platform.node(),
        "target": args.target or "embedded demo", "drafter": args.drafter or "embedded demo",
        "draft_vocab": getattr(engine.proposer, "draft_vocab", 0) or None,
        "int8_drafter": getattr(engine.proposer, "int8", None) is not None,
        "int8_scheme": engine.proposer.int8.as_dict() if getattr(engine.proposer, "int8", None) else None,
        "routes": engine.routes.as_dict(),
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "batch": args.batch,
        "cost_table": None if table is None else table.as_dict(),
        "status": "partial", "results": [],
    }
    passes, unstable = {run: [] for run in runs}, []
    try:
        # Pass by pass over all runs, so a drift of the machine (clocks, other load) hits every mode alike.
        for rep, (mode, budget) in tqdm([(i, run) for i in range(args.repeats) for run in runs],
                                        desc="ddtree-bench", unit="run"):
            if budget == "auto" and table is None:
                table = bench.auto_cost_table(engine, prompts, args)
                report["cost_table"] = table.as_dict()
                print(f"step-time table for --budgets auto (batch {table.batch}): {table.source}", file=sys.stderr)
            r, outs = bench.run_mode(engine, prompts, mode, budget, max_new_tokens=args.max_new_tokens,
                                     batch=args.batch, phase_repeats=args.phase_repeats if rep == 0 else 0,
                                     auto_budgets=args.auto_budgets, decide_every=args.decide_every,
                                     decide_on=args.decide_on, cost_table=table)
            if rep == 0:
                outputs[(mode, r.budget)] = outs
            elif outs != outputs[(mode, r.budget)] and f"{mode}/{r.budget}" not in unstable:
                unstable.append(f"{mode}/{r.budget}")  # reported below, never hidden
            passes[(mode, budget)].append(r)
            results = [bench.merge_repeats(p) for p in passes.values() if p]
            # Each finished run is on disk at once: a run cut short (time limit, ^C) keeps them.
            atomic.write_json(json_path, {**report, "repeats": args.repeats,
                                          "results": [dataclasses.asdict(x) for x in results]})
    except ValueError as e:
        die(str(e))
    report.update(repeats=args.repeats, passes_differ=unstable)
    bench.compare(results, outputs, engine=engine, prompts=prompts)
    report.update(status="complete", results=[dataclasses.asdict(r) for r in results])
    atomic.write_json(json_path, report)
    png = os.path.join(args.out, "bench.png")
    try:
        bench.plot(results, png)
        auto = next((r for r in results if r.budget == "auto"), None)
        if auto is not None:
            bench.plot_choices(auto, os.path.join(args.out, "auto_choices.png"))
    except ImportError:  # matplotlib is the optional 'bench' extra
        note("matplotlib is not installed, so no bench.png (pip install 'ddtree-jax[bench]')")
        png = None
    print(bench.table(results))
    print(f"wrote {json_path}" + (f" and {png}" if png else ""), file=sys.stderr)
    ties = [f"{r.mode}/{r.budget}" for r in results if r.outputs_match_ar is False and r.divergences_are_ties]
    bugs = [f"{r.mode}/{r.budget}" for r in results if r.outputs_match_ar is False and not r.divergences_are_ties]
    if ties:
        print(f"note: {ties} part from plain decoding only at near-ties of the target's top two logits "
              f"(within {engine.cfg.dtype} rounding; see 'divergences' in bench.json)", file=sys.stderr)
    if unstable:
        print(f"note: {unstable} generated other tokens in a later pass than in the first (the comparisons "
              "use the first pass; see 'passes_differ' in bench.json)", file=sys.stderr)
    if bugs:
        print(f"ERROR: outputs differ from plain decoding away from any near-tie for {bugs}", file=sys.stderr)
        return 1  # a finding, not an input error
    return 0


if __name__ == "__main__":
    sys.exit(main())
