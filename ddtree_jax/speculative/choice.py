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
  global ratio; the global ratio starts at 1, the drafter's own probabilities, with a weight of
  `global_prior` tokens). DFlash's per-depth marginals make E an underestimate where the drafter
  is right (the demo pair: E 0.3-1.5 where 1-3 tokens are accepted), other drafters overstate it;
  the ratio corrects either.
- Before the draft exists (whether to draft at all): the rate of every speculative choice from a
  per-row moving average of its calibrated E over the earlier speculative steps, against the plain
  step's n_active / T_ar. Plain steps teach nothing about the drafts, so after a run of them a
  speculative step is forced (a probe) once the plain steps since the last speculative one reach
  a wait that keeps the probes' extra cost near `probe_budget` of the time: (T_spec / T_ar - 1) /
  probe_budget plain steps for the cheapest speculative choice, within `probe_wait`; it doubles
  while probes keep choosing plain steps. Chosen once a chunk (decide_every > 1), a probe is a
  one-step chunk (learning_draft); chosen by the host, its advance call's own cost (the table's
  call_ms) counts too.

Under continuous batching (ddtree_jax/serve) rows join and leave a running state: the per-row
fields (ROW_FIELDS) move with their request and start from the population's expectation when a
new one joins (`joining`); the calibration and the probe schedule belong to the batch and persist.

Everything is arrays in the loop state (`AdaptiveState`), updated without a host round trip.
Pure functions of arrays: the generation loop (speculative/adaptive.py) and the offline simulation
(scripts/adaptive_sim.py) run the same code.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtri

AR, DFLASH, FIRST_TREE = 0, 1, 2
OBJECTIVES = ("tokens", "makespan")
DECIDE_ON = ("device", "host", "generation")


@dataclasses.dataclass(frozen=True)
class AutoBudget:
    """budget="auto": the compiled choices and the policy's settings (GenSpec.budget; part of the
    jit key, so another set or setting compiles another program)."""

    # DDTree budgets compiled, ascending; the last is Bmax, whose selection every draft pays (the
    # demo pair on the H200: 21 us at 32 against 58 us at 64 plus an XLA top-k of 64 candidates;
    # at the 27B shape's 17 ms steps, add 64)
    budgets: tuple[int, ...] = (4, 8, 16, 32)
    ar: bool = True  # plain decoding steps among the choices
    dflash: bool = True  # the DFlash chain among the choices
    ar_burst: int = 8  # plain steps per plain choice; the drafter takes their features once a burst
    decay: float = 0.9  # calibration memory: weight of the past at each observation of a choice
    prior: float = 4.0  # shrinkage of a choice's calibration ratio to the global one, in predicted tokens
    global_prior: float = 1.0  # shrinkage of the global ratio to 1 (the drafter's own probabilities)
    smooth: float = 0.5  # per-row moving average of calibrated E, for the decision before a draft
    probe_budget: float = 0.03  # share of the time that probes may cost while plain steps run
    probe_wait: tuple[int, int] = (8, 1024)  # the fewest and most plain steps between probes
    # how much better than the best draft plain steps must be predicted to be to be chosen (0:
    # whichever is predicted better; 0.3 until the makespan's spread term: a bias to drafting that
    # made batches 8 and 16 draft where plain steps won by 7-37 % on the H200, decision 0050)
    ar_margin: float = 0.0
    # device chunks: the weight of the scored draft's own E in the chunk's choice, the rest the rows'
    # moving average of calibrated E (a chunk runs its choice for up to decide_every steps; a draft's
    # E predicts its own acceptance, hardly the next steps'). 0.25 by simulation on the H200 demo
    # tables (decision 0048)
    chunk_weight: float = 0.25
    # what a step maximises: "tokens" = the batch's expected tokens per ms (rows replaced as they
    # finish: continuous batching); "makespan" = progress of the row that would finish last (a
    # fixed batch that runs until every row is done). Equal at batch 1.
    objective: str = "makespan"
    # makespan: weight of the acceptance's spread in the slowest row's steps. A row that needs
    # `left` tokens at 1 + e a step takes left / (1 + e) steps on average with a spread of
    # sqrt(left * e) / (1 + e) (accepted drafts about geometric: variance e (1 + e)); the slowest of
    # n rows lands ~z(n) spreads above (z: the expected maximum of n standard normals, 1.43 at 8).
    # Plain steps have none, so at larger batches a draft must beat them by its spread (0: off)
    spread: float = 1.0
    # how often the choice is made. 0: every step, on device (lax.cond plain-or-draft, lax.switch
    # over the drafts: one program, no host round trip; the server's default). n > 0: once per chunk
    # of up to n steps, where `decide_on` says. 32 on device: the chosen draft's steps cost what a
    # fixed budget's do, and it compiles in the per-step program's time (decision 0046)
    decide_every: int = 32
    # where a chunk's choice is made (decide_every > 0). "device": one program; a chunk scores its
    # draft (Bmax selection, E of every choice) and chooses, then runs up to n steps of the chosen
    # draft's fixed-budget step (no conditional, no selection, no learning; the first verifies the
    # scored draft and teaches the policy), or a plain burst of max(n, ar_burst) steps; a chunk
    # goes on across advance calls (`plan`; n = 1 is the per-step program). "host": the host reads
    # the policy's next choice (`plan`) after each advance call and runs that choice's own program
    # (`run`) for the next chunk: no conditional a step, but an advance call a chunk and a program
    # per choice (decision 0045). "generation": the host chooses once a generation and runs that
    # choice's plain fixed-budget program (`--budget b`'s own), learning from what each generation
    # realised (speculative/generation_choice.py): no cost a step at all, for a target whose steps
    # are launch-bound (decision 0051); decide_every is then unused
    decide_on: str = "device"
    # the choice a program runs at every step (-1: it chooses; c >= 0: `programs()` sets it)
    run: int = -1

    def program(self, c: int) -> "AutoBudget":
        """The policy of the program that runs choice c every step (the host decides): a plain chunk
        is one burst, so the drafter catches up once a chunk."""
        burst = max(self.ar_burst, self.decide_every) if c == AR else self.ar_burst
        return dataclasses.replace(self, run=c, ar_burst=burst)

    @property
    def host_decides(self) -> bool:
        """The host picks each chunk's program (decide_every > 0, decide_on "host")."""
        return self.decide_every > 0 and self.decide_on == "host"

    @property
    def per_generation(self) -> bool:
        """The host picks one choice a generation and runs its fixed-budget program (decide_on
        "generation")."""
        return self.decide_on == "generation"

    @property
    def device_chunks(self) -> bool:
        """One program whose chunks of decide_every steps make one choice each on device."""
        return self.decide_every > 1 and self.decide_on == "device" and self.run < 0

    @property
    def form(self) -> str:
        """How the program chooses, as a step-time table records it (its times are that program's)."""
        if self.per_generation:
            return "per generation"
        if self.device_chunks:
            return f"device chunks of {self.decide_every}"
        if self.host_decides:
            return f"host chunks of {self.decide_every}"
        return "per step"

    @property
    def burst(self) -> int:
        """Plain steps a plain choice runs before the drafter catches up: a whole chunk when chunks
        make the choice (one catch-up a chunk)."""
        return max(self.ar_burst, self.decide_every) if self.device_chunks else self.ar_burst

    @property
    def choices(self) -> tuple[int, ...]:
        """The enabled choices' indices."""
        return tuple(c for c, on in enumerate(self.enabled) if on)

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
        if not 0 <= self.decay < 1 or not 0 <= self.smooth < 1 or not self.prior > 0 or not self.global_prior > 0 \
                or not self.ar_margin >= 0:
            out.append(f"need 0 <= decay < 1, 0 <= smooth < 1, prior > 0, global_prior > 0, ar_margin >= 0; got "
                       f"{self.decay}, {self.smooth}, {self.prior}, {self.global_prior}, {self.ar_margin}")
        if not self.spread >= 0:
            out.append(f"spread must be >= 0, got {self.spread}")
        if not 0 <= self.chunk_weight <= 1:
            out.append(f"chunk_weight must be in [0, 1], got {self.chunk_weight}")
        if not isinstance(self.decide_every, int) or self.decide_every < 0:
            out.append(f"decide_every must be an integer >= 0 (0: every step on device), got {self.decide_every!r}")
        if self.decide_on not in DECIDE_ON:
            out.append(f"decide_on must be one of {DECIDE_ON}, got {self.decide_on!r}")
        if not isinstance(self.run, int) or not -1 <= self.run < self.size or (
                self.run >= 0 and not self.enabled[self.run]):
            out.append(f"run must be -1 or an enabled choice's index, got {self.run!r}")
        if self.objective not in OBJECTIVES:
            out.append(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        lo, hi = self.probe_wait
        if not 0 < self.probe_budget <= 1:
            out.append(f"probe_budget must be in (0, 1], got {self.probe_budget}")
        if not 1 <= lo <= hi:
            out.append(f"probe_wait must be (first, most) with 1 <= first <= most, got {self.probe_wait}")
        return out


class AdaptiveState(NamedTuple):
    """The adaptive budget's part of the loop state (C choices, B rows, K cost-table contexts)."""

    cost_ms: jax.Array  # [C, K] float32 step time of each choice at each context (inf: not available)
    cost_ctx: jax.Array  # [K] float32 committed lengths of the table's columns, ascending
    # int32: -1 = choose; c >= 0 = run choice c every step (timing the cost table); size + c = choice c
    # in one-step device chunks (the table's calibration pass: every draft scored)
    force: jax.Array
    real: jax.Array  # [C] float32 decayed sums of realised accepted tokens (steps that ran the choice)
    pred: jax.Array  # [C] float32 ... and of predicted (raw E) accepted tokens
    all_real: jax.Array  # float32 decayed sums over all speculative steps
    all_pred: jax.Array  # float32
    row_e: jax.Array  # [B, C] float32 moving average of each row's calibrated E (decision before a draft)
    have_e: jax.Array  # bool: row_e (and pop_e) hold a speculative step's values or a table's measured acceptance
    # [C] float32 the population's calibrated E: decayed mean over the active rows of each speculative
    # step (decay `decay` per step); a row that joins a running batch (ddtree_jax/serve) starts from it
    pop_e: jax.Array
    since: jax.Array  # int32 plain steps since the last speculative step
    gap: jax.Array  # int32 the probe wait's multiplier: doubles at each probe that chooses plain steps again
    # statistics (whole generation): per choice steps, row-steps, row-steps whose draft was scored
    # (every speculative one but a device chunk's lean steps), sums of raw / calibrated predicted
    # (over the scored row-steps) and of realised accepted tokens (over all); the choice of every step
    n_steps: jax.Array  # [C] int32
    n_rows: jax.Array  # [C] int32
    n_scored: jax.Array  # [C] int32
    sum_pred: jax.Array  # [C] float32
    sum_cal: jax.Array  # [C] float32
    sum_real: jax.Array  # [C] float32
    trace: jax.Array  # [T] int8 choice of step i (-1: no step)
    # int32 [2]: [choice, steps] of the next chunk. The host deciding: the policy's plan at the end of
    # the last advance call (read with the chunk's other results). Device chunks: the choice and the
    # steps left of the chunk the last call's end cut short (steps 0: a fresh chunk next). Zeros
    # otherwise.
    plan: jax.Array
    call_ms: jax.Array  # float32 the table's cost of an advance call beyond its steps (a chunk's own)


# The AdaptiveState fields with the batch on axis 0 (one row of them belongs to one sequence); the
# others belong to the batch (the table, the calibration, the probe schedule, the statistics).
ROW_FIELDS = ("row_e",)


class TableArrays(NamedTuple):
    """A step-time table as a generation starts from it (cost_table.CostTable.arrays)."""

    ms: jax.Array  # [C, K] step time of each choice at each context (inf: not compiled)
    contexts: jax.Array  # [K] committed lengths, ascending
    ratios: jax.Array  # [C] realised / predicted accepted tokens measured with the table (-1: unknown)
    accepted: jax.Array  # [C] accepted draft tokens per row and step measured with the table (-1: unknown)
    call_ms: Any = 0.0  # what an advance call costs beyond its steps (dispatch, launch, the read ending it; 0: unknown)


def init_state(policy: AutoBudget, batch: int, steps: int, table: TableArrays) -> AdaptiveState:
    """Fresh state for `batch` rows and up to `steps` steps from a step-time table. The table's
    ratios are the first calibration, held as `prior` predicted tokens of evidence for each choice
    and for the global ratio (their mean), decayed like the generation's own observations, which
    soon outweigh them; its accepted counts are every row's expected acceptance before any draft
    (without them the first step drafts, to learn one)."""
    c = policy.size
    ms, ctx = jnp.asarray(table.ms, jnp.float32), jnp.asarray(table.contexts, jnp.float32)
    if ms.shape != (c, ctx.shape[0]) or ctx.ndim != 1 or ctx.shape[0] < 1 or jnp.shape(table.ratios) != (c,) \
            or jnp.shape(table.accepted) != (c,):
        raise ValueError(f"step-time table arrays must be [{c}, K], [K] (K >= 1), [{c}], [{c}]; got {ms.shape}, "
                         f"{ctx.shape}, {jnp.shape(table.ratios)}, {jnp.shape(table.accepted)}")
    zc, zf = jnp.zeros((c,), jnp.int32), jnp.zeros((c,), jnp.float32)
    ratios = jnp.asarray(table.ratios, jnp.float32)
    spec = jnp.arange(c) != AR
    seeded = spec & (ratios >= 0)  # the measured calibration as pseudo-observations
    pred = jnp.where(seeded, policy.prior, 0.0).astype(jnp.float32)
    real = jnp.where(seeded, ratios, 0.0) * pred
    n_seeded = jnp.sum(seeded)
    all_pred = jnp.where(n_seeded > 0, jnp.float32(policy.prior), 0.0)
    all_real = jnp.sum(real) / jnp.maximum(n_seeded, 1)
    accepted = jnp.asarray(table.accepted, jnp.float32)
    known = jnp.all(jnp.where(spec & jnp.asarray(policy.enabled), accepted >= 0, True))
    pop_e = jnp.where(spec & (accepted >= 0), accepted, 0.0).astype(jnp.float32)
    return AdaptiveState(ms, ctx, jnp.int32(-1), real, pred, all_real, all_pred,
                         jnp.broadcast_to(pop_e, (batch, c)), known, pop_e, jnp.int32(0), jnp.int32(1), zc, zc, zc, zf,
                         zf, zf, jnp.full((steps,), -1, jnp.int8), jnp.zeros((2,), jnp.int32),
                         jnp.asarray(table.call_ms, jnp.float32))


def carried_over(table: TableArrays, real, pred, pop_e) -> TableArrays:
    """The table a generation starts from after another ran with the same program: its calibration
    (real / pred of each choice that was scored) and population expectation (pop_e) replace the
    measured ratios and accepted counts, so what one generation of a few chunks learned is not lost
    at the next (the Engine carries them; a server's state persists by itself). Host arrays in and
    out (numpy: read with the generation's last results, no device op)."""
    real, pred, pop_e = (np.asarray(x, np.float32) for x in (real, pred, pop_e))
    ratios = np.where(pred > 0, real / np.maximum(pred, 1e-9), np.asarray(table.ratios, np.float32))
    spec = np.arange(pred.shape[0]) != AR
    accepted = np.where(spec & (pop_e > 0), pop_e, np.asarray(table.accepted, np.float32))
    return table._replace(ratios=ratios.astype(np.float32), accepted=accepted.astype(np.float32))


def joining(a: AdaptiveState, row: AdaptiveState) -> AdaptiveState:
    """row (the state of newly prefilled rows) with its per-row fields (ROW_FIELDS) as rows that join
    the running batch `a` start them (a server's new requests): row_e = a's population expectation,
    never the values of the row that held the slot before."""
    return row._replace(row_e=jnp.broadcast_to(a.pop_e, row.row_e.shape).astype(row.row_e.dtype))


def clear_statistics(a: AdaptiveState) -> AdaptiveState:
    """a with its statistics (steps, row-steps and accepted-token sums per choice, the trace) zeroed:
    a server reads them per chunk of steps and starts the next chunk from zero, so no counter grows
    with the server's lifetime. The policy's state (calibration, population E, probes) is kept."""
    zc, zf = jnp.zeros_like(a.n_steps), jnp.zeros_like(a.sum_pred)
    return a._replace(n_steps=zc, n_rows=zc, n_scored=zc, sum_pred=zf, sum_cal=zf, sum_real=zf,
                      trace=jnp.full_like(a.trace, -1))


def step_costs(policy: AutoBudget, a: AdaptiveState, context: jax.Array) -> jax.Array:
    """[C] ms of each choice at this committed length (linear between the table's contexts, flat
    beyond them); choices not compiled cost inf."""
    ms = jax.vmap(lambda row: jnp.interp(context, a.cost_ctx, row))(a.cost_ms)
    return jnp.where(jnp.asarray(policy.enabled), ms, jnp.inf)


def mean_context(lengths: jax.Array, left: jax.Array) -> jax.Array:
    """The batch's mean committed length over active rows (the cost table's context axis)."""
    active = left > 0
    n = jnp.maximum(jnp.sum(active), 1)
    return jnp.sum(jnp.where(active, lengths, 0)).astype(jnp.float32) / n.astype(jnp.float32)


def _values(policy: AutoBudget, e: jax.Array, left: jax.Array, costs: jax.Array, xp=jnp) -> jax.Array:
    """[C] worth of each choice for the batch (higher is better; -inf: not available). e [B, C]
    expected accepted tokens, left [B] tokens each row still generates (0: done).
    tokens: sum over active rows of (1 + e) / T; makespan: -T x the steps the slowest active row
    needs at this choice's rate: max over rows of left / (1 + e) + spread x z(n) x sqrt(left e) / (1 + e),
    e the active rows' mean (AutoBudget.spread). xp: jax.numpy on device, numpy on the host (the
    choice once a generation, speculative/generation_choice.py)."""
    active = (left > 0)[:, None]
    if policy.objective == "tokens":
        value = xp.sum(xp.where(active, 1.0 + e, 0.0), axis=0) / costs
    else:
        # every active row at the rows' mean E: a row's own E comes from a draft or two and is mostly
        # noise (the max over rows picked the unluckiest row's), while the spread term carries how far
        # the slowest row falls behind the mean
        need = left[:, None].astype(xp.float32)
        n = xp.maximum(xp.sum(active), 1).astype(xp.float32)
        e = xp.broadcast_to(xp.sum(xp.where(active, e, 0.0), axis=0) / n, e.shape)
        steps = need / (1.0 + e)
        if policy.spread > 0:
            z = expected_max_normal(xp.sum(active)) if xp is jnp else _expected_max_normal_host(int(xp.sum(active)))
            steps = steps + policy.spread * z * xp.sqrt(need * xp.maximum(e, 0.0)) / (1.0 + e)
        value = -costs * xp.max(xp.where(active, steps, 0.0), axis=0)
    return xp.where(xp.isfinite(costs), value, -xp.inf)


def expected_max_normal(n) -> jax.Array:
    """The expected maximum of n independent standard normals (float32; 0 at n <= 1), by Blom's
    approximation Phi^-1((n - 0.375) / (n + 0.25)): within 0.03 of the exact value (1.434 against
    1.424 at n = 8)."""
    n = jnp.maximum(jnp.asarray(n, jnp.float32), 1.0)
    return jnp.maximum(ndtri((n - 0.375) / (n + 0.25)), 0.0)


def _expected_max_normal_host(n: int) -> float:
    """expected_max_normal on the host (no device op)."""
    n = max(n, 1)
    return max(statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25)), 0.0)


def _predicted_spec_wins(policy: AutoBudget, a: AdaptiveState, left: jax.Array, costs: jax.Array) -> jax.Array:
    """Whether some speculative choice, at the rows' averaged calibrated E, is predicted to do at
    least as well as plain steps, those given an edge of `ar_margin` (a plain step is chosen before
    its draft exists, on a prediction, where a speculative choice is made on the draft's own E)."""
    v = _values(policy, jnp.where(jnp.arange(policy.size) == AR, 0.0, a.row_e), left, costs)
    best = jnp.max(v[DFLASH:])
    if policy.objective == "tokens":  # values are rates
        return best * (1 + policy.ar_margin) >= v[AR]
    return best >= v[AR] * (1 + policy.ar_margin)  # values are minus times


def _probe_due(policy: AutoBudget, a: AdaptiveState, costs: jax.Array) -> jax.Array:
    """Whether the plain steps since the last speculative one reached the probe wait. Chosen by
    the host (host_decides), a probe is a chunk of its own and costs an advance call more."""
    lo, hi = policy.probe_wait
    ratio = jnp.min(costs[DFLASH:]) / costs[AR]
    if policy.host_decides:
        ratio = ratio + a.call_ms / costs[AR]
    wait = jnp.clip(jnp.ceil((ratio - 1) / policy.probe_budget), lo, hi).astype(jnp.int32)
    return a.since >= jnp.minimum(a.gap * wait, hi)


def forced(policy: AutoBudget, a: AdaptiveState) -> jax.Array:
    """The choice a measurement forces (int32; -1: none). `force` c < size forces c; size + c forces c
    in one-step device chunks, every draft scored (the step-time table's calibration pass)."""
    return jnp.where(a.force >= policy.size, a.force - policy.size, a.force)


def draft_next(policy: AutoBudget, a: AdaptiveState, left: jax.Array, costs: jax.Array) -> jax.Array:
    """Whether the next step drafts (bool): forced, or no speculative step has run yet, or a probe is
    due, or some speculative choice's predicted worth beats the plain step's."""
    if not policy.ar:
        return jnp.bool_(True)
    chosen = ~a.have_e | _probe_due(policy, a, costs) | _predicted_spec_wins(policy, a, left, costs)
    f = forced(policy, a)
    return jnp.where(f >= 0, f != AR, chosen)


def learning_draft(policy: AutoBudget, a: AdaptiveState, left: jax.Array, costs: jax.Array) -> jax.Array:
    """Whether a draft now would run to learn rather than for its predicted worth: before any
    speculative step, or a probe among plain steps (those predicted better). A chunk that starts
    with one is a single step, so the next choice sees what it taught."""
    if not policy.ar:
        return ~a.have_e
    return ~a.have_e | (_probe_due(policy, a, costs) & ~_predicted_spec_wins(policy, a, left, costs))


def plan(policy: AutoBudget, a: AdaptiveState, left: jax.Array, costs: jax.Array) -> jax.Array:
    """int32 [choice, steps]: the next chunk's choice and length when the host chooses every
    `decide_every` steps. Plain steps where draft_next says so; else the speculative choice of
    the most predicted worth at the rows' averaged calibrated E. A probe, or a draft before any
    speculative step has run, is one step: the host decides again on what it taught."""
    drafts = draft_next(policy, a, left, costs)
    e = jnp.where(jnp.arange(policy.size) == AR, 0.0, a.row_e)
    v = _values(policy, e, left, costs).at[AR].set(-jnp.inf)
    best = jnp.argmax(v).astype(jnp.int32)
    f = forced(policy, a)
    c = jnp.where(f >= 0, f, jnp.where(drafts, best, AR))
    n = jnp.where(drafts & learning_draft(policy, a, left, costs) & (a.force < 0), 1, policy.decide_every)
    return jnp.stack([c, n]).astype(jnp.int32)


def calibrated(policy: AutoBudget, a: AdaptiveState, e_raw: jax.Array) -> jax.Array:
    """[B, C] calibrated E: each choice's raw E times its shrunk realised / predicted ratio."""
    overall = (a.all_real + policy.global_prior) / (a.all_pred + policy.global_prior)
    ratio = (a.real + policy.prior * overall) / (a.pred + policy.prior)
    return e_raw * ratio[None, :]


def choose(policy: AutoBudget, a: AdaptiveState, e_raw: jax.Array, left: jax.Array, costs: jax.Array):
    """The speculative choice for this draft: (choice int32 >= 1, calibrated E [B, C]). Ties go to
    the lower index (the cheaper draft). e_raw [B, C] (column AR unused)."""
    e = calibrated(policy, a, e_raw)
    v = _values(policy, _chunk_e(policy, a, e), left, costs).at[AR].set(-jnp.inf)
    c = jnp.argmax(v).astype(jnp.int32)
    f = forced(policy, a)
    return jnp.where(f >= 0, f, c), e


def _chunk_e(policy: AutoBudget, a: AdaptiveState, e: jax.Array) -> jax.Array:
    """The E a choice is valued at: this draft's calibrated E, or in device chunks (one choice for
    up to decide_every steps) its blend with the rows' moving average, weight `chunk_weight` on the
    draft (a draft's E predicts its own acceptance, hardly the next steps')."""
    if not policy.device_chunks or policy.chunk_weight >= 1:
        return e
    w = policy.chunk_weight
    return jnp.where(a.have_e, w * e + (1 - w) * a.row_e, e)


def after_spec(policy: AutoBudget, a: AdaptiveState, c, e_raw, e_cal, accepted, left, step, costs,
               counted: bool = False) -> AdaptiveState:
    """Learn from a speculative step of choice c (e_cal: the calibrated E it was chosen by):
    accepted [B] draft tokens the verify accepted, left [B] as before the step. The rows' averaged
    E for the next decision before a draft takes this step's E under the calibration updated by
    this step. counted: the step is already in the step, row-step and realised counts and the trace
    (after_lean: a device chunk's first step, learned from once its chunk has run)."""
    active = left > 0
    act = active.astype(jnp.float32)
    real = jnp.sum(accepted.astype(jnp.float32) * act)
    pred = jnp.sum(e_raw[:, c] * act)
    onehot = jnp.arange(policy.size) == c
    d = policy.decay
    n = jnp.sum(active).astype(jnp.int32)
    b = a._replace(
        real=jnp.where(onehot, d * a.real + real, a.real), pred=jnp.where(onehot, d * a.pred + pred, a.pred),
        all_real=d * a.all_real + real, all_pred=d * a.all_pred + pred, have_e=jnp.bool_(True),
        n_scored=a.n_scored + onehot * n,
        sum_pred=a.sum_pred + onehot * pred, sum_cal=a.sum_cal + onehot * jnp.sum(e_cal[:, c] * act))
    if not counted:
        b = b._replace(n_steps=a.n_steps + onehot, n_rows=a.n_rows + onehot * n, sum_real=a.sum_real + onehot * real,
                       trace=a.trace.at[step].set(c.astype(jnp.int8), mode="drop"))
    e_new = calibrated(policy, b, e_raw)
    row_e = jnp.where(a.have_e, policy.smooth * a.row_e + (1 - policy.smooth) * e_new, e_new)
    mean_e = jnp.sum(jnp.where(active[:, None], e_new, 0.0), axis=0) / jnp.maximum(n, 1).astype(jnp.float32)
    pop_e = jnp.where(a.have_e, d * a.pop_e + (1 - d) * mean_e, mean_e)
    b = b._replace(row_e=jnp.where(active[:, None], row_e, a.row_e), pop_e=jnp.where(n > 0, pop_e, a.pop_e))
    # if plain steps come next, the next probe waits twice as long when this step was itself a probe
    # (it ran for the wait, not for its predicted worth) and as long as the costs say otherwise
    was_probe = _probe_due(policy, a, costs) & a.have_e & ~_predicted_spec_wins(policy, a, left, costs)
    again = was_probe & ~_predicted_spec_wins(policy, b, left, costs)
    return b._replace(since=jnp.int32(0), gap=jnp.where(again, jnp.minimum(2 * a.gap, policy.probe_wait[1]), 1))


def after_lean(a: AdaptiveState, c: int, step, accepted: jax.Array, left: jax.Array) -> AdaptiveState:
    """Count one step of a device chunk's fixed-budget program for choice c: accepted [B] draft
    tokens, left [B] as before the step. It learns nothing (the calibration learns from a chunk's
    scored first step) and predicts nothing (n_scored)."""
    active = left > 0
    return a._replace(n_steps=a.n_steps.at[c].add(1), n_rows=a.n_rows.at[c].add(jnp.sum(active).astype(jnp.int32)),
                      sum_real=a.sum_real.at[c].add(jnp.sum(jnp.where(active, accepted, 0)).astype(jnp.float32)),
                      trace=a.trace.at[step].set(jnp.int8(c), mode="drop"))


def after_ar(a: AdaptiveState, left: jax.Array, step) -> AdaptiveState:
    """Count one plain step (left [B] as before it)."""
    return a._replace(since=a.since + 1, n_steps=a.n_steps.at[AR].add(1),
                      n_rows=a.n_rows.at[AR].add(jnp.sum(left > 0).astype(jnp.int32)),
                      trace=a.trace.at[step].set(jnp.int8(AR), mode="drop"))


def summary(policy: AutoBudget, a: AdaptiveState) -> dict:
    """Host-side statistics of a finished generation: steps per choice, predicted (raw and
    calibrated) vs realised accepted tokens per row-step of each choice, the choice of each step.
    Realised is per row-step; predicted and calibrated per scored row-step ("scored_row_steps":
    with device chunks only a chunk's first step is scored)."""
    n_steps, n_rows = jax.device_get(a.n_steps).tolist(), jax.device_get(a.n_rows).tolist()
    n_scored = jax.device_get(a.n_scored).tolist()
    sums = {k: jax.device_get(getattr(a, k)).tolist() for k in ("sum_pred", "sum_cal", "sum_real")}
    trace = jax.device_get(a.trace).tolist()
    names = policy.names
    per = {}
    for i, name in enumerate(names):
        if n_steps[i]:
            r, q = max(n_rows[i], 1), max(n_scored[i], 1)
            per[name] = {"steps": n_steps[i], "row_steps": n_rows[i], "scored_row_steps": n_scored[i],
                         "predicted": sums["sum_pred"][i] / q, "calibrated": sums["sum_cal"][i] / q,
                         "realised": sums["sum_real"][i] / r}
    return {"choices": {n: s for n, s in zip(names, n_steps) if s}, "acceptance": per,
            "trace": [names[c] for c in trace if c >= 0]}
