"""HF tensor names -> this project's parameter paths, as ordered regex rules.

A rule maps one HF tensor (after the model's prefix is stripped) to one or more parameter
paths with a layout transform. `map_checkpoint` applies the rules to every tensor of a
checkpoint, checks each result against the shapes the JAX model expects, and collects
every problem (unexpected, missing, mis-shaped tensors) into one error.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Mapping

import numpy as np


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message lists every problem found."""

    def __init__(self, problems: list[str], source: str = "checkpoint"):
        self.problems = list(problems)
        shown = self.problems[:40]
        more = f"\n  ... and {len(self.problems) - 40} more" if len(self.problems) > 40 else ""
        lines = "\n".join(f"  - {p}" for p in shown)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}{more}")


Transform = Callable[[np.ndarray], "np.ndarray | dict[str, np.ndarray]"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """`pattern` matches a full HF name; `dest` is a path template using the match groups.

    If `transform` returns a dict, its keys are path suffixes appended to `dest` (one HF tensor
    feeding several parameters, e.g. Qwen3-Next's fused projections).
    """

    pattern: str
    dest: str
    transform: Transform | None = None

    def match(self, name: str):
        return re.fullmatch(self.pattern, name)


def linear(w: np.ndarray) -> np.ndarray:
    """torch Linear weight [out, in] -> kernel [in, out]."""
    return np.ascontiguousarray(w.T)


def stacked_linear(shape: tuple[int, ...], what: str) -> Transform:
    """A stack of torch Linear weights [E, out, in] that must have `shape` (what: the config sizes
    that give it, for the error) -> [E, in, out]. Its own inverse (`.inverse`, for the export)."""

    def transform(w: np.ndarray) -> np.ndarray:
        if tuple(w.shape) != tuple(shape):
            raise ValueError(f"has shape {tuple(w.shape)}, the config needs {tuple(shape)} ({what})")
        return np.ascontiguousarray(np.swapaxes(w, 1, 2))

    transform.inverse = lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))
    return transform


def checked_linear(shape: tuple[int, int], what: str) -> Transform:
    """`linear` for a weight [out, in] that must have `shape` (what: the config sizes that give it)."""

    def transform(w: np.ndarray) -> np.ndarray:
        if tuple(w.shape) != tuple(shape):
            raise ValueError(f"has shape {tuple(w.shape)}, the config needs {tuple(shape)} ({what})")
        return linear(w)

    transform.inverse = lambda x: np.ascontiguousarray(x.T)
    return transform


def depthwise_conv(w: np.ndarray) -> np.ndarray:
    """torch depthwise Conv1d weight [C, 1, K] -> [K, C]."""
    if w.ndim != 3 or w.shape[1] != 1:
        raise ValueError(f"expected a depthwise conv weight [C, 1, K], got shape {tuple(w.shape)}")
    return np.ascontiguousarray(w[:, 0, :].T)


def flatten_paths(tree: Mapping, prefix: str = "") -> dict[str, object]:
    """Nested dict -> {'a/b/c': leaf}; integer keys become their decimal strings."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_paths(value, path))
        else:
            out[path] = value
    return out


def unflatten_paths(flat: Mapping[str, object]) -> dict:
    """{'layers/0/w': x} -> {'layers': {0: {'w': x}}} (digit keys become ints, as nnx uses)."""
    root: dict = {}
    for path, value in flat.items():
        node = root
        parts = [int(p) if p.isdigit() else p for p in path.split("/")]
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return root


def map_checkpoint(
    names: Iterable[str],
    load: Callable[[str], np.ndarray],
    rules: list[Rule],
    expected: Mapping[str, tuple[tuple[int, ...], object]],
    *,
    strip_prefixes: tuple[str, ...] = (),
    ignore: tuple[str, ...] = (),
    dtype=None,
    source: str = "checkpoint",
    on_tensor: Callable[[str], None] | None = None,
    unavailable: Iterable[str] = (),
) -> dict[str, np.ndarray]:
    """Map every tensor to a flat {path: array}; raise CheckpointError listing all problems.

    expected: path -> (shape, dtype) of every parameter the model needs.
    load(name) reads one tensor lazily (so checkpoints stream, one tensor in memory at a time).
    unavailable: names the checkpoint lists but cannot provide (e.g. in a missing shard), already
    reported by the caller; the parameters they would fill are not reported as missing again.
    """
    problems: list[str] = []
    out: dict[str, np.ndarray] = {}
    # Paths a present-but-unusable tensor was meant for: already reported, so not "missing" too.
    reported: set[str] = set()

    def strip(name: str) -> str:
        for prefix in strip_prefixes:
            if name.startswith(prefix):
                return name[len(prefix) :]
        return name

    for name in unavailable:
        rule = next((r for r in rules if r.match(strip(name))), None)
        if rule is not None:
            reported.add(rule.match(strip(name)).expand(rule.dest))
    for name in names:
        if on_tensor is not None:
            on_tensor(name)
        if any(re.fullmatch(p, name) for p in ignore):
            continue
        short = strip(name)
        rule = next((r for r in rules if r.match(short)), None)
        if rule is None:
            problems.append(f"unexpected tensor '{name}'")
            continue
        dest = rule.match(short).expand(rule.dest)
        try:
            value = load(name)
            value = rule.transform(value) if rule.transform else value
        except ValueError as e:
            problems.append(f"tensor '{name}': {e}")
            reported.add(dest)  # for a multi-output rule, covers every path under dest
            continue
        parts = value.items() if isinstance(value, dict) else [("", value)]
        for suffix, arr in parts:
            path = f"{dest}/{suffix}" if suffix else dest
            if path not in expected:
                problems.append(f"unexpected tensor '{name}' (maps to '{path}', which this model does not have)")
                continue
            shape, want_dtype = expected[path]
            if tuple(arr.shape) != tuple(shape):
                problems.append(
                    f"tensor '{name}' has shape {tuple(arr.shape)} but '{path}' needs {tuple(shape)}"
                )
                reported.add(path)
                continue
            if path in out:
                problems.append(f"tensor '{name}' duplicates '{path}'")
                continue
            out[path] = np.asarray(arr).astype(dtype or want_dtype)
    missing = sorted(
        p for p in set(expected) - set(out) if not any(p == r or p.startswith(r + "/") for r in reported)
    )
    problems.extend(f"missing tensor for '{p}'" for p in missing)
    if problems:
        raise CheckpointError(problems, source)
    return out
