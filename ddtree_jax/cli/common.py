"""Shared CLI plumbing: running a command (interrupts, program name), argument types, one-line
errors, input checks that name the problem, loading an engine with clear messages.

Exit status of every ddtree command (EXIT_STATUS_HELP, in each --help): 0 success; 1 a runtime
failure; 2 a usage or input error, reported on one line (or one line per checkpoint problem)
before anything is written to stdout; 130 / 143 interrupted by SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import os
import sys

from ddtree_jax.cli import interrupts

INPUT_ERROR = 2  # usage or input error (argparse's own code for bad options)
RUNTIME_ERROR = 1
MAX_BUDGET = 1024  # ddtree_jax.speculative.build.MAX_BUDGET (checked equal by tests/test_cli_errors.py)

EXIT_STATUS_HELP = """\
exit status:
  0    success
  1    runtime failure (a failed write, out of memory, ...){extra}
  2    usage or input error (bad option, missing / wrong kind of / unreadable file, checkpoint that
       does not fit), reported before anything is written to stdout
  130  interrupted by Ctrl-C (SIGINT); 143: terminated by SIGTERM. Either way one line on stderr,
       and nothing unfinished is left behind
"""

_prog = ["ddtree"]  # the running command's name, for die()


def run(prog: str, work, argv):
    """Run a command's work(argv) as `prog` (its errors say `prog: error: ...`), with Ctrl-C / SIGTERM
    ending it on one line (ddtree_jax.cli.interrupts)."""
    set_prog(prog)
    return interrupts.run(prog, work, argv)


def set_prog(prog: str) -> None:
    """Name the running command in die() / note() (ddtree-serve runs outside run(): uvicorn owns signals)."""
    _prog[0] = prog


def die(message: str, code: int = INPUT_ERROR):
    """Print `prog: error: message` (no traceback) and exit."""
    print(f"{_prog[0]}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def note(message: str) -> None:
    print(f"{_prog[0]}: note: {message}", file=sys.stderr)


# ---- paths and text ----------------------------------------------------------------------------
def check_dir(path: str, what: str) -> str:
    """`path` must be an existing directory; the error names what it is instead."""
    if not os.path.exists(path):
        die(f"{what} {path} does not exist")
    if not os.path.isdir(path):
        die(f"{what} {path} is a file, expected a directory")
    return path


def check_file(path: str, what: str) -> str:
    """`path` must be an existing file (not a directory); the error names what it is instead."""
    if not os.path.exists(path):
        die(f"{what} {path} does not exist")
    if os.path.isdir(path):
        die(f"{what} {path} is a directory, expected a file")
    return path


def decode_utf8(data: bytes, what: str) -> str:
    """UTF-8 bytes -> str; invalid UTF-8 is an error naming the first bad byte and its offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        die(f"{what} is not valid UTF-8: byte 0x{data[e.start]:02x} at byte offset {e.start} ({e.reason}); "
            "expected UTF-8 text")


def read_text_file(path: str, what: str) -> str:
    """A UTF-8 text file, or one clear error (missing, a directory, unreadable, not UTF-8)."""
    check_file(path, what)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        die(f"cannot read {what} {path}: {e.strerror or e}")
    return decode_utf8(data, f"{what} {path}")


def read_stdin_text(what: str = "the text on stdin") -> str:
    """All of stdin as UTF-8 text (read as bytes, so invalid UTF-8 is named, not passed on as
    surrogate escapes)."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream without bytes underneath (e.g. io.StringIO)
        return sys.stdin.read()
    return decode_utf8(buffer.read(), what)


def check_argv_text(text: str, what: str) -> str:
    """Text from the command line: bytes that were not UTF-8 arrive as surrogate escapes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        decode_utf8(os.fsencode(text), what)
    return text


def _checked(text: str, convert, ok, expected: str, show=str):
    """convert(text) when it parses and ok(value) holds; else argparse's `expected ..., got ...`."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {show(value)}")
    return value


def budget(text: str) -> int:
    return _checked(text, int, lambda v: 1 <= v <= MAX_BUDGET, f"an integer in [1, {MAX_BUDGET}]")


def non_negative_float(text: str) -> float:
    return _checked(text, float, lambda v: v >= 0, "a number >= 0", show=lambda v: text)


def probability_mass(text: str) -> float:
    return _checked(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]", show=lambda v: text)


def non_negative_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v > 0, "a positive integer")


def budget_arg(text: str) -> int | str:
    """--budget: 'auto' or an integer in [1, MAX_BUDGET]."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return budget(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(str(e).replace("expected an integer", "expected 'auto' or an integer")
                                         ) from None


def budget_list(text: str) -> tuple[int, ...]:
    """--auto-budgets: comma-separated budgets, distinct, ascending."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated budgets like 4,8,16,32,64, got {text!r}") from None
    if not values or any(not 1 <= v <= MAX_BUDGET for v in values) or list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"budgets must be distinct, ascending and in [1, {MAX_BUDGET}], got {text!r}")
    return values


def add_decoding_arguments(group, cost_table_help: str, decide_every: bool = True) -> None:
    """--mode and --budget, and --budget auto's settings (add_auto_budget_arguments)."""
    group.add_argument("--mode", choices=["ar", "dflash", "ddtree"], default=None,
                       help="ar = plain decoding; dflash = linear drafts; ddtree = draft trees (default: ddtree with "
                       "a drafter, ar without)")
    group.add_argument("--budget", type=budget_arg, default="auto",
                       help=f"DDTree nodes per step (1..{MAX_BUDGET}), or auto (default): chosen by cost "
                       "(see --decide-on)")
    add_auto_budget_arguments(group, cost_table_help, decide_every)


def add_auto_budget_arguments(group, cost_table_help: str, decide_every: bool = True) -> None:
    """--auto-budgets, --cost-table and (decide_every) --decide-every / --decide-on, the settings of
    --budget auto."""
    group.add_argument("--auto-budgets", type=budget_list, default=None, metavar="B1,B2,...",
                       help="--budget auto: the DDTree budgets it may choose each step, besides plain decoding and "
                       "DFlash (default 4,8,16,32; each one is compiled, so fewer compile faster; every draft pays "
                       "the selection of the largest: add 64 for large models, whose steps dwarf it)")
    group.add_argument("--cost-table", default=None, metavar="FILE", help=cost_table_help)
    if decide_every:
        group.add_argument("--decide-every", type=non_negative_int, default=None, metavar="N",
                           help="--budget auto: N > 1 chooses once per chunk of N steps (default 32; see --decide-on); "
                           "0 chooses every step on device (each step then pays the choice's conditionals)")
        group.add_argument("--decide-on", choices=["device", "host", "generation"], default=None,
                           help="--budget auto: generation = the host picks one choice a generation and runs that "
                           "choice's own fixed program, learning from what each generation accepted (the default "
                           "for targets under 4 GiB of weights, whose steps are launch-bound; decision 0051); "
                           "with --decide-every N: device (the default for larger targets) = one program; a chunk "
                           "scores its draft and chooses, then runs up to N of the chosen draft's fixed-budget steps "
                           "(the first verifies the scored draft and teaches the policy), going on across streamed "
                           "calls; host = the host picks each chunk and runs that choice's own program (an advance "
                           "call a chunk; decisions 0045, 0046)")


def decide_on_problem(args) -> str | None:
    """--decide-on without chunks to decide (--decide-every N > 1) is a mistake worth naming."""
    if getattr(args, "decide_on", None) == "generation" and args.decide_every is not None:
        return "--decide-every has no effect with --decide-on generation (one choice a whole generation)"
    if getattr(args, "decide_on", None) not in (None, "generation") and (args.decide_every or 0) < 2:
        return (f"--decide-on {args.decide_on} needs --decide-every N with N > 1 (chunks to decide; 0 or 1 is the "
                f"per-step program, chosen on device)")
    return None


def parse_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.replace(" ", "").split(",") if x != "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"expected non-negative token ids like 1,2,3, got {text!r}")
    return ids


def add_draft_vocab_argument(group) -> None:
    group.add_argument("--draft-vocab", default=None, metavar="N|FILE",
                       help="draft from N token ids only (ids 0..N-1) or from the ids in a JSON file "
                       "(scripts/hot_tokens.py writes one from text): a smaller draft head, shorter steps; "
                       "output unchanged, but drafts outside the ids are never proposed, which costs acceptance "
                       "unless the ids cover nearly all of the text (default: whole vocabulary)")


def add_autotune_cache_argument(group) -> None:
    from ddtree_jax import autotune_cache

    autotune_cache.add_argument(group)


def use_autotune_cache(args) -> None:
    """--autotune-cache DIR into XLA's flags, before anything starts the backend (a second, different
    directory already in XLA_FLAGS is a named error)."""
    if args.autotune_cache:
        from ddtree_jax import autotune_cache

        try:
            autotune_cache.use_autotune_cache(args.autotune_cache)
        except (ValueError, OSError) as e:
            die(f"--autotune-cache: {e}")


def add_int8_drafter_argument(group) -> None:
    group.add_argument("--int8-drafter", nargs="?", const="w8a8", default=None, choices=["w8a8", "weight-only"],
                       help="run the drafter and its draft head with int8 weights (one scale per output column; "
                       "w8a8, the default: the wide products with int8 activations too; weight-only): fewer bytes "
                       "a draft step reads (figures at the 27B shape: docs/benchmarks.md); output unchanged, "
                       "the drafts may differ slightly (ddtree_jax/models/int8.py)")


def add_routes_arguments(group) -> None:
    """--impl and --route NAME=VALUE (ddtree_jax/routes.py); --kernels: the former name of --impl."""
    from ddtree_jax import routes

    routes.add_arguments(group)
    group.add_argument("--kernels", dest="impl", choices=routes.IMPLS, help=argparse.SUPPRESS)


def routes_from(args):
    """The Routes the arguments ask for (a bad --route is a usage error naming every problem)."""
    from ddtree_jax import routes

    try:
        return routes.from_args(args)
    except ValueError as e:
        die(str(e))


def add_tokenizer_argument(group) -> None:
    group.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="directory with the tokenizer.json to use (or that file), for a target directory "
                       "without one (default: the target's own; ddtree-convert copies it)")


def model_paths(target, drafter) -> tuple[str, str | None]:
    """(target, drafter) directories as given, the embedded demo pair when no target is given; each
    checked to be a directory (the error names what the path is instead)."""
    from ddtree_jax.demo import demo_paths

    if target is None:
        try:
            target, default_drafter = demo_paths()
        except FileNotFoundError as e:
            die(str(e))
        drafter = drafter or default_drafter
    check_dir(target, "target checkpoint directory")
    if drafter is not None:
        check_dir(drafter, "drafter checkpoint directory")
    return target, drafter


def tokenizer_source(tokenizer, target: str, needed: bool) -> str | None:
    """The tokenizer.json to use: --tokenizer's (DIR or the file itself), else the target's. When
    text must be encoded (`needed`) and there is none, the error names both ways out."""
    from ddtree_jax.engine import TOKENIZER_FILE, tokenizer_file

    if tokenizer is not None:
        if not os.path.exists(tokenizer):
            die(f"--tokenizer {tokenizer} does not exist")
        path = tokenizer_file(tokenizer)
        if path is None:
            die(f"--tokenizer {tokenizer}: no {TOKENIZER_FILE} in this directory")
        return path
    path = tokenizer_file(target) if os.path.isdir(target) else None
    if path is None and needed:
        die(f"the target {target} has no {TOKENIZER_FILE}, so text cannot be turned into token ids: pass "
            f"--tokenizer DIR (a directory with {TOKENIZER_FILE}, e.g. the Hugging Face model it was converted "
            "from) or give the prompt as token ids (--prompt-ids 1,2,3 / {\"prompt_ids\": [...]} lines)")
    return path


def use_tokenizer(engine, path: str) -> None:
    """Give the engine the tokenizer at `path` (--tokenizer, resolved by tokenizer_source)."""
    from ddtree_jax.engine import load_tokenizer

    try:
        engine.tokenizer = load_tokenizer(path)
    except ValueError as e:
        die(str(e))


def load_engine(target, drafter, dtype=None, max_context=None, routes=None, draft_vocab=None,
                int8_drafter=None):
    """Engine from CLI paths (demo pair when target is None), with every load error as one line. On a
    terminal a line (and, for Hugging Face directories, a bar) shows the load on stderr."""
    from converters.keymap import CheckpointError
    from ddtree_jax.cli import progress
    from ddtree_jax.config import ConfigError
    from ddtree_jax.engine import Engine

    if target is None:
        target, drafter = model_paths(None, drafter)
        if dtype is None:
            import jax

            # The demo is stored in bf16; XLA:CPU runs bf16 matmuls slowly, so upcast (exactly) there.
            dtype = "fp32" if jax.default_backend() == "cpu" else None
    target, drafter = model_paths(target, drafter)
    terminal = progress.stderr_is_terminal()
    try:
        with progress.step(f"loading {target}" + (f" and {drafter}" if drafter else ""), show=terminal):
            return Engine.load(target, drafter, dtype=dtype, max_context=max_context, routes=routes,
                               draft_vocab=draft_vocab, int8_drafter=int8_drafter or False,
                               progress=terminal)
    except (ConfigError, CheckpointError) as e:
        die(str(e))
    except (OSError, ValueError) as e:
        die(str(e))
