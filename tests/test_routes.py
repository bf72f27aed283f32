"""ddtree_jax.routes: the frozen Routes object is the only way to choose a kernel or a form, it is
part of the jit key (another route compiles another program), and bad settings are named."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.routes import IMPLS, REFERENCE, Routes
from ddtree_jax.speculative import generate as gen
from tests.tiny_models import HYBRID, make_target

INTERPRET = Routes.resolve(impl="pallas_interpret")


def test_defaults_and_resolve_per_platform():
    assert REFERENCE == Routes() and REFERENCE.impl == "xla" and not REFERENCE.kernels
    cpu, gpu = Routes.resolve(platform="cpu"), Routes.resolve(platform="gpu")
    assert cpu.impl == "xla" and cpu.sort_top_k_max == 0 and not cpu.staged_top_k
    assert gpu.impl == "pallas" and gpu.kernels and gpu.sort_top_k_max == 16 and gpu.staged_top_k
    assert gpu.prefilter_top_k and gpu.rank_select_max == 1024 and gpu.ssd_kernel_max_nodes == 16
    assert INTERPRET.impl == "pallas_interpret" and INTERPRET.ssd_kernel_max_nodes > 1000
    # the MoE decode's weighted parts and in-launch gate (decision 0056): on wherever kernels run
    assert gpu.moe_parts_into_norm and gpu.moe_gate_in_decode_kernel
    assert gpu.gdn_decode_dv_split == 4 and cpu.gdn_decode_dv_split == INTERPRET.gdn_decode_dv_split == 1
    assert INTERPRET.moe_parts_into_norm and INTERPRET.moe_gate_in_decode_kernel
    assert Routes.resolve(platform="gpu", impl="xla", split_k_parts=False).split_k_parts is False
    assert Routes.resolve().impl == ("pallas" if jax.default_backend() == "gpu" else "xla")


def test_frozen_hashable_and_reported_whole():
    a, b = Routes.resolve(platform="gpu"), Routes.resolve(platform="gpu")
    assert a == b and hash(a) == hash(b) and a != a.replace(gdn_decode_kernel=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.impl = "xla"
    d = a.as_dict()
    assert set(d) == {f.name for f in dataclasses.fields(Routes)} and d["split_k_rows"] == [32, 128]


def test_settings_parse_and_every_bad_one_is_named():
    r = REFERENCE.with_settings(["gdn_decode_kernel=false", "bits_kernel_max_nodes = 32", "split_k_rows=16,64",
                                 "impl=pallas_interpret"])
    assert (not r.gdn_decode_kernel and r.bits_kernel_max_nodes == 32 and r.split_k_rows == (16, 64)
            and r.impl == "pallas_interpret")
    with pytest.raises(ValueError) as e:
        REFERENCE.with_settings(["nope=1", "ssd_kernel_max_nodes=x", "add_norm_kernel=maybe", "impl"])
    msg = str(e.value)
    assert "no route named 'nope'" in msg and "expected an integer, got 'x'" in msg
    assert "expected true or false, got 'maybe'" in msg and "expected name=value" in msg
    with pytest.raises(ValueError, match="impl must be one of"):
        REFERENCE.with_settings(["impl=cuda"])
    with pytest.raises(ValueError, match="split_k_rows"):
        Routes(split_k_rows=(64, 32))
    with pytest.raises(ValueError, match="integer >= 0"):
        Routes(bits_kernel_max_nodes=-1)
    with pytest.raises(ValueError, match="gdn_decode_dv_split must be a power of two >= 1, got 3.*"
                                         "attention_split_keys must be a power of two >= 1, got 0"):
        Routes(gdn_decode_dv_split=3, attention_split_keys=0)
    assert REFERENCE.with_settings(["gdn_decode_dv_split=4"]).gdn_decode_dv_split == 4
    with pytest.raises(ValueError, match="gdn_decode_programs_per_sm must be >= 1, got 0"):
        Routes(gdn_decode_programs_per_sm=0)
    assert REFERENCE.with_settings(["gdn_decode_programs_per_sm=8"]).gdn_decode_programs_per_sm == 8
    assert set(IMPLS) == {"xla", "pallas", "pallas_interpret"}


def test_row_pad_window_parses_resolves_and_names_bad_values():
    """row_pad_weights: weight sizes lo..hi (inclusive) whose one-row products pad to two rows;
    (0, 0), the reference, never; the GPU default mirrors XLA's 10M strength-reduction threshold."""
    assert REFERENCE.row_pad_weights == (0, 0) and not REFERENCE.pads_row(1000)
    r = REFERENCE.with_settings(["impl=pallas", "row_pad_weights=1,9999999"])
    assert r.row_pad_weights == (1, 9_999_999) and r.as_dict()["row_pad_weights"] == [1, 9_999_999]
    assert r.pads_row(1) and r.pads_row(9_999_999) and not r.pads_row(10_000_000)
    assert not r.replace(impl="xla").pads_row(1000)  # kernels off: never
    assert not r.replace(row_pad_weights=(0, 0)).pads_row(0)
    assert Routes.resolve(platform="gpu").row_pad_weights == (1 << 19, 9_999_999)
    assert Routes.resolve(platform="cpu").row_pad_weights == (0, 0)
    assert Routes.resolve(platform="gpu", row_pad_weights=(0, 0)).row_pad_weights == (0, 0)
    for bad in ["row_pad_weights=10,5", "row_pad_weights=-1,5", "row_pad_weights=1,2,3"]:
        with pytest.raises(ValueError, match="row_pad_weights must be two element counts 0 <= lo <= hi"):
            REFERENCE.with_settings([bad])
    with pytest.raises(ValueError, match="expected integers like 32,128, got 'a,b'"):
        REFERENCE.with_settings(["row_pad_weights=a,b"])
    for bad in [(True, 5), (1.0, 5), [1, 5], 5]:
        with pytest.raises(ValueError, match="row_pad_weights"):
            Routes(row_pad_weights=bad)


def test_moe_kernel_form_carries_every_decode_route():
    """The expert kernels' form routes reach pallas_kernels.moe_experts as one KernelForm, each
    field from its route (the defaults: the H200's fastest, decisions 0064, 0065 and 0067)."""
    from pallas_kernels.moe_experts import KernelForm

    routes = Routes(moe_decode_max_pairs=16, moe_decode_fused=True, moe_decode_masked_row=False, moe_decode_rows=False,
                    moe_grouping_kernel=False)
    assert routes.moe_kernel_form() == KernelForm(max_pairs=16, fused=True, masked_row=False, rows=False,
                                                  grouping_kernel=False)
    assert Routes().moe_kernel_form() == KernelForm() and KernelForm().rows and KernelForm().masked_row
    assert REFERENCE.with_settings(["moe_decode_rows=false"]).moe_kernel_form().rows is False


def test_changing_a_route_changes_the_compiled_program():
    """Routes travel in GenSpec, a static argument of the jitted generation: a generation with
    another route is another cache entry and another program (here the GDN decode kernel leaves
    plain decoding's loop), and the same route hits the cache."""
    cfg, gd, params = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16), seed=31,
                                  base=HYBRID)
    prompt = jnp.asarray(np.arange(1, 9)[None] % cfg.vocab_size, jnp.int32)
    lens = jnp.asarray([8], jnp.int32)
    on, off = INTERPRET, INTERPRET.replace(gdn_decode_kernel=False)
    run = lambda routes: gen.generate(gd, params, prompt, lens, mode="ar", max_new_tokens=4, routes=routes)
    before = gen.generate._cache_size()
    a = run(on)
    assert gen.generate._cache_size() == before + 1
    run(on)
    assert gen.generate._cache_size() == before + 1  # the same routes: a cache hit
    b = run(off)
    assert gen.generate._cache_size() == before + 2  # another route: another program
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    text = lambda routes: str(jax.make_jaxpr(lambda p: gen.generate(gd, p, prompt, lens, mode="ar", max_new_tokens=4,
                                                                      routes=routes).tokens)(params))
    assert "gdn_decode" in text(on) and "gdn_decode" not in text(off)
