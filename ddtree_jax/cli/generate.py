"""ddtree-generate: text out of a target (+ DFlash drafter), plain, DFlash linear or DDTree."""

from __future__ import annotations

import argparse
import os
import sys

from ddtree_jax.cli.common import (add_auto_budget_arguments, add_autotune_cache_argument, add_draft_vocab_argument,
                                   add_int8_drafter_argument, add_routes_arguments, budget_arg, routes_from,
                                   die, parse_ids, positive_int, use_autotune_cache)
from ddtree_jax.speculative.sampling import Sampling

EPILOG = """\
examples:
  ddtree-generate --prompt "def fibonacci(n):"                      # the embedded demo pair
  ddtree-generate --target ckpt/qwen35 --drafter ckpt/qwen35-dflash --prompt-file q.txt
  echo "import os" | ddtree-generate --mode dflash --max-new-tokens 64
  ddtree-generate --prompt-ids 1,2,3 --mode ar --json

Output is the same as plain decoding of the target (greedy by default); --mode only changes
how fast it is produced. At the end: tokens/s, mean acceptance length (tokens per target pass)
and time per step. --budget auto (the default): every step picks plain decoding, DFlash or a tree
of one of --auto-budgets for the most tokens per second, from the drafter's confidence and a
step-time table (measured at start-up, a few seconds, or --cost-table FILE from ddtree-bench);
the summary line says which steps it chose.
"""


def build_parser() -> argparse.ArgumentParser:
    from ddtree_jax.demo import DEMO_DIR

    p = argparse.ArgumentParser(
        prog="ddtree-generate",
        description="Generate text with tree speculative decoding (DDTree over a DFlash drafter).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("models")
    src.add_argument("--target", default=None, help=f"target model directory: HF safetensors or converted "
                     f"(default: the embedded demo pair in {DEMO_DIR})")
    src.add_argument("--drafter", default=None, help="DFlash drafter directory (default: the demo drafter when "
                     "--target is not given; none otherwise, which allows only --mode ar)")
    src.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="params dtype (default: checkpoint's)")
    add_routes_arguments(src)
    inp = p.add_argument_group("prompt (one of)")
    inp.add_argument("--prompt", default=None, help="prompt text")
    inp.add_argument("--prompt-file", default=None, help="file with the prompt text ('-' for stdin)")
    inp.add_argument("--prompt-ids", default=None, type=parse_ids, help="prompt as token ids, e.g. 1,2,3")
    dec = p.add_argument_group("decoding")
    dec.add_argument("--mode", choices=["ar", "dflash", "ddtree"], default=None,
                     help="ar = plain decoding; dflash = linear drafts; ddtree = draft trees (default: ddtree with a "
                     "drafter, ar without)")
    dec.add_argument("--budget", type=budget_arg, default="auto",
                     help="DDTree nodes per step (1..1024), or auto (default): chosen each step")
    add_auto_budget_arguments(dec, "--budget auto: step times from this file (ddtree-bench --cost-table writes it "
                              "for a model, GPU and batch) instead of measuring them at start-up")
    dec.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate (default 128)")
    add_draft_vocab_argument(dec)
    add_int8_drafter_argument(dec)
    add_autotune_cache_argument(src)  # e.g. the one scripts/pick_autotune_cache.py installs
    dec.add_argument("--max-context", type=positive_int, default=None,
                     help="longest prompt + generation allowed (default: the model's max_position_embeddings)")
    dec.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    dec.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    dec.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    dec.add_argument("--seed", type=int, default=0, help="sampling seed")
    dec.add_argument("--stop-token-ids", type=parse_ids, default=(), help="extra stop tokens besides EOS, e.g. 13,198")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object (ids, text, stats) instead of text")
    out.add_argument("--no-stream", action="store_true", help="print the text at the end instead of as it is committed")
    out.add_argument("--compare-ar", action="store_true",
                     help="also run plain decoding and report whether the outputs are identical")
    return p


def read_prompt(args) -> str | list[int]:
    given = [x for x in (args.prompt, args.prompt_file, args.prompt_ids) if x is not None]
    if len(given) > 1:
        die("give only one of --prompt, --prompt-file, --prompt-ids")
    if args.prompt_ids is not None:
        return list(args.prompt_ids)
    if args.prompt is not None:
        return args.prompt
    path = args.prompt_file
    if path is None:
        if sys.stdin is None or sys.stdin.isatty():
            die("no prompt: use --prompt TEXT, --prompt-file FILE, --prompt-ids 1,2,3, or pipe text on stdin")
        path = "-"
    if path == "-":
        return sys.stdin.read()
    if not os.path.isfile(path):
        die(f"prompt file {path} does not exist")
    with open(path) as f:
        return f.read()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    use_autotune_cache(args)  # before the backend starts
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        die(str(e))
    prompt = read_prompt(args)
    if isinstance(prompt, str) and not prompt:
        die("the prompt is empty")
    if args.budget != "auto" or args.mode in ("ar", "dflash"):
        given = [flag for flag, v in (("--auto-budgets", args.auto_budgets), ("--cost-table", args.cost_table)) if v]
        if given:
            die(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --mode ddtree --budget auto only")

    from ddtree_jax.cli.common import load_engine

    engine = load_engine(args.target, args.drafter, args.dtype, args.max_context, routes_from(args),
                         args.draft_vocab, args.int8_drafter)
    mode = args.mode or ("ddtree" if engine.proposer is not None else "ar")
    stream_text = not args.json and not args.no_stream
    printed = []

    def on_tokens(row, ids):
        printed.extend(ids)
        if engine.tokenizer is None:
            sys.stdout.write(" ".join(map(str, ids)) + " ")
        else:  # decode the whole text so far so multi-byte characters come out whole
            full = engine.decode(printed)
            prev = engine.decode(printed[: len(printed) - len(ids)])
            sys.stdout.write(full[len(prev):] if full.startswith(prev) else "")
        sys.stdout.flush()

    try:
        if args.cost_table and mode == "ddtree" and args.budget == "auto":
            engine.load_cost_table(args.cost_table, 1)  # a bad table is named before anything is printed
        if stream_text and isinstance(prompt, str):
            sys.stdout.write(prompt)
        [c] = engine.generate([prompt], mode=mode, budget=args.budget, max_new_tokens=args.max_new_tokens,
                              sampling=sampling, seed=args.seed, stop_token_ids=args.stop_token_ids,
                              stream=on_tokens if stream_text else None, auto_budgets=args.auto_budgets,
                              cost_table=args.cost_table)
        same = None
        if args.compare_ar and mode != "ar":
            [ref] = engine.generate([prompt], mode="ar", max_new_tokens=args.max_new_tokens, sampling=sampling,
                                    seed=args.seed, stop_token_ids=args.stop_token_ids)
            same = ref.token_ids == c.token_ids
    except ValueError as e:
        die(str(e))
    if args.json:
        from ddtree_jax.engine import completion_json

        line = completion_json(c, mode)
        if same is not None:
            import json

            d = json.loads(line)
            d["identical_to_ar"] = same
            line = json.dumps(d)
        print(line)
        return 0
    if not stream_text:
        sys.stdout.write((c.text if c.text is not None else " ".join(map(str, c.token_ids))))
    s = c.stats
    print()
    print(f"[{mode}] {s.num_tokens} tokens in {s.seconds:.2f} s = {s.tokens_per_second:.1f} tok/s | "
          f"acceptance length {s.acceptance_length:.2f} tokens/step | {s.step_ms:.1f} ms/step | "
          f"finish: {c.finish_reason}", file=sys.stderr)
    if s.adaptive is not None:
        print(f"[auto] {describe_adaptive(s.adaptive)}", file=sys.stderr)
    if same is not None:
        r = ref.stats
        print(f"[ar] {r.num_tokens} tokens in {r.seconds:.2f} s = {r.tokens_per_second:.1f} tok/s | "
              f"{r.step_ms:.1f} ms/step (plain decoding, not streamed) | {mode} / plain speed: "
              f"{s.tokens_per_second / r.tokens_per_second:.2f}x", file=sys.stderr)
        if sampling.greedy:
            print(f"[check] output identical to plain decoding: {'yes' if same else 'NO'}", file=sys.stderr)
            if not same:
                print(f"[check] {explain_divergence(engine, prompt, c.token_ids, ref.token_ids)}", file=sys.stderr)
        else:
            print("[check] sampling: both runs draw from the target's distribution with different random "
                  "streams, so token-for-token equality is not expected", file=sys.stderr)
    return 0


def describe_adaptive(a: dict) -> str:
    """One line: the steps of each choice, realised vs calibrated acceptance, the table's source."""
    parts = []
    for name, n in a["choices"].items():
        acc = a["acceptance"][name]
        label = "plain" if name == "ar" else "DFlash" if name == "dflash" else f"budget {name}"
        parts.append(f"{label} {n}" + ("" if name == "ar" else
                                       f" (accepted {acc['realised']:.2f}, predicted {acc['calibrated']:.2f})"))
    return f"steps: {', '.join(parts)} | step times {a['cost_table']['source']}"


def explain_divergence(engine, prompt, got: list[int], ref: list[int]) -> str:
    """Where greedy speculative output first departs from plain decoding, and whether plain
    decoding's top two logits there are within the dtype's rounding (a near tie that rounding in a
    different batch shape may flip) or not (a bug worth reporting)."""
    from ddtree_jax import bench

    k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    gap = bench.top2_gap(engine, ids + list(ref[:k]))
    tol = bench.TIE_TOLERANCE.get(engine.cfg.dtype, 1e-3)
    where = f"first difference at generated token {k}: plain decoding's top two logits differ by {gap:.2e} of the logit scale"
    if gap < tol:
        return f"{where}, a near tie within {engine.cfg.dtype} rounding (tolerance {tol:g}): not a bug"
    return f"{where}, NOT a near tie (tolerance {tol:g}): please report this as a bug"


if __name__ == "__main__":
    sys.exit(main())
