"""budget="auto" end to end: lossless on every target family, whatever the policy chooses and with
every choice forced (one compiled program: the choice and the cost table are data), the drafter's
context in step after plain bursts, the choice following the cost table, the calibration
converging on a scripted proposer of known acceptance, sampling exact at temperature 1, one
device loop with no host callback, and the Engine / CLI surface (start-up and file tables,
statistics in --json, ddtree-bench's table and plot)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import decode
from ddtree_jax.cache import init_target_cache
from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.choice import AR, DFLASH, FIRST_TREE, AutoBudget, TableArrays, summary
from ddtree_jax.speculative.sampling import Sampling
from tests.hf_mamba_models import make_jax_target
from tests.scripted_proposers import RecordingProposer, ScriptedProposer
from tests.tiny_models import ATTENTION_ONLY, HYBRID, make_target

B, T, NEW, BLOCK = 2, 12, 128, 6
# chosen every step (device chunks: tests/test_adaptive_chunks.py)
AUTO = AutoBudget(budgets=(3, 8), ar_burst=3, probe_wait=(4, 8), decide_every=0)
CHOICES = (AR, DFLASH, FIRST_TREE, FIRST_TREE + 1)
MIXED = [1.0, 2.6, 2.7, 3.4]  # ms of ar, dflash, 3, 8: speculative steps win by a little
MODELS = {
    "qwen3_5": lambda: make_target(HYBRID, seed=3),
    "qwen3": lambda: make_target(ATTENTION_ONLY, seed=4),
    "nemotron_h": lambda: make_jax_target("nemotron_h", seed=5),
    "bamba": lambda: make_jax_target("bamba", seed=6),
}
_CACHE = {}


def costs(ms):
    """A step-time table's loop-state arrays: ms per choice at one context, no measured acceptance."""
    n = len(ms)
    return TableArrays(np.asarray(ms, np.float32)[:, None], np.zeros((1,), np.float32), np.full(n, -1.0, np.float32),
                       np.full(n, -1.0, np.float32))


def setup(name):
    """(model, prompts, greedy reference, the oracle's table of absolute positions)."""
    if name not in _CACHE:
        cfg, gd, params = MODELS[name]()
        rng = np.random.default_rng(0)
        prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
        lens = jnp.asarray([T, T - 5], jnp.int32)
        ref = gen.generate(gd, params, prompt, lens, mode="ar", max_new_tokens=NEW + BLOCK + 2)
        table = np.zeros((B, T + NEW + 2 * BLOCK + 4), np.int32)
        for b in range(B):
            n = int(lens[b])
            table[b, :n] = np.asarray(prompt[b, :n])
            table[b, n: n + ref.tokens.shape[1]] = np.asarray(ref.tokens[b])
        _CACHE[name] = (cfg, gd, params, prompt, lens, np.asarray(ref.tokens[:, :NEW]), jnp.asarray(table))
    return _CACHE[name]


def oracle(cfg):
    """The scripted oracle with errors (each depth wrong with probability 0.2), recording the
    features it is given; one object per config, so tests share the compiled program."""
    return RecordingProposer(ScriptedProposer(BLOCK, cfg.vocab_size, 0.2, seed=11), feature_dim=2 * cfg.hidden_size)


def run_auto(gd, params, prompt, lens, proposer, dparams, ms, force=-1, auto=AUTO, new=NEW, sampling=Sampling(),
             key=0):
    """An auto generation through start / advance (force >= 0: that choice every step)."""
    spec = gen.GenSpec("ddtree", auto, None, new, sampling, 0, proposer)
    s = gen.start(gd, params, dparams, prompt, lens, None, jax.random.PRNGKey(key), spec, costs=costs(ms))
    s = s._replace(adapt=s.adapt._replace(force=jnp.int32(force)))
    return gen.advance(gd, params, dparams, s, None, jnp.int32(2**30), spec)


def check_features(name, proposer, res, table):
    """Every committed position's recorded target features are the features of the committed token
    there (speculative steps and plain bursts alike), none past the committed length."""
    cfg, gd, params, *_ = setup(name)
    lengths = np.asarray(res.cache.lengths)
    np.testing.assert_array_equal(np.asarray(res.dstate.inner.lengths), lengths)
    recorded = np.asarray(res.dstate.features)
    for b in range(B):
        committed = jnp.asarray(table[b, : lengths[b]])[None]
        pre = decode.prefill(gd, params, init_target_cache(cfg, 1, 256), committed, jnp.asarray([lengths[b]]),
                             hidden_ids=proposer.hidden_ids, all_logits=True)
        np.testing.assert_allclose(recorded[b, : lengths[b]], pre.features[0], atol=2e-5, rtol=1e-5)
        assert not np.any(recorded[b, lengths[b]:])


@pytest.mark.parametrize("name", ["qwen3_5", pytest.param("qwen3", marks=pytest.mark.slow),
                                  pytest.param("nemotron_h", marks=pytest.mark.slow),
                                  pytest.param("bamba", marks=pytest.mark.slow)])
def test_greedy_auto_equals_plain_decoding(name):
    """The scripted oracle with errors (long accepts and rejects at every depth): the policy's own
    choices and every choice forced for the whole generation give plain greedy decoding's tokens;
    the drafter saw the committed tokens' features at every position (plain bursts included)."""
    cfg, gd, params, prompt, lens, ref, table = setup(name)
    proposer = oracle(cfg)
    used = set()
    for force in (-1,) + CHOICES:
        res = run_auto(gd, params, prompt, lens, proposer, table, MIXED, force)
        np.testing.assert_array_equal(np.asarray(res.out), ref, err_msg=f"force {force}")
        check_features(name, proposer, res, table)
        s = summary(AUTO, res.adapt)
        used |= set(s["choices"])
        assert sum(s["choices"].values()) == int(res.steps.max())  # every step counted once
        if force >= 0:
            assert set(s["choices"]) == {AUTO.names[force]}
    assert used == set(AUTO.names)


@pytest.mark.slow
def test_real_dflash_drafter_auto_is_lossless():
    """The random-weight DFlash drafter (features of two target layers) on the hybrid target:
    greedy auto == plain decoding, its context length == the target's after plain bursts too."""
    from tests.test_dflash_generate import drafter_for

    cfg, gd, params, prompt, lens, ref, _ = setup("qwen3_5")
    proposer, dparams = drafter_for(cfg)
    for force in (-1, AR):
        res = run_auto(gd, params, prompt, lens, proposer, dparams, MIXED, force)
        np.testing.assert_array_equal(np.asarray(res.out), ref)
        np.testing.assert_array_equal(np.asarray(res.dstate.lengths), np.asarray(res.cache.lengths))


def test_choice_follows_the_cost_table_and_calibration_converges():
    """The same compiled program under three tables: cheap plain steps -> plain steps but for
    the probes; cheap big trees -> budget 8 at every speculative step; cheap DFlash -> the chain,
    whose calibrated prediction then matches the realised acceptance, which matches the scripted
    drafter's known rate: each depth right with probability 0.8, so E[accepted] = sum 0.8^d."""
    cfg, gd, params, prompt, lens, ref, table = setup("qwen3_5")
    proposer = oracle(cfg)
    s = summary(AUTO, run_auto(gd, params, prompt, lens, proposer, table, [0.2, 5, 5, 5]).adapt)
    assert s["choices"]["ar"] >= 0.8 * sum(s["choices"].values())
    s = summary(AUTO, run_auto(gd, params, prompt, lens, proposer, table, [9, 5, 5, 1]).adapt)
    assert set(s["choices"]) == {"8"}
    res = run_auto(gd, params, prompt, lens, proposer, table, [9, 1, 5, 5])
    s = summary(AUTO, res.adapt)
    assert set(s["choices"]) == {"dflash"}
    acc = s["acceptance"]["dflash"]
    known = sum(0.8 ** d for d in range(1, BLOCK))
    assert abs(acc["realised"] - known) < 0.3, acc
    assert abs(acc["calibrated"] - acc["realised"]) < 0.15 * acc["realised"], acc
    assert acc["predicted"] > acc["realised"] + 1  # the raw drafter is overconfident: calibration mattered


def test_one_device_loop_and_chunked_advance():
    """No host callback in the auto loop; streaming in chunks of steps reuses one compilation and
    a plain burst ends where the chunk's step budget ends."""
    cfg, gd, params, prompt, lens, ref, table = setup("qwen3_5")
    proposer = oracle(cfg)
    spec = gen.GenSpec("ddtree", AUTO, None, NEW, Sampling(), 0, proposer)
    text = str(jax.make_jaxpr(lambda p: gen.generate(gd, params, p, lens, proposer=proposer, drafter_params=table,
                                                     budget=AUTO, max_new_tokens=NEW, costs=costs(MIXED)))(prompt))
    assert "while[" in text and "cond[" in text and "callback" not in text
    state = gen.start(gd, params, table, prompt, lens, None, jax.random.PRNGKey(0), spec, costs=costs([0.2, 5, 5, 5]))
    before = gen.advance._cache_size()
    seen = []
    for steps in (1, 2, 5, 1000):  # cheap plain steps: bursts of 3 after the first draft
        state = gen.advance(gd, params, table, state, None, jnp.int32(steps), spec)
        seen.append(int(state.i))
    assert gen.advance._cache_size() <= before + 1
    assert seen[:3] == [1, 3, 8]
    np.testing.assert_array_equal(np.asarray(state.out), ref)


@pytest.mark.parametrize("decide_every", [0, pytest.param(2, marks=pytest.mark.slow)])  # 2: ~25 s more
def test_sampling_at_temperature_1_is_exact(decide_every):
    """Sampled sequences follow the target's exact distribution at temperature 1 (tests/
    test_sampling.py's chi-square machinery) when speculative and plain steps mix in a sequence
    (cheap plain steps after the first draft) and when trees run every step; chosen every step
    and in device chunks (scored steps and fixed-budget steps mixed)."""
    from tests.test_sampling import MODEL, NEW as S_NEW, PROMPT, SAMPLES, V, chi2, exact_distribution

    sampling = Sampling(temperature=1.0)
    exact = exact_distribution(sampling)
    cfg, gd, params = MODEL
    auto = AutoBudget(budgets=(5,), ar_burst=2, decide_every=decide_every)
    proposer = ScriptedProposer(3, V, error_rate=0.5, seed=1)
    prompt, lens = jnp.repeat(PROMPT, SAMPLES, axis=0), jnp.full((SAMPLES,), 4, jnp.int32)
    for seed, ms in ((1, [0.2, 5, 5]), (2, [9, 5, 1])):
        res = run_auto(gd, params, prompt, lens, proposer, None, ms, auto=auto, new=S_NEW, sampling=sampling, key=seed)
        toks = np.asarray(res.out)
        assert (toks >= 0).all()
        counts = np.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V**3)
        stat, critical = chi2(counts, exact)
        assert stat < critical, f"table {ms}: chi2 {stat:.1f} >= critical {critical:.1f} at alpha=0.001"
        used = summary(auto, res.adapt)["choices"]
        assert ("ar" in used) == (seed == 1) and len(used) >= 1


def test_auto_settings_are_validated():
    cfg, gd, params, prompt, lens, *_ = setup("qwen3_5")
    proposer = ScriptedProposer(BLOCK, cfg.vocab_size, 0.2)
    with pytest.raises(ValueError, match="distinct and ascending"):
        gen.GenSpec("ddtree", AutoBudget(budgets=(8, 3)), None, 8, Sampling(), 0, proposer).validate(cfg.vocab_size)
    with pytest.raises(ValueError, match="budget must be an integer in"):
        gen.GenSpec("ddtree", AutoBudget(budgets=(3, 2000)), None, 8, Sampling(), 0, proposer).validate(cfg.vocab_size)
    with pytest.raises(ValueError, match="needs a step-time table"):
        gen.generate(gd, params, prompt, lens, proposer=proposer, budget=AUTO, max_new_tokens=8)


# ---- the Engine and the CLIs ------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tests.cli_fixtures import write_drafter, write_target

    root = tmp_path_factory.mktemp("auto_cli")
    return write_target(str(root / "target")), write_drafter(str(root / "drafter"))


@pytest.mark.slow  # ~70 s; the default run keeps the per-generation engine test and the chunk programs' own
def test_engine_measures_its_table_at_start_up(ckpts, tmp_path):
    """Engine.generate(budget="auto") measures its step-time table at start-up, reports the choices
    in Completion.stats.adaptive and equals plain decoding; the table saved to a file loads back
    for this engine, and a file for another model is refused by name."""
    from ddtree_jax.engine import Engine
    from ddtree_jax.speculative import cost_table

    target, drafter = ckpts
    engine = Engine.load(target, drafter)
    [ref] = engine.generate([[5, 6, 7, 8]], mode="ar", max_new_tokens=12)
    [got] = engine.generate([[5, 6, 7, 8]], auto_budgets=(2, 4), max_new_tokens=12)
    a = got.stats.adaptive
    assert got.token_ids == ref.token_ids
    # chosen by the host every 3 steps (one program per choice), and on device once per chunk of 3,
    # streamed in chunks of 2: the same tokens, every step counted once
    for where in ("host", "device"):
        streamed = []
        [chunked] = engine.generate([[5, 6, 7, 8]], auto_budgets=(2, 4), max_new_tokens=12, decide_every=3,
                                    decide_on=where, stream=lambda r, ids: streamed.extend(ids), stream_every=2)
        assert chunked.token_ids == ref.token_ids == streamed, where
        assert sum(chunked.stats.adaptive["choices"].values()) == chunked.stats.steps, where
    assert a["cost_table"]["source"].startswith("measured at start-up") and a["budgets"] == [2, 4]
    assert set(a["cost_table"]["ms"]) == {"ar", "dflash", "2", "4"} and a["calibration_seconds"] > 0
    assert sum(a["choices"].values()) == got.stats.steps == len(a["trace"])
    # device chunks (the default): each choice's own call intercept is recorded, and every draft
    # choice's calibration ratio comes from a pass of one-step chunks (every draft scored)
    assert set(a["cost_table"]["starts"]) == {"ar", "dflash", "2", "4"}
    assert set(a["cost_table"]["ratios"]) == set(a["cost_table"]["accepted"]) == {"dflash", "2", "4"}
    assert "calibration ratios over 8 drafts each" in a["cost_table"]["source"]
    # the first generation of a program starts from the table, the next from what the last learned
    assert a["calibration_from"] == "the table"
    [again] = engine.generate([[5, 6, 7, 8]], auto_budgets=(2, 4), max_new_tokens=12)
    assert again.token_ids == ref.token_ids
    assert again.stats.adaptive["calibration_from"] == "the last generation of this program"
    path = tmp_path / "costs.json"
    table = cost_table.CostTable(1, (8.0,), {k: (v[0],) for k, v in a["cost_table"]["ms"].items()}, "test")
    cost_table.save(path, table, device=engine.device_kind, model=engine.fingerprint())
    assert engine.load_cost_table(path, 1).ms == table.ms
    cost_table.save(path, table, device=engine.device_kind, model={"fingerprint": "another"})
    with pytest.raises(ValueError, match="another model"):
        Engine.load(target, drafter).generate([[5, 6, 7, 8]], max_new_tokens=4, cost_table=path)


def test_cli_reads_a_table_file_and_names_a_missing_one(ckpts, tmp_path, capsys):
    """ddtree-generate --cost-table FILE: a missing file is one error before anything is printed."""
    from ddtree_jax.cli import generate as cli

    target, drafter = ckpts
    with pytest.raises(SystemExit) as e:
        cli.main(["--target", target, "--drafter", drafter, "--prompt", "x", "--cost-table", str(tmp_path / "no.json")])
    captured = capsys.readouterr()
    assert e.value.code == 2 and "no.json does not exist" in captured.err and captured.out == ""
    with pytest.raises(SystemExit) as e:
        cli.main(["--target", target, "--drafter", drafter, "--prompt", "x", "--decide-every", "-1"])
    assert e.value.code == 2 and "expected an integer >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["--target", target, "--drafter", drafter, "--prompt", "x", "--budget", "8", "--decide-every", "4"])
    assert e.value.code == 2 and "--decide-every applies to --mode ddtree --budget auto only" in capsys.readouterr().err
    for extra in ([], ["--decide-every", "1"]):  # no chunks to decide: a named error, not a silent per-step run
        with pytest.raises(SystemExit) as e:
            cli.main(["--target", target, "--drafter", drafter, "--prompt", "x", "--decide-on", "host", *extra])
        captured = capsys.readouterr()
        assert e.value.code == 2 and "--decide-on host needs --decide-every N with N > 1" in captured.err
        assert captured.out == ""


@pytest.mark.slow
def test_bench_runs_auto_and_writes_the_table(ckpts, tmp_path, capsys):
    """ddtree-bench --budgets auto,...: the auto run beside the fixed ones (same output as plain
    decoding, its choices and acceptance in bench.json), the table in --cost-table FILE, the plot
    of the choices; --cost-table-in then uses that file, and so does ddtree-generate --cost-table."""
    from ddtree_jax.cli import bench as bench_cli

    target, drafter = ckpts
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nimport os\n")
    table = tmp_path / "costs.json"
    args = ["--target", target, "--drafter", drafter, "--prompts", str(prompts), "--modes", "ar,ddtree",
            "--budgets", "auto,2", "--auto-budgets", "2,4", "--max-new-tokens", "16", "--phase-repeats", "0",
            "--cost-repeats", "1"]
    code = bench_cli.main(args + ["--cost-table", str(table), "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 0, err
    report = json.loads((tmp_path / "a" / "bench.json").read_text())
    auto = next(r for r in report["results"] if r["budget"] == "auto")
    assert auto["outputs_match_ar"] and sum(auto["adaptive"]["choices"].values()) > 0
    assert set(json.loads(table.read_text())["tables"]) == {"1"} and report["cost_table"]["source"].endswith(str(table))
    assert (tmp_path / "a" / "auto_choices.png").stat().st_size > 1000
    code = bench_cli.main(args + ["--cost-table-in", str(table), "--out", str(tmp_path / "b")])
    assert code == 0 and f"loaded from {table}" in capsys.readouterr().err

    from ddtree_jax.cli import generate as cli

    code = cli.main(["--target", target, "--drafter", drafter, "--prompt", "def f(x):", "--max-new-tokens", "16",
                     "--auto-budgets", "2,4", "--cost-table", str(table), "--json", "--compare-ar"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["identical_to_ar"]
    assert d["stats"]["adaptive"]["cost_table"]["source"] == f"loaded from {table}"
