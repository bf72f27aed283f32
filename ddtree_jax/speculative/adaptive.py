"""budget="auto": each step's draft chosen on device for the most tokens per second.

One loop step (generate._step hands over here when GenSpec.budget is a choice.AutoBudget):

    if choice.draft_next(...):             # before any draft: from earlier steps' calibrated E
        logq = propose(...)                 # the drafter, once
        select the `Bmax` best prefixes with their scores (build.tree_candidates)
        E of the chain and of every compiled budget (expected.py); calibrate; choose (choice.py)
        lax.switch over the compiled choices: DFlash chain | tree of budget b (build.tree_from_candidates)
            each branch = the fixed-budget step's verify and commit at that shape
        learn from the accepted count (choice.after_spec)
    else:
        a burst of up to `ar_burst` plain decoding steps, keeping the target features the drafter
        reads; then one drafter extend with all of them (its context stays in step with the
        committed tokens at every step boundary where a draft can happen)

With device chunks (AutoBudget.decide_every n > 1, decide_on "device") the choice is made once a
chunk of up to n steps:

    if the last call cut a chunk short: its choice and steps left (AdaptiveState.plan), unscored
    elif choice.draft_next(...):
        logq = propose(...); Bmax selection; E of every choice; choose c      # scored, not verified
    else:
        plain steps
    lax.switch: a burst of up to max(n, ar_burst) plain steps, or up to n steps of c's
        fixed-budget step (the first verifies the draft just scored: the drafter is
        deterministic in the state)
    learn from that first step's accepted count (choice.after_spec)

so the conditionals, the Bmax selection and the learning are paid once a chunk (plus one drafter
pass), and the other steps cost what `--budget b` costs. A chunk whose draft runs to learn (the
first, or a probe among plain chunks) is one step. A chunk goes on across advance calls, so a
streamed generation (a call every few steps) keeps its chunks.

Output is lossless whatever is chosen: every branch is a valid draft tree (greedy output equals
plain decoding, sampling keeps the target's distribution; the choice depends only on the past and
the drafter's output, never on this step's target samples). No host round trip: the choice, the
calibration and the statistics live in LoopState.adapt (choice.AdaptiveState).

The phase functions come from generate.py as `Phases` (generate imports this module, not the
other way around).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from ddtree_jax.speculative import choice
from ddtree_jax.speculative.build import tree_candidates, tree_from_candidates
from ddtree_jax.speculative.choice import DFLASH, FIRST_TREE, AutoBudget
from ddtree_jax.speculative.expected import chain_expectation, tree_expectations


class Phases(NamedTuple):
    """The generation step's parts (speculative/generate.py), as the adaptive step calls them."""

    propose: Callable
    vocab_ids: Callable
    build: Callable
    verify: Callable
    commit_and_emit: Callable
    ar_step: Callable  # (model, s, eos_ids, spec, hidden_ids) -> (state, n_new, features)
    count_step: Callable  # (s, new, n_new, spec) -> new with steps / hist / i advanced


def init(auto: AutoBudget, batch: int, spec, costs) -> choice.AdaptiveState:
    """The loop state's adaptive part; costs: a choice.TableArrays in auto.names order
    (cost_table.CostTable.arrays)."""
    if costs is None:
        raise ValueError("budget='auto' needs a step-time table: cost_table.CostTable.arrays(...), measured at "
                         "start-up (Engine does) or loaded from a file `ddtree-bench --cost-table` wrote")
    return choice.init_state(auto, batch, spec.max_new_tokens, choice.TableArrays(*costs))


def _fixed(spec, **changes):
    """The fixed-budget GenSpec whose verify / commit a branch runs."""
    return dataclasses.replace(spec, **changes)


def _left(s, spec):
    """[B] tokens each row still has to generate (0: done)."""
    return jnp.where(s.done, 0, jnp.minimum(s.rows.max_new, spec.max_new_tokens) - s.n_out)


def _score(model, dparams, s, spec, phases: Phases, left, costs):
    """This step's draft scored: (the Bmax best prefixes, raw E [B, C] of every choice, the
    policy's choice, calibrated E)."""
    auto: AutoBudget = spec.adaptive
    logq = phases.propose(model, dparams, s, spec)
    cands = tree_candidates(logq, auto.budgets[-1], spec.candidates, spec.routes)
    b = logq.shape[0]
    e_raw = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), chain_expectation(cands.best)[:, None],
                             tree_expectations(cands, auto.budgets)], axis=1)  # [B, C]
    c, e_cal = choice.choose(auto, s.adapt, e_raw, left, costs)
    return logq, cands, e_raw, c, e_cal


def _spec_step(model, dparams, s, eos_ids, spec, phases: Phases, costs):
    """A speculative step that scores its draft, chooses, verifies the choice and learns (the
    per-step program; with `run`, the host's program of one choice). Returns (state, choice)."""
    auto: AutoBudget = spec.adaptive
    left = _left(s, spec)
    logq, cands, e_raw, c, e_cal = _score(model, dparams, s, spec, phases, left, costs)
    ids = phases.vocab_ids(spec, dparams)

    def run(fixed, tree_fn):
        def branch(st):
            tree = tree_fn(st)
            res = phases.verify(model, st, tree, fixed)
            new, n_new = phases.commit_and_emit(model, dparams, st, tree, res, eos_ids, fixed)
            return new, n_new, res.count - 1
        return branch

    branches, index = [], [0] * auto.size  # index[c]: the branch of choice c
    if auto.dflash:
        chain = _fixed(spec, mode="dflash", budget=1)
        index[DFLASH] = len(branches)
        branches.append(run(chain, lambda st: phases.build(logq, st, chain, ids)))
    for j, budget in enumerate(auto.budgets):
        index[FIRST_TREE + j] = len(branches)
        branches.append(run(_fixed(spec, budget=budget), lambda st, budget=budget: tree_from_candidates(
            cands, budget, st.bonus, st.cache.lengths, spec.routes, ids)))
    if auto.run >= 0:  # this program runs one choice: no switch (AutoBudget.host_decides)
        c = jnp.int32(auto.run)
        new, n_new, accepted = branches[index[auto.run]](s)
    else:
        new, n_new, accepted = jax.lax.switch(jnp.asarray(index, jnp.int32)[c], branches, s)
    adapt = choice.after_spec(auto, s.adapt, c, e_raw, e_cal, accepted, left, s.i, costs)
    return phases.count_step(s, new._replace(adapt=adapt), n_new, spec), c


def _fixed_of(spec, c: int):
    """The fixed GenSpec of speculative choice c: the DFlash chain or the tree of one budget."""
    if c == DFLASH:
        return _fixed(spec, mode="dflash", budget=1)
    return _fixed(spec, budget=spec.adaptive.budgets[c - FIRST_TREE])


def _lean_steps(model, dparams, s, eos_ids, spec, phases: Phases, c: int, steps, stop_at):
    """A device chunk's steps (AutoBudget.device_chunks) of the speculative choice c its deciding
    draft chose: up to `steps` steps of c's fixed-budget step (the same as `--budget b`'s: no
    conditional, no selection of Bmax prefixes, no learning), each counted in the choice
    statistics. Returns (state, [B] draft tokens the first step accepted: what the choice learns)."""
    fixed = _fixed_of(spec, c)
    ids = phases.vocab_ids(spec, dparams)
    end = jnp.minimum(stop_at, s.i + steps)

    def body(carry):
        st, first = carry
        tree = phases.build(phases.propose(model, dparams, st, fixed), st, fixed, ids)
        res = phases.verify(model, st, tree, fixed)
        new, n_new = phases.commit_and_emit(model, dparams, st, tree, res, eos_ids, fixed)
        first = jnp.where(st.i == s.i, res.count - 1, first)
        adapt = choice.after_lean(st.adapt, c, st.i, res.count - 1, _left(st, spec))
        return phases.count_step(st, new._replace(adapt=adapt), n_new, fixed), first

    more = lambda carry: ~jnp.all(carry[0].done) & (carry[0].i < end)
    return jax.lax.while_loop(more, body, (s, jnp.zeros(s.bonus.shape, jnp.int32)))


def _device_chunk(model, dparams, s, eos_ids, spec, phases: Phases, costs, stop_at):
    """One device chunk (AutoBudget.device_chunks), or the rest of one an advance call's end cut
    short (AdaptiveState.plan = [choice, steps left]: streaming calls continue it, unscored).

    A fresh chunk scores its draft (the Bmax selection, E of every choice) and chooses, or, where
    plain steps are predicted better (choice.draft_next), is a plain burst. One lax.switch then
    runs the choice: a plain burst, or the chosen draft's fixed-budget loop, whose first step
    verifies the scored draft (the drafter is deterministic in the state); the policy learns from
    that first step. A chunk whose draft runs to learn (choice.learning_draft: nothing learned
    yet, or a probe among plain chunks) is one step: the next decision then sees what it taught."""
    auto: AutoBudget = spec.adaptive
    left = _left(s, spec)
    b = s.bonus.shape[0]
    none = jnp.zeros((b, auto.size), jnp.float32)

    def resume(st):
        return st.adapt.plan[0], st.adapt.plan[1], none, none, jnp.bool_(False)

    def score(st):
        _, _, e_raw, c, e_cal = _score(model, dparams, st, spec, phases, left, costs)
        learning = (choice.learning_draft(auto, st.adapt, left, costs) & (st.adapt.force < 0)) | (
            st.adapt.force >= auto.size)  # a calibration pass: every draft scored
        steps = jnp.where(learning, 1, auto.decide_every).astype(jnp.int32)
        return c.astype(jnp.int32), steps, e_raw, e_cal.astype(jnp.float32), jnp.bool_(True)

    def plain(st):
        return jnp.int32(choice.AR), jnp.int32(auto.burst), none, none, jnp.bool_(False)

    # one conditional picks the chunk's head (a host-read predicate each on a GPU, decision 0048)
    resuming = s.adapt.plan[1] > 0
    if auto.ar:
        head = jnp.where(resuming, 0, jnp.where(choice.draft_next(auto, s.adapt, left, costs), 1, 2))
        c, steps, e_raw, e_cal, learn = jax.lax.switch(head, [resume, score, plain], s)
    else:
        c, steps, e_raw, e_cal, learn = jax.lax.cond(resuming, resume, score, s)
    index, branches = [0] * auto.size, []
    if auto.ar:
        branches.append(lambda st: (_ar_burst(model, dparams, st, eos_ids, spec, phases, stop_at, steps),
                                    jnp.zeros((b,), jnp.int32)))
    for k in auto.choices:
        if k != choice.AR:
            index[k] = len(branches)
            branches.append(lambda st, k=k: _lean_steps(model, dparams, st, eos_ids, spec, phases, k, steps, stop_at))
    new, first = jax.lax.switch(jnp.asarray(index, jnp.int32)[c], branches, s)
    learned = choice.after_spec(auto, new.adapt, c, e_raw, e_cal, first, left, s.i, costs, counted=True)
    adapt = jax.tree.map(lambda x, y: jnp.where(learn, x, y), learned, new.adapt)
    rest = jnp.where(jnp.all(new.done), 0, jnp.maximum(steps - (new.i - s.i), 0))
    return new._replace(adapt=adapt._replace(plan=jnp.stack([c, rest]).astype(jnp.int32)))


def _ar_burst(model, dparams, s, eos_ids, spec, phases: Phases, stop_at, limit=None):
    """Up to AutoBudget.burst plain steps (or `limit` <= that, traced: the rest of a device chunk;
    fewer when every row stops or the advance call's step budget ends), then the drafter's
    catch-up on their target features."""
    auto: AutoBudget = spec.adaptive
    hidden = spec.proposer.hidden_ids
    n = auto.burst
    b = s.bonus.shape[0]
    feats = None
    if hidden:  # the drafter reads target features: keep each step's in a [B, n, F] buffer
        shape = jax.eval_shape(lambda: model(s.bonus[:, None], s.cache, jnp.ones((b,), jnp.int32), chunked=False,
                                             hidden_ids=hidden, routes=spec.routes))[1]
        feats = jnp.zeros((b, n, shape.shape[-1]), shape.dtype)

    def body(carry):
        st, buf, j, committed = carry
        active = ~st.done
        new, n_new, f = phases.ar_step(model, st, eos_ids, spec, hidden)
        if buf is not None:
            buf = jax.lax.dynamic_update_slice_in_dim(buf, f.astype(buf.dtype), j, axis=1)
        new = new._replace(adapt=choice.after_ar(st.adapt, _left(st, spec), st.i))
        return phases.count_step(st, new, n_new, spec), buf, j + 1, committed + active.astype(jnp.int32)

    def more(carry):
        st, _, j, _ = carry
        return (j < (n if limit is None else limit)) & ~jnp.all(st.done) & (st.i < stop_at)

    st, feats, _, committed = jax.lax.while_loop(more, body, (s, feats, jnp.int32(0), jnp.zeros((b,), jnp.int32)))
    dstate = spec.proposer.extend(dparams, st.dstate, feats, committed, routes=spec.routes)
    return st._replace(dstate=dstate)


def with_plan(s, spec):
    """s with its adaptive state's plan for the next chunk (choice.plan), as an advance call ends."""
    auto: AutoBudget = spec.adaptive
    left = _left(s, spec)
    costs = choice.step_costs(auto, s.adapt, choice.mean_context(s.cache.lengths, left))
    return s._replace(adapt=s.adapt._replace(plan=choice.plan(auto, s.adapt, left, costs)))


def step(model, dparams, s, eos_ids, spec, phases: Phases, stop_at):
    """One step of the adaptive loop (a speculative step, or a burst of plain steps), or with
    device chunks one chunk (a deciding step and its choice's fixed-budget steps, or a burst)."""
    auto: AutoBudget = spec.adaptive
    left = _left(s, spec)
    costs = choice.step_costs(auto, s.adapt, choice.mean_context(s.cache.lengths, left))
    if auto.device_chunks:
        return _device_chunk(model, dparams, s, eos_ids, spec, phases, costs, stop_at)
    spec_step = lambda st: _spec_step(model, dparams, st, eos_ids, spec, phases, costs)[0]
    if auto.run > choice.AR or not auto.ar:
        return spec_step(s)
    if auto.run == choice.AR:
        return _ar_burst(model, dparams, s, eos_ids, spec, phases, stop_at)
    return jax.lax.cond(choice.draft_next(auto, s.adapt, left, costs), spec_step,
                        lambda st: _ar_burst(model, dparams, st, eos_ids, spec, phases, stop_at), s)
