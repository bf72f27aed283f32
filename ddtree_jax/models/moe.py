"""Mixture-of-experts blocks: one sparse expert computation, two routers.

Expert products (every MoE family): `experts(x [T, H], expert_ids [T, k] int32, weights [T, k]
float32, w_in, w_out, *, act, routes) -> y [T, H]` (pallas_kernels/moe_experts.py: the grouped
expert kernel and its XLA forms) with stacked expert weights [E, in, out]:
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

import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.config import TargetConfig
from ddtree_jax.models.layers import Linear, Relu2MLP, SplitKParts, SwiGLU, _init, dense
from ddtree_jax.models.mixer import StatelessMixer
from ddtree_jax.routes import REFERENCE, Routes
from pallas_kernels import moe_experts, row_product
from pallas_kernels.router_choice import router_choice
from pallas_kernels.softmax_top_k import SOFTMAX_TOP_K_MAX_K, SOFTMAX_TOP_K_MAX_LEN, softmax_top_k

HIGHEST = jax.lax.Precision.HIGHEST
SILU_GLU, RELU2 = moe_experts.ACTS


# ---- expert products --------------------------------------------------------------------------
def experts(x, expert_ids, weights, w_in, w_out, *, act: str, routes: Routes = REFERENCE,
            shared: moe_experts.Shared | None = None, parts: bool = False,
            choice: moe_experts.Choice | None = None) -> jax.Array:
    """The expert products y [T, H] (module docstring) through pallas_kernels/moe_experts.py: with
    kernels on (routes.moe_experts_kernel) the kernels: their decode path (one row per (token,
    choice), no grouping) while T * k <= routes.moe_decode_max_pairs, else the grouped kernel,
    which reads each touched expert's weights once per tile of its tokens; otherwise the kernel
    module's XLA form (each (token, choice)'s weights gathered while T * k < E, else tokens grouped
    by expert). A layer the kernels cannot take is announced by a warning when traced and runs the
    XLA form. `shared`: a shared expert summed as one more choice (callers pass it where
    `fuses_shared` says the form takes it). parts: y as float32 partials [n, T, H]
    (moe_experts.expert_mlp's `parts`). choice (expert_ids and weights None; where `takes_choice`
    says): the router's logits, the experts chosen inside the decode path's first launch
    (moe_experts.chosen_expert_mlp)."""
    if choice is not None:
        return moe_experts.chosen_expert_mlp(x, choice, w_in, w_out, act=act, impl=routes.impl,
                                             form=routes.moe_kernel_form(), shared=shared, parts=parts)[0]
    impl = "xla"
    if routes.kernels and routes.moe_experts_kernel:
        problems = moe_experts.kernel_problems(w_in.shape[1], w_out.shape[1], w_in.shape[0], expert_ids.shape[-1],
                                               x.dtype)
        if problems:
            warnings.warn("the MoE expert products use the XLA form, not the grouped kernel: " + "; ".join(problems),
                          stacklevel=3)
        else:
            impl = routes.impl
    return moe_experts.expert_mlp(x, expert_ids, weights, w_in, w_out, act=act, impl=impl,
                                  form=routes.moe_kernel_form(), shared=shared, parts=parts)


def fuses_shared(tokens: int, top_k: int, w_in, w_out, shared_inter: int, dtype, routes: Routes) -> bool:
    """Whether a shared expert of intermediate size shared_inter runs inside the expert kernels
    (kernels on, the routed experts' sizes): in the decode path as T more pairs
    (routes.moe_shared_in_decode_kernel; the decode path with XLA's combine), or in the grouped
    kernel as one more expert of the grouping (routes.moe_shared_in_grouped_kernel: tree verify,
    prefill). One launch pair for routed and shared experts instead of the shared expert's own
    products, pads, gate and sum."""
    e, h, inter = w_in.shape[0], w_in.shape[1], w_out.shape[1]
    if not (routes.kernels and routes.moe_experts_kernel and shared_inter == inter
            and not moe_experts.kernel_problems(h, inter, e, top_k, dtype)):
        return False
    form = routes.moe_kernel_form()
    decode = isinstance(moe_experts.kernel_config(tokens, top_k, e, h, inter, form), moe_experts.DecodeConfig)
    wanted = routes.moe_shared_in_decode_kernel if decode else routes.moe_shared_in_grouped_kernel
    return wanted and moe_experts.takes_shared(tokens, top_k, e, h, inter, impl=routes.impl, form=form)


# ---- Qwen3.5-MoE / Qwen3-Next ---------------------------------------------------------------------
def route_softmax_top_k(logits, *, top_k: int, norm: bool, weights_dtype=jnp.float32,
                        routes: Routes = REFERENCE) -> tuple[jax.Array, jax.Array]:
    """Router logits [..., E] -> chosen experts [..., k] (int32, by descending probability, equal
    probabilities: lower index first) and their float32 weights (renormalised to sum 1 if norm,
    rounded to weights_dtype), through pallas_kernels/softmax_top_k.py: one kernel launch with
    kernels on (routes.moe_router_kernel; announced when a router is too wide), else its XLA
    reference. Every path (prefill, decode, tree verify) takes the same form, so a token's experts
    do not depend on how many tokens share the call. logits may be SplitKParts (a one-row router
    product of the row-product kernel): the kernel adds them and rounds to weights_dtype, the
    logits' dtype, as XLA's sum would."""
    parts = logits.parts if isinstance(logits, SplitKParts) else None
    impl = "xla"
    if routes.kernels and routes.moe_router_kernel:
        e = (logits if parts is None else parts).shape[-1]
        if e <= SOFTMAX_TOP_K_MAX_LEN and top_k <= SOFTMAX_TOP_K_MAX_K:
            impl = routes.impl
        else:
            warnings.warn(f"the MoE router's top-{top_k} of {e} experts uses XLA: the softmax top-k kernel takes up "
                          f"to {SOFTMAX_TOP_K_MAX_LEN} experts and k up to {SOFTMAX_TOP_K_MAX_K}", stacklevel=3)
    if parts is not None:
        if impl == "xla":
            return softmax_top_k(dense(logits, weights_dtype), top_k, norm=norm, weights_dtype=weights_dtype)
        return softmax_top_k(parts, top_k, norm=norm, weights_dtype=weights_dtype, impl=impl,
                             logits_dtype=weights_dtype)
    return softmax_top_k(logits, top_k, norm=norm, weights_dtype=weights_dtype, impl=impl)


class StackedExperts(nnx.Module):
    """E SwiGLU experts stacked: gate_up_proj [E, H, 2I] (per expert gate columns, then up) and
    down_proj [E, I, H] (HF's in-memory experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I],
    each expert's matrix transposed to [in, out])."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, dtype, rngs: nnx.Rngs):
        self.gate_up_proj = nnx.Param(_init(rngs, (num_experts, hidden, 2 * inter), dtype, hidden**-0.5))
        self.down_proj = nnx.Param(_init(rngs, (num_experts, inter, hidden), dtype, inter**-0.5))


class SparseMoeBlock(StatelessMixer, nnx.Module):
    """The sparse FFN of Qwen3.5-MoE and Qwen3-Next (module docstring): router (HF mlp.gate), routed
    experts (mlp.experts), shared SwiGLU expert (mlp.shared_expert) scaled by
    sigmoid(mlp.shared_expert_gate(x)). `parts_out` (set by the layer that owns it, where an add +
    RMSNorm kernel consumes the output): where the experts' decode path takes the shared expert
    and routes.moe_parts_into_norm, the block returns SplitKParts, one weighted partial per choice
    written by the experts' second launch, so no combine launch runs."""

    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        h, e = cfg.hidden_size, cfg.moe_num_experts
        self.top_k, self.norm_topk_prob = cfg.moe_top_k, cfg.moe_norm_topk_prob
        self.router = Linear(h, e, dtype=dtype, rngs=rngs)
        self.experts = StackedExperts(e, h, cfg.moe_intermediate_size, dtype=dtype, rngs=rngs)
        self.shared_expert = SwiGLU(h, cfg.moe_shared_intermediate_size, dtype=dtype, rngs=rngs)
        self.shared_expert_gate = Linear(h, 1, dtype=dtype, rngs=rngs)
        self.parts_out = False

    def route(self, x: jax.Array, routes: Routes = REFERENCE) -> tuple[jax.Array, jax.Array]:
        """Chosen experts [..., k] and their combine weights [..., k] (float32 holding values of the
        params dtype: HF rounds the weights to it) of tokens x [..., H]. One row with
        routes.moe_router_fused: the product and the choice in one launch (router_choice)."""
        kernel = routes.kernels and routes.moe_router_kernel  # takes the row-product kernel's partials
        if kernel and routes.moe_router_fused and x.size == x.shape[-1]:
            r, w = self.router, self.router.kernel[...]
            problems = [] if r.scale is None and r.bias is None else ["an int8 or biased router"]
            problems += [] if w.dtype == x.dtype else [f"router weights {w.dtype} for a {x.dtype} row"]
            problems += row_product.problems(*w.shape, x.dtype)
            if w.shape[1] > SOFTMAX_TOP_K_MAX_LEN or self.top_k > min(w.shape[1], SOFTMAX_TOP_K_MAX_K):
                problems.append(f"top-{self.top_k} of {w.shape[1]} experts")
            if not problems:
                return router_choice(x, w, self.top_k, norm=self.norm_topk_prob, weights_dtype=x.dtype,
                                     impl=routes.impl)
            warnings.warn("the MoE router's product and choice run as two launches, not router_choice's one: "
                          + "; ".join(problems), stacklevel=3)
        return route_softmax_top_k(self.router(x, routes, one_row_parts=kernel), top_k=self.top_k,
                                   norm=self.norm_topk_prob, weights_dtype=x.dtype, routes=routes)

    def choice_in_experts(self, x: jax.Array, routes: Routes) -> moe_experts.Choice | None:
        """The router's logits of tokens x [T, H] as the experts' decode launch takes them to choose
        from (routes.moe_choice_in_experts, where moe_experts.takes_choice says), else None: the
        choice is then its own launch (`route`)."""
        w_in = self.experts.gate_up_proj
        e, h, inter = w_in.shape[0], w_in.shape[1], self.experts.down_proj.shape[1]
        if not (routes.kernels and routes.moe_router_kernel and routes.moe_choice_in_experts
                and not (routes.moe_router_fused and x.shape[0] == 1)
                and moe_experts.takes_choice(x.shape[0], self.top_k, e, h, inter, dtype=x.dtype, impl=routes.impl,
                                             form=routes.moe_kernel_form())):
            return None
        logits = self.router(x, routes, one_row_parts=True)
        if isinstance(logits, SplitKParts):
            choice = moe_experts.Choice(logits.parts, self.top_k, self.norm_topk_prob, x.dtype, logits_dtype=x.dtype)
        else:
            choice = moe_experts.Choice(logits, self.top_k, self.norm_topk_prob, x.dtype)
        if choice.problems():
            warnings.warn("the MoE router's choice runs as a launch of its own, not in the experts' decode launch: "
                          + "; ".join(choice.problems()), stacklevel=3)
            return None
        return choice

    def __call__(self, x: jax.Array, routes: Routes = REFERENCE) -> jax.Array:
        flat = x.reshape(-1, x.shape[-1])
        choice = self.choice_in_experts(flat, routes)
        idx, weights = self.route(flat, routes) if choice is None else (None, None)
        w_in, w_out = self.experts.gate_up_proj[...], self.experts.down_proj[...]
        gate = lambda: jax.nn.sigmoid(self.shared_expert_gate(flat, routes))  # [T, 1]
        mlp, g = self.shared_expert, self.shared_expert_gate
        if mlp.gate_up_proj.scale is None and mlp.gate_up_proj.bias is None and fuses_shared(
                flat.shape[0], self.top_k, w_in, w_out, mlp.down_proj.kernel.shape[0], flat.dtype, routes):
            w_in1, w_out1 = mlp.gate_up_proj.kernel[...][None], mlp.down_proj.kernel[...][None]
            if routes.moe_gate_in_decode_kernel and g.scale is None and g.bias is None and g.kernel.dtype == flat.dtype:
                shared = moe_experts.Shared(w_in1, w_out1, gate_w=g.kernel[...][:, 0])  # the product in the kernel
            else:
                shared = moe_experts.Shared(w_in1, w_out1, gate()[:, 0].astype(jnp.float32))
            if self.parts_out and routes.moe_parts_into_norm:
                parts = experts(flat, idx, weights, w_in, w_out, act=SILU_GLU, routes=routes, shared=shared, parts=True,
                                choice=choice)
                return SplitKParts(parts.reshape(parts.shape[0], *x.shape))
            y = experts(flat, idx, weights, w_in, w_out, act=SILU_GLU, routes=routes, shared=shared, choice=choice)
        else:
            y = (experts(flat, idx, weights, w_in, w_out, act=SILU_GLU, routes=routes, choice=choice)
                 + gate() * mlp(flat, routes))
        return y.reshape(x.shape)


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
        logits = jnp.einsum("...h,he->...e", x.astype(jnp.float32), self.router[...].astype(jnp.float32),
                            precision=HIGHEST)
        return route_top_k(
            logits, self.correction_bias[...].astype(jnp.float32), top_k=cfg.moe_top_k, n_group=cfg.moe_n_group,
            topk_group=cfg.moe_topk_group, norm=cfg.moe_norm_topk_prob, scale=cfg.moe_routed_scaling_factor,
        )

    def expert_inputs(self, x: jax.Array, routes: Routes = REFERENCE) -> jax.Array:
        """What the experts read: x, or its latent projection."""
        return x if self.fc1_latent_proj is None else self.fc1_latent_proj(x, routes)

    def __call__(self, x: jax.Array, routes: Routes = REFERENCE) -> jax.Array:
        idx, weights = self.route(x)
        xe = self.expert_inputs(x, routes)
        k = idx.shape[-1]
        routed = experts(xe.reshape(-1, xe.shape[-1]), idx.reshape(-1, k), weights.reshape(-1, k),
                         self.up_proj[...], self.down_proj[...], act=RELU2, routes=routes).reshape(xe.shape)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed, routes)
        return routed + self.shared_experts(x, routes)
