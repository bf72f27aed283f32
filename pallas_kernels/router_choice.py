"""A softmax router's choice for one row in one kernel launch: the router's one-row product
(pallas_kernels/row_product.py's programs) and the softmax, top-k and renormalisation
(pallas_kernels/softmax_top_k.py's arithmetic) run by the product's last program. Next to its
reference.

    ids, weights = router_choice(x, w, k, norm=True, weights_dtype=jnp.bfloat16, config=None,
                                 impl="xla" | "pallas" | "pallas_interpret")

x [..., K] holding one row, w [K, E] -> ids [..., k] int32, weights [..., k] float32: exactly
softmax_top_k(row_product(x, w, partials=True), k, logits_dtype=x.dtype): the logits are the
float32 partial products over config.split_k slices of K, added in index order and rounded to
x's dtype, then chosen as softmax_top_k chooses.

Why it was built: a batch-1 decode step's router is two launches, the product (2.1 us on the H200
at the Qwen3.6-35B-A3B router, 2048 x 256) and the choice (3.2 us), 40 times a step
(docs/benchmarks.md section 6). Measured, the step is 0.05-0.1 ms slower with it
(docs/decisions/0059-last-program-epilogues.md): the choice runs after the product in the
product's 4-warp program (the choice alone is fastest at 1 warp). An option
(`Routes.moe_router_fused`, off). Here every program writes its float32
partial product, then (after a CTA barrier, so that its threads' stores come first) adds one to a
counter (an atomic, acquire-release at GPU scope); the program that reads the count of all programs
less one has every partial in view and makes the choice. The counter is a zeroed input aliased to
an output. Deterministic: the sum runs in index order whoever makes it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import row_product as rp
from pallas_kernels import softmax_top_k as stk
from pallas_kernels._common import check_impl, count_finished, counted_call, dot_precision, load, next_pow2, store


def reference(x, w, k: int, *, norm: bool, weights_dtype, split_k: int = 1):
    """softmax_top_k's reference of row_product's float32 partials over split_k slices, summed and
    rounded to x's dtype."""
    parts = rp.reference(x, w, split_k=split_k, partials=True)
    return stk.softmax_top_k(parts, k, norm=norm, weights_dtype=weights_dtype, logits_dtype=x.dtype)


def _kernel(x_ref, w_ref, _cnt_in, p_ref, ids_ref, wts_ref, c_ref, *, cfg: rp.RowConfig, k_per_split, n, n_pad, k,
            kp, norm, dtype, logits_dtype, precision, interpret):
    """Program (column block, K slice): its partial product into p_ref [S, n]; the last program to
    count (c_ref [1]) makes the choice."""
    col, split = pl.program_id(0), pl.program_id(1)
    y = rp.slab_product(x_ref, w_ref, cfg=cfg, k_per_split=k_per_split, precision=precision)
    store(p_ref, (split, pl.ds(col * cfg.block_n, cfg.block_n)), y)
    done = count_finished(c_ref, (jnp.int32(0),), interpret)
    programs = pl.num_programs(0) * pl.num_programs(1)

    def choose():
        real = jax.lax.broadcasted_iota(jnp.int32, (n_pad,), 0) < n
        rows = [load(p_ref, (jnp.int32(s), pl.ds(0, n_pad)), mask=real, other=0.0) for s in range(cfg.split_k)]
        logits = rows[0]
        for r in rows[1:]:
            logits = logits + r  # index order
        stk.store_choice(ids_ref, wts_ref, logits, real, k=k, kp=kp, norm=norm, dtype=dtype, interpret=interpret,
                         round_to=logits_dtype)

    pl.when(done == programs - 1)(choose)


def router_choice(x, w, k: int, *, norm: bool, weights_dtype=jnp.float32, config: rp.RowConfig | None = None,
                  impl: str = "xla", num_warps: int | None = None):
    """(ids int32, weights float32) [..., k] of the one row x [..., K] against router weights w [K, E]
    (module docstring). config: the product's tiling (row_product.default_config's narrow tiling
    when None; its split_k sets the partials summed); num_warps overrides the config's."""
    check_impl(impl)
    kk, n = w.shape
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    bad = [] if x.shape[-1] == kk and rows == 1 else [f"x {tuple(x.shape)} must hold one row of K = {kk}"]
    bad += [] if x.dtype == w.dtype else [f"x and w must share a dtype, got {x.dtype} and {w.dtype}"]
    bad += rp.problems(kk, n, x.dtype, config)
    if n > stk.SOFTMAX_TOP_K_MAX_LEN or not 1 <= k <= min(n, stk.SOFTMAX_TOP_K_MAX_K):
        bad.append(f"k = {k} of E = {n} experts (the choice takes E <= {stk.SOFTMAX_TOP_K_MAX_LEN}, "
                   f"1 <= k <= min(E, {stk.SOFTMAX_TOP_K_MAX_K}))")
    if bad:
        raise ValueError("router_choice: " + "; ".join(bad))
    cfg = (config or rp.default_config(kk, n, partials=True)).fit(kk, n)
    if num_warps is not None:
        cfg = dataclasses.replace(cfg, num_warps=num_warps)
    lead = x.shape[:-1]
    if impl == "xla":
        ids, wts = reference(x, w, k, norm=norm, weights_dtype=weights_dtype, split_k=cfg.split_k)
        return ids.reshape(*lead, k), wts.reshape(*lead, k)
    interpret = impl == "pallas_interpret"
    n_pad, kp = max(16, next_pow2(n)), max(16, next_pow2(k))
    kernel = functools.partial(_kernel, cfg=cfg, k_per_split=kk // cfg.split_k, n=n, n_pad=n_pad, k=k, kp=kp,
                               norm=norm, dtype=jnp.dtype(weights_dtype), logits_dtype=x.dtype,
                               precision=dot_precision(x.dtype), interpret=interpret)
    out_shape = [jax.ShapeDtypeStruct((cfg.split_k, n), jnp.float32), jax.ShapeDtypeStruct((k,), jnp.int32),
                 jax.ShapeDtypeStruct((k,), jnp.float32)]
    _, ids, wts = counted_call(kernel, grid=(n // cfg.block_n, cfg.split_k), operands=(x.reshape(kk, 1), w),
                               out_shape=out_shape, counters=1, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                               interpret=interpret, name="router_choice")
    return ids.reshape(*lead, k), wts.reshape(*lead, k)
