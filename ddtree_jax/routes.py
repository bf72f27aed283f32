"""Which implementation each part of a generation step runs: the kernel route and the measured
switches and thresholds that pick between a Pallas kernel and an XLA form.

`Routes` is frozen and hashable. It travels in `GenSpec` (so it is part of the jit cache key:
another route compiles another program) and down every call where a model or the tree build
chooses a form. Nothing reads a module global to choose. `Routes()` is the reference (XLA forms
everywhere, the simplest build forms); `Routes.resolve()` picks the measured-fastest forms for a
device; `--route name=value` (ddtree-bench, the benchmark scripts) changes one field for an A/B
run, and reports record `Routes.as_dict()` whole. Why each default is what it is:
docs/decisions/ (the index names the field).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax

from pallas_kernels.moe_experts import DECODE_MAX_PAIRS, KernelForm
from pallas_kernels.tree_attention import MIN_SPLIT_KEYS

IMPLS = ("xla", "pallas", "pallas_interpret")
_NO_LIMIT = 1 << 20  # a threshold no tree reaches: the kernel is always taken where it can be
# Weights that get the row pad on a GPU: 2^19 up to the 10,000,000 elements under which XLA GPU's
# algebraic simplifier turns a dot with a vector operand into multiply + reduce
# (GpuAlgebraicSimplifierVisitor::ShouldStrengthReduceDotToReduce with
# IsMatrixMultiplicationTooSmallForRewriting: (M + N) * K < 10M; a one-row lhs is a vector once its
# unit dims are dropped). Measured on the H200 (docs/decisions/0049-single-row-products.md): at the
# Qwen3.6-35B-A3B shape (weights of 0.5M-8.4M elements) the batch-1 decode step took 3.33 ms
# padded against 4.65 ms; on the demo pair (weights of at most 0.3M) padding made it slower
# (0.21 against 0.16 ms: the pad and slice launches outweigh a tiny product), hence the floor.
ROW_PAD_WEIGHTS_GPU = (1 << 19, 9_999_999)
# One-row products through pallas_kernels/row_product.py on a GPU: the same window. In it at the
# 35B-A3B shape the router (2048 x 256) and the output projections (4096 x 2048, partials into the
# add + RMSNorm kernel) beat XLA's padded GEMM (3.3 / 9.2 us against 5.3 / 10.2 us with their pads
# and slices); the wider input projections (18.9M, 25.3M elements) stay XLA GEMMs, faster there.
# Decode step 2.93-2.96 ms against 3.01-3.03; 2.95 with the router's partials summed in
# softmax_top_k (docs/decisions/0054-row-product-kernel.md).
ROW_PRODUCT_WEIGHTS_GPU = ROW_PAD_WEIGHTS_GPU


# A GDN decode step's value heads over up to 4 programs each on a GPU: at the 35B-A3B layer (32
# heads, batch 1) the kernel with its norm after it took 10.7-12.5 us against 12.5-13.7 unsplit
# (docs/decisions/0058-gdn-decode-split-and-attention-splits.md).
GDN_DECODE_DV_SPLIT_GPU = 4

# The generation loop's steps between two reads of its predicate on a GPU, unrolled: the 35B-A3B
# decode step 2.57 / 2.57 against 2.62 / 2.65 ms, the demo pair's steps 4-15 % shorter, at most one
# step run past an end token (docs/decisions/0075-generation-loop-in-pairs-of-steps.md).
LOOP_CHUNK_GPU = 2


@dataclasses.dataclass(frozen=True)
class Routes:
    """Kernel route and form choices of one compiled generation.

    impl: "xla" (the XLA forms, the reference), "pallas" (the Pallas GPU kernels) or
    "pallas_interpret" (the same kernels in interpret mode: tests on any machine). The switches
    below choose per kernel when impl is not "xla"; a kernel that cannot take a shape is announced
    by a warning when the step is traced, never skipped silently.
    """

    impl: str = "xla"
    # ---- model kernels (impl != "xla") ----
    attention_decode_kernel: bool = True  # decode-step attention through the tree-attention kernel
    attention_split_keys: int = MIN_SPLIT_KEYS  # the tree-attention kernel's fewest cache keys a split
    attention_prologue_kernel: bool = True  # q / k norms + RoPE of the merged q | k | v product
    # ... whose k / v programs also write the appended rows into the K / V cache in place (decode,
    # prefill), instead of XLA's cast + update slice after it (decision 0071)
    attention_prologue_writes_kv: bool = True
    gdn_decode_kernel: bool = True  # a GDN decode step's core as one kernel
    # ... over up to this many programs a value head while the grid fits gdn_decode_programs_per_sm
    # programs an SM (> 1: the gated norm after the kernel; gdn_decode.fitting_split)
    gdn_decode_dv_split: int = 1
    # ... that cap: at batch 8 a split of 4 under a cap of 8 made the kernel faster alone but the
    # 35B-A3B decode step slower (6.72 against 6.58 ms, decision 0069)
    gdn_decode_programs_per_sm: int = 2
    # ... and with a split the output projection's row-product kernel applies that norm as it loads
    # the row (pallas_kernels/row_product.NormedRow), instead of an XLA fusion of its own (decision
    # 0062: the 35B-A3B decode step 2.80 vs 2.81-2.82 ms)
    gdn_norm_into_out_proj: bool = True
    gdn_tree_prologue_kernel: bool = True  # GDN tree conv .. casts as one kernel
    # GDN tree verify of an unpeeled tree whose node count is not a power of two >= 16 (DDTree-4 / -8):
    # the kernel loads its rows masked instead of XLA padding q / k / v / g / beta (gdn_tree.py)
    gdn_tree_masked_rows: bool = True
    # a Mamba2 decode step's dt, conv, state update, gate and window slide as one kernel, the group
    # norm one fusion after it (pallas_kernels/mamba2_decode.py; decision 0073: Nemotron-H-8B decode
    # at batch 1 4.14-4.20 against 4.20-4.27 ms, at batches 4 / 8 within the runs' noise)
    mamba2_decode_kernel: bool = True
    # ... over up to this many programs a head (its P rows split) while the grid fits
    # mamba2_decode_programs_per_sm programs an SM (pallas_kernels._common.fitting_split); 1: no
    # split, the H200's measure (one layer, batch 1: 9.78 us unsplit, 10.4 in 4; batch 8: 22.2 / 23.7)
    mamba2_decode_p_split: int = 1
    mamba2_decode_programs_per_sm: int = 4
    # ... its group norm run by each group's last program (a counter per group) instead of two XLA
    # fusions after the kernel: one layer 10.3 / 24.9 us against 9.78 / 22.2 (batch 1 / 8; 0073)
    mamba2_decode_norm_in_kernel: bool = False
    add_norm_kernel: bool = True  # residual add + RMSNorm as one kernel
    # ... in one-mixer blocks (NemotronH) from this many tokens a row: at the Nemotron-H-8B shape on the
    # H200 the DDTree-8 step (9 a row) 8.70 against 8.83 ms at batch 8, the decode step (1 a row)
    # 4.81 against 4.75 ms (decision 0072)
    add_norm_one_mixer_min_tokens: int = 2
    split_k_parts: bool = True  # residual-stream products at verify rows return split-K partials
    split_k_rows: tuple[int, int] = (32, 128)  # row counts (inclusive) that return partials
    # One-row Linear products (a decode step at batch 1) whose weight holds lo..hi elements
    # (inclusive; (0, 0): never) pad the row with a zero row: XLA GPU strength-reduces a dot with a
    # vector operand and fewer than 10M operand elements to a multiply over the whole weight and a
    # reduce, far slower than its GEMM (issue #26; docs/decisions/0049-single-row-products.md).
    # Kernels on only, like the fields around it; split-K partials take precedence where both apply.
    row_pad_weights: tuple[int, int] = (0, 0)
    # One-row Linear products whose weight holds lo..hi elements (inclusive; (0, 0): never) run as
    # one launch of pallas_kernels/row_product.py, the row read in place (no pad, no slice), a
    # split_k_out product writing the add + RMSNorm kernel's partials. Takes precedence over the pad.
    # Only the forms measured to win take it: narrow outputs (routers) and partials; a wide output
    # wanted whole keeps the pad (Linear._row_kernel_runs, decision 0070).
    row_product_weights: tuple[int, int] = (0, 0)
    drafter_attention_kernel: bool = True  # the drafter's non-causal attention through the tree kernel
    ssd_kernel_max_nodes: int = 16  # Mamba2 tree verify: the SSD kernel up to this many nodes
    # ... reading an unpeeled tree's rows masked instead of XLA padding x / dt / B / C (the GDN tree
    # kernel's masked rows, decision 0068; timed on a Mamba2 hybrid in decision 0070)
    ssd_tree_masked_rows: bool = True
    moe_experts_kernel: bool = True  # MoE expert products through the expert kernels
    moe_router_kernel: bool = True  # a softmax router's softmax + top-k + renormalisation in one launch
    # ... and at one row its product too (pallas_kernels/router_choice.py: the product's last program
    # chooses; slower on the H200, decision 0059)
    moe_router_fused: bool = False
    # ... or, where the experts' two-launch decode path runs, made inside its first launch (each
    # routed program chooses its token's experts from the router's logits; decision 0071)
    moe_choice_in_experts: bool = True
    moe_shared_in_decode_kernel: bool = True  # the shared expert as T more pairs of the experts' decode path
    # ... and as one more expert of the grouped kernel's grouping (verify, prefill): its weights read
    # in the grouped launches, summed with the routed choices before the one rounding (the DDTree-8 step
    # 0.15-0.21 ms slower on the H200: 0066; 0.12-0.14 ms with the grouping kernel, 0067)
    moe_shared_in_grouped_kernel: bool = False
    # ... whose second launch writes each choice's weighted product as float32 partials that the next
    # add + RMSNorm kernel sums (no combine launch), where the MoE block's output meets that kernel
    moe_parts_into_norm: bool = True
    moe_gate_in_decode_kernel: bool = True  # ... and the shared expert's sigmoid gate product in its first launch
    moe_decode_max_pairs: int = DECODE_MAX_PAIRS  # ... their decode path (no grouping) up to T * top_k pairs
    # ... in one launch (pallas_kernels/_moe_fused.py: programs own chunks of a pair's intermediate
    # columns, the last of a pair's programs sums the chunks' down products; slower on the H200, 0059)
    moe_decode_fused: bool = False
    # ... their first launch taking the row as a masked load Triton pipelines with the weights (the
    # padded row's per-step register loads held 38 % of its stalls, 0063; the step 2-3 % faster, 0064)
    moe_decode_masked_row: bool = True
    # ... both their launches in the "rows" MMA form (the padded row on the MMA's M side), else "cols":
    # one layer 0.2-6.3 us faster in four sweeps on the H200 (0064), the step 11-18 us (0065)
    moe_decode_rows: bool = True
    # the grouped kernel's pairs (verify, prefill) grouped by one launch (pallas_kernels/pair_groups.py;
    # up to PAIR_GROUPS_MAX_PAIRS pairs) instead of XLA's ~10 small launches: the 35B-A3B DDTree-8 step
    # 0.07-0.24 ms faster on the H200 (0067)
    moe_grouping_kernel: bool = True
    # ---- tree build kernels (impl != "xla") ----
    bits_kernel_max_nodes: int = 64  # ancestor bitsets: the kernel up to this many nodes
    tree_select_kernel: bool = True  # the DDTree node selection in one launch (budgets it takes)
    row_top_k_kernel: bool = True  # the vocabulary top-k of short rows in one launch
    # ---- XLA forms of the build (any impl) ----
    sort_top_k_max: int = 0  # k up to this: top-k as one stable sort (GPU: beats XLA's TopK kernel)
    staged_top_k: bool = False  # long rows: top-k of chunks, then of the candidates
    prefilter_top_k: bool = False  # very long rows: the block-max prefilter before the top-k
    rank_select_max: int = 0  # beam rows up to this long: selection by pairwise ranks
    # ---- XLA compiler options of the compiled program (any impl; `compiler_options`) ----
    xla_pdl: bool = False  # programmatic dependent launch: a kernel starts while its predecessor drains
    # ---- the generation loop (any impl) ----
    loop_chunk: int = 1  # fixed-budget steps per predicate read, unrolled (GenSpec.chunk; GPU: 2)

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ValueError("invalid routes: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        if self.impl not in IMPLS:
            out.append(f"impl must be one of {IMPLS}, got {self.impl!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "bool" and not isinstance(v, bool):
                out.append(f"{f.name} must be true or false, got {v!r}")
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                out.append(f"{f.name} must be an integer >= 0, got {v!r}")
        for name in ("gdn_decode_programs_per_sm", "loop_chunk"):
            v = getattr(self, name)
            if isinstance(v, int) and not isinstance(v, bool) and v < 1:
                out.append(f"{name} must be >= 1, got {v}")
        for name in ("gdn_decode_dv_split", "attention_split_keys"):
            v = getattr(self, name)
            if isinstance(v, int) and not isinstance(v, bool) and (v < 1 or v & (v - 1)):
                out.append(f"{name} must be a power of two >= 1, got {v}")
        lo, hi = self.split_k_rows if _int_pair(self.split_k_rows) else (1, 0)
        if not _int_pair(self.split_k_rows) or not 1 <= lo <= hi:
            out.append(f"split_k_rows must be two row counts lo <= hi, got {self.split_k_rows!r}")
        for name in ("row_pad_weights", "row_product_weights"):
            v = getattr(self, name)
            lo, hi = v if _int_pair(v) else (1, 0)
            if not _int_pair(v) or not 0 <= lo <= hi:
                out.append(f"{name} must be two element counts 0 <= lo <= hi, got {v!r}")
        return out

    def pads_row(self, weight_elements: int) -> bool:
        """Whether a one-row product with a weight of this many elements pads its row to two
        (row_pad_weights; kernels on)."""
        lo, hi = self.row_pad_weights
        return self.kernels and hi > 0 and lo <= weight_elements <= hi

    def row_product_kernel(self, weight_elements: int) -> bool:
        """Whether a one-row product with a weight of this many elements runs as the row-product
        kernel (row_product_weights; kernels on)."""
        lo, hi = self.row_product_weights
        return self.kernels and hi > 0 and lo <= weight_elements <= hi

    def moe_kernel_form(self) -> KernelForm:
        """The expert kernels' form options these routes name (moe_decode_*, moe_grouping_kernel),
        for pallas_kernels.moe_experts."""
        return KernelForm(max_pairs=self.moe_decode_max_pairs, fused=self.moe_decode_fused,
                          masked_row=self.moe_decode_masked_row, rows=self.moe_decode_rows,
                          grouping_kernel=self.moe_grouping_kernel)

    def compiler_options(self) -> tuple[tuple[str, Any], ...]:
        """XLA compiler options of a program compiled with these routes, as sorted (name, value)
        pairs (jax.jit's compiler_options; ddtree_jax/compiled.py passes them): part of the program
        like every other field, never a process-wide XLA_FLAGS."""
        return (("xla_gpu_enable_pdl", True),) if self.xla_pdl else ()

    @property
    def kernels(self) -> bool:
        """Whether Pallas kernels run at all (impl "pallas" or "pallas_interpret")."""
        return self.impl != "xla"

    @classmethod
    def resolve(cls, device=None, impl: str | None = None, *, platform: str | None = None, **overrides) -> "Routes":
        """The measured defaults for `device` (default: JAX's first device; or name a `platform`,
        "gpu" / "cpu", directly): Pallas kernels and the GPU build forms on a GPU, the XLA forms
        elsewhere (Pallas runs on a CPU only in interpret
        mode, which is for tests). impl "pallas_interpret" takes the SSD kernel at every tree size
        (its threshold is a GPU measurement), so tests exercise it. `overrides` set fields last."""
        platform = platform or (device or jax.devices()[0]).platform
        gpu = platform == "gpu"
        impl = impl or ("pallas" if gpu else "xla")
        fields: dict[str, Any] = dict(impl=impl)
        if gpu:
            fields.update(sort_top_k_max=16, staged_top_k=True, prefilter_top_k=True, rank_select_max=1024,
                          row_pad_weights=ROW_PAD_WEIGHTS_GPU, row_product_weights=ROW_PRODUCT_WEIGHTS_GPU,
                          gdn_decode_dv_split=GDN_DECODE_DV_SPLIT_GPU, loop_chunk=LOOP_CHUNK_GPU)
        if impl == "pallas_interpret":
            fields.update(ssd_kernel_max_nodes=_NO_LIMIT)
        fields.update(overrides)
        return cls(**fields)

    def replace(self, **changes) -> "Routes":
        return dataclasses.replace(self, **changes)

    def with_settings(self, settings: Iterable[str]) -> "Routes":
        """These routes with `name=value` settings applied (the `--route` option); every bad
        setting is reported at once (ValueError)."""
        changes, problems = {}, []
        types = {f.name: f.type for f in dataclasses.fields(self)}
        for text in settings or ():
            name, sep, value = (part.strip() for part in text.partition("="))
            if not sep or not name:
                problems.append(f"{text!r}: expected name=value")
            elif name not in types:
                problems.append(f"{text!r}: no route named {name!r} (routes: {', '.join(types)})")
            else:
                try:
                    changes[name] = _parse(types[name], value)
                except ValueError as e:
                    problems.append(f"{text!r}: {e}")
        if problems:
            raise ValueError("bad --route: " + "; ".join(problems))
        try:
            return self.replace(**changes)
        except ValueError as e:
            raise ValueError(f"bad --route: {e}") from None

    def as_dict(self) -> dict:
        """Every field, for reports (JSON-ready)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}


def _parse(kind: str, text: str):
    low = text.lower()
    if kind == "bool":
        if low in ("true", "1", "on", "yes"):
            return True
        if low in ("false", "0", "off", "no"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if kind == "str":
        return text
    if kind.startswith("tuple"):
        try:
            return tuple(int(x) for x in text.strip("()[] ").split(","))
        except ValueError:
            raise ValueError(f"expected integers like 32,128, got {text!r}") from None
    raise ValueError(f"cannot parse a {kind}")  # pragma: no cover


def _int_pair(v) -> bool:
    return (isinstance(v, tuple) and len(v) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in v))


REFERENCE = Routes()  # the XLA forms: the default of every model and build entry point


def add_arguments(parser, *, impl_default_help: str = "pallas on GPU, xla elsewhere") -> None:
    """`--impl` and `--route NAME=VALUE` (repeatable) for the CLIs and benchmark tools."""
    parser.add_argument("--impl", choices=IMPLS, default=None,
                        help=f"kernel route: xla (reference forms), pallas (GPU kernels), pallas_interpret "
                             f"(kernels in interpret mode, for tests) (default: {impl_default_help})")
    parser.add_argument("--route", action="append", default=[], metavar="NAME=VALUE",
                        help="change one route for this run, e.g. gdn_decode_kernel=false (A/B of a kernel); "
                             "repeatable; the names are ddtree_jax.routes.Routes' fields")


def from_args(args, device=None) -> Routes:
    """Routes.resolve(device, args.impl) with args.route applied (ValueError names every bad one)."""
    return Routes.resolve(device, args.impl).with_settings(args.route)
