"""Step-time tables of the adaptive budget: T(choice, context) for one model, device and batch.

A table is measured in the compiled programs the generation runs: each choice is run for n and 2n
steps from a generation's start, interleaved choice by choice, repeated, and its step time is the
median over repeats of (T(2n) - T(n)) / (steps the second call ran more); the difference cancels
the call's fixed cost (host dispatch, prefill is not in it: the calls start from a prefilled
state). Chosen by the host (AutoBudget.host_decides) each choice has its own program
(AutoBudget.program); otherwise the one auto program runs the choice forced
(LoopState.adapt.force): per step, its switch and shared draft / selection included; in device
chunks, the chosen draft's fixed-budget steps (each choice's own intercept, its call and chunk
start, is recorded in `starts`), then one call of n steps per draft choice in one-step chunks,
every draft scored, for the calibration ratios. Either way a table costs no compilation beyond the
generation's.

The Engine measures one at start-up for each new batch and prompt bucket, at the prompt's length;
`ddtree-bench --cost-table FILE` writes its table into a JSON file (one entry per batch; other
batches already in the file are kept) that `ddtree-generate --cost-table FILE` and
Engine.generate(cost_table=...) load. A file records the device and a fingerprint of the model,
its drafter, dtype and kernel routes; loading it elsewhere is an error. Format:

    {"format": "ddtree-cost-table/1", "device": "NVIDIA H200", "model": {"fingerprint": "...", ...},
     "tables": {"1": {"contexts": [140.0], "ms": {"ar": [0.27], "dflash": [0.46], "4": [...], ...},
                      "how": "...", "date": "..."}}}

ms[choice][k] is the step time at committed length contexts[k] (linear in between, flat beyond).
"ratios", "accepted" (optional): realised / predicted accepted tokens and accepted tokens per row
and step of each choice in the measurement's runs: a generation's first calibration and
expectation (choice.init_state). "call_ms" (optional, default 0): an advance call's cost beyond
its steps, the timings' intercept, which a probe chosen on the host pays; "starts" (optional):
each choice's own intercept.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import atomic
from ddtree_jax.speculative.choice import AR, AutoBudget, TableArrays

FORMAT = "ddtree-cost-table/1"
POINTS = 8  # contexts a table may hold: the loop state's arrays always have this many (one compiled shape)


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Step times (ms) of named choices ("ar", "dflash", budgets as text) at committed lengths."""

    batch: int
    contexts: tuple[float, ...]
    ms: dict  # choice name -> tuple of ms, one per context
    source: str  # how the table was obtained (measured at start-up, or the file it came from)
    # what the measurement's runs accepted, per choice name: realised / predicted accepted tokens,
    # and accepted draft tokens per row and step (a generation's first calibration and expectation)
    ratios: dict = dataclasses.field(default_factory=dict)
    accepted: dict = dataclasses.field(default_factory=dict)
    # ms an advance call costs beyond its steps (the timing's intercept; 0: not measured): what a
    # chunk chosen on the host pays once (choice.AutoBudget.decide_every)
    call_ms: float = 0.0
    # the auto program's form the times are of (AutoBudget.form; "": not recorded, an older file)
    program: str = ""
    # per choice name, ms a call of it costs beyond its steps (its own intercept: the call and, in
    # device chunks, the chunk's start); empty: not recorded
    starts: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not 1 <= len(self.contexts) <= POINTS:
            raise ValueError(f"a step-time table holds 1 to {POINTS} contexts, got {len(self.contexts)}")

    def arrays(self, auto: AutoBudget) -> TableArrays:
        """The loop state's arrays in auto.names order: ms [C, POINTS] (inf for choices not compiled,
        the last context repeated to POINTS), contexts [POINTS], ratios [C] and accepted [C] (-1 where
        none was measured). A compiled choice missing from the table is an
        error."""
        missing = [n for n, on in zip(auto.names, auto.enabled) if on and n not in self.ms]
        if missing:
            raise ValueError(f"the step-time table ({self.source}) has no times for {missing}; it has "
                             f"{sorted(self.ms, key=_order)}: measure one for these budgets")
        rows = [self.ms[n] if on else [np.inf] * len(self.contexts) for n, on in zip(auto.names, auto.enabled)]
        pad = POINTS - len(self.contexts)
        ms, ctx = np.asarray(rows, np.float32), np.asarray(self.contexts, np.float32)
        ratios = np.asarray([self.ratios.get(n, -1.0) for n in auto.names], np.float32)
        accepted = np.asarray([self.accepted.get(n, -1.0) for n in auto.names], np.float32)
        return TableArrays(np.pad(ms, ((0, 0), (0, pad)), mode="edge"), np.pad(ctx, (0, pad), mode="edge"), ratios,
                           accepted, np.float32(self.call_ms))

    def as_dict(self) -> dict:
        return {"batch": self.batch, "contexts": list(self.contexts), "ms": {k: list(v) for k, v in self.ms.items()},
                "ratios": dict(self.ratios), "accepted": dict(self.accepted), "call_ms": self.call_ms,
                "starts": dict(self.starts), "program": self.program, "source": self.source}


def _order(name: str):
    return (0, name) if not name.isdigit() else (1, int(name))


def placeholder(auto: AutoBudget):
    """Arrays of a table for a state whose choices are forced (the measurement itself)."""
    c = auto.size
    unknown = np.full((c,), -1.0, np.float32)
    return TableArrays(np.ones((c, POINTS), np.float32), np.zeros((POINTS,), np.float32), unknown, unknown,
                       np.float32(0))


def timing_defaults(steps: int | None = None, repeats: int | None = None) -> tuple[int, int]:
    """(steps, repeats) of a start-up measurement: those given, else this backend's. On an accelerator a step of the
    demo pair is ~0.3 ms and a call's timing jitters by ~0.1 ms, so calls of 8 / 16 steps left the
    step times ~5 % apart at random (budget 16 timed cheaper than 8), enough to pick 32 where 16
    was 12 % cheaper a step (decision 0048): 16 / 32 steps and 7 pairs cost ~1 s there. A CPU step
    is ~50x longer: 8 / 16 steps and 3 pairs keep its start-up in seconds."""
    d_steps, d_repeats = (8, 3) if jax.default_backend() == "cpu" else (16, 7)
    return steps or d_steps, repeats or d_repeats


def fingerprint(cfg, proposer, routes) -> dict:
    """What a step time depends on besides the device and batch: the target's and drafter's
    configurations (dtype included), the draft vocabulary, int8 and the kernel routes."""
    parts = (repr(cfg), repr(getattr(proposer, "cfg", None)), repr(getattr(proposer, "draft_vocab", 0)),
             repr(getattr(proposer, "int8", None)), repr(routes))
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return {"fingerprint": digest, "target": f"{cfg.model_type}, {len(cfg.layer_types)} layers, hidden "
            f"{cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.dtype}", "routes_impl": routes.impl}


def measure(advance: Callable, start_state, auto: AutoBudget, *, steps: int = 8, repeats: int = 3,
            batch: int | None = None, context: float | None = None, calibrate: bool = True) -> CostTable:
    """Time every compiled choice of `auto` from start_state (a prefilled LoopState of the auto
    program; never modified): advance(state, c, n) -> state runs up to n steps of choice c (its
    state has adapt.force = c; it may donate its input: each call gets a copy). Rows should not
    stop early (pass an EOS set nothing matches); steps actually run are counted, so a generation
    that ends early still yields a time. The
    forced runs' acceptance per choice comes with the table (`ratios`: realised / predicted,
    `accepted`: per row and step; the generations' first calibration and expectation). context:
    the table's committed length (default the mean over start_state's rows; a server whose state
    has idle slots gives its rows'). calibrate: False skips the calibration pass of device chunks (a
    caller that keeps no acceptance)."""
    if context is None:
        context = float(np.mean(np.asarray(start_state.cache.lengths)))
    i0 = int(start_state.i)

    real, pred, rows, scored = (np.zeros(auto.size) for _ in range(4))
    cal_real, cal_pred = np.zeros(auto.size), np.zeros(auto.size)  # the calibration pass's (device chunks)

    def run(c: int, n: int, force: int | None = None) -> tuple[float, int]:
        force = c if force is None else force
        st = jax.tree.map(jnp.copy, start_state._replace(adapt=start_state.adapt._replace(force=jnp.int32(force))))
        jax.block_until_ready(st)
        t0 = time.perf_counter()
        out = advance(st, c, n)
        ran = int(out.i)  # blocks until the call is done
        seconds = time.perf_counter() - t0
        if force != c:  # one-step chunks: every draft scored, each step a pair of E and accepted tokens
            cal_real[c] += float(out.adapt.sum_real[c])
            cal_pred[c] += float(out.adapt.sum_pred[c])
        else:
            real[c] += float(out.adapt.sum_real[c])
            pred[c] += float(out.adapt.sum_pred[c])
            rows[c] += float(out.adapt.n_rows[c])
            scored[c] += float(out.adapt.n_scored[c])
        return seconds, ran - i0

    choices = list(auto.choices)
    ms, starts, call_ms = _time_choices(run, auto, steps, repeats)
    how = (f"measured at start-up: each choice run for {steps} and {2 * steps} steps from the prefilled state, "
           f"median of {repeats} interleaved pairs")
    if not calibrate:  # the caller keeps no acceptance (a server's synthetic request): no calibration pass
        ratios = {}
    elif auto.device_chunks:
        # Every timing call scores one draft, the same one (the calls start from one state): a ratio
        # from it is that draft's luck (the H200 demo: 9.8 for DFlash, which then realised a quarter
        # of its calibrated E). So each draft choice runs once more in one-step chunks, every draft
        # scored, and the ratio is over those n drafts (decision 0048).
        for c in choices:
            if c != AR:
                run(c, steps, force=auto.size + c)
        ratios = {auto.names[c]: cal_real[c] / cal_pred[c] for c in choices if cal_pred[c] > 0}
        how += f"; calibration ratios over {steps} drafts each, in one-step chunks"
    else:  # realised over predicted accepted tokens per row-step, every draft scored
        ratios = {auto.names[c]: (real[c] / rows[c]) / (pred[c] / scored[c]) for c in choices if pred[c] > 0}
    accepted = {auto.names[c]: real[c] / rows[c] for c in choices if c != AR and rows[c] > 0}
    return CostTable(batch or int(start_state.bonus.shape[0]), (context,), ms, how, ratios, accepted, call_ms,
                     auto.form, starts)


def _time_choices(run: Callable, auto: AutoBudget, steps: int, repeats: int) -> tuple[dict, dict, float]:
    """(ms a step, each choice's intercept, the median intercept) of every compiled choice;
    run(c, n) -> (seconds, steps run, ...) runs up to n steps of choice c from the same state."""
    choices = list(auto.choices)
    for c in choices:  # warm-up: XLA's first run of each program / branch
        run(c, steps)
    per = {c: [] for c in choices}
    intercepts = {c: [] for c in choices}  # a call's cost beyond its steps: T(n) - n x the step time
    for _ in range(repeats):
        for c in choices:  # interleaved, so drifts of the machine hit every choice alike
            t1, n1 = run(c, steps)[:2]
            t2, n2 = run(c, 2 * steps)[:2]
            per[c].append(1000 * ((t2 - t1) / (n2 - n1) if n2 > n1 else t2 / max(n2, 1)))
            if n2 > n1:
                intercepts[c].append(1000 * t1 - n1 * per[c][-1])
    ms = {auto.names[c]: (max(statistics.median(v), 1e-6),) for c, v in per.items()}
    # each choice's own intercept: the call and, in device chunks, its chunk's start. Recorded, not
    # charged to the steps: on the H200 demo they spread by ~0.5 ms with no order among the choices
    # (decision 0048), noise that 1/n of would move a plain step's time by several per cent
    starts = {auto.names[c]: max(statistics.median(v), 0.0) for c, v in intercepts.items() if v}
    every = [x for v in intercepts.values() for x in v]
    return ms, starts, max(statistics.median(every), 0.0) if every else 0.0


def measure_programs(run: Callable, auto: AutoBudget, *, steps: int = 8, repeats: int = 3, batch: int,
                     context: float) -> CostTable:
    """The table for choosing once a generation (AutoBudget.per_generation): every compiled choice
    timed in its own fixed program. run(c, n) -> (seconds, steps run, accepted draft tokens, row-steps)
    runs up to n steps of choice c's program from its prefilled state (a copy each call); the
    acceptance per choice is over every timing run (`accepted`; no `ratios`: nothing is predicted)."""
    real, rows = np.zeros(auto.size), np.zeros(auto.size)

    def counted(c: int, n: int):
        seconds, ran, accepted, row_steps = run(c, n)
        real[c] += accepted
        rows[c] += row_steps
        return seconds, ran

    ms, starts, call_ms = _time_choices(counted, auto, steps, repeats)
    accepted = {auto.names[c]: real[c] / rows[c] for c in auto.choices if c != AR and rows[c] > 0}
    how = (f"measured at start-up: each choice's own program run for {steps} and {2 * steps} steps from the "
           f"prefilled state, median of {repeats} interleaved pairs; acceptance over those runs")
    return CostTable(batch, (context,), ms, how, {}, accepted, call_ms, auto.form, starts)


def load(path: str | os.PathLike, batch: int, *, device: str, model: dict, program: str | None = None) -> CostTable:
    """The table for `batch` in a file ddtree-bench wrote; every mismatch is a named error. program:
    the auto form it is for (AutoBudget.form): a table of another form's program is refused (a
    per-step program's step costs more than a chunk's), one that records none is taken."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"step-time table {path} does not exist (ddtree-bench --cost-table {path} writes one)")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"step-time table {path} is not readable JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a step-time table (expected format {FORMAT!r})")
    problems = []
    if doc.get("device") != device:
        problems.append(f"it was measured on {doc.get('device')!r}, this is {device!r}")
    theirs = (doc.get("model") or {}).get("fingerprint")
    if theirs != model["fingerprint"]:
        problems.append(f"it was measured for another model / drafter / dtype / routes ({(doc.get('model') or {})}; "
                        f"this is {model})")
    tables = doc.get("tables") or {}
    recorded = (tables.get(str(batch)) or {}).get("program")
    if program and recorded and recorded != program:
        problems.append(f"it was measured for auto {recorded}, this run is auto {program} (ddtree-bench with the same "
                        f"--decide-every / --decide-on writes one)")
    if str(batch) not in tables:
        problems.append(f"it has no table for batch {batch} (batches: {sorted(int(b) for b in tables)}); "
                        f"ddtree-bench --batch {batch} --cost-table {path} adds one")
    if problems:
        raise ValueError(f"step-time table {path} does not fit this run: " + "; ".join(problems))
    t = tables[str(batch)]
    contexts = tuple(float(x) for x in t["contexts"])
    ms = {k: tuple(float(x) for x in v) for k, v in t["ms"].items()}
    bad = [k for k, v in ms.items() if len(v) != len(contexts) or not all(x > 0 for x in v)]
    if not contexts or list(contexts) != sorted(contexts) or bad:
        raise ValueError(f"step-time table {path}, batch {batch}: contexts must ascend and every choice needs one "
                         f"positive time per context (bad: {bad})")
    ratios = {k: float(v) for k, v in (t.get("ratios") or {}).items()}
    accepted = {k: float(v) for k, v in (t.get("accepted") or {}).items()}
    call_ms = float(t.get("call_ms", 0.0))
    starts = {k: float(v) for k, v in (t.get("starts") or {}).items()}
    return CostTable(batch, contexts, ms, f"loaded from {path}", ratios, accepted, call_ms, t.get("program", ""),
                     starts)


def save(path: str | os.PathLike, table: CostTable, *, device: str, model: dict, extra: dict | None = None) -> None:
    """Write `table` into the file at `path` (atomically), keeping the file's tables of other
    batches when it was written for the same device and model (replacing it otherwise)."""
    path = os.fspath(path)
    doc = None
    if os.path.isfile(path):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError):
            doc = None
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("device") == device
            and (doc.get("model") or {}).get("fingerprint") == model["fingerprint"]):
        doc = {"format": FORMAT, "device": device, "model": model, "tables": {}}
    entry = {"contexts": list(table.contexts), "ms": {k: list(v) for k, v in table.ms.items()},
             "ratios": dict(table.ratios), "accepted": dict(table.accepted), "call_ms": table.call_ms,
             "starts": dict(table.starts), "program": table.program, "how": table.source,
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    doc["tables"][str(table.batch)] = entry | (extra or {})
    atomic.write_json(path, doc)
