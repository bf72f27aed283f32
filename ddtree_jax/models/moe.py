"""Mixture-of-experts blocks: one sparse expert computation, two routers.

Expert products (every MoE family): `expert_mlp(x [T, H], expert_ids [T, k] int32, weights [T, k]
float32, w_in, w_out, *, act, impl) -> y [T, H]` with stacked expert weights [E, in, out]:
    y_t = sum_j weights[t, j] * act(x_t @ w_in[e]) @ w_out[e],   e = expert_ids[t, j]
- act "silu_glu" (Qwen): w_in [E, H, 2I] holds gate | up per expert (gate columns first),
  act(h) = silu(gate) * up;  act "relu2" (NemotronH): w_in [E, H, I], act(h) = relu(h)^2;
- w_out [E, I, H]; each (token, choice)'s product is made in the weights' dtype and the k products
  are summed in float32 with their weights, then rounded to x's dtype.
A token may pick the same expert as other tokens (tree nodes, batch rows share experts); exact:
no capacity factor, nothing dropped.

Routers:
- Qwen3.5-MoE / Qwen3-Next (`SparseMoeBlock`, HF Qwen3_5MoeSparseMoeBlock / Qwen3NextSparseMoeBlock):
      logits = x @ W_router (params dtype) ; p = softmax(float32(logits)) over the E experts
      top-k of p (ties: the lower expert index first) ; weights = p_top / sum(p_top) if renormalised
      (always in Qwen3.5-MoE, norm_topk_prob in Qwen3-Next), rounded to the params dtype as HF does
      out = experts(x) + sigmoid(x @ w_shared_gate) * shared_expert(x)      (shared: SwiGLU)
- NemotronH (`NemotronMoE`, HF NemotronHMoE + NemotronHTopkRouter):
      logits = x_f32 @ W_router_f32 ;  s = sigmoid(logits) ; choice = s + e_score_correction_bias
      group score = sum of the top-2 `choice` in each of n_group groups; keep the topk_group best
      groups; top_k experts by `choice` among the kept ones; weights = s at those experts
      (NOT choice), / (sum + 1e-20) if norm_topk_prob, * routed_scaling_factor
      out = experts(x') (act relu2; x' = fc1_latent(x) if latent, then fc2_latent(out))
          + shared_experts(x)                                        (relu^2 MLP, no gate)

Ties in router scores: torch.topk leaves the order of equal values unspecified (its CPU kernel
selects with std::partial_sort / std::nth_element, whose pick among equal values depends on k and
on the other values: neither the lower nor the higher index first, and CUDA's kernel differs), so
HF has no tie rule to copy. Here jax.lax.top_k decides: equal scores go to the lower expert index,
on every path (prefill, decode, tree verify), which is what lossless speculation needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.config import TargetConfig
from ddtree_jax.models.layers import Linear, Relu2MLP, SwiGLU, _init, relu2

HIGHEST = jax.lax.Precision.HIGHEST
SILU_GLU, RELU2 = "silu_glu", "relu2"
ACTS = (SILU_GLU, RELU2)


# ---- expert products --------------------------------------------------------------------------
def _activate(h: jax.Array, act: str) -> jax.Array:
    if act == SILU_GLU:
        gate, up = jnp.split(h, 2, axis=-1)
        return jax.nn.silu(gate) * up
    if act == RELU2:
        return relu2(h)
    raise ValueError(f"unknown expert activation {act!r}; expected one of {ACTS}")


def dense_combine(idx, weights, num_experts: int):
    """Chosen experts idx [..., k] and their weights -> [..., E] weights, zero off the chosen."""
    return jnp.sum(jax.nn.one_hot(idx, num_experts, dtype=jnp.float32) * weights[..., None], axis=-2)


def expert_mlp_gathered(x, expert_ids, weights, w_in, w_out, *, act: str) -> jax.Array:
    """Each (token, choice)'s expert weights gathered ([T, k, in, out]) and only those products
    made: reads T * k expert matrices (a decode step: top_k of the E)."""
    h = jnp.einsum("th,tkhi->tki", x, w_in[expert_ids])
    out = jnp.einsum("tki,tkio->tko", _activate(h, act), w_out[expert_ids])
    return jnp.einsum("tko,tk->to", out.astype(jnp.float32), weights.astype(jnp.float32)).astype(x.dtype)


def expert_mlp_dense(x, expert_ids, weights, w_in, w_out, *, act: str) -> jax.Array:
    """Every expert on every token, combined with weights that are zero off the chosen experts
    (the reference; reads each of the E expert matrices once for all T tokens)."""
    combine = dense_combine(expert_ids, weights.astype(jnp.float32), w_in.shape[0])
    h = jnp.einsum("th,ehi->tei", x, w_in)
    out = jnp.einsum("tei,eio->teo", _activate(h, act), w_out)
    return jnp.einsum("teo,te->to", out.astype(jnp.float32), combine).astype(x.dtype)


def gathered_reads_less(x: jax.Array, top_k: int, num_experts: int) -> bool:
    """Whether gathering each token's top_k experts reads fewer expert matrices than the dense
    form's E (static: from x's shape)."""
    tokens = 1
    for d in x.shape[:-1]:
        tokens *= d
    return tokens * top_k < num_experts


def _expert_mlp(x, expert_ids, weights, w_in, w_out, *, act: str = SILU_GLU, impl: str = "xla") -> jax.Array:
    """The expert products y [T, H] (module docstring), in jnp: the gathered form while it reads
    fewer expert matrices than the dense form (T * k < E: decoding), else the dense form (prefill,
    tree verify). Same signature as pallas_kernels/moe_experts.expert_mlp (the grouped expert
    kernel), which takes over this call; `impl` is that kernel's route, unused by the jnp forms."""
    del impl
    if gathered_reads_less(x, expert_ids.shape[-1], w_in.shape[0]):
        return expert_mlp_gathered(x, expert_ids, weights, w_in, w_out, act=act)
    return expert_mlp_dense(x, expert_ids, weights, w_in, w_out, act=act)


# The blocks call `expert_mlp`: this jnp stand-in until pallas_kernels/moe_experts.expert_mlp replaces it.
expert_mlp = _expert_mlp


# ---- Qwen3.5-MoE / Qwen3-Next ---------------------------------------------------------------------
def route_softmax_top_k(logits, *, top_k: int, norm: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [..., E] -> chosen experts [..., k] (int32, by descending probability, equal
    probabilities: lower index first) and their float32 weights (renormalised to sum 1 if norm)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, top_k)
    if norm:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return idx.astype(jnp.int32), top


class StackedExperts(nnx.Module):
    """E SwiGLU experts stacked: gate_up_proj [E, H, 2I] (per expert gate columns, then up) and
    down_proj [E, I, H] (HF's in-memory experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I],
    each expert's matrix transposed to [in, out])."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, dtype, rngs: nnx.Rngs):
        self.gate_up_proj = nnx.Param(_init(rngs, (num_experts, hidden, 2 * inter), dtype, hidden**-0.5))
        self.down_proj = nnx.Param(_init(rngs, (num_experts, inter, hidden), dtype, inter**-0.5))


class SparseMoeBlock(nnx.Module):
    """The sparse FFN of Qwen3.5-MoE and Qwen3-Next (module docstring): router (HF mlp.gate), routed
    experts (mlp.experts), shared SwiGLU expert (mlp.shared_expert) scaled by
    sigmoid(mlp.shared_expert_gate(x))."""

    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        h, e = cfg.hidden_size, cfg.moe_num_experts
        self.top_k, self.norm_topk_prob = cfg.moe_top_k, cfg.moe_norm_topk_prob
        self.router = Linear(h, e, dtype=dtype, rngs=rngs)
        self.experts = StackedExperts(e, h, cfg.moe_intermediate_size, dtype=dtype, rngs=rngs)
        self.shared_expert = SwiGLU(h, cfg.moe_shared_intermediate_size, dtype=dtype, rngs=rngs)
        self.shared_expert_gate = Linear(h, 1, dtype=dtype, rngs=rngs)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Chosen experts [..., k] and their combine weights [..., k] (float32 holding values of the
        params dtype: HF rounds the weights to it) of tokens x [..., H]."""
        idx, weights = route_softmax_top_k(self.router(x), top_k=self.top_k, norm=self.norm_topk_prob)
        return idx, weights.astype(x.dtype).astype(jnp.float32)

    def __call__(self, x: jax.Array, impl: str = "xla") -> jax.Array:
        flat = x.reshape(-1, x.shape[-1])
        idx, weights = self.route(flat)
        experts = self.experts
        routed = expert_mlp(flat, idx, weights, experts.gate_up_proj[...], experts.down_proj[...], act=SILU_GLU,
                            impl=impl)
        shared = jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat, impl)
        return (routed + shared).reshape(x.shape)


# ---- NemotronH ------------------------------------------------------------------------------------
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
    return idx.astype(jnp.int32), weights * scale


class NemotronMoE(nnx.Module):
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

    def __call__(self, x: jax.Array, impl: str = "xla") -> jax.Array:
        idx, weights = self.route(x)
        xe = self.expert_inputs(x)
        k = idx.shape[-1]
        routed = expert_mlp(xe.reshape(-1, xe.shape[-1]), idx.reshape(-1, k), weights.reshape(-1, k),
                            self.up_proj[...], self.down_proj[...], act=RELU2, impl=impl).reshape(xe.shape)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)
