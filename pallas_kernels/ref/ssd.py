"""Mamba2 state-space duality (SSD) in pure JAX: one-token step, chunked prefill, the block form
that serves both chunks and trees, and the path-commit scan.

Per head h (scalar decay), with state h_t [head_dim P, state N]:
    a_t = dt_t * A_h                      (A_h = -exp(A_log_h) < 0, dt_t > 0)
    h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T
    y_t = h_t C_t + D_h x_t
Head h reads group g = h // (H / G) of B and C (HF `repeat_interleave`). Inside this module heads
are laid out as (G, R) with h = g * R + r, so B and C are never copied per head.

A block of T tokens in which token i sees the tokens j in `visible[i]` (i itself and the earlier
tokens on its path) has the closed form, with path sums Acs_i = sum_{j visible to i} a_j:
    y_i = exp(Acs_i) C_i . h0 + sum_{j visible} exp(Acs_i - Acs_j) (C_i . B_j) dt_j x_j + D x_i
A chain (visible = lower triangle, Acs = cumsum) is one chunk of the chunked prefill; a tree
(visible = ancestor-or-self) is tree verification. The mask is applied BEFORE exp: for
non-visible pairs Acs_i - Acs_j can be large and positive (inf * 0 = NaN otherwise).

Tokens to skip (padding) must carry dt = 0: then a = 0 and dt x B^T = 0, the state is unchanged.
Everything runs in float32 at HIGHEST matmul precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def _mm(spec: str, *xs):
    return jnp.einsum(spec, *xs, precision=HIGHEST)


def _groups(x, groups: int):
    """[..., H, *rest] with heads at axis `2` -> [..., G, R, *rest] (x is [B, T, H, ...])."""
    b, t, h = x.shape[:3]
    return x.reshape(b, t, groups, h // groups, *x.shape[3:])


# ---- one token ---------------------------------------------------------------------------------
def step(x, dt, A, B, C, D, state):
    """One token. x [b, H, P], dt [b, H], A, D [H], B, C [b, G, N], state [b, H, P, N] (fp32).

    Returns (y [b, H, P], new state). `path_state` uses the same state arithmetic, so a committed
    path equals sequential decoding bit for bit (up to XLA's fusion choices)."""
    state = _advance_one(x, dt, A, B, state)
    g = B.shape[1]
    Ch = jnp.repeat(C, x.shape[1] // g, axis=1)  # [b, H, N]
    y = _mm("bhpn,bhn->bhp", state, Ch) + D[None, :, None] * x
    return y, state


def _advance_one(x, dt, A, B, state):
    g = B.shape[1]
    Bh = jnp.repeat(B, x.shape[1] // g, axis=1)  # [b, H, N]
    decay = jnp.exp(dt * A[None, :])  # [b, H]
    return state * decay[..., None, None] + (dt[..., None] * x)[..., None] * Bh[:, :, None, :]


def recurrent(x, dt, A, B, C, D, state):
    """Token-by-token over T: x [b, T, H, P], dt [b, T, H], B, C [b, T, G, N]; returns (y, state)."""

    def body(s, xs):
        xt, dtt, bt, ct = xs
        y, s = step(xt, dtt, A, bt, ct, D, s)
        return s, y

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (x, dt, B, C))
    state, y = jax.lax.scan(body, state, xs)
    return jnp.moveaxis(y, 0, 1), state


def path_state(x, dt, A, B, state):
    """Commit scan: the state after feeding P tokens in order (x [b, P, H, P_], dt [b, P, H],
    B [b, P, G, N]); tokens with dt = 0 are skipped. Same arithmetic as `step`."""

    def body(s, xs):
        xt, dtt, bt = xs
        return _advance_one(xt, dtt, A, bt, s), None

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (x, dt, B))
    state, _ = jax.lax.scan(body, state, xs)
    return state


# ---- blocks: chunks and trees ------------------------------------------------------------------
def path_sums(dt, A, visible=None):
    """Acs [b, H, T]: sums of a = dt * A over each token's visible set (cumsum when visible is None)."""
    a = jnp.swapaxes(dt * A[None, None, :], 1, 2)  # [b, H, T]
    if visible is None:
        return jnp.cumsum(a, axis=-1)
    return _mm("bij,bhj->bhi", visible.astype(a.dtype), a)


def block(x, dt, A, B, C, D, state, visible, acs):
    """Outputs of T tokens that each see `visible` predecessors, from the state before them.

    x [b, T, H, P]; dt [b, T, H]; B, C [b, T, G, N]; state [b, H, P, N];
    visible [T, T] or [b, T, T] bool (self included); acs [b, H, T] from `path_sums`.
    Returns y [b, T, H, P].
    """
    b, t, h, p = x.shape
    g = B.shape[2]
    r = h // g
    if visible.ndim == 2:
        visible = visible[None]
    diff = acs[..., :, None] - acs[..., None, :]  # [b, H, i, j]
    decay = jnp.exp(jnp.where(visible[:, None], diff, -jnp.inf))  # mask BEFORE exp
    decay = decay.reshape(b, g, r, t, t)
    cb = _mm("bign,bjgn->bgij", C, B)  # [b, G, i, j]
    dtg = jnp.swapaxes(dt, 1, 2).reshape(b, g, r, 1, t)  # dt_j
    m = cb[:, :, None] * decay * dtg  # [b, G, R, i, j]
    xg = _groups(x, g)  # [b, T, G, R, P]
    y = _mm("bgrij,bjgrp->bigrp", m, xg)
    h0 = state.reshape(b, g, r, p, -1)
    from_state = _mm("bign,bgrpn->bigrp", C, h0)
    exp_acs = jnp.exp(acs).reshape(b, g, r, t)
    y = y + jnp.moveaxis(exp_acs, -1, 1)[..., None] * from_state
    y = y + D.reshape(1, 1, g, r, 1) * xg
    return y.reshape(b, t, h, p)


def advance(x, dt, B, acs, state):
    """State after a chain block (acs = cumsum): exp(Acs_T) h0 + sum_j exp(Acs_T - Acs_j) dt_j x_j B_j^T."""
    b, t, h, p = x.shape
    g = B.shape[2]
    r = h // g
    end = acs[..., -1]  # [b, H]
    w = jnp.exp(end[..., None] - acs) * jnp.swapaxes(dt, 1, 2)  # [b, H, T]
    w = w.reshape(b, g, r, t)
    new = _mm("bgrj,bjgrp,bjgn->bgrpn", w, _groups(x, g), B).reshape(b, h, p, -1)
    return jnp.exp(end)[..., None, None] * state + new


def chunked(x, dt, A, B, C, D, state, chunk: int):
    """Chunked prefill over T tokens (the HF `mamba2_chunk_scan` math, chunk by chunk with a
    scan over chunks): returns (y [b, T, H, P], final state). Skipped tokens carry dt = 0."""
    b, t = x.shape[:2]
    pad = (-t) % chunk
    if pad:
        padder = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        x, dt, B, C = map(padder, (x, dt, B, C))
    nc = (t + pad) // chunk
    split = lambda a: jnp.moveaxis(a.reshape(b, nc, chunk, *a.shape[2:]), 1, 0)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))

    def body(s, xs):
        xc, dtc, bc, cc = xs
        acs = path_sums(dtc, A)
        y = block(xc, dtc, A, bc, cc, D, s, causal, acs)
        return advance(xc, dtc, bc, acs, s), y

    state, y = jax.lax.scan(body, state, tuple(map(split, (x, dt, B, C))))
    y = jnp.moveaxis(y, 0, 1).reshape(b, nc * chunk, *y.shape[3:])
    return y[:, :t], state
