"""tree_verify: one target forward over [root] + draft nodes, then the acceptance walk.

Pure: it reads the committed cache and returns what was accepted plus the per-layer pending
work that `commit` needs; no committed state is written here.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ddtree_jax.cache import TargetCache
from ddtree_jax.routes import REFERENCE, Routes
from ddtree_jax.speculative.accept import accept
from ddtree_jax.speculative.sampling import RowSampling, SamplingCode, choose
from ddtree_jax.tree import Tree


class VerifyResult(NamedTuple):
    path: jax.Array  # [B, P] accepted node indices, root first (padded by repeating the last)
    count: jax.Array  # [B] nodes to commit (root + accepted)
    bonus: jax.Array  # [B] next root token
    features: jax.Array | None  # [B, P, F] target features of the accepted nodes (drafter context)
    pending: tuple  # per-layer inputs of commit (tree K/V, recurrent inputs): never per-node states


def tree_verify(model, cache: TargetCache, tree: Tree | None, tokens: jax.Array, code: SamplingCode,
                rows: RowSampling | None, keys, *, max_depth: int, hidden_ids=(), routes: Routes = REFERENCE
                ) -> VerifyResult:
    """Verify tokens [B, N] laid out as `tree` (None = a chain, linear DFlash).

    The target's choice at every node follows each row's settings (rows; keys [B, N, 2]: the key
    of the position each node's choice fills; both unused by greedy code). max_depth (static) bounds the accepted path
    length: P = max_depth + 1. routes pick the tree kernels (ddtree_jax/routes.py).
    """
    h, feats, pending = model.verify(tokens, cache, tree, hidden_ids=hidden_ids, routes=routes)
    logits = model.logits(h)
    post = choose(logits, code, rows, keys)
    if tree is None:
        b, n = tokens.shape
        parents = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (b, n))
        shape = Tree(tokens, parents, jnp.zeros_like(parents), jnp.zeros_like(parents), jnp.ones((b, n), bool), None)
    else:
        shape = tree
    acc = accept(shape, post, max_depth)
    acc_feats = None if feats is None else jnp.take_along_axis(feats, acc.path[:, :, None], axis=1)
    return VerifyResult(acc.path, acc.count, acc.bonus, acc_feats, pending)
