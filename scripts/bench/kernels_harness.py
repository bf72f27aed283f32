"""What every kernel run of scripts.bench.kernels shares: the Run (options, device, report), the
registry entry of a kernel (Kernel, the `kernel` decorator), a row's pass test, the option helpers
the subcommands reuse and the random trees the problems are built on."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.bench import deep_parents
from ddtree_jax.tree import ancestor_bits_from_parents
from pallas_kernels._common import pow2_at_least
from scripts.bench.common import err_str, fmt, jax_rates, max_rel_err, record_row, rotations_for, time_jax
from scripts.bench.shapes import DRAFT_DEPTHS


@dataclasses.dataclass
class Run:
    """One kernel's run: options, device, the impl under test and the report being written."""

    name: str
    args: argparse.Namespace
    gpu: bool
    impl: str  # "pallas" on a GPU, "pallas_interpret" with --cpu-smoke
    report: dict
    out: str
    t0: float = dataclasses.field(default_factory=time.time)

    @property
    def smoke(self) -> bool:
        return self.args.cpu_smoke

    @property
    def quick(self) -> bool:
        return self.args.quick or self.args.cpu_smoke

    def rates(self) -> dict:
        """The device's read rate and matmul rate, measured once per run (common.jax_rates)."""
        if "rates" not in self.report:
            self.report["rates"] = jax_rates(self.gpu, self.quick)
            print(f"[{self.name}] read rate {self.report['rates']['hbm_GBps']:.0f} GB/s, bf16 matmul "
                  f"{self.report['rates']['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
        return self.report["rates"]

    def time(self, f, arg_sets, est_s, **kw):
        return time_jax(f, arg_sets, est_s, gpu=self.gpu, **kw)

    def rotations(self, nbytes: int, **kw) -> int:
        return rotations_for(nbytes, **kw) if self.gpu else 1

    def elapsed(self) -> float:
        return time.time() - self.t0

    def record(self, row: dict) -> None:
        record_row(self.report, row, self.out, f"[{self.name}] " + ", ".join(
            f"{k}={fmt(v, '.3g') if isinstance(v, float) else v}" for k, v in row.items() if not isinstance(v, dict)))


@dataclasses.dataclass(frozen=True)
class Kernel:
    run: Callable[[Run], None]  # records rows with run.record
    lead: tuple  # the table's leading columns: (row key, title, width, number format or None)
    options: Callable[[argparse.ArgumentParser], None]
    help: str


def check_decode_step(row: dict, problem, reference, kernel, state_pos: int) -> None:
    """A decode kernel's correctness columns of row: for a float32 and a bf16 problem (problem(dtype)
    -> the arguments, n_valid last), the kernel's outputs against the reference's (row[dtype +
    "_rel_err"]; "_ok" within 1e-5 / 3e-2 and every idle row's state, output 1, its input at
    state_pos bit for bit; "_error" if the kernel fails), and row["ok"] for both. The reference
    runs at "highest" matmul precision (no TF32 in its float32 products)."""
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        args = problem(dtype)
        name = jnp.dtype(dtype).name
        with jax.default_matmul_precision("highest"):
            want = reference(*args)
        try:
            got = kernel(*args)
            row[f"{name}_rel_err"] = err = max_rel_err(want, got)
            idle = [i for i in range(args[-1].shape[0]) if int(args[-1][i]) == 0]
            same = all(bool((np.asarray(got[1][i]) == np.asarray(args[state_pos][i])).all()) for i in idle)
            row[f"{name}_ok"] = bool(err <= tol and same)
        except Exception as e:
            row[f"{name}_error"] = err_str(e)
    row["ok"] = bool(row.get("float32_ok") and row.get("bfloat16_ok"))


def time_carried(run: Run, row: dict, variants: dict, step, args: tuple, est_s: float, carry) -> None:
    """row[name + "_us"]: each variant's carried decode step (step(opts) maps the arguments to the
    carried ones, at positions `carry`) timed on args; a variant that fails records its error."""
    for name, opts in variants.items():
        try:
            row[name + "_us"] = run.time(step(opts), [args], est_s, carry=carry)[0] * 1e6
        except Exception as e:
            row[name + "_error"] = err_str(e)


def registrar(registry: dict[str, Kernel]):
    """The decorator `kernel(name, lead, help, options)` of a family module: registers a kernel's run
    under `name` in `registry` (the module's KERNELS)."""
    def kernel(name: str, lead, help: str, options=lambda ap: None):
        def register(run):
            registry[name] = Kernel(run, tuple(lead), options, help)
            return run
        return register
    return kernel


PEERS = ("torch_", "fla_", "sdpa", "flex")  # a peer that fails to run is reported, not a failed check


def row_ok(row: dict) -> bool:
    """A row passed: its checks (`ok`, every `*_equal`) hold and none of our forms raised."""
    return bool(row.get("ok", True)) and all(v for k, v in row.items() if k.endswith("_equal")) and not any(
        k.endswith("_error") and not k.startswith(PEERS) for k in row)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def masked_rows_apply(n: int) -> bool:
    """Whether an n-node tree is neither a power of two >= 16 nor peeled by the tree kernels (root
    peel: n - 1 a power of two that halves the padded rows): the trees whose rows the kernels can
    read masked instead of padded (`masked_rows`, decision 0068), e.g. DDTree-8's 9 nodes."""
    return pow2_at_least(n) != n and pow2_at_least(n - 1) == pow2_at_least(n)


def variant_name(base: str, opts: dict) -> str:
    """'kernel' for the defaults, else e.g. 'kernel_dv32_w4' / 'kernel_tf32x3'; a flag as its name
    when true, 'no_' and its name when false ('kernel_masked_rows', 'kernel_no_masked_rows')."""
    short = {"block_dv": "dv", "block_n": "n", "block_p": "p", "block_k": "k", "block_r": "r", "num_warps": "w",
             "num_stages": "s", "precision": "", "split_scale": "split", "window": "window"}
    parts = [short.get(k, k) if v is True else f"no_{short.get(k, k)}" if v is False else f"{short.get(k, k)}{v}"
             for k, v in opts.items() if v is not None]
    return "_".join([base] + parts)


def rel_err(out, ref) -> float:
    return max_rel_err([ref], [out])


def add_batches(ap, default="1,8"):
    ap.add_argument("--batches", default=default, help="batch sizes (comma list)")


def add_warps(ap):
    ap.add_argument("--warps", default="", help="also time the kernel at these num_warps, e.g. 4,16")


def add_peers(ap):
    ap.add_argument("--no-peers", action="store_true", help="skip the PyTorch / FLA peers")


def add_sweep(ap):
    ap.add_argument("--no-sweep", action="store_true", help="default tiles only")


def tree_parents(rng, n: int, kind: str = "ddtree") -> list[int]:
    """A topological parent list: a chain, a star (every node under the root: what the random-weight
    benchmark's drafter builds), or DDTree-like (ddtree_jax.bench.deep_parents: depth <= 15)."""
    if kind == "chain":
        return [-1] + list(range(n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    return deep_parents(n, rng, DRAFT_DEPTHS).tolist()


def ancestor_words(trees) -> jax.Array:
    """[B, N, ceil(N / 32)] uint32 ancestor-or-self bits of parent lists (the library's form)."""
    n = len(trees[0])
    return ancestor_bits_from_parents(jnp.asarray(np.asarray(trees, np.int32)), max(n - 1, 0))

