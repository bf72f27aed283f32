"""NemotronH MoE block (ddtree_jax/models/moe.py): the gathered form (each token's chosen experts
only: what a decode step runs) equals the dense form (every expert, zero weights off the chosen
ones: prefill and tree verify), and the block picks the one that reads fewer expert matrices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax.config import TargetConfig
from ddtree_jax.models.moe import NemotronMoE, gathered_reads_less
from tests.hf_mamba_models import config_dict, random_jax_params

BLOCKS = {}


def _block(name: str, dtype):
    """A randomised MoE block of the tiny NemotronH fixture `name` (nemo_b: grouped routing,
    latent projections, biases, no top-k normalization)."""
    if (name, dtype) not in BLOCKS:
        cfg = TargetConfig.from_hf_dict(config_dict(name))
        gd, params = nnx.split(NemotronMoE(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
        params = random_jax_params(params, 3)
        # a spread correction bias, so group routing and the bias both matter
        params["correction_bias"][...] = jnp.linspace(-0.3, 0.3, cfg.moe_num_experts, dtype=jnp.float32)
        BLOCKS[name, dtype] = cfg, gd, params
    return BLOCKS[name, dtype]


@settings(max_examples=8, deadline=None)
@given(name=st.sampled_from(["nemo_a", "nemo_b"]), tokens=st.sampled_from([1, 3]), seed=st.integers(0, 2**31 - 1),
       bf16=st.booleans())
def test_gathered_form_equals_dense_form(name, tokens, seed, bf16):
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    cfg, gd, params = _block(name, dtype)
    x = jnp.asarray(np.random.default_rng(seed).normal(size=(tokens, cfg.hidden_size)), dtype)

    g, d, idx = _both(name, dtype)(params, x)
    assert idx.shape == (tokens, cfg.moe_top_k) and len(np.unique(np.asarray(idx), axis=1)) == tokens
    tol = 2e-2 if bf16 else 1e-5
    np.testing.assert_allclose(np.asarray(g), np.asarray(d), rtol=tol, atol=tol * float(np.abs(np.asarray(d)).max()))


FORMS = {}


def _both(name, dtype):
    """Jitted once per fixture and dtype (one compilation per token count serves every example):
    (gathered, dense, chosen experts) of a block."""
    if (name, dtype) in FORMS:
        return FORMS[name, dtype]
    cfg, gd, _ = _block(name, dtype)

    @jax.jit
    def both(p, x):
        from ddtree_jax.models.moe import dense_combine

        m = nnx.merge(gd, p)
        idx, w = m.route(x)
        xe = m.expert_inputs(x)
        return m._gathered(xe, idx, w), m._dense(xe, dense_combine(idx, w, cfg.moe_num_experts)), idx

    FORMS[name, dtype] = both
    return both


@pytest.mark.parametrize("tokens,gathered", [(1, True), (2, True), (3, False), (8, False)])
def test_block_reads_the_fewer_expert_matrices(tokens, gathered):
    """nemo_b: 8 experts, top 3. One or two tokens (6 assignments < 8) gather their experts' weights
    and multiply [.., 3, in, out] slices; three tokens or more (9+ >= 8) run every expert once."""
    cfg, gd, params = _block("nemo_b", jnp.float32)
    x = jnp.zeros((1, tokens, cfg.hidden_size), jnp.float32)
    assert gathered_reads_less(x, cfg.moe_top_k, cfg.moe_num_experts) == gathered
    jaxpr = str(jax.make_jaxpr(lambda p, x: nnx.merge(gd, p)(x))(params, x))
    d, inter = cfg.moe_latent_size, cfg.moe_intermediate_size
    slices = f"[1,{tokens},{cfg.moe_top_k},{d},{inter}]"  # the chosen experts' up weights, gathered
    every = f"[1,{tokens},{cfg.moe_num_experts},{inter}]"  # every expert's hidden activations
    assert (slices in jaxpr) == gathered and (every in jaxpr) != gathered
    out = jax.jit(lambda p, x: nnx.merge(gd, p)(x))(params, x + 0.5)
    assert out.shape == x.shape and bool(jnp.all(jnp.isfinite(out)))
