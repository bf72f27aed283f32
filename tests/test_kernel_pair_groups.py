"""The one-launch grouping of an MoE layer's (token, choice) pairs by expert (`impl`: interpret
mode, natively under -m gpu) equals its reference, `group_pairs` (XLA), field for field: random
routings with repeats across tokens, ids outside [0, E) (E, -1), pair counts that are not a power
of two, a shared expert's extra group (E + 1 experts); the grouped expert kernel gives the same
output with either grouping; what the kernel cannot take is named; (-m gpu) the Qwen3.6-35B-A3B
router's shape at a DDTree-8 verify and at the most pairs the kernel takes."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import moe_experts as moe
from pallas_kernels.pair_groups import PAIR_GROUPS_MAX_PAIRS, pair_groups, problems, reference


@functools.partial(jax.jit, static_argnames=("num_experts", "block_m", "impl"))
def _groups(ids, num_experts, block_m, impl):
    return pair_groups(ids, num_experts, block_m, impl=impl)


def _ids(seed, t, k, e, invalid=0):
    """[T, k] distinct experts a token (any repeats across tokens); `invalid` of them set to E or -1."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    for n in range(invalid):
        ids[rng.integers(t), rng.integers(k)] = e if n % 2 == 0 else -1
    return jnp.asarray(ids)


def _assert_groups_equal(got, want, what):
    for name, g, w in zip(want._fields, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, name, g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{what}: {name}")


@settings(max_examples=6, deadline=None)
@given(t=st.integers(1, 40), k=st.integers(1, 8), e=st.integers(8, 300), block_m=st.sampled_from([16, 32, 64]),
       invalid=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_kernel_equals_the_reference(impl, t, k, e, block_m, invalid, seed):
    k = min(k, e)
    ids = _ids(seed, t, k, e, invalid)
    _assert_groups_equal(_groups(ids, e, block_m, impl), reference(ids, e, block_m), f"T={t} k={k} E={e}")


@pytest.mark.parametrize("t, k, e, block_m", [
    (9, 8, 256, 16),  # a 35B-A3B DDTree-8 verify (9 nodes, top-8 of 256)
    (9, 9, 257, 16),  # ... with the shared expert as one more choice and expert
    (65, 2, 4, 64),  # a few experts, each chosen by most tokens: several full tiles an expert
    (1, 1, 1, 16),  # one pair
    (PAIR_GROUPS_MAX_PAIRS // 8, 8, 256, 16),  # the most pairs the kernel takes
])
def test_kernel_equals_the_reference_at_named_shapes(impl, t, k, e, block_m):
    ids = _ids(t + k + e, t, k, e, invalid=2 if t * k > 2 else 0)
    _assert_groups_equal(_groups(ids, e, block_m, impl), reference(ids, e, block_m), f"T={t} k={k} E={e}")


def test_grouped_kernel_gives_the_same_output_with_either_grouping(impl):
    """The grouped expert kernel with config.grouping "kernel" equals "xla", bit for bit (the same
    tiles), with and without a shared expert; kernel_config takes the kernel where the form asks (by
    default) and where it takes the pairs (a shared expert's counted)."""
    rng = np.random.default_rng(3)
    t, k, e, h, inter = 9, 4, 8, 32, 16
    if impl == "pallas":
        h, inter = 8 * h, 8 * inter
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.bfloat16)
    ids = _ids(4, t, k, e, invalid=2)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    w_in = jnp.asarray(rng.normal(size=(e, h, 2 * inter)) * h**-0.5, jnp.bfloat16)
    w_out = jnp.asarray(rng.normal(size=(e, inter, h)) * inter**-0.5, jnp.bfloat16)
    shared = moe.Shared(w_in[:1] * 0.5, w_out[:1], jnp.asarray(rng.uniform(0.1, 1.0, (t,)), jnp.float32))
    cfg = moe.MoeConfig(block_m=16, up=moe.GemmConfig(block_n=16, block_k=16),
                        down=moe.GemmConfig(block_n=16, block_k=16))
    # ids traced (ids outside [0, E) are refused where concrete)
    run = jax.jit(lambda ids, s, config: moe.expert_mlp(x, ids, w, w_in, w_out, act="silu_glu", impl=impl,
                                                        config=config, shared=s), static_argnums=2)
    for s in (None, shared):
        want = np.asarray(run(ids, s, cfg))
        got = np.asarray(run(ids, s, dataclasses.replace(cfg, grouping="kernel")))
        np.testing.assert_array_equal(got, want)
    form = moe.KernelForm()  # the kernel by default (decision 0067)
    assert moe.kernel_config(9, 8, 256, 2048, 512, form).grouping == "kernel"
    assert moe.kernel_config(9, 8, 256, 2048, 512, moe.KernelForm(grouping_kernel=False)).grouping == "xla"
    assert moe.kernel_config(PAIR_GROUPS_MAX_PAIRS // 9, 8, 256, 2048, 512, form).grouping == "kernel"
    assert moe.kernel_config(PAIR_GROUPS_MAX_PAIRS // 9 + 1, 8, 256, 2048, 512, form).grouping == "xla"


def test_what_the_kernel_cannot_take_is_named():
    assert problems(9, 8, 256, 16) == []
    bad = problems(PAIR_GROUPS_MAX_PAIRS + 1, 1, 256, 8)
    assert any(f"{PAIR_GROUPS_MAX_PAIRS + 1} pairs" in b for b in bad) and any("block_m = 8" in b for b in bad)
    with pytest.raises(ValueError, match="pair_groups kernel: .* pairs"):
        pair_groups(jnp.zeros((PAIR_GROUPS_MAX_PAIRS + 1, 1), jnp.int32), 4, 16, impl="pallas_interpret")
    x = jnp.zeros((2 * PAIR_GROUPS_MAX_PAIRS, 32), jnp.float32)
    ids = jnp.zeros((2 * PAIR_GROUPS_MAX_PAIRS, 1), jnp.int32)
    w_in, w_out = jnp.zeros((4, 32, 32), jnp.float32), jnp.zeros((4, 16, 32), jnp.float32)
    config = moe.MoeConfig(grouping="kernel")
    with pytest.raises(ValueError, match="the grouping kernel: .* pairs"):
        moe.expert_mlp(x, ids, jnp.ones_like(ids, jnp.float32), w_in, w_out, act="silu_glu", impl="pallas_interpret",
                       config=config)
    assert any("grouping = 'fast'" in p for p in moe.MoeConfig(grouping="fast").problems())


@pytest.mark.script
def test_bench_cpu_smoke(tmp_path):
    """scripts.bench.kernels pair_groups --cpu-smoke: the kernel equals the XLA form in the
    interpreter and both land in the report."""
    import json

    from scripts.bench import kernels as bench

    out = tmp_path / "pg.json"
    assert bench.main(["pair_groups", "--cpu-smoke", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["ok"] and row["xla_ok"] and row["kernel_w4_ok"] and row["kernel_w4_wall_us"] > 0
