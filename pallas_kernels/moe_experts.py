"""The routed experts of a mixture-of-experts layer: each token's top-k expert MLPs, weighted and
summed (Pallas / Triton grouped GEMM + its XLA forms).

    y = expert_mlp(x, expert_ids, weights, w_in, w_out, act=..., impl="xla" | "pallas" | "pallas_interpret",
                   config=None, w_layout="in_out")

x [T, H] tokens (model dtype: bf16 / fp16 / fp32); expert_ids [T, k] int32, distinct within a token
(any repeats across tokens); weights [T, k] float32 combine weights; w_in [E, H, 2I] for
act="silu_glu" (per expert the gate columns, then the up columns) or [E, H, I] for act="relu2"
(NemotronH: up only); w_out [E, I, H]. With w_layout="out_in" the experts are stored as HF holds
them, transposed: w_in [E, 2I | I, H], w_out [E, H, I].

    y[t] = sum_j weights[t, j] * down_e(act(x[t] @ w_in[e]))     e = expert_ids[t, j]
    silu_glu: act(g | u) = silu(g) * u          relu2: act(u) = relu(u)^2

Rounding (every form; `dt` = the model dtype, round(.) = round to nearest even into dt, the
identity for float32):
    g, u = round(x @ w_in[e])                   products accumulated in float32, rounded like a Linear
    silu_glu: a = round(round(silu(g)) * u)     silu computed in float32 from the rounded g, as torch's
              bf16 silu does, then the product of two dt values rounded (HF: act_fn(gate) * up)
    relu2:    a = round(relu(u) * relu(u))      (HF: square(relu(up)))
    o = round(a @ w_out[e])                     float32 accumulation, rounded
    y = round(sum_j float32(weights[t, j]) * float32(o_j))   weighted and summed in float32, rounded once
A `Shared` expert (w_in [1, ...], w_out [1, ...], a weight per token or its sigmoid gate's weight
gate_w [H]: Qwen-MoE's shared expert) is one more choice of every token in that sum, where the form
takes it (`takes_shared`: every form but the decode path's per-token combine; the decode path runs
it as T more pairs and the gate's product in its first launch, the grouped forms as expert E of
the grouping).
HF's bf16 module multiplies o by the (bf16) weight and adds the k products into a bf16 buffer one
by one; the float32 sum here rounds once instead (it differs from HF's by bf16 rounding steps).
Float32 matmuls run at full precision (IEEE, no TF32) in every form. An expert id outside
[0, E) adds nothing (HF skips the id E: "not on this rank"); `check_operands` rejects such ids
where they are concrete.

Forms:
- `reference`: the gathered form: each (token, choice) pair's expert weights gathered, only those
  products made. Reads T k expert matrices: the XLA route while T k < E (`xla_form`).
- `dense_reference`: every expert on every token, combined with a [T, E] matrix that is zero off
  the chosen experts: the form every other one is tested against.
- `grouped_xla`: the pairs grouped by expert (`group_pairs`) into row tiles of one expert each
  (padded groups), the tiles' rows and their experts' weights gathered, two batched GEMMs. The
  XLA route from T k >= E.
- the decode path (impl "pallas" / "pallas_interpret" with a `DecodeConfig`; the default while
  T k <= KernelForm.max_pairs): no grouping at all; each (token, choice) pair is its own row, its
  expert read from expert_ids in the kernel; two launches, the second of which can sum a token's
  k choices and write y itself; or with combine "fused" one launch whose programs each own a
  chunk of a row's intermediate columns (pallas_kernels/_moe_fused.py). Reads T k expert
  matrices (one per pair, repeats included): what a decode step reads when its tokens' choices
  rarely coincide.
- the grouped kernel (impl "pallas" / "pallas_interpret" with a `MoeConfig`): the grouping of
  grouped_xla; two launches over (tile, output column block, K slice), each program streaming its
  expert's weight block once; the weighted sum over the k choices is one XLA gather + reduce.

Where they live: this module is the entry point (`expert_mlp`, the routes `xla_form` and
`kernel_config`, `KernelForm`, DECODE_MAX_PAIRS) and re-exports the public names of the three modules it is
built from: pallas_kernels/_moe_common.py (constants, tilings, operand checks, the shared rounding
and activation, `reference`, `dense_reference`), pallas_kernels/_moe_grouped.py (the grouping,
`grouped_xla`, the grouped kernel; its docstring details both) and pallas_kernels/_moe_decode.py
(the decode path; its docstring details the launches).

Why a kernel: on the H200 (jax 0.11.2, one Qwen3.6-35B-A3B expert layer, bf16, one token, 8
experts: 8 x 6.3 MB of weights, roofline 23.8 us as issue #26 states it) XLA's gather form took
163-184 us, `lax.ragged_dot` 533-558 us and the dense form 535-572 us; at 33 tokens the gather and
ragged forms did not finish within ~200 s. Neither XLA primitive reads only the touched experts'
weights. scripts/bench/moe_experts.py times every form here against the kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import check_impl
from pallas_kernels._moe_common import (  # noqa: F401 (re-exported: callers import them from here)
    ACTS, COMBINES, DTYPES, GEMM_LAYOUTS, MIN_BLOCK, TARGET_PROGRAMS, W_LAYOUTS, Choice, DecodeConfig, GemmConfig,
    MoeConfig,
    Shared, _dims, activate, check_operands, combine_choices, dense_reference, gate_weight, kernel_problems, reference,
    shared_weight)
from pallas_kernels._moe_decode import _decode, default_decode_config, default_fused_config
from pallas_kernels._moe_fused import one_launch
from pallas_kernels import pair_groups as pair_grouping
from pallas_kernels._moe_grouped import (  # noqa: F401 (re-exported: callers import them from here)
    RANK_BY_COUNT_MAX_PAIRS, PairGroups, _pallas, default_config, group_pairs, grouped_xla, max_tiles)

DECODE_MAX_PAIRS = 8  # the decode path up to this many (token, choice) pairs: one token at top-8 (decision 0039)


@dataclasses.dataclass(frozen=True)
class KernelForm:
    """Which forms the expert kernels take for a call's (token, choice) pairs: the decode path (no
    grouping) while T k <= max_pairs, else the grouped kernel. fused: the decode path in one launch
    (pallas_kernels/_moe_fused.py; slower on the H200, decision 0059). masked_row: launch (1) takes
    x's row as a masked load (`GemmConfig.masked_row`, decision 0064), else the loaded row padded by
    a select. rows: both launches in the "rows" MMA form (the padded row on the MMA's M side),
    else "cols" (decision 0065). grouping_kernel: the grouped kernel's pairs grouped by one launch
    (pallas_kernels/pair_groups.py) where it takes them (up to PAIR_GROUPS_MAX_PAIRS pairs, counting
    a shared expert's), else by XLA's fusions (decision 0067). The defaults are the H200's fastest; the model's
    routes set each field (ddtree_jax.routes.Routes.moe_kernel_form)."""

    max_pairs: int = DECODE_MAX_PAIRS
    fused: bool = False
    masked_row: bool = True
    rows: bool = True
    grouping_kernel: bool = True


def kernel_config(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                  form: KernelForm = KernelForm()) -> MoeConfig | DecodeConfig:
    """The kernel route's config for T tokens at top-k: the decode path while T k <= form.max_pairs
    (`default_decode_config`, or `default_fused_config` with form.fused, the MMA layout and the row
    load as `form` says), else the grouped kernel (`default_config`, its pairs grouped by one launch
    where form.grouping_kernel asks and pallas_kernels/pair_groups.py takes them)."""
    if tokens * top_k > form.max_pairs:
        config = default_config(tokens, top_k, num_experts, hidden, inter)
        # the kernel where it takes the pairs with a shared expert's too (one more choice and expert)
        fits = not pair_grouping.problems(tokens, top_k + 1, num_experts + 1, config.block_m)
        return dataclasses.replace(config, grouping="kernel") if form.grouping_kernel and fits else config
    if form.fused:
        return default_fused_config(tokens, top_k, num_experts, hidden, inter)
    config = default_decode_config(tokens, top_k, num_experts, hidden, inter)
    layout = "rows" if form.rows else "cols"
    # set as asked: an "fma" default would be refused by config.problems(), not ignored
    return dataclasses.replace(config, up=dataclasses.replace(config.up, layout=layout, masked_row=form.masked_row),
                               down=dataclasses.replace(config.down, layout=layout))


def xla_form(tokens: int, top_k: int, num_experts: int) -> str:
    """impl="xla"'s choice: the gathered `reference` while the T k pairs are fewer than the E experts
    (it reads one expert matrix per pair, <= E; no sort), `grouped_xla` from T k >= E (it reads each
    touched expert once per tile of rows)."""
    return "reference" if tokens * top_k < num_experts else "grouped_xla"


def takes_shared(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, *, impl: str,
                 form: KernelForm = KernelForm()) -> bool:
    """Whether expert_mlp's form for this call takes a `Shared` expert: every form but the decode
    path with its per-token combine (combine "kernel", which sums the routed choices only)."""
    if impl == "xla":
        return True
    config = kernel_config(tokens, top_k, num_experts, hidden, inter, form)
    return not (isinstance(config, DecodeConfig) and config.combine == "kernel")


def expert_mlp(x, expert_ids, weights, w_in, w_out, *, act: str, impl: str = "xla",
               config: MoeConfig | DecodeConfig | None = None, w_layout: str = "in_out",
               form: KernelForm = KernelForm(), shared: Shared | None = None, parts: bool = False):
    """y [T, H] = sum_j weights[t, j] * down_e(act(x[t] @ w_in[e])), e = expert_ids[t, j], rounded
    as the module docstring says. impl "xla": `xla_form`'s choice of reference / grouped_xla;
    "pallas" / "pallas_interpret": the decode path (config a DecodeConfig) or the grouped kernel
    (a MoeConfig); default `kernel_config(..., form)`: the decode path while T k <= form.max_pairs
    (`KernelForm`), else the grouped kernel. A layer the kernels cannot take (`kernel_problems`)
    raises. Pure and jit-compatible (config, act, impl, w_layout and form static). A `shared` expert
    (one more weighted choice of every token, summed before the one rounding) is taken by the forms
    `takes_shared` names; another form raises. parts: y as float32 partials [n, T, H] whose sum in index
    order, rounded to x's dtype, is y (an add + RMSNorm kernel's split-K input): the decode path's
    second launch then writes each choice's weighted product itself (n = k, + 1 with a shared expert)
    and no combine runs (`writes_parts`; so does the fused decode path's last program of each row); any
    other form returns y as the one partial (n = 1)."""
    check_impl(impl)
    bad = check_operands(x, expert_ids, weights, w_in, w_out, act, w_layout, shared)
    if bad:
        raise ValueError("expert_mlp: " + "; ".join(bad))
    t, k = expert_ids.shape
    one = (lambda y: y.astype(jnp.float32)[None]) if parts else (lambda y: y)
    if impl == "xla":
        if xla_form(t, k, w_in.shape[0]) == "reference":
            return one(reference(x, expert_ids, weights, w_in, w_out, act=act, w_layout=w_layout, shared=shared))
        return one(grouped_xla(x, expert_ids, weights, w_in, w_out, act=act, w_layout=w_layout, shared=shared))
    e, h, _, inter, _ = _dims(w_in, w_out, w_layout)
    config = config or kernel_config(t, k, e, h, inter, form)
    interpret = impl == "pallas_interpret"
    if isinstance(config, DecodeConfig) and config.combine == "fused":
        return one_launch(x, expert_ids, weights, w_in, w_out, act=act, w_layout=w_layout, config=config,
                          interpret=interpret, shared=shared, parts=parts)
    if isinstance(config, DecodeConfig):
        return _decode(x, expert_ids, weights, w_in, w_out, act=act, w_layout=w_layout, config=config,
                       interpret=interpret, shared=shared, parts=parts)
    group = pair_grouping.group_pairs
    if config.grouping == "kernel":
        n = 1 if shared is not None else 0
        bad = pair_grouping.problems(t, k + n, e + n, config.block_m)
        if bad:
            raise ValueError("expert_mlp: the grouping kernel: " + "; ".join(bad) + " (use grouping 'xla')")
        group = functools.partial(pair_grouping.pair_groups, impl=impl)
    return one(_pallas(x, expert_ids, weights, w_in, w_out, act=act, w_layout=w_layout, config=config,
                       interpret=interpret, shared=shared, group=group))


def takes_choice(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, *, dtype, impl: str,
                 form: KernelForm = KernelForm()) -> bool:
    """Whether `chosen_expert_mlp` takes this call (tokens of `dtype`): the kernels' two-launch decode path."""
    if impl == "xla" or kernel_problems(hidden, inter, num_experts, top_k, dtype):
        return False
    config = kernel_config(tokens, top_k, num_experts, hidden, inter, form)
    return isinstance(config, DecodeConfig) and config.combine != "fused"


def chosen_expert_mlp(x, choice: Choice, w_in, w_out, *, act: str, impl: str, config: DecodeConfig | None = None,
                      w_layout: str = "in_out", form: KernelForm = KernelForm(), shared: Shared | None = None,
                      parts: bool = False):
    """expert_mlp's decode path with the router's choice made inside its first launch: (y, ids [T, k]
    int32, weights [T, k] float32), y as expert_mlp(x, *choice.reference(), ...) gives it (ids and
    weights equal to softmax_top_k's: the same arithmetic). One launch fewer than the choice's own
    kernel before the experts' (decision 0071). impl "pallas" / "pallas_interpret" and the decode
    path (`takes_choice`) only: another call raises."""
    check_impl(impl)
    t, k = choice.logits.shape[-2], choice.top_k
    bad = check_operands(x, np.zeros((t, k), np.int32), np.zeros((t, k), np.float32), w_in, w_out, act, w_layout,
                         shared)  # the choice's shapes (its ids are in range by construction)
    bad += choice.problems()
    e, h, _, inter, _ = _dims(w_in, w_out, w_layout)
    config = config or (kernel_config(t, k, e, h, inter, form) if impl != "xla" else None)
    if not isinstance(config, DecodeConfig) or config.combine == "fused":
        bad.append(f"the choice runs in the decode path's first launch (impl 'pallas' / 'pallas_interpret', a "
                   f"two-launch DecodeConfig), not impl {impl!r} with {type(config).__name__}")
    if bad:
        raise ValueError("chosen_expert_mlp: " + "; ".join(bad))
    return _decode(x, None, None, w_in, w_out, act=act, w_layout=w_layout, config=config,
                   interpret=impl == "pallas_interpret", shared=shared, parts=parts, choice=choice)


def writes_parts(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, *, impl: str,
                 form: KernelForm = KernelForm()) -> bool:
    """Whether expert_mlp(parts=True) of this call returns one weighted partial per choice
    written by the decode path's kernel (no combine launch), rather than y as one partial."""
    if impl == "xla":
        return False
    config = kernel_config(tokens, top_k, num_experts, hidden, inter, form)
    if not isinstance(config, DecodeConfig):
        return False
    return config.combine == "fused" or (config.combine == "xla" and config.down.fit(hidden, inter).split_k == 1)
