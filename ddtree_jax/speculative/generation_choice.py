"""budget="auto" chosen once a generation by the host (AutoBudget.decide_on "generation").

On a target whose steps are launch-bound (the demo pair on an H200: 0.2-0.5 ms a step, mostly
kernel launches and the host's reads of loop predicates) choosing on device costs more than it
gains: the device-chunk program's steps ran 15-30 % slower than the same choice's own fixed-budget
program (decision 0051). Here the host picks one choice before each generation (plain decoding,
the DFlash chain or the tree of one compiled budget) and runs exactly the program `--budget b`
runs, so the generation costs what that fixed choice costs; it learns from what each generation
realised.

Each choice c is valued at a_c, its expected accepted draft tokens per row and step:
  - the step-time table's acceptance (`CostTable.accepted`: what the table's timing runs accepted,
    the first steps of the first batch of prompts),
  - corrected by what the generations that ran c realised (sums decayed by AutoBudget.decay at each
    generation of c), shrunk with a weight of `prior` row-steps towards the table's value times the
    global ratio (realised over the table's, over every draft choice run, itself shrunk to 1 with a
    weight of `global_prior` tokens), so that a choice not run yet follows what the others taught;
then by the device policy's objective (choice._values: tokens per ms, or the makespan with the
slowest row's spread) at each row's tokens left and the table's step times. Plain generations
teach nothing about drafts, so after a run of them the best draft runs once (a probe), at a wait
that keeps the probes' predicted loss near `probe_budget`: (its predicted time / plain's - 1) /
probe_budget plain generations, within `probe_wait`.

Host state only (numpy): the programs it runs are the fixed ones, with no adaptive state.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ddtree_jax.speculative import choice
from ddtree_jax.speculative.choice import AR, DFLASH, FIRST_TREE, AutoBudget

FORM = "per generation"


def fixed_specs(spec) -> dict:
    """{choice index: the GenSpec of that choice's own fixed program} for an auto GenSpec: plain
    decoding, the DFlash chain, the tree of each compiled budget."""
    auto: AutoBudget = spec.adaptive
    out = {}
    for c in auto.choices:
        if c == AR:
            out[c] = dataclasses.replace(spec, mode="ar", budget=1)
        elif c == DFLASH:
            out[c] = dataclasses.replace(spec, mode="dflash", budget=1)
        else:
            out[c] = dataclasses.replace(spec, budget=auto.budgets[c - FIRST_TREE])
    return out


def table_problems(auto: AutoBudget, table) -> list[str]:
    """What a step-time table lacks for choosing once a generation: a time for every compiled
    choice, an acceptance for every draft choice."""
    names = [auto.names[c] for c in auto.choices]
    out = []
    missing = [n for n in names if n not in table.ms]
    if missing:
        out.append(f"no step times for {missing}")
    unaccepted = [n for n in names if n != "ar" and table.accepted.get(n, -1.0) < 0]
    if unaccepted:
        out.append(f"no measured acceptance for {unaccepted}")
    return out


@dataclasses.dataclass
class GenerationPolicy:
    """The host's choice of one program a generation and what it learned (one per compiled auto
    spec and table, kept across generations by the Engine)."""

    auto: AutoBudget
    table: object  # cost_table.CostTable
    real: np.ndarray  # [C] decayed sums of realised accepted draft tokens of the generations that ran c
    rows: np.ndarray  # [C] ... and of their row-steps
    plain_run: int = 0  # plain generations since a draft ran
    generations: int = 0

    @classmethod
    def start(cls, auto: AutoBudget, table) -> "GenerationPolicy":
        problems = table_problems(auto, table)
        if problems:
            raise ValueError(f"the step-time table ({table.source}) cannot choose once a generation: "
                             f"{'; '.join(problems)}; measure one for this form (ddtree-bench --budgets auto "
                             f"--decide-on generation --cost-table FILE)")
        return cls(auto, table, np.zeros(auto.size), np.zeros(auto.size))

    def table_accepted(self) -> np.ndarray:
        """[C] the table's accepted draft tokens per row-step (0: plain, or not compiled)."""
        return np.asarray([0.0 if c == AR or not on else float(self.table.accepted[n])
                           for c, (n, on) in enumerate(zip(self.auto.names, self.auto.enabled))])

    def expected(self) -> np.ndarray:
        """[C] expected accepted draft tokens per row-step of each choice (0 for plain)."""
        prior = self.table_accepted()
        drafts = np.asarray([c != AR and on for c, on in enumerate(self.auto.enabled)])
        w = self.auto.global_prior
        ratio = (np.sum(self.real[drafts]) + w) / (np.sum(self.rows[drafts] * prior[drafts]) + w)
        k = self.auto.prior
        return np.where(drafts, (self.real + k * ratio * prior) / (self.rows + k), 0.0)

    def step_ms(self, context: float) -> np.ndarray:
        """[C] the table's step time of each choice at a committed length (inf: not compiled)."""
        ctx = np.asarray(self.table.contexts, np.float64)
        return np.asarray([np.interp(context, ctx, np.asarray(self.table.ms[n], np.float64)) if on else np.inf
                           for n, on in zip(self.auto.names, self.auto.enabled)])

    def values(self, left: np.ndarray, context: float) -> np.ndarray:
        """[C] the objective's worth of each choice (higher is better) for rows with `left` tokens."""
        left = np.asarray(left, np.float32)
        e = np.broadcast_to(self.expected().astype(np.float32), (left.shape[0], self.auto.size))
        return choice._values(self.auto, e, left, self.step_ms(context).astype(np.float32), xp=np)

    def choose(self, left: np.ndarray, context: float) -> tuple[int, bool]:
        """(the choice for the next generation, whether it is a probe). left: [B] tokens each row
        will generate after its first (0: a padding row); context: the rows' mean prompt length."""
        v = self.values(left, context)
        c = int(np.argmax(v))
        if c != AR or not any(self.auto.enabled[DFLASH:]):
            return c, False
        d = DFLASH + int(np.argmax(v[DFLASH:]))
        lo, hi = self.auto.probe_wait
        if self.auto.objective == "tokens":  # values are rates
            loss = v[AR] / max(v[d], 1e-30) - 1.0
        else:  # values are minus times
            loss = v[d] / min(v[AR], -1e-30) - 1.0
        wait = int(min(max(math.ceil(max(loss, 0.0) / self.auto.probe_budget), lo), hi))
        return (d, True) if self.plain_run >= wait else (AR, False)

    def learn(self, c: int, accepted: float, row_steps: float) -> None:
        """What a generation of choice c realised: accepted draft tokens over its row-steps."""
        self.generations += 1
        if c == AR:
            self.plain_run += 1
            return
        self.plain_run = 0
        self.real[c] = self.auto.decay * self.real[c] + accepted
        self.rows[c] = self.auto.decay * self.rows[c] + row_steps

    def summary(self, c: int, steps: int, row_steps: int, accepted: float, expected: np.ndarray, probe: bool) -> dict:
        """A generation's statistics in the device policy's form (choice.summary): steps per choice,
        predicted vs realised accepted tokens per row-step, the choice of each step; expected: the
        `expected()` the choice was made with."""
        name = self.auto.names[c]
        predicted = float(expected[c])
        realised = accepted / row_steps if row_steps else 0.0
        per = {name: {"steps": steps, "row_steps": row_steps, "scored_row_steps": 0, "predicted": predicted,
                      "calibrated": predicted, "realised": realised}}
        return {"form": FORM, "choices": {name: steps} if steps else {}, "acceptance": per if steps else {},
                "trace": [name] * steps, "probe": probe,
                "expected": {n: float(x) for n, x, on in zip(self.auto.names, expected, self.auto.enabled) if on}}
