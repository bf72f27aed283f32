"""scripts/bench/moe_step.py's host-side pieces: the correlated stand-in routing (each node shares
3/4 of its experts with the node before, every node's experts distinct), the matching of a smaller
budget's tree nodes to the largest tree's verify rows by token path, and distinct-expert counts."""

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.tree import make_tree
from scripts.bench import moe_step


@pytest.mark.parametrize("k,e", [(8, 256), (4, 16), (2, 3)])
def test_correlated_ids_share_experts_with_the_previous_node(k, e):
    rows, nodes = 3, 9
    ids = moe_step.correlated_ids(rows, nodes, k, e, seed=1)
    assert ids.shape == (rows * nodes, k) and ids.min() >= 0 and ids.max() < e
    assert all(len(set(r)) == k for r in ids)  # a top-k: distinct within a node
    shared = max(moe_step.shared_of(k), 2 * k - e)
    for r in range(rows):
        chain = ids[r * nodes:(r + 1) * nodes]
        assert all(len(set(a) & set(b)) == shared for a, b in zip(chain, chain[1:]))
    assert moe_step.shared_of(8) == 6
    assert (moe_step.correlated_ids(rows, nodes, k, e, seed=1) == ids).all()  # reproducible


def _tree(tokens, parents):
    t = jnp.asarray(tokens, jnp.int32)
    return make_tree(t, jnp.asarray(parents, jnp.int32), t >= 0, jnp.zeros((t.shape[0],), jnp.int32), 4)


def test_node_rows_match_smaller_trees_by_token_path():
    """Row 0: the big tree root 5 -> {7, 9 -> 3}; the small one holds root, 9, 9 -> 3 in another
    order. Row 1: the small tree has a node (11 under the root) the big one lacks: counted missing.
    Rows are flat verify rows b * N_big + node."""
    big = _tree([[5, 7, 9, 3], [6, 8, 2, 4]], [[-1, 0, 0, 2], [-1, 0, 1, 0]])
    small = _tree([[5, 9, 3], [6, 11, 8]], [[-1, 0, 1], [-1, 0, 0]])
    rows, missing = moe_step.node_rows(big, small)
    assert rows.tolist() == [0, 2, 3, 4, 5] and missing == 1
    ids = [np.asarray([[0, 1], [0, 2], [1, 2], [3, 4], [5, 6], [5, 7], [0, 1], [0, 9]])]
    assert moe_step.distinct_per_layer(ids, rows) == [8]  # rows 0, 2, 3, 4, 5: {0, 1, 2, 3, 4, 5, 6, 7}
    assert moe_step.distinct_per_layer(ids, np.asarray([0, 4])) == [4]  # the roots: the decode step's rows


def test_unprobed_decode_bytes_count_the_experts_a_step_reads():
    """Plain decoding alone (no routing probe): the roofline keeps k experts a layer at batch 1 and
    the expected distinct count under uniform routing at more rows; never the whole expert table
    (the 35B-A3B shape's ar-only report once claimed 5.5x its roofline)."""
    from ddtree_jax.config import MOE

    class Cfg:
        hidden_size, moe_intermediate_size, dtype = 8, 4, jnp.bfloat16
        moe_num_experts, moe_top_k, ffn_kinds = 16, 4, (MOE, "dense", MOE)

    eb = moe_step.expert_bytes(Cfg)
    dense = 10**6 + 2 * 16 * eb
    one, how1 = moe_step.unprobed_decode_bytes(Cfg, dense, 1)
    assert one == 10**6 + 2 * 4 * eb and "batch 1" in how1
    eight, how8 = moe_step.unprobed_decode_bytes(Cfg, dense, 8)
    expected = 16 * (1 - (1 - 4 / 16) ** 8)
    assert abs(eight - (10**6 + 2 * expected * eb)) <= 1 and "uniform" in how8
    assert one < eight < dense
