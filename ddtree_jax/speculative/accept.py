"""Acceptance: walk the tree from the root following the target's own choices.

At node `cur`, if the target's choice post[cur] is the token of one of cur's children, move to
that child; the first choice that matches no child becomes the next bonus token. Greedy, this
accepts the longest path that matches the target's argmax; with sampling, the same walk on the
target's own samples keeps the target distribution exactly (siblings carry distinct tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ddtree_jax.tree import Tree


class Acceptance(NamedTuple):
    path: jax.Array  # [B, P] node indices root first; entries past count repeat the last node
    count: jax.Array  # [B] nodes committed this step = 1 (root) + accepted draft nodes
    bonus: jax.Array  # [B] the target's choice after the last accepted node


def accept(tree: Tree, post: jax.Array, max_depth: int) -> Acceptance:
    """tree with N slots; post [B, N] the target's choice at every node; static max_depth."""
    b, n = tree.tokens.shape
    is_child = (tree.parents[:, None, :] == jnp.arange(n)[None, :, None]) & tree.valid[:, None, :]
    match = is_child & (tree.tokens[:, None, :] == post[:, :, None])  # [B, parent, child]
    has_next = jnp.any(match, axis=-1)
    nxt = jnp.argmax(match, axis=-1).astype(jnp.int32)
    path = [jnp.zeros((b,), jnp.int32)]
    alive = jnp.ones((b,), bool)
    count = jnp.ones((b,), jnp.int32)
    for _ in range(max_depth):
        cur = path[-1]
        step = alive & jnp.take_along_axis(has_next, cur[:, None], axis=1)[:, 0]
        path.append(jnp.where(step, jnp.take_along_axis(nxt, cur[:, None], axis=1)[:, 0], cur))
        count = count + step
        alive = step
    path = jnp.stack(path, axis=1)
    last = jnp.take_along_axis(path, (count - 1)[:, None], axis=1)[:, 0]
    bonus = jnp.take_along_axis(post, last[:, None], axis=1)[:, 0]
    return Acceptance(path, count, bonus)
