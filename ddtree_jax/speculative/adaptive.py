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

    if choice.draft_next(...):
        logq = propose(...); Bmax selection; E of every choice; choose c      # scored, not verified
        lax.switch over the speculative choices: up to n steps of c's fixed-budget step (the
            first verifies the draft just scored: the drafter is deterministic in the state)
        learn from the first step's accepted count (choice.after_spec)
    else:
        a burst of up to max(n, ar_burst) plain steps

so the conditionals, the Bmax selection and the learning are paid once a chunk (plus one drafter
pass), and the other steps cost what `--budget b` costs. A chunk whose draft runs to learn (the
first, or a probe among plain chunks) is one step.

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


def _spec_step(model, dparams, s, eos_ids, spec, phases: Phases, costs):
    auto: AutoBudget = spec.adaptive
    left = _left(s, spec)
    logq = phases.propose(model, dparams, s, spec)
    ids = phases.vocab_ids(spec, dparams)
    cands = tree_candidates(logq, auto.budgets[-1], spec.candidates, spec.routes)
    b = logq.shape[0]
    e_raw = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), chain_expectation(cands.best)[:, None],
                             tree_expectations(cands, auto.budgets)], axis=1)  # [B, C]
    c, e_cal = choice.choose(auto, s.adapt, e_raw, left, costs)

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
        return phases.count_step(st, new._replace(adapt=choice.after_lean(st.adapt, c, st.i)), n_new, fixed), first

    more = lambda carry: ~jnp.all(carry[0].done) & (carry[0].i < end)
    return jax.lax.while_loop(more, body, (s, jnp.zeros(s.bonus.shape, jnp.int32)))


def _spec_chunk(model, dparams, s, eos_ids, spec, phases: Phases, costs, stop_at):
    """A speculative step that chooses and learns, or with device chunks a chunk of speculative
    steps: the chunk's draft is scored (the Bmax selection, E of every choice) and chosen from,
    then lax.switch runs the chosen draft's fixed-budget loop, whose first step verifies that
    same draft (the drafter is deterministic in the state), and the policy learns from that first
    step. A chunk whose draft runs to learn (choice.learning_draft: nothing learned yet, or a
    probe among plain chunks) is one step: the next decision then sees what it taught."""
    auto: AutoBudget = spec.adaptive
    if not auto.device_chunks:
        return _spec_step(model, dparams, s, eos_ids, spec, phases, costs)[0]
    left = _left(s, spec)
    logq = phases.propose(model, dparams, s, spec)
    cands = tree_candidates(logq, auto.budgets[-1], spec.candidates, spec.routes)
    b = logq.shape[0]
    e_raw = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), chain_expectation(cands.best)[:, None],
                             tree_expectations(cands, auto.budgets)], axis=1)  # [B, C]
    c, e_cal = choice.choose(auto, s.adapt, e_raw, left, costs)
    steps = jnp.where(choice.learning_draft(auto, s.adapt, left, costs) & (s.adapt.force < 0), 1, auto.decide_every)
    spec_choices = [k for k in auto.choices if k != choice.AR]
    index = [0] * auto.size
    for j, k in enumerate(spec_choices):
        index[k] = j
    branches = [lambda st, k=k: _lean_steps(model, dparams, st, eos_ids, spec, phases, k, steps, stop_at)
                for k in spec_choices]
    new, first = jax.lax.switch(jnp.asarray(index, jnp.int32)[c], branches, s)
    adapt = choice.after_spec(auto, new.adapt, c, e_raw, e_cal, first, left, s.i, costs, counted=True)
    return new._replace(adapt=adapt)


def _ar_burst(model, dparams, s, eos_ids, spec, phases: Phases, stop_at):
    """Up to AutoBudget.burst plain steps (fewer when every row stops or the advance call's step
    budget ends), then the drafter's catch-up on their target features."""
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
        return (j < n) & ~jnp.all(st.done) & (st.i < stop_at)

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
    spec_step = lambda st: _spec_chunk(model, dparams, st, eos_ids, spec, phases, costs, stop_at)
    if auto.run > choice.AR or not auto.ar:
        return spec_step(s)
    if auto.run == choice.AR:
        return _ar_burst(model, dparams, s, eos_ids, spec, phases, stop_at)
    return jax.lax.cond(choice.draft_next(auto, s.adapt, left, costs), spec_step,
                        lambda st: _ar_burst(model, dparams, st, eos_ids, spec, phases, stop_at), s)
