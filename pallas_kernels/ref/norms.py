"""RMSNorm variants as the HF models round them (float32 math, cast back), and the L2 norm of the
Gated DeltaNet's q / k."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, zero_centered: bool,
             weight_fp32: bool = False) -> jax.Array:
    """RMSNorm of x over the last axis: zero_centered gives norm(x) * (1 + w) (Qwen3.5);
    weight_fp32 scales in float32 before the cast back (NemotronH); otherwise the plain Qwen3 /
    Llama order, cast to the input dtype first, then scaled."""
    normed = rms_normalize(x, eps)
    w = weight.astype(jnp.float32)
    if zero_centered:
        return (normed * (1.0 + w)).astype(x.dtype)
    if weight_fp32:
        return (w * normed).astype(x.dtype)
    return w.astype(x.dtype) * normed.astype(x.dtype)


def gated_rms_norm(o: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """w * rmsnorm(o) * silu(z) over the last axis, rounded as HF's Gated DeltaNet norm rounds."""
    return gate_normed(rms_normalize(o, eps).astype(o.dtype), z, weight)


def gate_normed(normed: jax.Array, z: jax.Array, weight: jax.Array) -> jax.Array:
    """The gated norm's tail: w * normed * silu(z), in normed's dtype (normed already rounded to it)."""
    return (weight * normed * jax.nn.silu(z.astype(jnp.float32))).astype(normed.dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
