"""The router's choice made inside the experts' first decode launch (moe_experts.chosen_expert_mlp,
decision 0071): the same experts and weights as softmax_top_k's kernel followed by expert_mlp, and
one error naming each problem where it cannot run. Interpret mode by default, natively under -m gpu."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pallas_kernels import moe_experts as moe
from pallas_kernels.moe_experts import DecodeConfig, GemmConfig
from tests.test_kernel_moe_experts import CONFIGS, _assert_close, _problem, _shared

CHOICE_CONFIGS = {
    "split_xla": DecodeConfig(up=GemmConfig(block_n=16, block_k=16, split_k=2, layout="rows", masked_row=True),
                              down=GemmConfig(block_n=16, block_k=16, layout="rows"), combine="xla"),
    "kernel": DecodeConfig(up=GemmConfig(block_n=16, block_k=16), down=GemmConfig(block_n=16, block_k=16),
                           combine="kernel"),
}


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), t=st.sampled_from([1, 2]), k=st.sampled_from([1, 4, 8]),
       e=st.sampled_from([8, 12]), partials=st.sampled_from([0, 1, 3]), bf16=st.booleans(), norm=st.booleans(),
       cfg=st.sampled_from(sorted(CHOICE_CONFIGS)), shared=st.sampled_from(["none", "gate", "parts"]))
def test_choice_in_the_first_launch_equals_the_choice_apart(impl, seed, t, k, e, partials, bf16, norm, cfg, shared):
    """moe.chosen_expert_mlp (the router's softmax top-k made in the decode path's first launch, each
    routed program choosing its token's experts; decision 0071) against softmax_top_k's kernel then
    expert_mlp: the same ids (coarse logits, so ties across the top-k boundary: the lower index),
    weights within one rounding, y within the decode path's own bound; logits as the router's
    float32 partial sums (1 or 3) or whole; a shared expert with its gate, and the weighted parts."""
    from pallas_kernels.softmax_top_k import softmax_top_k

    dtype = "bfloat16" if bf16 else "float32"
    h, inter = (32, 16) if impl != "pallas" else (256, 128)
    x, _, _, w_in, w_out = _problem(seed % 1000, t, min(k, e), e, h, inter, "silu_glu", dtype, "random")
    rng = np.random.default_rng(seed)
    coarse = rng.integers(-4, 4, size=(max(partials, 1), t, e)) * 0.5  # ties across the top-k boundary
    lt = jnp.dtype(dtype)
    if partials:
        choice = moe.Choice(jnp.asarray(coarse, jnp.float32), k, norm, lt, logits_dtype=lt)
    else:
        choice = moe.Choice(jnp.asarray(coarse[0], lt), k, norm, lt)
    with_shared = shared != "none" and CHOICE_CONFIGS[cfg].combine == "xla"
    sh = None
    if with_shared:
        base = _shared(seed % 97, t, h, inter, "silu_glu", dtype, "in_out")
        sh = moe.Shared(base.w_in, base.w_out, gate_w=jnp.asarray(rng.normal(size=(h,)) * h**-0.5, dtype))
    parts = shared == "parts" and with_shared
    fn = jax.jit(lambda x, lg: moe.chosen_expert_mlp(x, choice._replace(logits=lg), w_in, w_out, act="silu_glu",
                                                     impl=impl, config=CHOICE_CONFIGS[cfg], shared=sh, parts=parts))
    y, ids, wts = fn(x, choice.logits)
    want_ids, want_w = softmax_top_k(choice.logits, k, norm=norm, weights_dtype=lt, impl=impl,
                                     logits_dtype=choice.logits_dtype)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(wts), np.asarray(want_w), rtol=2**-7 if bf16 else 1e-6)
    want = moe.expert_mlp(x, want_ids, want_w, w_in, w_out, act="silu_glu", impl=impl, config=CHOICE_CONFIGS[cfg],
                          shared=sh, parts=parts)
    _assert_close(jnp.sum(y, axis=0) if parts else y, jnp.sum(want, axis=0) if parts else want, dtype, cfg)


def test_choice_in_the_first_launch_is_refused_where_it_cannot_run():
    """Another form than the two-launch decode path (impl 'xla', the grouped kernel, the one-launch
    form), or a router the choice cannot take: one error naming each problem; takes_choice agrees."""
    x, _, _, w_in, w_out = _problem(0, 1, 4, 8, 32, 16, "silu_glu", "float32", "random")
    choice = moe.Choice(jnp.zeros((1, 8), jnp.float32), 4, True)
    for impl, config in (("xla", None), ("pallas_interpret", CONFIGS["small"]),
                         ("pallas_interpret", CONFIGS["fused"])):
        with pytest.raises(ValueError, match="the choice runs in the decode path's first launch"):
            moe.chosen_expert_mlp(x, choice, w_in, w_out, act="silu_glu", impl=impl, config=config)
    bad = moe.Choice(jnp.zeros((1, 8), jnp.bfloat16), 9, True, logits_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"\[T, E\], or float32 partial sums.*top-9 of 8 experts"):
        moe.chosen_expert_mlp(x, bad, w_in, w_out, act="silu_glu", impl="pallas_interpret")
    bf = jnp.bfloat16
    assert moe.takes_choice(1, 8, 256, 2048, 512, dtype=bf, impl="pallas")
    assert not moe.takes_choice(1, 8, 256, 2048, 512, dtype=bf, impl="xla")
    assert not moe.takes_choice(2, 8, 256, 2048, 512, dtype=bf, impl="pallas")  # 16 pairs: the grouped kernel
    assert not moe.takes_choice(1, 8, 256, 2048, 512, dtype=bf, impl="pallas", form=moe.KernelForm(fused=True))
    assert not moe.takes_choice(1, 8, 256, 2048, 512, dtype=jnp.int8, impl="pallas")  # a dtype the kernels refuse
