"""The gated delta rule in pure JAX: one-token recurrence, chunked (WY/UT) form, and the block
form that serves both chunks and trees.

Per value head, S is [dk, dv] and one token does
    S <- exp(g) S ;  u = beta (v - S^T k) ;  S <- S + k u^T ;  o = S^T q.
A block of N tokens where token i sees the tokens j in `visible[i]` (j == i or an earlier
token on its path) has the closed form (G = path sums of g, A strictly lower triangular):
    A_ij = beta_i exp(G_i - G_j) k_i.k_j        for visible strict predecessors j
    (I + A) U = beta (V - exp(G) (K S0))
    O = exp(G) (Q S0) + ((Q K^T) * D) U,       D_ij = exp(G_i - G_j) on visible pairs
A chain (visible = lower triangle) is one chunk of the chunked prefill; a tree (visible =
ancestor-or-self) is tree verification. All math runs in float32 at HIGHEST precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ref.norms import l2_normalize

HIGHEST = jax.lax.Precision.HIGHEST
CHUNK = 64


def _mm(spec: str, *xs):
    return jnp.einsum(spec, *xs, precision=HIGHEST)


def unit_lower_solve(a, rhs):
    """Solve (I + a) u = rhs for strictly lower-triangular a [..., N, N], rhs [..., N, dv].

    On the CPU by forward substitution in a fori_loop (XLA:CPU's triangular_solve took 44 ms for
    4 x 65 x 65 systems, 100x the work); elsewhere the library triangular solve. Same algorithm,
    same exactness."""
    if jax.default_backend() != "cpu":
        system = a + jnp.eye(a.shape[-1], dtype=a.dtype)
        return jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)

    def body(i, u):
        row_a = jax.lax.dynamic_index_in_dim(a, i, axis=a.ndim - 2, keepdims=False)  # [..., N]
        row_r = jax.lax.dynamic_index_in_dim(rhs, i, axis=rhs.ndim - 2, keepdims=False)  # [..., dv]
        row = row_r - jnp.einsum("...j,...jv->...v", row_a, u, precision=HIGHEST)
        return jax.lax.dynamic_update_index_in_dim(u, row, i, axis=u.ndim - 2)

    return jax.lax.fori_loop(0, a.shape[-1], body, jnp.zeros_like(rhs))


def recurrent_step(q, k, v, g, beta, state):
    """One token. q, k [B,H,dk] (q scaled), v [B,H,dv], g, beta [B,H], state [B,H,dk,dv]."""
    state = state * jnp.exp(g)[..., None, None]
    kv_mem = _mm("bhkv,bhk->bhv", state, k)
    u = beta[..., None] * (v - kv_mem)
    state = state + k[..., :, None] * u[..., None, :]
    return _mm("bhkv,bhk->bhv", state, q), state


def recurrent(q, k, v, g, beta, state):
    """Token-by-token reference over T: inputs [B,H,T,...]; returns o [B,H,T,dv], final state."""

    def body(s, xs):
        o, s = recurrent_step(*xs, s)
        return s, o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, g, beta))
    state, o = jax.lax.scan(body, state, xs)
    return jnp.moveaxis(o, 0, 2), state


def block(q, k, v, path_g, beta, state, visible):
    """Outputs of N tokens that each see `visible` predecessors, from the state before them.

    q, k [B,H,N,dk]; v [B,H,N,dv]; path_g, beta [B,H,N]; state [B,H,dk,dv];
    visible [N,N] or [B,N,N] bool (self included). Returns (o [B,H,N,dv], u [B,H,N,dv]).
    `u` are the corrected values; the state after a path is exp(G_end) S0 + sum_j exp(G_end - G_j) k_j u_j^T
    over the path's tokens (see `advance`).
    """
    n = q.shape[2]
    if visible.ndim == 3:
        visible = visible[:, None]
    eye = jnp.eye(n, dtype=bool)
    diff = path_g[..., :, None] - path_g[..., None, :]
    # Mask BEFORE exp: for non-visible pairs the exponent can be large and positive.
    decay = jnp.exp(jnp.where(visible, diff, -jnp.inf))
    strict = decay * (~eye)
    a = beta[..., :, None] * _mm("bhik,bhjk->bhij", k, k) * strict
    exp_g = jnp.exp(path_g)[..., None]
    rhs = beta[..., None] * (v - exp_g * _mm("bhnk,bhkv->bhnv", k, state))
    u = unit_lower_solve(a, rhs)
    o = exp_g * _mm("bhnk,bhkv->bhnv", q, state) + _mm("bhij,bhjv->bhiv", _mm("bhik,bhjk->bhij", q, k) * decay, u)
    return o, u


def advance(k, u, path_g, state, end_g):
    """State after a chain of tokens: exp(end_g) S0 + sum_j exp(end_g - G_j) k_j u_j^T.

    k [B,H,N,dk], u [B,H,N,dv], path_g [B,H,N] (G_j), end_g [B,H] (G of the last token).
    Tokens that are not on the path must have zero u (beta = 0).
    """
    w = jnp.exp(end_g[..., None] - path_g)[..., None] * k
    return jnp.exp(end_g)[..., None, None] * state + _mm("bhnk,bhnv->bhkv", w, u)


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Chunked prefill over T tokens: inputs [B,H,T,...]; returns o [B,H,T,dv], final state.

    Positions to skip (padding) must carry g = 0 and beta = 0: they then leave the state as is.
    """
    b, h, t, _ = q.shape
    pad = (-t) % chunk
    if pad:
        padder = lambda a: jnp.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3))
        q, k, v, g, beta = map(padder, (q, k, v, g, beta))
    nc = (t + pad) // chunk
    split = lambda a: jnp.moveaxis(a.reshape(b, h, nc, chunk, *a.shape[3:]), 2, 0)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))

    def body(s, xs):
        qc, kc, vc, gc, bc = xs
        path_g = jnp.cumsum(gc, axis=-1)
        o, u = block(qc, kc, vc, path_g, bc, s, causal)
        return advance(kc, u, path_g, s, path_g[..., -1]), o

    state, o = jax.lax.scan(body, state, tuple(map(split, (q, k, v, g, beta))))
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, nc * chunk, -1)
    return o[:, :, :t], state


def path_state(k, v, g, beta, state):
    """Commit scan: the state after feeding P tokens in order (k [B,H,P,dk], v [B,H,P,dv],
    g, beta [B,H,P]); tokens with g = beta = 0 are skipped. Same arithmetic as `recurrent_step`,
    so a committed state equals the state of sequential decoding."""

    def body(s, xs):
        kt, vt, gt, bt = xs
        s = s * jnp.exp(gt)[..., None, None]
        u = bt[..., None] * (vt - _mm("bhkv,bhk->bhv", s, kt))
        return s + kt[..., :, None] * u[..., None, :], None

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (k, v, g, beta))
    state, _ = jax.lax.scan(body, state, xs)
    return state


# ---- the rule's inputs from a layer's projections ----------------------------------------
def gate_values(a: jax.Array, b: jax.Array, a_log: jax.Array, dt_bias: jax.Array):
    """(beta, g) float32 from the a / b projections (in the model dtype): beta = sigmoid(b),
    g = -exp(A_log) * softplus(a + dt_bias)."""
    beta = jax.nn.sigmoid(b).astype(jnp.float32)
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return beta, g


def split_heads(conv_out: jax.Array, num_k_heads: int, dk: int, num_v_heads: int, dv: int):
    """Activated conv outputs [..., conv_dim] -> float32 q (normed, scaled), k (normed) [..., Hv, dk]
    (v-head j reads k-head j // (Hv / Hk)) and v [..., Hv, dv]."""
    kd = num_k_heads * dk
    lead = conv_out.shape[:-1]
    q = conv_out[..., :kd].reshape(*lead, num_k_heads, dk)
    k = conv_out[..., kd : 2 * kd].reshape(*lead, num_k_heads, dk)
    v = conv_out[..., 2 * kd :].reshape(*lead, num_v_heads, dv)
    rep = num_v_heads // num_k_heads
    if rep > 1:
        q, k = jnp.repeat(q, rep, axis=-2), jnp.repeat(k, rep, axis=-2)
    q = l2_normalize(q.astype(jnp.float32)) * dk**-0.5
    k = l2_normalize(k.astype(jnp.float32))
    return q, k, v.astype(jnp.float32)
