"""Shared CLI plumbing: argument types, one-line errors, loading an engine with clear messages."""

from __future__ import annotations

import argparse
import os
import sys


def die(message: str, code: int = 2):
    """Print `prog: error: message` (no traceback) and exit."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "ddtree"
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def budget_arg(text: str) -> int | str:
    """--budget: 'auto' or a positive integer."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive integer, got {text!r}") from None


def budget_list(text: str) -> tuple[int, ...]:
    """--auto-budgets: comma-separated budgets, distinct, ascending."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated budgets like 4,8,16,32,64, got {text!r}") from None
    if not values or any(v < 1 or v > 1024 for v in values) or list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"budgets must be distinct, ascending and in [1, 1024], got {text!r}")
    return values


def add_auto_budget_arguments(group, cost_table_help: str) -> None:
    """--auto-budgets and --cost-table, the settings of --budget auto."""
    group.add_argument("--auto-budgets", type=budget_list, default=None, metavar="B1,B2,...",
                       help="--budget auto: the DDTree budgets it may choose each step, besides plain decoding and "
                       "DFlash (default 4,8,16,32; each one is compiled, so fewer compile faster; every draft pays "
                       "the selection of the largest: add 64 for large models, whose steps dwarf it)")
    group.add_argument("--cost-table", default=None, metavar="FILE", help=cost_table_help)


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
                       "a draft step reads (H200 figures at the 27B shape: docs/benchmarks.md); output unchanged, "
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


def load_engine(target, drafter, dtype=None, max_context=None, routes=None, draft_vocab=None,
                int8_drafter=None):
    """Engine from CLI paths (demo pair when target is None), with every load error as one line."""
    from converters.keymap import CheckpointError
    from ddtree_jax.config import ConfigError
    from ddtree_jax.demo import demo_paths
    from ddtree_jax.engine import Engine

    if target is None:
        try:
            target, default_drafter = demo_paths()
        except FileNotFoundError as e:
            die(str(e))
        drafter = drafter or default_drafter
        if dtype is None:
            import jax

            # The demo is stored in bf16; XLA:CPU runs bf16 matmuls slowly, so upcast (exactly) there.
            dtype = "fp32" if jax.default_backend() == "cpu" else None
    for name, path in (("target", target), ("drafter", drafter)):
        if path is not None and not os.path.isdir(path):
            die(f"{name} checkpoint directory {path} does not exist")
    try:
        return Engine.load(target, drafter, dtype=dtype, max_context=max_context, routes=routes,
                           draft_vocab=draft_vocab, int8_drafter=int8_drafter or False)
    except (ConfigError, CheckpointError) as e:
        die(str(e))
    except (FileNotFoundError, ValueError) as e:
        die(str(e))
