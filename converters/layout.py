"""Merged projection layouts: one weight where HF holds several.

The models hold `mlp/gate_up_proj` [in, gate | up] (and a MoE's `shared_expert/gate_up_proj`),
`self_attn/qkv_proj` [in, q | k | v] and `linear_attn/in_proj_qkvzba` [in, qkv | z | b | a]
(columns in that order; biases likewise; docs/decisions/0005-merged-projection-layouts.md). HF
checkpoints hold the parts. The key maps keep mapping HF tensors onto the parts; `map_into_layout`
asks them for the parts a merged model needs and concatenates after, `split` cuts them back for an
export, and `alternatives` lets a converted checkpoint saved in an older layout (separate parts, or
qkv | z and b | a) be restored.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from converters.keymap import map_checkpoint

# merged module name -> its parts, in column order
MERGES = {
    "mlp/gate_up_proj": ("mlp/gate_proj", "mlp/up_proj"),
    "shared_expert/gate_up_proj": ("shared_expert/gate_proj", "shared_expert/up_proj"),  # a MoE's SwiGLU
    "self_attn/qkv_proj": ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj"),
    "linear_attn/in_proj_qkv_z": ("linear_attn/in_proj_qkv", "linear_attn/in_proj_z"),
    "linear_attn/in_proj_ba": ("linear_attn/in_proj_b", "linear_attn/in_proj_a"),
    "linear_attn/in_proj_qkvzba": ("linear_attn/in_proj_qkv", "linear_attn/in_proj_z", "linear_attn/in_proj_b",
                                   "linear_attn/in_proj_a"),
}
_MERGED = re.compile(r"(.*/)?(" + "|".join(re.escape(m) for m in MERGES) + r")/(kernel|bias)")
Shapes = Mapping[str, tuple[tuple[int, ...], object]]
Plan = list[tuple[str, list[tuple[str, int]]]]  # merged path -> [(part path, width)]


def _widths(merged: str, total: int, kv_width: int | None, expected: Shapes, prefix: str) -> list[int]:
    """Column widths of a merged weight's parts. q | k | v needs the k / v width; qkv | z reads the
    z width off the layer's out_proj (its input is the gated z-normed value)."""
    if merged == "linear_attn/in_proj_qkvzba":
        out = expected.get(f"{prefix}linear_attn/out_proj/kernel")
        a_log = expected.get(f"{prefix}linear_attn/A_log")
        if out is None or a_log is None or total <= out[0][0] + 2 * a_log[0][0]:
            raise ValueError(f"cannot split a {total}-wide qkv | z | b | a projection at {prefix!r} without its "
                             "out_proj and A_log")
        hv = a_log[0][0]
        return [total - out[0][0] - 2 * hv, out[0][0], hv, hv]
    if merged == "linear_attn/in_proj_qkv_z":
        out = expected.get(f"{prefix}linear_attn/out_proj/kernel")
        if out is None or total <= out[0][0]:
            raise ValueError(f"cannot split a {total}-wide qkv | z projection at {prefix!r} without its out_proj")
        return [total - out[0][0], out[0][0]]
    if merged == "self_attn/qkv_proj":
        if kv_width is None or total <= 2 * kv_width:
            raise ValueError(f"cannot split a {total}-wide q | k | v projection without the k / v width")
        return [total - 2 * kv_width, kv_width, kv_width]
    if total % 2:
        raise ValueError(f"cannot halve a {total}-wide {merged}")
    return [total // 2, total // 2]


def to_parts(expected: Shapes, kv_width: int | None) -> tuple[dict, Plan]:
    """Shapes with every merged weight replaced by its parts; and the plan that joins them back."""
    out, plan = {}, []
    for path, (shape, dtype) in expected.items():
        m = _MERGED.fullmatch(path)
        if m is None:
            out[path] = (shape, dtype)
            continue
        prefix, merged, leaf = m.group(1) or "", m.group(2), m.group(3)
        parts = []
        for name, w in zip(MERGES[merged], _widths(merged, shape[-1], kv_width, expected, prefix)):
            part = f"{prefix}{name}/{leaf}"
            out[part] = (tuple(shape[:-1]) + (w,), dtype)
            parts.append((part, w))
        plan.append((path, parts))
    return out, plan


def to_merged(expected: Shapes, kinds=None) -> tuple[dict, Plan]:
    """Shapes with every complete group of parts (of the merged kinds `kinds`, default all of
    MERGES) replaced by its merged weight; and the plan that splits it back."""
    out, plan, done = dict(expected), [], set()
    for path in expected:
        for merged, names in MERGES.items():
            if kinds is not None and merged not in kinds:
                continue
            for leaf in ("kernel", "bias"):
                suffix = f"{names[0]}/{leaf}"
                if not (path == suffix or path.endswith("/" + suffix)) or path in done:
                    continue
                prefix = path[: len(path) - len(suffix)]
                parts = [f"{prefix}{name}/{leaf}" for name in names]
                if not all(p in expected for p in parts) or any(p in done for p in parts):
                    continue
                shapes = [expected[p][0] for p in parts]
                widths = [s[-1] for s in shapes]
                for p in parts:
                    del out[p]
                    done.add(p)
                out[f"{prefix}{merged}/{leaf}"] = (tuple(shapes[0][:-1]) + (sum(widths),), expected[parts[0]][1])
                plan.append((f"{prefix}{merged}/{leaf}", list(zip(parts, widths))))
    return out, plan


def _xp(a):
    """jnp for device arrays (a restore: stay on the device), numpy for host ones (a conversion)."""
    return jnp if isinstance(a, jax.Array) else np


def join(flat: dict, plan: Plan) -> dict:
    """Concatenate the parts of each merged weight (popping them: one copy in memory). A merged
    weight with a part absent (its tensor in a missing shard: map_checkpoint's `unavailable`,
    which the caller reports) is left out as well, so the caller's error is the one raised."""
    for merged, parts in plan:
        if not all(p in flat for p, _ in parts):
            for p, _ in parts:
                flat.pop(p, None)
            continue
        pieces = [flat.pop(p) for p, _ in parts]
        flat[merged] = _xp(pieces[0]).concatenate(pieces, axis=-1)
    return flat


def split(flat: dict, plan: Plan) -> dict:
    """Cut each merged weight into its parts."""
    for merged, parts in plan:
        whole = flat.pop(merged)
        edges = [int(e) for e in np.cumsum([w for _, w in parts])[:-1]]
        for (p, _), piece in zip(parts, _xp(whole).split(whole, edges, axis=-1)):
            flat[p] = piece
    return flat


def map_into_layout(names, load: Callable[[str], np.ndarray], rules, expected: Shapes, *, kv_width=None, **kw) -> dict:
    """keymap.map_checkpoint onto a model in either layout: the rules fill the parts, which are
    joined where the model holds merged weights. Problems name the parts (as HF names them)."""
    parts, plan = to_parts(expected, kv_width)
    return join(map_checkpoint(names, load, rules, parts, **kw), plan)


def _overlapping(kinds) -> bool:
    """Whether two merged kinds claim the same part (qkv | z | b | a against qkv | z or b | a)."""
    seen = set()
    for m in kinds:
        if seen & set(MERGES[m]):
            return True
        seen |= set(MERGES[m])
    return False


def alternatives(expected: Shapes, kv_width: int | None):
    """[(stored shapes, convert)] for a checkpoint saved in another layout than the model's:
    every combination of merged / separate per kind of MERGES that the model has, kinds that
    claim the same part never together (at most 39 others); convert(flat of the stored shapes)
    gives the model's flat params."""
    parts, model_plan = to_parts(expected, kv_width)
    present = [m for m in MERGES if to_merged(parts, {m})[1]]
    own = {merged for path, _ in model_plan for merged in MERGES if path.endswith(merged + "/kernel")
           or path.endswith(merged + "/bias")}
    out = []
    for mask in range(2 ** len(present)):
        kinds = {m for i, m in enumerate(present) if mask >> i & 1}
        if kinds == own or _overlapping(kinds):
            continue
        stored, back = to_merged(parts, kinds)
        out.append((stored, lambda flat, back=back: join(split(flat, back), model_plan)))
    return out
