"""Tokens per second of each decoding choice from a scripts.bench.e2e report's step times and an
acceptance curve, best first (ddtree_jax/budget_table.py): where DDTree pays, and at which budget.

    python -m scripts.bench.budget_table $OUT/e2e_35b.json --acceptance demo
    python -m scripts.bench.budget_table e2e.json --acceptance curve.json   # {"ar": 1, "16": 3.1, ...}
    python -m scripts.bench.budget_table a.json b.json --acceptance demo    # budgets timed in two calls

One table per batch of the report, from its loop step times (`step_ms_by_choice`: plain decoding,
DFlash where timed, every DDTree budget). On an MoE shape (the report's `moe` figures) a second
table per batch puts each budget's step under correlated routing in place of the random one: the
step timed with the stand-in router where it ran (--moe-correlated-steps), else the estimate (the
expert products' time swapped). The two bracket a trained router's case. `--acceptance demo` is the
demo pair's measured curve (docs/benchmarks.md), a placeholder for the target's own drafter.
"""

from __future__ import annotations

import argparse
import json
import sys

from ddtree_jax.budget_table import format_table, load_acceptance, rank


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", metavar="REPORT",
                    help="scripts.bench.e2e JSON reports of one shape (several: united per batch)")
    ap.add_argument("--acceptance", default="demo",
                    help="'demo' (the demo pair's measured curve) or a JSON file {choice: tokens a step}")
    args = ap.parse_args(argv)
    problems, reports = [], []
    for path in args.reports:
        try:
            with open(path) as f:
                report = json.load(f)
            if not isinstance(report, dict) or not report.get("runs"):
                problems.append(f"{path}: no runs (is it a scripts.bench.e2e report?)")
            reports.append(report)
        except (OSError, ValueError) as e:
            problems.append(f"{path}: {e}")
    shapes = {r.get("shape") for r in reports if isinstance(r, dict)}
    if len(shapes) > 1:
        problems.append(f"the reports are of different shapes: {sorted(map(str, shapes))}")
    try:
        acceptance, estimated = load_acceptance(args.acceptance)
    except (OSError, ValueError) as e:
        problems.append(f"--acceptance {args.acceptance}: {e}")
    if problems:
        ap.error("; ".join(problems))
    report = merge_reports(reports)
    try:
        for _, _, steps in step_tables(report):
            rank(steps, acceptance)  # every bad entry named before anything is printed
    except ValueError as e:
        ap.error(str(e))
    print_tables(report, acceptance, estimated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
