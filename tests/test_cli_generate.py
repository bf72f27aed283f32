"""ddtree-generate end to end on tiny checkpoints: same greedy text in every mode, streaming,
and one clear error for every bad input."""

import dataclasses
import io
import json
import os

import pytest

from ddtree_jax.cli import generate as cli
from tests.cli_fixtures import write_drafter, write_target


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = write_target(str(root / "target"))
    drafter = write_drafter(str(root / "drafter"))
    bad = write_drafter(str(root / "bad_drafter"), hidden_size=32, head_dim=8)
    return target, drafter, bad


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_all_modes_give_identical_greedy_text(ckpts, capsys, tmp_path):
    """ar, dflash and ddtree, and ddtree drafting from a draft vocabulary (--draft-vocab FILE: the
    drafts come from those ids only), all give the same greedy text."""
    target, drafter, _ = ckpts
    hot = tmp_path / "hot.json"
    hot.write_text(json.dumps(list(range(0, 128, 3))))
    outs = {}
    for mode, extra in (("ar", ()), ("dflash", ()), ("ddtree", ()), ("ddtree", ("--draft-vocab", str(hot)))):
        code, out, err = run(capsys, "--target", target, "--drafter", drafter, "--prompt", "def f(x):",
                             "--mode", mode, "--max-new-tokens", "40", "--budget", "16", "--json", *extra)
        assert code == 0, err
        key = mode + ("+vocab" if extra else "")
        outs[key] = json.loads(out)
        assert outs[key]["mode"] == mode and len(outs[key]["token_ids"]) >= 1
        assert outs[key]["stats"]["steps"] >= 1
    assert (outs["ar"]["token_ids"] == outs["dflash"]["token_ids"] == outs["ddtree"]["token_ids"]
            == outs["ddtree+vocab"]["token_ids"])
    assert outs["ar"]["text"] == outs["ddtree"]["text"]


def test_streaming_prints_text_and_stats(ckpts, capsys, monkeypatch):
    """The streamed run prints its text as it goes; --compare-ar's plain run is timed the same way
    (a host sync every 4 steps, its tokens shown nowhere), so the speed ratio compares like with like."""
    from ddtree_jax.engine import Engine

    calls, generate = [], Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, prompts, **kw: calls.append(
        (kw["mode"], kw["stream"] is not None, kw["stream_every"])) or generate(self, prompts, **kw))
    target, drafter, _ = ckpts
    code, out, err = run(capsys, "--target", target, "--drafter", drafter, "--prompt", "x = ", "--max-new-tokens",
                         "24", "--compare-ar", "--budget", "8")  # budget auto: tests/test_adaptive_generate.py
    assert code == 0
    assert out.startswith("x = ")
    assert "tok/s" in err and "acceptance length" in err and "ms/step" in err
    assert "identical to plain decoding: yes" in err
    assert "[ar]" in err and "/ plain speed" in err and "timed like the ddtree run" in err
    assert calls == [("ddtree", True, 4), ("ar", True, 4)], calls


def test_compare_ar_with_sampling_checks_the_seeded_sample(ckpts, capsys):
    """Each position's draw depends on the seed and the position only, so a sampled speculative run
    writes plain sampling's tokens: --compare-ar checks sampled output too, and says it sampled."""
    target, drafter, _ = ckpts
    code, _, err = run(capsys, "--target", target, "--drafter", drafter, "--prompt", "x = ", "--max-new-tokens",
                       "12", "--temperature", "0.8", "--seed", "3", "--compare-ar", "--budget", "8")
    assert code == 0
    assert "output identical to plain decoding (sampled, seed 3): yes" in err


def test_divergence_is_explained_with_the_top_two_gap(ckpts):
    """A greedy mismatch is reported with where it starts and whether plain decoding's top two
    logits are a near tie there."""
    from ddtree_jax.cli.generate import explain_divergence
    from ddtree_jax.engine import Engine

    target, drafter, _ = ckpts
    engine = Engine.load(target, drafter)
    [ref] = engine.generate([[5, 6, 7, 8]], mode="ar", max_new_tokens=6)
    got = list(ref.token_ids)
    got[3] = (got[3] + 1) % engine.cfg.vocab_size
    msg = explain_divergence(engine, [5, 6, 7, 8], got, ref.token_ids)
    assert msg.startswith("first difference at generated token 3")
    assert ("near tie within" in msg) != ("NOT a near tie" in msg)


def test_stream_callback_is_called_in_chunks(ckpts):
    from ddtree_jax.engine import Engine

    target, drafter, _ = ckpts
    engine = Engine.load(target, drafter)
    seen = []
    [c] = engine.generate(["a = 1\n"], mode="ddtree", budget=8, max_new_tokens=30,
                          stream=lambda r, ids: seen.append(ids), stream_every=1)
    assert len(seen) > 2, "tokens should arrive in several chunks"
    assert sum(seen, []) == c.token_ids


def test_prompt_from_stdin_and_ids(ckpts, capsys, monkeypatch):
    target, drafter, _ = ckpts
    monkeypatch.setattr(cli.sys, "stdin", io.StringIO("import os\n"))
    code, out, _ = run(capsys, "--target", target, "--mode", "ar", "--max-new-tokens", "5", "--json")
    assert code == 0 and json.loads(out)["prompt_ids"][:3] == [75, 79, 82]  # 'i', 'm', 'p'
    code, out, _ = run(capsys, "--target", target, "--mode", "ar", "--prompt-ids", "5,6,7", "--max-new-tokens", "5",
                       "--json")
    assert code == 0 and json.loads(out)["prompt_ids"] == [5, 6, 7]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--target", "/nonexistent/dir", "--prompt", "x"], "does not exist"),
        (["--prompt", "x", "--max-new-tokens", "0"], "positive integer"),
        (["--prompt", "x", "--budget", "-3"], "expected 'auto' or an integer in [1, 1024], got -3"),
        (["--prompt", "x", "--budget", "5000"], "budget"),
        (["--prompt", "x", "--temperature", "-1"], "temperature"),
        (["--prompt", "x", "--top-p", "0"], "--top-p"),
        (["--prompt", "x", "--prompt-ids", "1,2"], "only one of"),
        (["--prompt-ids", "1,x"], "token ids"),
        (["--prompt-ids", "1,999"], "outside the vocabulary"),
        (["--prompt", "x" * 40, "--max-context", "32"], "context limit"),
        (["--mode", "ddtree", "--prompt", "x", "--no-drafter"], "needs a drafter"),
        (["--prompt", "x", "--mode", "beam"], "invalid choice"),
        (["--prompt", "x", "--draft-vocab", "0"], "draft vocabulary size"),
        (["--prompt", "x", "--draft-vocab", "missing.json"], "neither a size nor a JSON file"),
    ],
)
def test_bad_input_gives_one_clear_error(ckpts, capsys, argv, message):
    target, drafter, _ = ckpts
    argv = list(argv)
    if "--target" not in argv:
        argv = ["--target", target] + argv
    if "--no-drafter" in argv:
        argv.remove("--no-drafter")
    elif "--drafter" not in argv:
        argv += ["--drafter", drafter]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2  # usage / input error
    captured = capsys.readouterr()
    assert message in captured.err, captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_mismatched_drafter_is_refused(ckpts, capsys):
    target, _, bad = ckpts
    with pytest.raises(SystemExit):
        cli.main(["--target", target, "--drafter", bad, "--prompt", "x"])
    err = capsys.readouterr().err
    assert "hidden" in err


def test_help_explains_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--target", "--drafter", "--mode", "--budget", "--prompt-ids", "--json", "--temperature"):
        assert flag in out


@pytest.mark.slow
def test_bench_writes_json_png_and_table(ckpts, tmp_path, capsys):
    from ddtree_jax.cli import bench as bench_cli

    target, drafter, _ = ckpts
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nimport os\\nimport sys\n")
    code = bench_cli.main(["--target", target, "--drafter", drafter, "--prompts", str(prompts), "--budgets", "4,8",
                           "--max-new-tokens", "16", "--phase-repeats", "2", "--out", str(tmp_path / "out"),
                           "--route", "bits_kernel_max_nodes=32"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["routes"]["bits_kernel_max_nodes"] == 32 and report["routes"]["impl"] == "xla"
    assert report["status"] == "complete" and not (tmp_path / "out" / "bench.json.tmp").exists()
    runs = {(r["mode"], r["budget"]): r for r in report["results"]}
    assert set(runs) == {("ar", None), ("dflash", None), ("ddtree", 4), ("ddtree", 8)}
    for r in runs.values():
        assert r["outputs_match_ar"] is True and r["tokens"] > 0 and r["tokens_per_second"] > 0
    assert set(runs[("ddtree", 8)]["phases_ms"]) == {"draft", "build", "verify", "commit"}
    assert (tmp_path / "out" / "bench.png").stat().st_size > 1000
    assert "ddtree" in captured.out and "verify" in captured.out


def test_bench_rejects_bad_routes_before_loading(tmp_path, capsys):
    """ddtree-bench --route names every bad setting at once and stops before any model loads."""
    from ddtree_jax.cli import bench as bench_cli

    with pytest.raises(SystemExit) as e:
        bench_cli.main(["--target", str(tmp_path / "missing"), "--prompts", "p.txt", "--route", "nope=1",
                        "--route", "bits_kernel_max_nodes=yes", "--route", "gdn_decode_kernel=maybe"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no route named 'nope'" in err and "expected an integer, got 'yes'" in err
    assert "expected true or false, got 'maybe'" in err
    assert "missing" not in err  # the checkpoint was never looked at


def test_bench_keeps_finished_runs_when_cut_short(ckpts, tmp_path, monkeypatch):
    """A bench stopped mid-sweep (time limit, ^C) leaves bench.json with the runs it finished."""
    from ddtree_jax import bench
    from ddtree_jax.cli import bench as bench_cli

    done = []

    def fake_run_mode(engine, prompts, mode, budget, **kw):
        if done:
            raise KeyboardInterrupt
        done.append(mode)
        r = bench.RunResult(**{f.name: None for f in dataclasses.fields(bench.RunResult)})
        return dataclasses.replace(r, mode=mode, budget=budget), [[1, 2]]

    monkeypatch.setattr(bench, "run_mode", fake_run_mode)
    target, drafter, _ = ckpts
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")
    with pytest.raises(KeyboardInterrupt):
        bench_cli.main(["--target", target, "--drafter", drafter, "--prompts", str(prompts), "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["status"] == "partial" and [r["mode"] for r in report["results"]] == ["ar"]


def test_bench_explains_divergences(ckpts):
    """A run that departs from AR is reported with where it departs and how close AR's top two
    logits are there; only a gap within the dtype's rounding counts as a tie."""
    from ddtree_jax import bench
    from ddtree_jax.engine import Engine

    target, drafter, _ = ckpts
    engine = Engine.load(target, drafter)
    prompt = [5, 6, 7, 8]
    [ref] = engine.generate([prompt], mode="ar", max_new_tokens=6)
    other = list(ref.token_ids)
    other[3] = (other[3] + 1) % 128
    r_ar = bench.RunResult("ar", None, 1, 6, 1.0, 6.0, 1.0, [], 1.0, {}, None)
    r_bad = bench.RunResult("ddtree", 8, 1, 6, 1.0, 6.0, 1.0, [], 1.0, {}, None)
    bench.compare([r_ar, r_bad], {("ar", None): [ref.token_ids], ("ddtree", 8): [other]}, engine=engine,
                  prompts=[prompt])
    assert r_bad.outputs_match_ar is False
    [(row, k, gap)] = r_bad.divergences
    assert (row, k) == (0, 3) and gap > 0
    assert r_bad.divergences_are_ties == (gap < bench.TIE_TOLERANCE["float32"])
    assert bench._same(r_bad) in ("tie", "NO")


def test_bench_can_skip_the_phase_split(ckpts, capsys):
    """--phase-repeats 0 skips the per-phase timing (its compilations dominate short GPU runs);
    the table shows '-' there. Negative values are refused by the parser."""
    from ddtree_jax import bench
    from ddtree_jax.cli import bench as bench_cli
    from ddtree_jax.engine import Engine

    target, drafter, _ = ckpts
    engine = Engine.load(target, drafter)
    r, outs = bench.run_mode(engine, [[5, 6, 7, 8]], "ddtree", 4, max_new_tokens=6, batch=1, phase_repeats=0)
    assert r.phases_ms == {} and len(outs[0]) == 6
    assert "   -" in bench.table([r])
    with pytest.raises(SystemExit):
        bench_cli.build_parser().parse_args(["--prompts", "p", "--phase-repeats", "-1"])
    assert "integer >= 0" in capsys.readouterr().err


def test_engine_times_generation_only(ckpts, monkeypatch):
    """The first call of a shape bucket runs prefill + one step untimed (compile, trace, first-run
    setup) on a throwaway state; later calls of the bucket do not, and outputs are unaffected."""
    from ddtree_jax import engine as engine_mod
    from ddtree_jax.engine import Engine

    target, drafter, _ = ckpts
    engine = Engine.load(target, drafter)
    calls = []
    real_bind = engine_mod.gen.bind

    def counting_bind(graphdef):
        start, advance = real_bind(graphdef)
        return (lambda *a, **k: calls.append(1) or start(*a, **k)), advance

    monkeypatch.setattr(engine_mod.gen, "bind", counting_bind)
    [first] = engine.generate([[5, 6, 7, 8]], mode="ddtree", budget=4, max_new_tokens=8)
    assert len(calls) == 2  # warm-up + the timed run
    [again] = engine.generate([[5, 6, 7, 8]], mode="ddtree", budget=4, max_new_tokens=8)
    assert len(calls) == 3 and again.token_ids == first.token_ids


def test_bench_repeats_interleave_passes_and_report_the_median(ckpts, tmp_path, monkeypatch):
    """--repeats N runs every (mode, budget) N times, pass by pass over all of them; tokens/s is
    the median with every pass kept, and a pass that generates other tokens is reported."""
    from ddtree_jax import bench
    from ddtree_jax.cli import bench as bench_cli

    order, speed = [], iter([10.0, 20.0, 30.0, 50.0, 40.0, 60.0])

    def fake_run_mode(engine, prompts, mode, budget, **kw):
        order.append((mode, budget, kw["phase_repeats"]))
        r = bench.RunResult(**{f.name: None for f in dataclasses.fields(bench.RunResult)})
        tps = next(speed)
        r = dataclasses.replace(r, mode=mode, budget=budget, tokens=8, seconds=8 / tps, tokens_per_second=tps,
                                acceptance_length=1.0, step_ms=1.0, phases_ms={}, accepted_hist=[1])
        flaky = mode == "dflash" and len(order) > 2
        return r, [[1, 2, 3] if flaky else [1, 2]]

    monkeypatch.setattr(bench, "run_mode", fake_run_mode)
    monkeypatch.setattr(bench, "plot", lambda results, path: None)
    target, drafter, _ = ckpts
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")
    code = bench_cli.main(["--target", target, "--drafter", drafter, "--prompts", str(prompts), "--modes", "ar,dflash",
                           "--repeats", "3", "--phase-repeats", "2", "--out", str(tmp_path)])
    assert code == 0
    assert [(m, p) for m, _, p in order] == [("ar", 2), ("dflash", 2), ("ar", 0), ("dflash", 0), ("ar", 0),
                                             ("dflash", 0)]
    report = json.loads((tmp_path / "bench.json").read_text())
    runs = {r["mode"]: r for r in report["results"]}
    assert runs["ar"]["tokens_per_second_runs"] == [10.0, 30.0, 40.0] and runs["ar"]["tokens_per_second"] == 30.0
    assert runs["dflash"]["tokens_per_second"] == 50.0
    assert report["repeats"] == 3 and report["passes_differ"] == ["dflash/None"]


def test_ar_phase_timing_carries_the_state(ckpts):
    """The plain-decoding phase loop (ddtree-bench's step timing, scripts/profile_step.py) runs n
    real consecutive steps - the state carried, as in the generation loop - so XLA keeps every
    cache / state writeback: its result equals n steps run one by one."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ddtree_jax import bench
    from ddtree_jax.engine import Engine
    from ddtree_jax.speculative import generate as gen

    target, drafter, _ = ckpts
    engine = Engine.load(target, drafter)
    spec = engine.spec("ar", budget=1, candidates=None, max_new_tokens=16, sampling=bench.Sampling(),
                       prompt_bucket=16)
    eos, key = jnp.zeros((0,), jnp.int32), jax.random.PRNGKey(0)
    g, p, dp = engine.graphdef, engine.params, engine.drafter_params
    prompt = jnp.asarray([[5, 6, 7, 8] + [0] * 12], jnp.int32)
    s = gen.start(g, p, dp, prompt, jnp.asarray([4], jnp.int32), eos, key, spec)
    got = bench._phase_loop(g, p, dp, s, None, None, None, eos, key, spec, "step", jnp.int32(3))
    model = nnx.merge(g, p)
    st, acc = s, jnp.float32(0)
    for _ in range(3):
        st = gen._ar_step(model, st, eos, spec)[0]
        acc = acc + bench._checksum(st.bonus)
    np.testing.assert_allclose(float(got), float(acc + bench._checksum(st)), rtol=1e-6)
    assert int(st.cache.lengths[0]) == int(s.cache.lengths[0]) + 3


def test_autotune_cache_flag_reaches_xla_flags_before_loading(tmp_path, capsys, monkeypatch):
    """ddtree-generate / ddtree-bench --autotune-cache DIR put XLA's cache flag in XLA_FLAGS before
    anything loads (the missing target is reported after); a second, different directory already
    in XLA_FLAGS is a named error."""
    from ddtree_jax import autotune_cache
    from ddtree_jax.cli import bench as bench_cli

    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(SystemExit):
        cli.main(["--target", str(tmp_path / "missing"), "--prompt", "x", "--autotune-cache", str(tmp_path / "atc")])
    assert f"{autotune_cache.FLAG}={tmp_path / 'atc'}" in os.environ["XLA_FLAGS"] and (tmp_path / "atc").is_dir()
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_cli.main(["--target", str(tmp_path / "missing"), "--prompts", "p.txt", "--autotune-cache",
                        str(tmp_path / "other")])
    assert "--autotune-cache: XLA_FLAGS already sets" in capsys.readouterr().err
