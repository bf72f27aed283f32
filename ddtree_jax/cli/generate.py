"""ddtree-generate: text out of a target (+ DFlash drafter), plain, DFlash linear or DDTree."""

from __future__ import annotations

import argparse
import sys

from ddtree_jax.cli import progress
from ddtree_jax.cli.common import (EXIT_STATUS_HELP, add_autotune_cache_argument, add_decoding_arguments,
                                   add_draft_vocab_argument, add_int8_drafter_argument, add_routes_arguments,
                                   add_tokenizer_argument, check_argv_text, decide_on_problem, die, model_paths,
                                   non_negative_float,
                                   non_negative_int, parse_ids, positive_int, probability_mass, read_stdin_text,
                                   read_text_file, routes_from, run, tokenizer_source, use_autotune_cache,
                                   use_tokenizer)

PROG = "ddtree-generate"
# The embedded demo pair's default temperature: its 15 MB model repeats itself when greedy; sampled,
# its output reads like (nonsense) Python and still equals plain decoding's for a seed.
DEMO_TEMPERATURE = 0.8

EPILOG = """\
examples:
  ddtree-generate --prompt "def fibonacci(n):"                      # the embedded demo pair
  ddtree-generate --target ckpt/qwen35 --drafter ckpt/qwen35-dflash --prompt-file q.txt
  echo "import os" | ddtree-generate --mode dflash --max-new-tokens 64
  ddtree-generate --prompt-ids 1,2,3 --mode ar --json

Output is the same as plain decoding of the target (greedy by default); --mode only changes
how fast it is produced. The text goes to stdout; on stderr a "compiling (first run of this
shape) ..." line with its time (the first run of a prompt / generation shape compiles), on a
terminal the loading and, for long generations, a progress bar, and at the end tokens/s, mean
acceptance length (tokens per target pass) and time per step.

--budget auto (the default): every step picks plain decoding, DFlash or a tree of one of
--auto-budgets for the most tokens per second, from the drafter's confidence and a step-time
table (measured at start-up, a few seconds, or --cost-table FILE from ddtree-bench); the summary
line says which steps it chose.

""" + EXIT_STATUS_HELP.format(extra="")


def _ignore_tokens(row, ids) -> None:
    """A stream callback that shows nothing: the plain reference run synced like the streamed one."""


def build_parser() -> argparse.ArgumentParser:
    from ddtree_jax.demo import DEMO_DIR

    p = argparse.ArgumentParser(
        prog=PROG,
        description="Generate text with tree speculative decoding (DDTree over a DFlash drafter).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("models")
    src.add_argument("--target", default=None, help=f"target model directory: HF safetensors or converted "
                     f"(default: the embedded demo pair in {DEMO_DIR})")
    src.add_argument("--drafter", default=None, help="DFlash drafter directory (default: the demo drafter when "
                     "--target is not given; none otherwise, which allows only --mode ar)")
    add_tokenizer_argument(src)
    src.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                     help="params dtype (default: checkpoint's)")
    add_routes_arguments(src)
    inp = p.add_argument_group("prompt (one of)")
    inp.add_argument("--prompt", default=None, help="prompt text")
    inp.add_argument("--prompt-file", default=None, help="file with the prompt text ('-' for stdin)")
    inp.add_argument("--prompt-ids", default=None, type=parse_ids, help="prompt as token ids, e.g. 1,2,3")
    dec = p.add_argument_group("decoding")
    add_decoding_arguments(dec, "--budget auto: step times from this file (ddtree-bench --cost-table writes it "
                              "for a model, GPU and batch) instead of measuring them at start-up")
    dec.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate (default 128)")
    add_draft_vocab_argument(dec)
    add_int8_drafter_argument(dec)
    add_autotune_cache_argument(src)  # e.g. the one scripts/pick_autotune_cache.py installs
    dec.add_argument("--max-context", type=positive_int, default=None,
                     help="longest prompt + generation allowed (default: the model's max_position_embeddings)")
    dec.add_argument("--temperature", type=non_negative_float, default=None,
                     help=f"0 = greedy (default; {DEMO_TEMPERATURE} for the embedded demo pair, whose tiny model "
                     "loops on itself when greedy). A sampled run's draw at each position depends only on --seed and "
                     "the position, so speculative output equals plain decoding's for a seed, sampled or greedy")
    dec.add_argument("--top-k", type=non_negative_int, default=0,
                     help="sample among the k most likely tokens (0 = off)")
    dec.add_argument("--top-p", type=probability_mass, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    dec.add_argument("--seed", type=int, default=0, help="sampling seed")
    dec.add_argument("--stop-token-ids", type=parse_ids, default=(), help="extra stop tokens besides EOS, e.g. 13,198")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object (ids, text, stats) instead of text")
    out.add_argument("--no-stream", action="store_true", help="print the text at the end instead of as it is committed")
    out.add_argument("--compare-ar", action="store_true",
                     help="also run plain decoding and report whether the outputs are identical")
    return p


def read_prompt(args) -> str | list[int]:
    """The prompt from --prompt / --prompt-file / --prompt-ids / stdin: text or token ids."""
    given = [x for x in (args.prompt, args.prompt_file, args.prompt_ids) if x is not None]
    if len(given) > 1:
        die("give only one of --prompt, --prompt-file, --prompt-ids")
    if args.prompt_ids is not None:
        return list(args.prompt_ids)
    if args.prompt is not None:
        text = check_argv_text(args.prompt, "--prompt")
    elif args.prompt_file not in (None, "-"):
        text = read_text_file(args.prompt_file, "prompt file")
    else:
        if args.prompt_file is None and (sys.stdin is None or sys.stdin.isatty()):
            die("no prompt: use --prompt TEXT, --prompt-file FILE, --prompt-ids 1,2,3, or pipe text on stdin")
        text = read_stdin_text("the prompt on stdin")
    if not text:
        die("the prompt is empty")
    return text


def prompt_ids(engine, prompt, args) -> list[int]:
    """The prompt as token ids, checked against the vocabulary and the context limit."""
    if isinstance(prompt, str):
        try:
            ids = engine.encode(prompt)
        except ValueError as e:
            die(str(e))
        if not ids:
            die("the prompt encodes to no tokens")
    else:
        ids = prompt
        bad = [t for t in ids if not 0 <= t < engine.cfg.vocab_size]
        if bad:
            die(f"--prompt-ids: token ids outside the vocabulary [0, {engine.cfg.vocab_size}): {bad[:5]}")
    need = len(ids) + args.max_new_tokens
    if need > engine.max_context:
        die(f"the prompt has {len(ids)} tokens; with --max-new-tokens {args.max_new_tokens} it needs {need} "
            f"positions but the context limit is {engine.max_context} (--max-context, default: the model's "
            "max_position_embeddings)")
    return ids


def main(argv=None) -> int:
    """ddtree-generate; Ctrl-C / SIGTERM at any moment end it on one line (exit 130 / 143)."""
    return run(PROG, generate_main, argv)


def generate_main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    use_autotune_cache(args)  # before the backend starts
    routes = routes_from(args)
    prompt = read_prompt(args)
    target, _ = model_paths(args.target, args.drafter)
    tokenizer = tokenizer_source(args.tokenizer, target, needed=isinstance(prompt, str))
    from ddtree_jax.speculative.sampling import Sampling

    try:
        temperature = args.temperature if args.temperature is not None else (
            DEMO_TEMPERATURE if args.target is None else 0.0)
        sampling = Sampling(temperature, args.top_k, args.top_p)
    except ValueError as e:
        die(str(e))
    if args.budget != "auto" or args.mode in ("ar", "dflash"):
        given = [flag for flag, v in (("--auto-budgets", args.auto_budgets), ("--cost-table", args.cost_table),
                                      ("--decide-every", args.decide_every is not None),
                                      ("--decide-on", args.decide_on is not None)) if v]
        if given:
            die(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --mode ddtree --budget auto only")
    problem = decide_on_problem(args)
    if problem:
        die(problem)

    from ddtree_jax.cli.common import load_engine

    engine = load_engine(args.target, args.drafter, args.dtype, args.max_context, routes, args.draft_vocab,
                         args.int8_drafter)
    if args.tokenizer is not None:
        use_tokenizer(engine, tokenizer)
    mode = args.mode or ("ddtree" if engine.proposer is not None else "ar")
    if mode != "ar" and engine.proposer is None:
        die(f"--mode {mode} needs a drafter: pass --drafter DIR (or --mode ar)")
    ids = prompt_ids(engine, prompt, args)
    engine.on_first_run = progress.compiling
    stream_text = not args.json and not args.no_stream
    printed = []
    echo = [stream_text and isinstance(prompt, str)]  # the prompt goes out with the first tokens: no
    # stdout before every check has passed and the compilation (its stderr line) is over

    def on_tokens(row, ids):
        if echo[0]:
            sys.stdout.write(prompt)
            echo[0] = False
        printed.extend(ids)
        if engine.tokenizer is None:
            sys.stdout.write(" ".join(map(str, ids)) + " ")
        else:  # decode the whole text so far so multi-byte characters come out whole
            full = engine.decode(printed)
            prev = engine.decode(printed[: len(printed) - len(ids)])
            sys.stdout.write(full[len(prev):] if full.startswith(prev) else "")
        sys.stdout.flush()

    def with_bar(callback, bar):
        """The stream callback: the text (or nothing) and the progress bar, where one is shown."""
        if not bar.show:
            return callback

        def both(row, ids):
            bar.update(len(ids))
            if callback is not None:
                callback(row, ids)

        return both

    try:
        if args.cost_table and mode == "ddtree" and args.budget == "auto":
            # a bad table is named before anything is printed
            form = engine.auto_budget(args.auto_budgets, args.decide_every, args.decide_on).form
            engine.load_cost_table(args.cost_table, 1, form)
        bar = progress.TokenBar(args.max_new_tokens, streaming=stream_text)
        every = 4 if stream_text else 16  # a bar alone: a host sync per 16 steps
        [c] = engine.generate([ids], mode=mode, budget=args.budget, max_new_tokens=args.max_new_tokens,
                              sampling=sampling, seed=args.seed, stop_token_ids=args.stop_token_ids,
                              stream=with_bar(on_tokens if stream_text else None, bar), stream_every=every,
                              auto_budgets=args.auto_budgets, decide_every=args.decide_every,
                              decide_on=args.decide_on, cost_table=args.cost_table)
        bar.close()
        same, line_ended = None, False
        if args.compare_ar and mode != "ar":
            if stream_text:  # end the streamed text's line before the comparison's own lines on stderr
                sys.stdout.write("\n")
                sys.stdout.flush()
                line_ended = True
            # timed like the run above: the same host sync every `every` steps where that one streamed
            bar = progress.TokenBar(args.max_new_tokens, streaming=False)
            [ref] = engine.generate([ids], mode="ar", max_new_tokens=args.max_new_tokens, sampling=sampling,
                                    seed=args.seed, stop_token_ids=args.stop_token_ids,
                                    stream=with_bar(_ignore_tokens if stream_text else None, bar), stream_every=every)
            bar.close()
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
    if echo[0]:  # no token was streamed (e.g. the first one was a stop token)
        sys.stdout.write(prompt)
    if not stream_text:
        sys.stdout.write((c.text if c.text is not None else " ".join(map(str, c.token_ids))))
    s = c.stats
    if not line_ended:
        print()
    print(f"[{mode}] {s.num_tokens} tokens in {s.seconds:.2f} s = {s.tokens_per_second:.1f} tok/s | "
          f"acceptance length {s.acceptance_length:.2f} tokens/step | {s.step_ms:.1f} ms/step | "
          f"finish: {c.finish_reason}", file=sys.stderr)
    if s.adaptive is not None:
        print(f"[auto] {describe_adaptive(s.adaptive)}", file=sys.stderr)
    if same is not None:
        r = ref.stats
        print(f"[ar] {r.num_tokens} tokens in {r.seconds:.2f} s = {r.tokens_per_second:.1f} tok/s | "
              f"{r.step_ms:.1f} ms/step (plain decoding, timed like the {mode} run) | {mode} / plain speed: "
              f"{s.tokens_per_second / r.tokens_per_second:.2f}x", file=sys.stderr)
        seeded = "" if sampling.greedy else f" (sampled, seed {args.seed})"
        print(f"[check] output identical to plain decoding{seeded}: {'yes' if same else 'NO'}", file=sys.stderr)
        if not same:
            print(f"[check] {explain_divergence(engine, ids, c.token_ids, ref.token_ids, sampling.greedy)}",
                  file=sys.stderr)
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


def explain_divergence(engine, prompt, got: list[int], ref: list[int], greedy: bool = True) -> str:
    """Where speculative output first departs from plain decoding, and whether plain decoding's top
    two logits there are within the dtype's rounding (a near tie that rounding in a different batch
    shape may flip) or not (a bug worth reporting). A sampled draw can flip at rounding level
    without a near tie of the top two (the draw lands near any boundary): greedy is the strict check."""
    from ddtree_jax import bench

    k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    if not greedy:
        return (f"first difference at generated token {k}: a sampled draw depends on logits the two passes round "
                "differently; rerun with --temperature 0 for the strict (greedy) check")
    ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    gap = bench.top2_gap(engine, ids + list(ref[:k]))
    tol = bench.TIE_TOLERANCE.get(engine.cfg.dtype, 1e-3)
    where = (f"first difference at generated token {k}: plain decoding's top two logits differ by {gap:.2e} "
             "of the logit scale")
    if gap < tol:
        return f"{where}, a near tie within {engine.cfg.dtype} rounding (tolerance {tol:g}): not a bug"
    return f"{where}, NOT a near tie (tolerance {tol:g}): please report this as a bug"


if __name__ == "__main__":
    sys.exit(main())
