"""Short causal depthwise convolution with an explicit window of past inputs.

weight is [K, C]: out_t = act(sum_m weight[m] * x_{t-(K-1)+m} (+ bias)), so weight[K-1] multiplies the
newest input (HF conv1d weight [C, 1, K] transposed). The window holds the last K-1 inputs,
oldest first; a fresh window is zeros, which matches HF's zero left-padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv(x: jax.Array, window: jax.Array, weight: jax.Array, bias: jax.Array | None = None):
    """x [B, T, C], window [B, K-1, C] -> pre-activation outputs [B, T, C] (in the weight dtype)."""
    kernel = weight.shape[0]
    t = x.shape[1]
    xs = jnp.concatenate([window.astype(weight.dtype), x.astype(weight.dtype)], axis=1)
    out = sum(xs[:, m : m + t] * weight[m] for m in range(kernel))
    if bias is not None:
        out = out + bias
    return out


def tree_conv(xs: jax.Array, window: jax.Array, weight: jax.Array, conv_src: jax.Array, bias=None) -> jax.Array:
    """Pre-activation conv outputs of tree nodes: node i's K taps are gathered through conv_src
    [B, N, K] (tree.geometry: m-th ancestor of i, or a committed window column) from
    concat(window [B, K-1, C], xs [B, N, C])."""
    seq = jnp.concatenate([window.astype(weight.dtype), xs.astype(weight.dtype)], axis=1)
    taps = jnp.take_along_axis(seq[:, :, None, :], conv_src[..., None], axis=1)  # [B, N, K, C]
    kernel = weight.shape[0]
    out = sum(taps[:, :, m] * weight[kernel - 1 - m] for m in range(kernel))
    return out if bias is None else out + bias


def next_window(x: jax.Array, window: jax.Array, n_valid: jax.Array) -> jax.Array:
    """Window after consuming the first n_valid[b] of the T inputs of each sequence."""
    keep = window.shape[1]
    xs = jnp.concatenate([window, x.astype(window.dtype)], axis=1)
    return jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, keep, axis=0))(xs, n_valid)
