"""GenSpec.loop_chunk / Routes.loop_chunk: the generation loop in unrolled chunks of a static step
count (one predicate read a chunk on a GPU) gives the single-step loop's generation exactly -
tokens, counts, per-row steps, the histogram, the step counter and the caches' lengths - for plain
decoding and DDTree, rows that stop at different steps, and `advance` called for a few steps at a
time (the stop inside a chunk); the routes' default applies unless a GenSpec sets its own; budget
"auto" runs single steps; bad values are refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.adaptive import AutoBudget
from ddtree_jax.speculative.sampling import Sampling
from tests.scripted_proposers import ScriptedProposer
from tests.hf_mamba_models import make_jax_target
from tests.tiny_models import ATTENTION_ONLY, HYBRID, HYBRID_MOE, NEXT_MOE, make_target

MODEL = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16), seed=21, base=HYBRID)
NEW = 12
MAX_NEW = (5, 12, 9)  # each row's own limit: the rows stop at different steps


def _setup():
    cfg, gd, params = MODEL
    rng = np.random.default_rng(3)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 6)), jnp.int32)
    lens = jnp.asarray([6, 4, 5], jnp.int32)
    ref = gen.generate(gd, params, prompt, lens, mode="ar", max_new_tokens=NEW)
    table = jnp.zeros((3, 32), jnp.int32)
    for r in range(3):
        n = int(lens[r])
        table = table.at[r, :n].set(prompt[r, :n]).at[r, n:n + NEW].set(ref.tokens[r])
    return cfg, gd, params, prompt, lens, table


def _run(mode, chunk, per_call):
    cfg, gd, params, prompt, lens, table = _setup()
    proposer = None if mode == "ar" else ScriptedProposer(4, cfg.vocab_size, 0.3, seed=5)
    spec = gen.GenSpec(mode, 8, None, NEW, Sampling(), 0, proposer, loop_chunk=chunk)
    rows = gen.uniform_rows(Sampling(), 3, NEW, jax.random.PRNGKey(0))._replace(max_new=jnp.asarray(MAX_NEW, jnp.int32))
    dparams = None if mode == "ar" else table
    s = gen.start(gd, params, dparams, prompt, lens, None, jax.random.PRNGKey(0), spec, rows=rows)
    calls = 0
    while not bool(np.asarray(s.done).all()):
        i0 = int(s.i)
        s = gen.advance(gd, params, dparams, s, None, jnp.int32(per_call), spec)
        assert int(s.i) - i0 <= per_call  # never past the stop
        calls += 1
        assert calls < 64
    return s


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
@pytest.mark.parametrize("per_call", [2**30, 4])
def test_chunked_loop_generates_what_the_single_step_loop_does(mode, per_call):
    want = _run(mode, 1, per_call)
    got = _run(mode, 3, per_call)
    for field in ("out", "n_out", "steps", "hist", "i", "done"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), err_msg=field)
    np.testing.assert_array_equal(np.asarray(got.cache.lengths), np.asarray(want.cache.lengths))
    assert list(np.asarray(got.n_out)) == list(MAX_NEW)


def test_chunked_loop_has_a_static_inner_loop():
    cfg, gd, params, prompt, lens, _ = _setup()
    spec = gen.GenSpec("ar", 1, None, NEW, Sampling(), 0, None, loop_chunk=4)
    s = gen.start(gd, params, None, prompt, lens, None, jax.random.PRNGKey(0), spec)
    text = str(jax.make_jaxpr(lambda st: gen._advance_from(gd, params, None, st, None, jnp.int32(8), spec))(s))
    assert "length=4" in text and "unroll=4" in text  # lax.fori_loop of static bounds, unrolled: 4 steps a chunk


def test_the_chunk_comes_from_the_routes_unless_set():
    from ddtree_jax.routes import REFERENCE, Routes

    cfg = MODEL[0]
    assert Routes.resolve(platform="gpu").loop_chunk == 2 and Routes.resolve(platform="cpu").loop_chunk == 1
    fixed = gen.GenSpec("ar", 1, None, NEW, Sampling(), 0, None, routes=REFERENCE.replace(loop_chunk=3))
    assert fixed.chunk == 3 and dataclasses.replace(fixed, loop_chunk=1).chunk == 1
    auto = gen.GenSpec("ddtree", AutoBudget(budgets=(4, 8)), None, NEW, Sampling(), 0,
                       ScriptedProposer(4, cfg.vocab_size, 0.3, seed=5), routes=REFERENCE.replace(loop_chunk=3))
    auto.validate(cfg.vocab_size)  # the routes' default is no request: "auto" runs single steps
    assert auto.chunk == 1
    with pytest.raises(ValueError, match="loop_chunk must be >= 1"):
        REFERENCE.replace(loop_chunk=0)


def test_a_routes_chunk_generates_what_single_steps_do():
    from ddtree_jax.routes import REFERENCE

    cfg, gd, params, prompt, lens, _ = _setup()
    outs = []
    for chunk in (1, 2):
        spec = gen.GenSpec("ar", 1, None, NEW, Sampling(), 0, None, routes=REFERENCE.replace(loop_chunk=chunk))
        rows = gen.uniform_rows(Sampling(), 3, NEW, jax.random.PRNGKey(0))._replace(
            max_new=jnp.asarray(MAX_NEW, jnp.int32))
        s = gen.start(gd, params, None, prompt, lens, None, jax.random.PRNGKey(0), spec, rows=rows)
        outs.append(gen.advance(gd, params, None, s, None, jnp.int32(7), spec))  # a stop inside a chunk
    for field in ("out", "n_out", "steps", "i", "done"):
        np.testing.assert_array_equal(np.asarray(getattr(outs[1], field)), np.asarray(getattr(outs[0], field)),
                                      err_msg=field)


def test_bad_loop_chunks_are_refused():
    cfg = MODEL[0]
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="loop_chunk must be a positive integer"):
            gen.GenSpec("ar", 1, None, NEW, Sampling(), 0, None, loop_chunk=bad).validate(cfg.vocab_size)
    auto = gen.GenSpec("ddtree", AutoBudget(budgets=(4, 8)), None, NEW, Sampling(), 0,
                       ScriptedProposer(4, cfg.vocab_size, 0.3, seed=5), loop_chunk=2)
    with pytest.raises(ValueError, match="loop_chunk = 2 is for fixed budgets"):
        auto.validate(cfg.vocab_size)
    assert dataclasses.replace(auto, loop_chunk=1).validate(cfg.vocab_size) is None


def test_an_engine_on_gpu_routes_runs_fixed_budgets_in_pairs():
    from ddtree_jax.cli.common import load_engine
    from ddtree_jax.engine import Engine
    from ddtree_jax.routes import Routes

    demo = load_engine(None, None)
    eng = Engine(demo.cfg, demo.graphdef, demo.params, proposer=demo.proposer, drafter_params=demo.drafter_params,
                 routes=Routes.resolve(platform="gpu"))
    kw = dict(candidates=None, max_new_tokens=NEW, sampling=Sampling(), prompt_bucket=16)
    assert eng.spec("ar", budget=1, **kw).chunk == 2
    assert eng.spec("ddtree", budget=8, **kw).chunk == 2
    assert eng.spec("ddtree", budget="auto", **kw).chunk == 1
    assert demo.spec("ddtree", budget=8, **kw).chunk == 1  # this CPU's routes


FAMILIES = {
    "qwen3": lambda: make_target(seed=2, base=ATTENTION_ONLY),
    "qwen3_5_moe": lambda: make_target(seed=3, base=HYBRID_MOE),
    "qwen3_next_moe": lambda: make_target(seed=4, base=NEXT_MOE),
    "nemotron_h": lambda: make_jax_target("nemotron_h", seed=5),
    "bamba": lambda: make_jax_target("bamba", seed=6),
    "mamba2": lambda: make_jax_target("mamba2", seed=7),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pairs_generate_what_single_steps_do_on_every_family(family):
    """The GPU's default (Routes.loop_chunk 2) against single steps on a tiny target of each family:
    DDTree (a scripted drafter, rows stopping at different steps) and plain decoding, one call."""
    from ddtree_jax.routes import REFERENCE

    cfg, gd, params = FAMILIES[family]()
    rng = np.random.default_rng(11)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    lens = jnp.asarray([5, 3], jnp.int32)
    for mode in ("ar", "ddtree"):
        proposer = None if mode == "ar" else ScriptedProposer(4, cfg.vocab_size, 0.3, seed=5)
        table = None if mode == "ar" else jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 32)), jnp.int32)
        outs = []
        for chunk in (1, 2):
            spec = gen.GenSpec(mode, 6, None, 9, Sampling(), 0, proposer, routes=REFERENCE.replace(loop_chunk=chunk))
            rows = gen.uniform_rows(Sampling(), 2, 9, jax.random.PRNGKey(0))._replace(
                max_new=jnp.asarray([9, 6], jnp.int32))
            s = gen.start(gd, params, table, prompt, lens, None, jax.random.PRNGKey(0), spec, rows=rows)
            outs.append(gen.advance(gd, params, table, s, None, jnp.int32(2**30), spec))
        for field in ("out", "n_out", "steps", "hist", "i"):
            np.testing.assert_array_equal(np.asarray(getattr(outs[1], field)), np.asarray(getattr(outs[0], field)),
                                          err_msg=f"{mode} {field}")
