"""scripts/bench/shapes.py: every benchmark shape's config parses, and the random filled caches have
the structure, shapes and dtypes of the model's own empty cache (what the steps are compiled for)."""

import jax
import pytest

from ddtree_jax.cache import init_target_cache
from scripts.bench.shapes import SHAPES, filled_caches


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_shape_parses(name):
    shape = SHAPES[name]
    cfg = shape.target()
    dcfg = shape.drafter(cfg)
    assert dcfg.hidden_size == cfg.hidden_size and shape.smoke in SHAPES
    if name == "nemotron-h-8b":  # 24 Mamba2, 24 MLP, 4 attention blocks
        kinds = cfg.layer_types
        assert (len(kinds), kinds.count("mamba2"), kinds.count("attention")) == (52, 24, 4)


@pytest.mark.parametrize("name", sorted({s.smoke for s in SHAPES.values()} | {"smoke"}))
def test_filled_caches_match_the_models_cache(name):
    shape = SHAPES[name]
    cfg = shape.target()
    dcfg = shape.drafter(cfg)
    cache, dcache = filled_caches(cfg, dcfg, batch=2, context=16, capacity=24, seed=0)
    empty = init_target_cache(cfg, 2, 24)
    spec = lambda tree: jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), tree)
    assert jax.tree_util.tree_structure(cache) == jax.tree_util.tree_structure(empty)
    assert spec(cache.layers) == spec(empty.layers)
    assert cache.lengths.tolist() == [16, 8] and dcache.lengths.tolist() == [16, 8]
    for leaf in jax.tree_util.tree_leaves(cache.layers):  # never zeros (shapes.py's docstring)
        assert float(abs(leaf.astype("float32")).max()) > 0
