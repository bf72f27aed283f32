"""DFlash drafters go through the same converter CLI: convert, restore, same drafts; the engine
loads converted targets and drafters."""

import numpy as np
import pytest

from converters.load import load_drafter, load_target
from ddtree_jax.cli import convert as convert_cli
from ddtree_jax.engine import Engine
from tests.cli_fixtures import write_drafter, write_target


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    return write_target(str(root / "target")), write_drafter(str(root / "drafter")), root


def test_drafter_converts_and_restores_identically(dirs, capsys):
    target, drafter, root = dirs
    assert convert_cli.main([drafter, str(root / "drafter_ckpt"), "-q"]) == 0
    assert "converted drafter" in capsys.readouterr().out
    dcfg_a, _, pa = load_drafter(drafter)
    dcfg_b, _, pb = load_drafter(str(root / "drafter_ckpt"))
    assert dcfg_a == dcfg_b
    for a, b in zip(__import__("jax").tree_util.tree_leaves(pa), __import__("jax").tree_util.tree_leaves(pb)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="drafter, not a target"):
        load_target(str(root / "drafter_ckpt"))


def test_engine_on_converted_pair_matches_hf_dirs(dirs):
    target, drafter, root = dirs
    assert convert_cli.main([target, str(root / "target_ckpt"), "-q"]) == 0
    if not (root / "drafter_ckpt").exists():
        assert convert_cli.main([drafter, str(root / "drafter_ckpt"), "-q"]) == 0
    a = Engine.load(target, drafter).generate([[5, 6, 7, 8]], mode="ddtree", budget=8, max_new_tokens=12)[0]
    b = Engine.load(str(root / "target_ckpt"), str(root / "drafter_ckpt")).generate(
        [[5, 6, 7, 8]], mode="ddtree", budget=8, max_new_tokens=12)[0]
    assert a.token_ids == b.token_ids
    assert a.stats.acceptance_length == b.stats.acceptance_length


def test_hf_and_converted_pairs_generate_alike_in_the_merged_layouts(dirs):
    """The engine loads the HF pair and the converted pair into the merged projection weights
    (gate | up for target and drafter, q | k | v, qkv | z | b | a) and both generate the same
    DDTree tokens."""
    target, drafter, root = dirs
    for name in ("target", "drafter"):
        if not (root / f"{name}_ckpt").exists():
            src = {"target": target, "drafter": drafter}[name]
            assert convert_cli.main([src, str(root / f"{name}_ckpt"), "-q"]) == 0
    outs = []
    for t, d in ((target, drafter), (str(root / "target_ckpt"), str(root / "drafter_ckpt"))):
        engine = Engine.load(t, d)
        assert "gate_up_proj" in str(engine.drafter_params) and "qkv_proj" in str(engine.params)
        assert "in_proj_qkvzba" in str(engine.params)
        outs.append(engine.generate([[5, 6, 7, 8]], mode="ddtree", budget=8, max_new_tokens=12)[0].token_ids)
    assert outs[0] == outs[1]
