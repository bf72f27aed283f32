"""Route constants set for one measurement run, e.g. a kernel switched off for an A/B timing.

The model and build routes read module constants when a step is traced (attention / gdn
DECODE_KERNEL, ROW_TOP_K_MAX_LEN, BITS_KERNEL_MAX_NODES, ...). `ddtree-bench --override` and the
benchmark scripts set them by name before anything is compiled, so a comparison needs no edited
copy of the code, and each report records what was set.
"""

from __future__ import annotations

import ast
import importlib


def apply_overrides(specs) -> dict:
    """Set module constants for one measurement run: each spec "package.module.NAME=value" (value
    a Python literal of the constant's type), e.g. "ddtree_jax.models.gdn.DECODE_KERNEL=False" or
    "pallas_kernels.row_top_k.ROW_TOP_K_MAX_LEN=0". Routes read these constants when a step is
    traced, so set them before anything is compiled. Every bad spec is reported at once
    (ValueError); returns {spec target: value} for the report."""
    problems, plan = [], []
    for spec in specs or ():
        target, sep, text = spec.partition("=")
        mod_name, _, attr = target.strip().rpartition(".")
        if not sep or not mod_name or not attr:
            problems.append(f"{spec!r}: expected package.module.NAME=value")
            continue
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            problems.append(f"{spec!r}: cannot import {mod_name} ({e})")
            continue
        if not hasattr(module, attr):
            problems.append(f"{spec!r}: {mod_name} has no {attr}")
            continue
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            problems.append(f"{spec!r}: {text.strip()!r} is not a Python literal")
            continue
        old = getattr(module, attr)
        if type(value) is not type(old):
            problems.append(f"{spec!r}: {attr} is a {type(old).__name__}, got a {type(value).__name__}")
            continue
        plan.append((module, attr, value, target.strip()))
    if problems:
        raise ValueError("bad --override: " + "; ".join(problems))
    for module, attr, value, _ in plan:
        setattr(module, attr, value)
    return {target: value for _, _, value, target in plan}


def add_argument(parser) -> None:
    """The `--override MODULE.NAME=VALUE` option (repeatable) of the benchmark tools."""
    parser.add_argument("--override", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="set a route constant for this run (A/B of a kernel without editing code), e.g. "
                             "ddtree_jax.models.gdn.DECODE_KERNEL=False; repeatable")


def apply_from_args(parser, args) -> dict:
    """apply_overrides(args.override); a bad spec ends the program with the parser's usage error."""
    try:
        return apply_overrides(args.override)
    except ValueError as e:
        parser.error(str(e))
