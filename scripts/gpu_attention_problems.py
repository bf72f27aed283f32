"""Random tree-attention problems at the Qwen3.6-27B attention shape for scripts/gpu_tree_attention.py:
ragged cache lengths, random trees of bounded depth, rotated input copies larger than L2, and
the byte / FLOP counts the report compares against."""

from __future__ import annotations

import math

import numpy as np

L2_BYTES = 50 * 2**20
NQ, NKV, HD = 24, 4, 256  # Qwen3.6-27B attention layer


def batch_lengths(b, cap):
    """Batch 1: the full cache. Batch > 1: different lengths, the longest = capacity."""
    if b == 1:
        return [cap]
    fr = np.linspace(0.55, 1.0, b)
    return [int(cap * x) - i * 7 for i, x in enumerate(fr)][:-1] + [cap]


def random_parents(rng, b, n, max_depth=15):
    par = np.full((b, n), -1, np.int32)
    depth = np.zeros((b, n), np.int32)
    for bb in range(b):
        for i in range(1, n):
            while True:
                p = int(rng.integers(0, i))
                if depth[bb, p] < max_depth:
                    break
            par[bb, i], depth[bb, i] = p, depth[bb, p] + 1
    return par


def make_problem(key, b, n, cap, lengths, dtype, nrot=1, nq=NQ, nkv=NKV, hd=HD):
    """Random inputs; nrot copies of the cache (and q / tree K/V) to rotate over."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.tree_mask import ancestor_bits

    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**30)))
    parents = jnp.asarray(random_parents(rng, b, n))
    bits = ancestor_bits(parents, impl="xla")
    lens = jnp.asarray(lengths, jnp.int32)
    sets = []
    for r in range(nrot):
        ks = jax.random.split(jax.random.fold_in(key, r), 5)
        q = jax.random.normal(ks[0], (b, n, nq, hd), jnp.float32).astype(dtype)
        kc = jax.random.normal(ks[1], (b, nkv, cap, hd), jnp.float32).astype(dtype)
        vc = jax.random.normal(ks[2], (b, nkv, cap, hd), jnp.float32).astype(dtype)
        kt = jax.random.normal(ks[3], (b, n, nkv, hd), jnp.float32).astype(dtype)
        vt = jax.random.normal(ks[4], (b, n, nkv, hd), jnp.float32).astype(dtype)
        sets.append((q, kc, vc, lens, kt, vt, bits))
    return sets, parents


def cache_bytes(lengths, nkv=NKV, hd=HD, itemsize=2):
    return int(sum(lengths) * nkv * hd * 2 * itemsize)


def attn_flops(lengths, n, nq=NQ, hd=HD):
    """QK^T and PV over the visible cache and the tree keys (dense over the tree)."""
    return int(sum(4 * n * nq * hd * (L + n) for L in lengths))


def rotations_for(nbytes):
    """Copies of the inputs so that one pass over all of them is > 1.25 x L2, at most 8 (each copy
    is one more traced call in the timing loop; 1k x batch 1 stays partly L2-resident)."""
    return int(max(1, min(8, math.ceil(1.25 * L2_BYTES / max(nbytes, 1)))))
