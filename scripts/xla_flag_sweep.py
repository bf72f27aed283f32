"""What XLA's own GPU options do to the decode step and the DDTree verify (run on the H200).

Each flag set runs scripts/profile_step.py in a process of its own (XLA_FLAGS is read once per
process) and the sweep tabulates, per phase, the kernel time, the kernel count and the split by
kind (GEMM / fusion / reduce / Pallas). A flag this jaxlib does not know ends its process at once
and is reported as such. Issue #6's decode roofline is lost in ~1200 small non-GEMM kernels and
its verify in GEMMs of 65 rows: both are XLA's decisions first.

    PYTHONPATH=. python3 scripts/xla_flag_sweep.py --out $OUT/flags.json              # on the H200
    PYTHONPATH=. python3 scripts/xla_flag_sweep.py --sets baseline,tma --phases step
    PYTHONPATH=. python3 scripts/xla_flag_sweep.py --smoke --sets baseline            # any device
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from ddtree_jax import atomic

# name -> XLA_FLAGS. Candidates for fewer decode kernels (block-level / multi-output fusions in
# Triton) and for faster 65-row GEMMs (warp specialization, the newer GEMM fusion, cuBLASLt).
# Every flag parses in jaxlib 0.10.2 (several of its other experimental names do not).
FLAG_SETS = {
    "baseline": "",
    "block_level_rewriter": "--xla_gpu_experimental_enable_fusion_block_level_rewriter=true",
    "all_fusions_triton": "--xla_gpu_experimental_all_fusions_with_triton=true",
    "heroless": "--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true",
    "multi_output": "--xla_gpu_unsupported_enable_triton_multi_output_fusion=true",
    "warp_specialization": "--xla_gpu_experimental_enable_triton_warp_specialization=true",
    "gemm_fusion_v2": "--xla_gpu_experimental_gemm_fusion_v2=true",
    "cublaslt": "--xla_gpu_enable_cublaslt=true",
    "no_dot_merger": "--xla_gpu_dot_merger_threshold_mb=0",
    # session 7: XLA's product over the 27B's merged gate | up weight beat the two separate ones
    # (80.2 vs 2 x 42.8 us at 1 row); a merger threshold above the 178 MB weights lets XLA merge them
    "merge_mlp": "--xla_gpu_dot_merger_threshold_mb=512",
    # session 11, for the verify's 65-row GEMMs (XLA's split-K + reduce on the 5120-wide products):
    # every Triton tiling instead of the pruned list, that with Triton for any GEMM, cuDNN's GEMMs
    "exhaustive": "--xla_gpu_exhaustive_tiling_search=true",
    "exhaustive_triton_any": "--xla_gpu_exhaustive_tiling_search=true --xla_gpu_triton_gemm_any=true",
    "cudnn_gemm": "--xla_gpu_cudnn_gemm_fusion_level=3",
}


def summarize(report: dict) -> dict:
    """Per phase: kernel ms, kernel count, ms by kind."""
    return {phase: {"kernel_ms": p["gpu_busy_ms"], "kernels": p["kernels_per_call"], "wall_ms": p["wall_ms"],
                    "by_kind_ms": p["by_kind_ms"]}
            for phase, p in report.get("phases", {}).items()}


def run_set(name: str, flags: str, args) -> dict:
    out = os.path.join(tempfile.mkdtemp(prefix=f"flags_{name}_"), "profile.json")
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "profile_step.py"),
           "--phases", args.phases, "--gemm-m", "", "--verify-budgets", "", "--iters", str(args.iters),
           "--top", str(args.top), "--out", out] + (["--smoke"] if args.smoke else [])
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    row = {"set": name, "xla_flags": flags, "rc": rc, "seconds": round(time.time() - t0, 1)}
    if "Unknown flag in XLA_FLAGS" in log:
        row["error"] = "unknown flag in this jaxlib"
    elif os.path.exists(out):
        with open(out) as f:
            report = json.load(f)
        row["phases"] = summarize(report)
        row["top"] = {phase: p["top"] for phase, p in report.get("phases", {}).items()}
        if rc != 0:
            row["error"] = f"exit {rc} after writing part of its profile"
    else:
        row["error"] = f"exit {rc}: " + " | ".join(log.strip().splitlines()[-3:])[-400:]
    return row


def print_table(rows, phases):
    print(f"\n{'set':<22}" + "".join(f"{p + ' ms':>12}{'kernels':>9}{'gemm':>8}{'other':>8}" for p in phases))
    for r in rows:
        if "phases" not in r:
            print(f"{r['set']:<22}  {r.get('error', '')}")
            continue
        line = f"{r['set']:<22}"
        for p in phases:
            ph = r["phases"].get(p)
            if ph is None:
                line += f"{'-':>12}{'-':>9}{'-':>8}{'-':>8}"
                continue
            gemm = ph["by_kind_ms"].get("gemm", 0.0)
            line += f"{ph['kernel_ms']:>12.2f}{ph['kernels']:>9.0f}{gemm:>8.2f}{ph['kernel_ms'] - gemm:>8.2f}"
        print(line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default=",".join(FLAG_SETS), help=f"comma list of: {', '.join(FLAG_SETS)}")
    ap.add_argument("--phases", default="step,verify", help="profile_step.py phases (step = plain decode)")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per flag set")
    ap.add_argument("--smoke", action="store_true", help="tiny model (any device): checks the script")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "xla_flags.json"))
    args = ap.parse_args(argv)
    names = [s for s in args.sets.split(",") if s]
    unknown = [s for s in names if s not in FLAG_SETS]
    if unknown:
        ap.error(f"unknown flag set(s) {unknown}; known: {', '.join(FLAG_SETS)}")
    phases = [p for p in args.phases.split(",") if p]
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["scripts/xla_flag_sweep.py"] + (argv if argv is not None else sys.argv[1:])),
              "rows": []}
    for name in names:
        row = run_set(name, FLAG_SETS[name], args)
        report["rows"].append(row)
        atomic.write_json(args.out, report)
        print(f"[flags] {name}: rc {row['rc']}, {row['seconds']} s {row.get('error', '')}", flush=True)
    print_table(report["rows"], phases)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
