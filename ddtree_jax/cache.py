"""Decoding state as immutable pytrees.

Every cache is created with a fixed capacity so jitted steps never change shape. Speculative
steps read these caches, build pending work, and return new caches on commit; nothing here
is ever mutated in place.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import jax
import jax.numpy as jnp

from ddtree_jax.config import ATTENTION, FFN_KINDS, GDN, MAMBA2, TargetConfig


class KVCache(NamedTuple):
    """Keys / values of one attention layer: [batch, kv_heads, capacity, head_dim]."""

    k: jax.Array
    v: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


class RecurrentCache(NamedTuple):
    """State of one recurrent mixer (Gated DeltaNet or Mamba2).

    conv:  the last K-1 inputs of the short causal conv, oldest first: [batch, K-1, conv_dim].
    state: the recurrent state, always float32: GDN [batch, v_heads, dk, dv];
           Mamba2 [batch, heads, head_dim, state_size].
    """

    conv: jax.Array
    state: jax.Array


# None: a block without any state (NemotronH "mlp" / "moe" blocks).
LayerCache = Union[KVCache, RecurrentCache, None]


class TargetCache(NamedTuple):
    """All layers' caches plus the number of committed tokens of each sequence."""

    layers: tuple[LayerCache, ...]
    lengths: jax.Array  # [batch] int32

    @property
    def capacity(self) -> int:
        for layer in self.layers:
            if isinstance(layer, KVCache):
                return layer.capacity
        return 1 << 30  # a purely recurrent model has no length limit


def init_target_cache(cfg: TargetConfig, batch: int, capacity: int, dtype=None) -> TargetCache:
    """Zeroed cache for `batch` sequences of up to `capacity` tokens."""
    if capacity <= 0 or batch <= 0:
        raise ValueError(f"cache needs batch > 0 and capacity > 0, got batch={batch}, capacity={capacity}")
    dtype = jnp.dtype(dtype or cfg.dtype)
    layers: list[LayerCache] = []
    for kind in cfg.layer_types:
        if kind == ATTENTION:
            shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
            layers.append(KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
        elif kind in FFN_KINDS:
            layers.append(None)
        elif kind == MAMBA2:
            layers.append(
                RecurrentCache(
                    conv=jnp.zeros((batch, cfg.conv_kernel - 1, cfg.mamba_conv_dim), dtype),
                    state=jnp.zeros(
                        (batch, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size), jnp.float32
                    ),
                )
            )
        else:
            assert kind == GDN, kind
            layers.append(
                RecurrentCache(
                    conv=jnp.zeros((batch, cfg.conv_kernel - 1, cfg.gdn_conv_dim), dtype),
                    state=jnp.zeros(
                        (batch, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim), jnp.float32
                    ),
                )
            )
    return TargetCache(tuple(layers), jnp.zeros((batch,), jnp.int32))
