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
import sys

from ddtree_jax.budget_table import load_inputs, print_tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", metavar="REPORT",
                    help="scripts.bench.e2e JSON reports of one shape (several: united per batch)")
    ap.add_argument("--acceptance", default="demo",
                    help="'demo' (the demo pair's measured curve) or a JSON file {choice: tokens a step}")
    args = ap.parse_args(argv)
    report, acceptance, estimated, problems = load_inputs(args.reports, args.acceptance)
    if problems:
        ap.error("; ".join(problems))
    print_tables(report, acceptance, estimated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
