"""Which decoding choice gives the most tokens per second, from measured step times and an
acceptance curve.

A choice is plain decoding ("ar"), the DFlash chain ("dflash") or a DDTree budget ("8", "16", ...:
the names of the step-time tables, e.g. scripts.bench.e2e's `step_ms_by_choice`). For batch B,
step time s (ms) and acceptance a (tokens a row emits per step, the bonus token included: 1.0 for
plain decoding):

    tokens / s = B * a / (s / 1000)

`rank` gives every choice present in both tables with its tokens per second and speedup over
plain decoding, best first; choices missing from either are listed as skipped, never guessed.
An acceptance curve depends on the drafter, the target and the text; on an MoE target the step
times also depend on how many experts a tree touches (docs/moe_targets.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys

# The demo pair's acceptance (docs/benchmarks.md section 4: H200, batch 1, 8 held-out prompts, 128
# new tokens, greedy). Budget 8 was not measured: 2.8 sits between DFlash linear (2.54) and
# DDTree-16 (3.06), marked an estimate in every table.
DEMO_ACCEPTANCE = {"ar": 1.0, "dflash": 2.54, "8": 2.8, "16": 3.06, "32": 3.35, "64": 3.56, "128": 3.79,
                   "256": 3.98}
DEMO_ESTIMATED = ("8",)
CHOICE = re.compile(r"^(ar|dflash|[1-9][0-9]*)$")


@dataclasses.dataclass(frozen=True)
class Ranked:
    choice: str
    step_ms: float
    tokens_per_step: float  # per row
    tokens_per_s: float  # all rows
    speedup: float | None  # over plain decoding, where "ar" is in both tables
    estimated: bool = False  # the acceptance is an estimate, not a measurement


def check_tables(step_ms: dict, acceptance: dict) -> list[str]:
    """Every problem with the two tables (names, values)."""
    bad = []
    for what, table in (("step time", step_ms), ("acceptance", acceptance)):
        for name, v in table.items():
            if not CHOICE.match(str(name)):
                bad.append(f"{what} of {name!r}: a choice is 'ar', 'dflash' or a budget like '16'")
            elif not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                bad.append(f"{what} of {name!r} must be a positive number, got {v!r}")
    bad += [f"acceptance of {n!r} is {a} tokens a step: below plain decoding's 1" for n, a in acceptance.items()
            if isinstance(a, (int, float)) and not isinstance(a, bool) and 0 < a < 1]
    return bad


def rank(step_ms: dict, acceptance: dict, batch: int = 1, estimated=()) -> tuple[list[Ranked], list[str]]:
    """(choices by tokens per second, best first; the choices in only one table). ValueError names
    every bad entry."""
    bad = check_tables(step_ms, acceptance)
    if batch < 1:
        bad.append(f"batch must be >= 1, got {batch}")
    if bad:
        raise ValueError("budget table: " + "; ".join(bad))
    both = [c for c in step_ms if c in acceptance]
    plain = batch * 1000 / step_ms["ar"] if "ar" in both else None
    rows = []
    for c in both:
        tps = batch * acceptance[c] * 1000 / step_ms[c]
        rows.append(Ranked(c, step_ms[c], acceptance[c], tps, tps / plain if plain else None, c in estimated))
    rows.sort(key=lambda r: -r.tokens_per_s)
    skipped = sorted(set(step_ms) ^ set(acceptance), key=_order)
    return rows, skipped


def _order(choice: str):
    return (0, 0) if choice == "ar" else (1, 0) if choice == "dflash" else (2, int(choice))


def load_acceptance(source: str) -> tuple[dict, tuple]:
    """(acceptance curve, the names whose value is an estimate) from "demo" or a JSON file holding
    {"ar": 1.0, "dflash": 2.5, "16": 3.1, ...} (or that object under "acceptance", with an optional
    "estimated" list)."""
    if source == "demo":
        return dict(DEMO_ACCEPTANCE), DEMO_ESTIMATED
    with open(source) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{source}: an acceptance file holds a JSON object of choice: tokens per step")
    curve = data.get("acceptance", data)
    if not isinstance(curve, dict):
        raise ValueError(f"{source}: 'acceptance' must be an object of choice: tokens per step")
    curve = {str(k): v for k, v in curve.items() if k != "estimated"}
    return curve, tuple(str(c) for c in data.get("estimated", ()))


def format_table(rows: list[Ranked], skipped: list[str], batch: int, title: str = "") -> str:
    """A plain-text table, best first, the best marked."""
    lines = [title] if title else []
    lines.append(f"{'choice':>7} {'ms/step':>9} {'tok/step':>9} {'tok/s':>10} {'vs plain':>8}")
    for i, r in enumerate(rows):
        star = " <- best" if i == 0 else ""
        est = "*" if r.estimated else " "
        lines.append(f"{r.choice:>7} {r.step_ms:9.3f} {r.tokens_per_step:8.2f}{est} {r.tokens_per_s:10.1f} "
                     f"{(f'{r.speedup:.2f}x' if r.speedup else '-'):>8}{star}")
    if any(r.estimated for r in rows):
        lines.append("* acceptance estimated, not measured")
    if skipped:
        lines.append(f"skipped (in one table only): {', '.join(skipped)}")
    lines.append(f"batch {batch}: tokens/s = batch x tokens a step / step time")
    return "\n".join(lines)


def step_tables(report: dict) -> list[tuple[str, int, dict]]:
    """(title, batch, {choice: step ms}) of every run in an e2e report: the measured steps, and on an
    MoE shape the correlated-routing bracket."""
    out = []
    for run in report.get("runs", []):
        batch = run["batch"]
        steps = dict(run.get("step_ms_by_choice") or {})
        out.append((f"batch {batch}, {report.get('shape', '?')}: measured steps (random routing on MoE shapes)",
                    batch, steps))
        budgets = (run.get("moe") or {}).get("budgets") or {}
        corr, how = dict(steps), set()
        for b, fig in budgets.items():
            for key, what in (("correlated_step_ms", "timed"), ("correlated_step_ms_estimate", "estimated")):
                if fig.get(key):
                    corr[str(b)] = fig[key]
                    how.add(what)
                    break
        if how:
            out.append((f"batch {batch}: DDTree steps under correlated routing ({' / '.join(sorted(how))}; "
                        f"{run['moe']['correlated_shared']} of {run['moe']['top_k']} experts shared with the "
                        "previous node)", batch, corr))
    return out


def merge_reports(reports: list[dict]) -> dict:
    """One report from several of the same shape (budgets timed in separate calls): each batch's
    step times and MoE budget figures united, a later report's entries replacing an earlier one's."""
    runs = {}
    for report in reports:
        for run in report.get("runs", []):
            have = runs.setdefault(run["batch"], {"batch": run["batch"], "step_ms_by_choice": {}})
            have["step_ms_by_choice"].update(run.get("step_ms_by_choice") or {})
            if run.get("moe"):
                budgets = {**(have.get("moe") or {}).get("budgets", {}), **run["moe"].get("budgets", {})}
                have["moe"] = {**run["moe"], "budgets": budgets}
    return {"shape": reports[0].get("shape"), "runs": [runs[b] for b in sorted(runs)]}


def print_tables(report: dict, acceptance: dict, estimated=(), file=None) -> list:
    """Print every table of the report (to file, default stdout); returns [(title, best choice)]."""
    best = []
    for title, batch, steps in step_tables(report):
        rows, skipped = rank(steps, acceptance, batch, estimated)
        print("\n" + format_table(rows, skipped, batch, title), file=file or sys.stdout)
        best.append((title, rows[0].choice if rows else None))
    return best


def load_inputs(paths, acceptance_source: str) -> tuple[dict, dict, tuple, list[str]]:
    """(one report united from the scripts.bench.e2e reports at `paths`, the acceptance curve, its
    estimated entries, every problem found: unreadable files, mixed shapes, bad table entries)."""
    problems, reports = [], []
    for path in paths:
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError) as e:
            problems.append(f"{path}: {e}")
            continue
        if not isinstance(report, dict) or not report.get("runs"):
            problems.append(f"{path}: no runs (is it a scripts.bench.e2e report?)")
            continue
        reports.append(report)
    shapes = {r.get("shape") for r in reports}
    if len(shapes) > 1:
        problems.append(f"the reports are of different shapes: {sorted(map(str, shapes))}")
    acceptance, estimated = {}, ()
    try:
        acceptance, estimated = load_acceptance(acceptance_source)
    except (OSError, ValueError) as e:
        problems.append(f"acceptance {acceptance_source}: {e}")
    report = merge_reports(reports) if reports else {"runs": []}
    if not problems:
        for _, _, steps in step_tables(report):
            problems += check_tables(steps, acceptance)
    return report, acceptance, estimated, problems
