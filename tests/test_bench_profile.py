"""scripts.bench.profile runs end to end on the CPU (no GPU kernels to count there, but every phase
loop compiles and runs at the smoke shape); the deep random trees it can verify on; the Nsight
Compute target (scripts.bench.ncu) runs each call."""

import json

import pytest


@pytest.mark.script
def test_profile_smoke_writes_hlo(tmp_path):
    """scripts.bench.profile end to end at smoke size, with the optimized HLO of each phase
    written gzipped (what the kernel table's fusion names refer to) and `--sources` (the same HLO
    indexed: scripts/bench/hlo_index.py)."""
    import gzip

    from scripts.bench.profile import main

    out, hlo = tmp_path / "p.json", tmp_path / "hlo"
    assert main(["--smoke", "--gemm-m", "", "--phases", "step,verify", "--verify-budgets", "", "--iters", "1",
                 "--inner", "1", "--hlo-dir", str(hlo), "--sources", "--out", str(out)]) == 0
    phases = json.loads(out.read_text())["phases"]
    assert set(phases) == {"step", "verify"}
    assert all("by_source" in p for p in phases.values())  # empty on a CPU: no GPU kernels in the trace
    for phase in ("step", "verify"):
        assert gzip.decompress((hlo / f"{phase}.hlo.txt.gz").read_bytes()).startswith(b"HloModule")


@pytest.mark.script
def test_profile_moe_shape(tmp_path):
    """--shape 35b-a3b --smoke (the moe-smoke shape): the decode step and a verify profile, and the
    GEMM sweep skips the dense MLP an MoE target lacks (intermediate size 0)."""
    from scripts.bench.profile import main

    out = tmp_path / "p.json"
    assert main(["--smoke", "--shape", "35b-a3b", "--gemm-m", "1", "--phases", "step,verify", "--verify-budgets",
                 "", "--budget", "8", "--iters", "1", "--inner", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["shape"] == "moe-smoke" and set(report["phases"]) == {"step", "verify"}
    assert {g["gemm"].split()[0] for g in report["gemm_sweep"]} == {"gdn_qkv", "lm_head"}


@pytest.mark.script
def test_profile_deep_tree(tmp_path):
    """--tree-shape deep: the verify / commit phases run on a DDTree-like tree of depth <= 15
    (bench.deep_tree) instead of the random drafter's depth-1 tree."""
    from scripts.bench.profile import main

    out = tmp_path / "p.json"
    assert main(["--smoke", "--gemm-m", "", "--phases", "verify,commit", "--verify-budgets", "", "--iters", "1",
                 "--inner", "1", "--tree-shape", "deep", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tree_shape"] == "deep" and 5 <= report["tree_max_depth"] <= 15
    assert set(report["phases"]) == {"verify", "commit"}


@pytest.mark.script
def test_profile_int8_drafter_with_a_draft_vocabulary(tmp_path):
    """--int8-drafter and --draft-vocab reach the drafter the draft phase profiles."""
    from scripts.bench.profile import main

    out = tmp_path / "p.json"
    assert main(["--smoke", "--gemm-m", "", "--phases", "draft", "--verify-budgets", "", "--iters", "1",
                 "--inner", "1", "--int8-drafter", "--draft-vocab", "64", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["int8_drafter"] == "w8a8" and report["draft_vocab"] == 64  # the flag alone: W8A8
    assert report["int8_scheme"]["w8a8"] is True and report["int8_scheme"]["layout"] == "out_in"
    assert set(report["phases"]) == {"draft"}


def test_deep_parents_is_a_topological_tree_of_bounded_depth():
    import numpy as np

    from ddtree_jax.bench import deep_parents, deep_tree
    from ddtree_jax.tree import Tree, root_path

    for seed in range(5):
        parents = deep_parents(65, seed)
        assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
        depth = [len(root_path(parents.tolist(), i)) - 1 for i in range(65)]
        assert max(depth) <= 15 and max(depth) >= 8  # a long main path, as a confident drafter gives
        assert (deep_parents(65, seed) == parents).all()  # seeded
    import jax.numpy as jnp

    flat = Tree(jnp.arange(65, dtype=jnp.int32)[None], jnp.zeros((1, 65), jnp.int32), jnp.zeros((1, 65), jnp.int32),
                jnp.zeros((1, 65), jnp.int32), jnp.ones((1, 65), bool), jnp.zeros((1, 65, 3), jnp.uint32))
    deep = deep_tree(flat, jnp.array([10]), seed=1)
    assert (np.asarray(deep.parents[0]) == deep_parents(65, 1)).all()
    assert (np.asarray(deep.tokens) == np.asarray(flat.tokens)).all()
    assert (np.asarray(deep.positions[0]) == 10 + np.asarray(deep.depths[0])).all()


@pytest.mark.script
def test_ncu_target_runs_every_kernel_on_the_cpu(capsys):
    """scripts.bench.ncu (the Nsight Compute target): each kernel's call at the 27B shape runs end to
    end (the references here; the profiler brackets are no-ops without a CUDA driver). The 35B-A3B
    experts' call ("moe_decode": 1 GB of weights made on this CPU, ~20 s) runs under -m slow."""
    from scripts.bench.ncu import main

    for argv in (["gdn", "--tree", "deep"], ["attention"], ["gemm", "--weight", "out"], ["gdn_decode"]):
        assert main([*argv, "--launches", "1", "--impl", "xla"]) == 0
    out = capsys.readouterr().out
    assert out.count("finite=True") == 4 and "gemm tree=star weight=out nodes=65" in out


@pytest.mark.slow
def test_ncu_target_runs_the_moe_decode_call(capsys):
    from scripts.bench.ncu import main

    assert main(["moe_decode", "--launches", "1", "--impl", "xla"]) == 0
    assert "finite=True" in capsys.readouterr().out


def test_the_step_phase_is_the_generation_loop():
    """_phase_loop's "step" is n steps of gen._advance (the loop generation runs, with its chunks),
    and refuses a speculative spec (whose whole step is "loop")."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax import bench as B
    from ddtree_jax.routes import REFERENCE
    from ddtree_jax.speculative import generate as gen
    from ddtree_jax.speculative.sampling import Sampling
    from tests.scripted_proposers import ScriptedProposer
    from tests.tiny_models import HYBRID, make_target

    cfg, gd, params = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16), seed=4,
                                  base=HYBRID)
    prompt, lens = jnp.ones((1, 5), jnp.int32), jnp.full((1,), 5, jnp.int32)
    eos, key = jnp.zeros((0,), jnp.int32), jax.random.PRNGKey(0)
    for chunk in (1, 2):
        spec = gen.GenSpec("ar", 1, None, 32, Sampling(), 0, None, routes=REFERENCE.replace(loop_chunk=chunk))
        s = gen.start(gd, params, None, prompt, lens, eos, key, spec)
        got = B._phase_loop(gd, params, None, s, None, None, None, eos, key, spec, "step", jnp.int32(5))
        want = B._checksum(gen.advance(gd, params, None, s, eos, jnp.int32(5), spec))
        assert float(got) == float(want)
    tree_spec = gen.GenSpec("ddtree", 4, None, 32, Sampling(), 0, ScriptedProposer(4, cfg.vocab_size, 0.3, seed=1))
    with pytest.raises(ValueError, match="plain decoding's"):
        B._phase_loop(gd, params, None, s, None, None, None, eos, key, tree_spec, "step", jnp.int32(1))
