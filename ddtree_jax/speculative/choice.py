"""The adaptive budget's policy on device: which step to run next, and what it learns from each.

Choices, by index: 0 = a plain decoding step ("ar"), 1 = the DFlash chain ("dflash"), 2 + j = the
DDTree of budgets[j]. A step of choice c costs T_c ms (the cost table, interpolated at the batch's
mean committed length) and emits, per active row, 1 + the accepted draft tokens. The policy
maximises the batch's expected tokens per ms,

    sum over active rows of (1 + E_row(c)) / T_c,

with E the drafter's expected acceptance of the choice's draft (speculative/expected.py; 0 for
"ar") corrected by an online calibration:

- Calibration: per choice, decayed sums of realised and predicted accepted tokens (over the steps
  that ran that choice, all active rows); E is scaled by their ratio, shrunk towards the ratio over
  all speculative steps with a weight of `prior` predicted tokens (a choice not run yet takes the
  global ratio; the global ratio starts at 1: the drafter's own probabilities).
- Before the draft exists (whether to draft at all): the rate of every speculative choice from a
  per-row moving average of its calibrated E over the earlier speculative steps, against the plain
  step's n_active / T_ar. Plain steps teach nothing about the drafts, so after a run of them a
  speculative step is forced (a probe); the wait doubles while probes keep choosing plain steps.

Everything is arrays in the loop state (`AdaptiveState`), updated without a host round trip.
Pure functions of arrays: the generation loop (speculative/adaptive.py) and the offline simulation
(scripts/adaptive_sim.py) run the same code.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

AR, DFLASH, FIRST_TREE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class AutoBudget:
    """budget="auto": the compiled choices and the policy's settings (GenSpec.budget; part of the
    jit key, so another set or setting compiles another program)."""

    budgets: tuple[int, ...] = (4, 8, 16, 32, 64)  # DDTree budgets compiled, ascending; the last is Bmax
    ar: bool = True  # plain decoding steps among the choices
    dflash: bool = True  # the DFlash chain among the choices
    ar_burst: int = 8  # plain steps per plain choice; the drafter takes their features once a burst
    decay: float = 0.9  # calibration memory: weight of the past at each observation of a choice
    prior: float = 4.0  # shrinkage of a choice's calibration ratio to the global one, in predicted tokens
    smooth: float = 0.5  # per-row moving average of calibrated E, for the decision before a draft
    probe_wait: tuple[int, int] = (16, 256)  # plain steps before a forced speculative step: first, most

    @property
    def names(self) -> tuple[str, ...]:
        return ("ar", "dflash") + tuple(str(b) for b in self.budgets)

    @property
    def enabled(self) -> tuple[bool, ...]:
        return (self.ar, self.dflash) + (True,) * len(self.budgets)

    @property
    def size(self) -> int:
        return FIRST_TREE + len(self.budgets)

    def problems(self) -> list[str]:
        """What is wrong with these settings (each budget's own range is build.validate_budget's)."""
        out = []
        b = self.budgets
        if not isinstance(b, tuple) or not b or any(not isinstance(x, int) or isinstance(x, bool) for x in b):
            out.append(f"the adaptive budget set must be a non-empty tuple of integers, got {b!r}")
        elif list(b) != sorted(set(b)):
            out.append(f"the adaptive budgets must be distinct and ascending, got {b}")
        if not isinstance(self.ar_burst, int) or self.ar_burst < 1:
            out.append(f"ar_burst must be a positive integer, got {self.ar_burst!r}")
        if not 0 <= self.decay < 1 or not 0 <= self.smooth < 1 or not self.prior > 0:
            out.append(f"need 0 <= decay < 1, 0 <= smooth < 1, prior > 0; got {self.decay}, {self.smooth}, "
                       f"{self.prior}")
        lo, hi = self.probe_wait
        if not 1 <= lo <= hi:
            out.append(f"probe_wait must be (first, most) with 1 <= first <= most, got {self.probe_wait}")
        return out


class AdaptiveState(NamedTuple):
    """The adaptive budget's part of the loop state (C choices, B rows, K cost-table contexts)."""

    cost_ms: jax.Array  # [C, K] float32 step time of each choice at each context (inf: not available)
    cost_ctx: jax.Array  # [K] float32 committed lengths of the table's columns, ascending
    force: jax.Array  # int32: -1 = choose; c >= 0 = run choice c every step (timing the cost table)
    real: jax.Array  # [C] float32 decayed sums of realised accepted tokens (steps that ran the choice)
    pred: jax.Array  # [C] float32 ... and of predicted (raw E) accepted tokens
    all_real: jax.Array  # float32 decayed sums over all speculative steps
    all_pred: jax.Array  # float32
    row_e: jax.Array  # [B, C] float32 moving average of each row's calibrated E (decision before a draft)
    have_e: jax.Array  # bool: row_e holds a speculative step's values
    wait: jax.Array  # int32 plain steps left before a forced speculative step
    gap: jax.Array  # int32 the wait set after the next speculative step that chooses plain steps again
    # statistics (whole generation): per choice steps, row-steps, and sums of raw / calibrated
    # predicted and of realised accepted tokens; the choice of every step
    n_steps: jax.Array  # [C] int32
    n_rows: jax.Array  # [C] int32
    sum_pred: jax.Array  # [C] float32
    sum_cal: jax.Array  # [C] float32
    sum_real: jax.Array  # [C] float32
    trace: jax.Array  # [T] int8 choice of step i (-1: no step)


def init_state(policy: AutoBudget, batch: int, steps: int, cost_ms, cost_ctx) -> AdaptiveState:
    """Fresh state for `batch` rows and up to `steps` steps, with a cost table ([C, K], [K])."""
    c = policy.size
    cost_ms = jnp.asarray(cost_ms, jnp.float32)
    cost_ctx = jnp.asarray(cost_ctx, jnp.float32)
    if cost_ms.shape != (c, cost_ctx.shape[0]) or cost_ctx.ndim != 1 or cost_ctx.shape[0] < 1:
        raise ValueError(f"cost table arrays must be [{c}, K] and [K] (K >= 1), got {cost_ms.shape} and "
                         f"{cost_ctx.shape}")
    zc, zf = jnp.zeros((c,), jnp.int32), jnp.zeros((c,), jnp.float32)
    return AdaptiveState(cost_ms, cost_ctx, jnp.int32(-1), zf, zf, jnp.float32(0), jnp.float32(0),
                         jnp.zeros((batch, c), jnp.float32), jnp.bool_(False), jnp.int32(0),
                         jnp.int32(policy.probe_wait[0]), zc, zc, zf, zf, zf, jnp.full((steps,), -1, jnp.int8))


def step_costs(policy: AutoBudget, a: AdaptiveState, context: jax.Array) -> jax.Array:
    """[C] ms of each choice at this committed length (linear between the table's contexts, flat
    beyond them); choices not compiled cost inf."""
    ms = jax.vmap(lambda row: jnp.interp(context, a.cost_ctx, row))(a.cost_ms)
    return jnp.where(jnp.asarray(policy.enabled), ms, jnp.inf)


def mean_context(lengths: jax.Array, active: jax.Array) -> jax.Array:
    """The batch's mean committed length over active rows (the cost table's context axis)."""
    n = jnp.maximum(jnp.sum(active), 1)
    return jnp.sum(jnp.where(active, lengths, 0)).astype(jnp.float32) / n.astype(jnp.float32)


def _rates(e: jax.Array, active: jax.Array, costs: jax.Array) -> jax.Array:
    """[C] expected tokens per ms: sum over active rows of (1 + e[row, c]) / costs[c]."""
    tokens = jnp.sum(jnp.where(active[:, None], 1.0 + e, 0.0), axis=0)
    return jnp.where(jnp.isfinite(costs), tokens / costs, -jnp.inf)


def _predicted_spec_wins(policy: AutoBudget, a: AdaptiveState, active: jax.Array, costs: jax.Array) -> jax.Array:
    """Whether some speculative choice's rate from the rows' averaged calibrated E beats a plain step."""
    rates = _rates(jnp.where(jnp.arange(policy.size) == AR, 0.0, a.row_e), active, costs)
    return jnp.max(rates[DFLASH:]) > rates[AR]


def draft_next(policy: AutoBudget, a: AdaptiveState, active: jax.Array, costs: jax.Array) -> jax.Array:
    """Whether the next step drafts (bool): forced, or no speculative step has run yet, or a probe is
    due, or some speculative choice's predicted rate beats the plain step's."""
    if not policy.ar:
        return jnp.bool_(True)
    chosen = ~a.have_e | (a.wait <= 0) | _predicted_spec_wins(policy, a, active, costs)
    return jnp.where(a.force >= 0, a.force != AR, chosen)


def calibrated(policy: AutoBudget, a: AdaptiveState, e_raw: jax.Array) -> jax.Array:
    """[B, C] calibrated E: each choice's raw E times its shrunk realised / predicted ratio."""
    overall = (a.all_real + policy.prior) / (a.all_pred + policy.prior)
    ratio = (a.real + policy.prior * overall) / (a.pred + policy.prior)
    return e_raw * ratio[None, :]


def choose(policy: AutoBudget, a: AdaptiveState, e_raw: jax.Array, active: jax.Array, costs: jax.Array):
    """The speculative choice for this draft: (choice int32 >= 1, calibrated E [B, C]). Ties go to
    the lower index (the cheaper draft). e_raw [B, C] (column AR unused)."""
    e = calibrated(policy, a, e_raw)
    rates = _rates(e, active, costs).at[AR].set(-jnp.inf)
    c = jnp.argmax(rates).astype(jnp.int32)
    return jnp.where(a.force >= 0, a.force, c), e


def after_spec(policy: AutoBudget, a: AdaptiveState, c, e_raw, e_cal, accepted, active, step, costs) -> AdaptiveState:
    """Learn from a speculative step of choice c: accepted [B] draft tokens the verify accepted."""
    act = active.astype(jnp.float32)
    real = jnp.sum(accepted.astype(jnp.float32) * act)
    pred = jnp.sum(e_raw[:, c] * act)
    onehot = jnp.arange(policy.size) == c
    d = policy.decay
    row_e = jnp.where(a.have_e, policy.smooth * a.row_e + (1 - policy.smooth) * e_cal, e_cal)
    row_e = jnp.where(active[:, None], row_e, a.row_e)
    # a step that ran only because a probe was due: the next wait is longer
    probe = (a.wait <= 0) & a.have_e & ~_predicted_spec_wins(policy, a, active, costs)
    lo, hi = policy.probe_wait
    gap = jnp.where(probe, jnp.minimum(2 * a.gap, hi), lo)
    n = jnp.sum(active).astype(jnp.int32)
    return a._replace(
        real=jnp.where(onehot, d * a.real + real, a.real), pred=jnp.where(onehot, d * a.pred + pred, a.pred),
        all_real=d * a.all_real + real, all_pred=d * a.all_pred + pred, row_e=row_e, have_e=jnp.bool_(True),
        wait=gap, gap=gap,
        n_steps=a.n_steps + onehot, n_rows=a.n_rows + onehot * n,
        sum_pred=a.sum_pred + onehot * pred, sum_cal=a.sum_cal + onehot * jnp.sum(e_cal[:, c] * act),
        sum_real=a.sum_real + onehot * real, trace=a.trace.at[step].set(c.astype(jnp.int8), mode="drop"))


def after_ar(a: AdaptiveState, active: jax.Array, step) -> AdaptiveState:
    """Count one plain step."""
    return a._replace(wait=a.wait - 1, n_steps=a.n_steps.at[AR].add(1),
                      n_rows=a.n_rows.at[AR].add(jnp.sum(active).astype(jnp.int32)),
                      trace=a.trace.at[step].set(jnp.int8(AR), mode="drop"))


def summary(policy: AutoBudget, a: AdaptiveState) -> dict:
    """Host-side statistics of a finished generation: steps per choice, predicted (raw and
    calibrated) vs realised accepted tokens per row-step of each choice, the choice of each step."""
    n_steps, n_rows = jax.device_get(a.n_steps).tolist(), jax.device_get(a.n_rows).tolist()
    sums = {k: jax.device_get(getattr(a, k)).tolist() for k in ("sum_pred", "sum_cal", "sum_real")}
    trace = jax.device_get(a.trace).tolist()
    names = policy.names
    per = {}
    for i, name in enumerate(names):
        if n_steps[i]:
            r = max(n_rows[i], 1)
            per[name] = {"steps": n_steps[i], "row_steps": n_rows[i],
                         "predicted": sums["sum_pred"][i] / r, "calibrated": sums["sum_cal"][i] / r,
                         "realised": sums["sum_real"][i] / r}
    return {"choices": {n: s for n, s in zip(names, n_steps) if s}, "acceptance": per,
            "trace": [names[c] for c in trace if c >= 0]}
