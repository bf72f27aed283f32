"""Expected acceptance of a step's draft under the drafter's own distribution.

The drafter gives a log-prob per depth and token; a prefix's probability is the product along it
(its DDTree score, exponentiated). If the target's continuation were drawn from that distribution,
a prefix-closed tree T would accept a path of length d exactly when the continuation's first d
tokens form a prefix in T, so the expected number of accepted draft tokens is

    E(T) = sum over d >= 1 of P(first d tokens in T) = sum over the prefixes in T of their probability,

the root's bonus token coming on top (a step emits 1 + accepted). For DDTree's top-b tree that is
the sum of the b selected prefixes' probabilities; every b <= budget takes the first b in the
heap's order (build.TreeCandidates.pop), so one selection at the largest budget gives E for all.
The DFlash chain (the argmax of every depth) is the tree of the chain's prefixes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.speculative.build import TreeCandidates


def tree_expectations(c: TreeCandidates, budgets: tuple[int, ...]) -> jax.Array:
    """[B, len(budgets)]: E of the top-b tree for every b in budgets (each <= the candidates' budget)."""
    prob = jnp.where(c.valid, jnp.exp(c.score), 0.0)  # [B, N]
    within = c.pop[:, :, None] < jnp.asarray(budgets, jnp.int32)[None, None, :]  # [B, N, nb]
    return jnp.sum(jnp.where(within, prob[:, :, None], 0.0), axis=1)


def chain_expectation(best: jax.Array) -> jax.Array:
    """[B]: E of the DFlash chain (the argmax of each depth) from best [B, D], each depth's largest
    log-prob (TreeCandidates.best: the vocabulary top-k's first; logq.max(-1)): the sum over depths
    of the product of the chain's token probabilities up to there."""
    return jnp.sum(jnp.exp(jnp.cumsum(best.astype(jnp.float32), axis=-1)), axis=-1)
