"""NemotronH mixture-of-experts block (HF NemotronHMoE + NemotronHTopkRouter).

    logits = x_f32 @ W_router_f32 ;  s = sigmoid(logits)
    choice = s + e_score_correction_bias
    group score = sum of the top-2 `choice` in each of n_group groups; keep the topk_group best
    groups; top_k experts by `choice` among the kept ones; weights = s at those experts
    (NOT choice), / (sum + 1e-20) if norm_topk_prob, * routed_scaling_factor
    out = sum_k w_k down_k(relu(up_k(x'))^2)  (x' = fc1_latent(x) if latent, then fc2_latent(out))
        + shared_experts(x)                                        (relu^2 MLP, no gate)

Two exact forms of the expert products, picked by how many expert weights each would read:
- gathered (T * top_k assignments < E experts: decoding, small batches): each token's chosen
  experts' weights are gathered and only those products made, so a decode step reads top_k of the
  E expert matrices per token instead of all E (the bulk of a MoE checkpoint's bytes);
- dense (otherwise: prefill, tree verify, large batches): every expert on every token, combined
  with a [T, E] weight matrix that is zero off the chosen experts; each expert's weights are read
  once for all T tokens. (A grouped matmul over tokens sorted by expert would do the chosen
  products only here as well; not written yet.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.config import TargetConfig
from ddtree_jax.models.layers import Linear, Relu2MLP, _init, relu2
from ddtree_jax.models.mixer import StatelessMixer
from ddtree_jax.routes import REFERENCE, Routes

HIGHEST = jax.lax.Precision.HIGHEST


def dense_combine(idx, weights, num_experts: int):
    """Chosen experts idx [..., k] and their weights -> [..., E] weights, zero off the chosen."""
    return jnp.sum(jax.nn.one_hot(idx, num_experts, dtype=jnp.float32) * weights[..., None], axis=-2)


def route_top_k(logits_f32, bias, *, top_k, n_group, topk_group, norm, scale):
    """Router logits [..., E] (float32) -> chosen experts [..., k] (int32) and their weights
    [..., k] (float32)."""
    e = logits_f32.shape[-1]
    scores = jax.nn.sigmoid(logits_f32)
    choice = scores + bias
    grouped = choice.reshape(*choice.shape[:-1], n_group, e // n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [..., n_group]
    _, group_idx = jax.lax.top_k(group_scores, topk_group)
    group_mask = jnp.sum(jax.nn.one_hot(group_idx, n_group, dtype=jnp.float32), axis=-2) > 0
    expert_mask = jnp.repeat(group_mask, e // n_group, axis=-1)
    masked = jnp.where(expert_mask, choice, -jnp.inf)
    _, idx = jax.lax.top_k(masked, top_k)  # [..., k]
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if norm:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return idx, weights * scale


class NemotronMoE(StatelessMixer, nnx.Module):
    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        h, e, inter = cfg.hidden_size, cfg.moe_num_experts, cfg.moe_intermediate_size
        d = cfg.moe_latent_size or h
        self.router = nnx.Param(_init(rngs, (h, e), jnp.float32, h**-0.5))  # kept in float32 (HF keeps it fp32)
        self.correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32))
        self.up_proj = nnx.Param(_init(rngs, (e, d, inter), dtype, d**-0.5))  # [E, in, out]
        self.down_proj = nnx.Param(_init(rngs, (e, inter, d), dtype, inter**-0.5))
        self.shared_experts = Relu2MLP(h, cfg.moe_shared_intermediate_size, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        if cfg.moe_latent_size:
            self.fc1_latent_proj = Linear(h, d, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
            self.fc2_latent_proj = Linear(d, h, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Chosen experts [..., k] and their combine weights [..., k] (float32) of tokens x."""
        cfg = self.cfg
        logits = jnp.einsum("...h,he->...e", x.astype(jnp.float32), self.router[...].astype(jnp.float32), precision=HIGHEST)
        return route_top_k(
            logits, self.correction_bias[...].astype(jnp.float32), top_k=cfg.moe_top_k, n_group=cfg.moe_n_group,
            topk_group=cfg.moe_topk_group, norm=cfg.moe_norm_topk_prob, scale=cfg.moe_routed_scaling_factor,
        )

    def expert_inputs(self, x: jax.Array) -> jax.Array:
        """What the experts read: x, or its latent projection."""
        return x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)

    def __call__(self, x: jax.Array, routes: Routes = REFERENCE) -> jax.Array:
        cfg = self.cfg
        idx, weights = self.route(x)
        xe = self.expert_inputs(x)
        if gathered_reads_less(x, cfg.moe_top_k, cfg.moe_num_experts):
            routed = self._gathered(xe, idx, weights).astype(x.dtype)
        else:
            routed = self._dense(xe, dense_combine(idx, weights, cfg.moe_num_experts)).astype(x.dtype)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)

    def _dense(self, xe: jax.Array, combine: jax.Array) -> jax.Array:
        """Every expert on every token; combine [..., E] is zero off the chosen experts."""
        hidden = relu2(jnp.einsum("...d,edi->...ei", xe, self.up_proj[...]))
        out = jnp.einsum("...ei,eid->...ed", hidden, self.down_proj[...])
        return jnp.einsum("...ed,...e->...d", out.astype(jnp.float32), combine)

    def _gathered(self, xe: jax.Array, idx: jax.Array, weights: jax.Array) -> jax.Array:
        """Each token's chosen experts only: their weights gathered [..., k, in, out]."""
        hidden = relu2(jnp.einsum("...d,...kdi->...ki", xe, self.up_proj[...][idx]))
        out = jnp.einsum("...ki,...kid->...kd", hidden, self.down_proj[...][idx])
        return jnp.einsum("...kd,...k->...d", out.astype(jnp.float32), weights)


def gathered_reads_less(x: jax.Array, top_k: int, num_experts: int) -> bool:
    """Whether gathering each token's top_k experts reads fewer expert matrices than the dense
    form's E (static: from x's shape)."""
    tokens = 1
    for d in x.shape[:-1]:
        tokens *= d
    return tokens * top_k < num_experts
