"""scripts.bench.kernels: every registered kernel has its subcommand and a line in the docstring;
every command the docs give parses today; without a GPU (and without --cpu-smoke) it says so; and
(-m script) every kernel's run at its --cpu-smoke size: the interpreter at tiny shapes, checks
passed, every form timed. The kernels' own test files hold the smoke runs of gdn_decode,
gdn_prologue, row_top_k, tree_select, add_rms_norm and softmax_top_k."""

import json
import re
import shlex
from pathlib import Path

import pytest

from scripts.bench import kernels as bench


def test_every_kernel_has_a_subcommand_and_a_docstring_line():
    assert set(bench.KERNELS) == {"gdn_tree", "gdn_commit", "gdn_decode", "gdn_prologue", "tree_attention",
                                  "ancestor_bits", "ssd_tree", "ssd_commit", "mamba2_decode", "row_top_k",
                                  "tree_select", "add_rms_norm", "softmax_top_k", "row_product", "pair_groups"}
    doc_names = {line.split()[0] for line in bench.__doc__.splitlines() if line.startswith("  ") and line.split()}
    assert set(bench.KERNELS) <= doc_names
    for name in bench.KERNELS:
        args = bench.parser().parse_args([name, "--quick"])
        assert args.name == name and args.quick and not args.cpu_smoke


def test_every_documented_command_parses(capsys):
    """Each `python -m scripts.bench.kernels NAME ...` in the benchmarks, the kernel docs and the
    README names a kernel and options the tool has today ($OUT and "..." stand for paths)."""
    root = Path(__file__).resolve().parent.parent
    docs = [root / "README.md", root / "docs" / "benchmarks.md", *sorted((root / "docs").glob("kernels_*.md"))]
    commands = []
    for doc in docs:
        for m in re.finditer(r"python -m scripts\.bench\.kernels ([^`\n#]*)", doc.read_text()):
            args = shlex.split(m.group(1).replace("$OUT", "out").replace("...", "x"))
            if args and args[0] != "NAME":
                commands.append((doc.name, args))
    assert len(commands) >= 15
    for doc, args in commands:
        try:
            bench.parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{doc}: python -m scripts.bench.kernels {shlex.join(args)}: {capsys.readouterr().err}")


def test_no_gpu_without_cpu_smoke_is_refused(capsys):
    assert bench.main(["row_top_k"]) == 2
    assert "no GPU visible" in capsys.readouterr().err


@pytest.mark.script
@pytest.mark.parametrize("name", ["gdn_tree", "gdn_commit", "tree_attention", "ancestor_bits", "ssd_tree",
                                  "ssd_commit"])
def test_cpu_smoke(tmp_path, name):
    out = tmp_path / f"{name}.json"
    assert bench.main([name, "--cpu-smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["kernel"] == name and report["impl"] == "pallas_interpret" and report["rows"]
    assert all(bench.row_ok(r) and r["kernel_us"] > 0 and r["xla_us"] > 0 for r in report["rows"])
    if name == "tree_attention":  # --splits (the smoke run: 2) times the kernel at a fixed split count too
        assert all(r["kernel_s2_us"] > 0 for r in report["rows"])
