"""The Pallas tree kernels wired into the model (interpret mode on CPU) compute what the XLA
reference path computes: node logits, committed state, and whole greedy generations."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax import decode
from ddtree_jax.cache import KVCache, init_target_cache
from ddtree_jax.config_fields import GDN
from ddtree_jax.routes import REFERENCE
from ddtree_jax.speculative.generate import generate
from ddtree_jax.tree import make_tree, root_path
from tests.scripted_proposers import ScriptedProposer
from tests.jaxpr_eqns import equations, kernel_name
from tests.tree_harness import INTERPRET
from tests.tiny_models import HYBRID, HYBRID_MOE, make_target

B, N, CAP = 2, 17, 64  # N = root + 16: the GDN kernel peels the root (16 rows, not 32)
MODEL = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16), seed=31, base=HYBRID)


@functools.partial(jax.jit, static_argnames=("graphdef", "routes"))
def verify_and_commit(graphdef, params, cache, tokens, parents, valid, path, count, routes):
    model = nnx.merge(graphdef, params)
    tree = make_tree(tokens, parents, valid, cache.lengths, max_depth=N - 1)
    h, _, pending = model.verify(tokens, cache, tree, routes=routes)
    return model.logits(h), model.commit(pending, path, count, cache, routes)


def test_tree_kernels_match_reference_in_the_model():
    cfg, gd, params = MODEL
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 10)), jnp.int32)
    cache = decode.prefill(gd, params, init_target_cache(cfg, B, CAP), prompt, jnp.asarray([10, 7], jnp.int32)).cache
    parents = np.full((B, N), -1)
    valid = np.zeros((B, N), bool)
    for b, n in enumerate((N, 11)):
        valid[b, :n] = True
        parents[b, 1:n] = [rng.integers(max(0, i - 3), i) for i in range(1, n)]
    # Accepted path: root -> ... -> the last valid node.
    paths, counts = np.zeros((B, N), np.int32), np.zeros(B, np.int32)
    for b, n in enumerate((N, 11)):
        p = root_path(parents[b], n - 1)
        paths[b, : len(p)] = p
        paths[b, len(p):] = p[-1]
        counts[b] = len(p)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, N)), jnp.int32)
    args = (gd, params, cache, tokens, jnp.asarray(parents, jnp.int32), jnp.asarray(valid), jnp.asarray(paths),
            jnp.asarray(counts))
    ref_logits, ref_cache = verify_and_commit(*args, routes=REFERENCE)
    got_logits, got_cache = verify_and_commit(*args, routes=INTERPRET)
    live = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(got_logits)[live], np.asarray(ref_logits)[live], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got_cache.lengths, ref_cache.lengths)
    for a, r in zip(got_cache.layers, ref_cache.layers):
        if isinstance(r, KVCache):
            n = int(ref_cache.lengths.max())
            np.testing.assert_allclose(a.k[:, :, :n], r.k[:, :, :n], rtol=1e-4, atol=1e-5)
        else:
            np.testing.assert_allclose(a.state, r.state, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(a.conv, r.conv, rtol=1e-4, atol=1e-5)


def test_budget_8_tree_reads_its_rows_masked():
    """A DDTree-8 verify (9 nodes: not peeled, not a power of two) runs the GDN tree kernel on its 9
    rows (gdn_tree_masked_rows, the default): five fewer pads a GDN layer than the padded form, the
    same logits and committed state."""
    cfg, gd, params = MODEL
    rng = np.random.default_rng(5)
    n = 9
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 10)), jnp.int32)
    cache = decode.prefill(gd, params, init_target_cache(cfg, B, CAP), prompt, jnp.asarray([10, 7], jnp.int32)).cache
    parents = np.array([[-1] + [int(rng.integers(0, i)) for i in range(1, n)] for _ in range(B)], np.int32)
    path = [root_path(p, n - 1) for p in parents]
    paths = np.array([p + [p[-1]] * (n - len(p)) for p in path], np.int32)
    args = (gd, params, cache, jnp.asarray(rng.integers(0, cfg.vocab_size, (B, n)), jnp.int32), jnp.asarray(parents),
            jnp.ones((B, n), bool), jnp.asarray(paths), jnp.asarray([len(p) for p in path], jnp.int32))
    padded_routes = INTERPRET.replace(gdn_tree_masked_rows=False)
    masked_logits, masked_cache = verify_and_commit(*args, routes=INTERPRET)
    padded_logits, padded_cache = verify_and_commit(*args, routes=padded_routes)
    np.testing.assert_allclose(np.asarray(masked_logits), np.asarray(padded_logits), rtol=1e-5, atol=1e-5)
    for a, r in zip(masked_cache.layers, padded_cache.layers):
        if not isinstance(r, KVCache):
            np.testing.assert_allclose(a.state, r.state, rtol=1e-6, atol=1e-6)
    pads = lambda routes: sum(e.primitive.name == "pad" for e in equations(
        jax.make_jaxpr(lambda *a: verify_and_commit(gd, *a, routes=routes))(*args[1:]).jaxpr))
    gdn_layers = sum(kind == GDN for kind in cfg.layer_types)
    assert gdn_layers and pads(padded_routes) - pads(INTERPRET) == 5 * gdn_layers


@functools.partial(jax.jit, static_argnames=("graphdef", "routes"))
def chain_verify_and_commit(graphdef, params, cache, tokens, count, routes):
    model = nnx.merge(graphdef, params)
    h, _, pending = model.verify(tokens, cache, None, routes=routes)
    path = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return model.logits(h), model.commit(pending, path, count, cache, routes)


def test_chain_through_the_kernels_matches_reference():
    """Linear DFlash verifies a chain (tree None): with kernels, its GDN layers run the tree
    kernel on the chain's ancestor bits (no root peel at 16 nodes) and equal the XLA form."""
    cfg, gd, params = MODEL
    rng = np.random.default_rng(2)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 10)), jnp.int32)
    cache = decode.prefill(gd, params, init_target_cache(cfg, B, CAP), prompt, jnp.asarray([10, 6], jnp.int32)).cache
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 16)), jnp.int32)
    count = jnp.asarray([16, 5], jnp.int32)
    ref_logits, ref_cache = chain_verify_and_commit(gd, params, cache, tokens, count, REFERENCE)
    got_logits, got_cache = chain_verify_and_commit(gd, params, cache, tokens, count, INTERPRET)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(ref_logits), rtol=1e-4, atol=1e-4)
    for a, r in zip(got_cache.layers, ref_cache.layers):
        if not isinstance(r, KVCache):
            np.testing.assert_allclose(a.state, r.state, rtol=1e-5, atol=1e-5)


def test_generation_with_kernels_equals_plain_greedy():
    cfg, gd, params = MODEL
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 8)), jnp.int32)
    lens = jnp.asarray([8], jnp.int32)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=24)
    table = jnp.zeros((1, 64), jnp.int32).at[0, 8:32].set(ref.tokens[0]).at[0, :8].set(prompt[0])
    proposer = ScriptedProposer(5, cfg.vocab_size, 0.3, seed=3)
    for mode in ("ddtree", "dflash"):
        got = generate(gd, params, prompt, lens, proposer=proposer, drafter_params=table, mode=mode, budget=16,
                       max_new_tokens=24, routes=INTERPRET)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens), err_msg=mode)


MOE_SIZES = dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, num_experts_per_tok=4,
                 moe_intermediate_size=32, shared_expert_intermediate_size=32)
MOE_MODEL = make_target(dict(MOE_SIZES, num_experts=8), seed=7, base=HYBRID_MOE)
MOE16_MODEL = make_target(dict(MOE_SIZES, num_experts=16), seed=7, base=HYBRID_MOE)  # a router the row kernels take


@pytest.mark.parametrize("mode, routes, model", [
    ("ar", INTERPRET, MOE_MODEL), ("ddtree", INTERPRET, MOE_MODEL),
    pytest.param("dflash", INTERPRET, MOE_MODEL, marks=pytest.mark.slow),
    ("ar", INTERPRET.replace(moe_decode_fused=True, moe_router_fused=True), MOE16_MODEL),
    pytest.param("ddtree", INTERPRET.replace(moe_shared_in_grouped_kernel=not INTERPRET.moe_shared_in_grouped_kernel),
                 MOE_MODEL, marks=pytest.mark.slow),
    pytest.param("ddtree", INTERPRET.replace(moe_grouping_kernel=not INTERPRET.moe_grouping_kernel), MOE_MODEL,
                 marks=pytest.mark.slow),
], ids=["ar", "ddtree", "dflash", "ar_one_launch_router_and_experts", "ddtree_shared_in_grouped_flipped",
        "ddtree_grouping_kernel_flipped"])
def test_moe_generation_with_kernels_equals_plain_greedy(mode, routes, model):
    """A Qwen3.5-MoE target with expert sizes the kernels take (intermediate 32, 8 experts, top 4):
    with every kernel on, plain decoding runs the router kernel and the experts' decode path with
    the shared expert inside it (one token: 4 pairs; in one launch with moe_decode_fused; the
    router's product and choice in one with moe_router_fused),
    DDTree's verify the grouped expert kernel (the shared expert inside it or apart, its pairs
    grouped by XLA or by one launch: the defaults and, under -m slow, the others); the greedy
    tokens equal plain greedy decoding through the XLA forms (DFlash under -m slow)."""
    cfg, gd, params = model
    if routes.moe_router_fused:  # the one-launch router is in the program
        block = nnx.merge(gd, params).layers[0].mlp
        x = jnp.ones((1, cfg.hidden_size), block.router.kernel[...].dtype)
        program = str(jax.make_jaxpr(lambda x: block(x, routes))(x))
        assert "router_choice" in program and "moe_decode_fused" in program
        # a router the one launch cannot take (8 experts: not a multiple of 16) says so
        small = nnx.merge(*MOE_MODEL[1:]).layers[0].mlp
        with pytest.warns(UserWarning, match="router's product and choice run as two launches.*N = 8"):
            jax.make_jaxpr(lambda x: small(x, routes))(jnp.ones((1, cfg.hidden_size), x.dtype))
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 6)), jnp.int32)
    lens = jnp.asarray([6], jnp.int32)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=12)
    if mode == "ar":
        got = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=12, routes=routes)
    else:
        table = jnp.zeros((1, 32), jnp.int32).at[0, 6:18].set(ref.tokens[0]).at[0, :6].set(prompt[0])
        got = generate(gd, params, prompt, lens, proposer=ScriptedProposer(4, cfg.vocab_size, 0.3, seed=5),
                       drafter_params=table, mode=mode, budget=8, max_new_tokens=12, routes=routes)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))


SPLIT_MODEL = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=32), seed=33, base=HYBRID)


@pytest.mark.filterwarnings("ignore:a one-row product of a")  # tiny weights the kernel cannot take: announced
def test_the_split_gdn_norm_runs_in_the_out_projection_kernel():
    """Routes.gdn_norm_into_out_proj: with a value head's columns over two programs, a batch-1 decode
    step hands the out projection the GDN output as a NormedRow and its row-product kernel norms it
    as it loads it (one fewer XLA fusion; the kernel reads the sums of squares, the gate and the
    norm weight): the same greedy tokens, hidden states within float32 rounding; at batch 2 (no
    row kernel) the norm is XLA's as without the route."""
    cfg, gd, params = SPLIT_MODEL
    on = INTERPRET.replace(gdn_decode_dv_split=2, row_product_weights=(1, 10**9))
    assert on.gdn_norm_into_out_proj  # the default
    off = on.replace(gdn_norm_into_out_proj=False)
    rng = np.random.default_rng(8)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 7)), jnp.int32)
    lens = jnp.asarray([7], jnp.int32)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=12, routes=off)
    got = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=12, routes=on)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))

    cache = decode.prefill(gd, params, init_target_cache(cfg, 1, CAP), prompt, lens).cache
    step = lambda c, t, routes: nnx.merge(gd, params)(t[:, None], c, jnp.ones((1,), jnp.int32), chunked=False,
                                                      routes=routes)[0]
    tok = jnp.asarray([3], jnp.int32)
    h_off, h_on = (jax.jit(step, static_argnums=2)(cache, tok, r) for r in (off, on))
    np.testing.assert_allclose(np.asarray(h_on), np.asarray(h_off), rtol=1e-5, atol=1e-5)

    def row_kernel_inputs(routes):  # operand counts of the step's row-product launches
        jaxpr = jax.make_jaxpr(lambda c: step(c, tok, routes))(cache).jaxpr
        return sorted(len(e.invars) for e in equations(jaxpr)
                      if e.primitive.name == "pallas_call" and "row_product" in kernel_name(e))

    gdn_layers = sum(t == GDN for t in cfg.layer_types)
    with_norm = row_kernel_inputs(on)
    assert with_norm.count(5) == gdn_layers and row_kernel_inputs(off).count(5) == 0, with_norm


@pytest.mark.parametrize("model, routes, seed", [
    (MODEL, INTERPRET, 2),
    # a value head's columns over two programs (the gated norm after the kernel), the decode
    # attention's cache in splits of >= 16 keys
    (SPLIT_MODEL, INTERPRET.replace(gdn_decode_dv_split=2, attention_split_keys=16), 5),
], ids=["defaults", "split_heads_short_splits"])
def test_plain_decoding_through_the_kernels(model, routes, seed):
    """Single-token steps with kernels attend through the tree-attention kernel (one node over the
    cache up to each row's length) and run the GDN core as one kernel (pallas_kernels/gdn_decode.py):
    a batch of two prompts of different lengths decodes the same greedy tokens as the XLA form, and
    one step's hidden states and caches (K / V, recurrent state, conv window) agree closely."""
    cfg, gd, params = model
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    lens = jnp.asarray([9, 5], jnp.int32)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=20)
    got = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=20, routes=routes)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))

    cache = decode.prefill(gd, params, init_target_cache(cfg, 2, CAP), prompt, lens).cache
    step = jax.jit(lambda c, t, routes: nnx.merge(gd, params)(t[:, None], c, jnp.ones((2,), jnp.int32), chunked=False,
                                                              routes=routes), static_argnums=2)
    tok = jnp.asarray([3, 7], jnp.int32)
    (h_ref, _, c_ref), (h_got, _, c_got) = step(cache, tok, REFERENCE), step(cache, tok, routes)
    np.testing.assert_allclose(np.asarray(h_got), np.asarray(h_ref), rtol=1e-4, atol=1e-4)
    kinds = set()
    for a, r in zip(c_got.layers, c_ref.layers):
        kinds.add(type(r).__name__)
        if isinstance(r, KVCache):
            np.testing.assert_allclose(a.k, r.k, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(a.v, r.v, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_allclose(a.state, r.state, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(a.conv, r.conv, rtol=1e-5, atol=1e-6)  # inputs from earlier layers
    assert kinds == {"KVCache", "RecurrentCache"}


def test_bf16_model_feeds_the_gdn_kernel_bf16_and_commits_exactly():
    """A bf16 model hands the GDN tree kernel bf16 q / k / v (one-pass TF32 on the GPU): node
    logits stay within bf16 rounding of the XLA path. The first GDN layer's committed state (its
    inputs are the embeddings on both paths) is replayed from the float32 pending k / v; its conv
    activations come from the prologue kernel, which rounds as the GDN decode kernel does (float32
    sum, one bf16 rounding before and one after SiLU) where XLA's bf16 conv rounds every tap, so
    it agrees to within bf16 rounding of the activations (asserted: 1 % of the state's scale);
    later layers also see bf16-rounded differences of the layers below."""
    cfg, gd, params = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                                       dtype="bfloat16"), seed=32, base=HYBRID)
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 10)), jnp.int32)
    cache = decode.prefill(gd, params, init_target_cache(cfg, B, CAP), prompt, jnp.asarray([10, 7], jnp.int32)).cache
    parents = np.stack([[-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, N)] for _ in range(B)])
    path = root_path(parents[0], N - 1)
    paths = np.tile(np.asarray(path + [path[-1]] * (N - len(path)), np.int32), (B, 1))
    counts = np.full(B, len(path), np.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, N)), jnp.int32)
    args = (gd, params, cache, tokens, jnp.asarray(parents, jnp.int32), jnp.ones((B, N), bool), jnp.asarray(paths),
            jnp.asarray(counts))
    ref_logits, ref_cache = verify_and_commit(*args, routes=REFERENCE)
    got_logits, got_cache = verify_and_commit(*args, routes=INTERPRET)
    scale = float(np.abs(np.asarray(ref_logits)).max())
    assert float(np.abs(np.asarray(got_logits) - np.asarray(ref_logits)).max()) <= 0.05 * scale
    recurrent = [(a, r) for a, r in zip(got_cache.layers, ref_cache.layers) if not isinstance(r, KVCache)]
    assert cfg.layer_types[0] == "gdn"
    first_got, first_ref = (np.asarray(x.state) for x in recurrent[0])
    assert float(np.abs(first_got - first_ref).max()) <= 0.01 * float(np.abs(first_ref).max())
    for a, r in recurrent[1:]:
        got_state, ref_state = np.asarray(a.state), np.asarray(r.state)
        assert float(np.abs(got_state - ref_state).max()) <= 0.02 * float(np.abs(ref_state).max())


@pytest.mark.parametrize("routes, want", [
    (INTERPRET, {"tree_attention", "gdn_decode"}),
    (INTERPRET.replace(gdn_decode_kernel=False), {"tree_attention"}),
    (INTERPRET.replace(attention_decode_kernel=False), {"gdn_decode"}),
    (REFERENCE, set()),
])
def test_decode_kernel_routes_pick_the_single_token_kernels(routes, want):
    """routes.attention_decode_kernel / gdn_decode_kernel take a kernel out of plain decoding: a
    decode step traces exactly the kernels its routes leave on, and warns of nothing."""
    import warnings

    cfg, gd, params = MODEL
    cache = init_target_cache(cfg, 2, CAP)
    step = lambda c, t: nnx.merge(gd, params)(t[:, None], c, jnp.ones((2,), jnp.int32), chunked=False, routes=routes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = str(jax.make_jaxpr(step)(cache, jnp.asarray([3, 7], jnp.int32)))
    assert {name for name in ("tree_attention", "gdn_decode") if name in text} == want


def test_drafter_attention_through_the_kernel():
    """routes.drafter_attention_kernel: with kernels, the DFlash drafter's (non-causal, unwindowed)
    layers attend through the tree-attention kernel as an all-visible block over the context up to
    each row's length: the same draft logits as the XLA form (float32), one kernel per layer, and
    with the route off the XLA form, announced by a warning; a DDTree generation with the real
    drafter and kernels equals plain greedy."""
    import warnings

    from ddtree_jax.models.drafter import init_drafter_cache
    from tests.test_dflash_generate import drafter_for

    cfg, gd, params = MODEL
    proposer, dparams = drafter_for(cfg, seed=4, head_dim=16)
    rng = np.random.default_rng(6)
    lengths = jnp.asarray([9, 4], jnp.int32)
    dstate = init_drafter_cache(proposer.cfg, B, 32)
    feats = jnp.asarray(rng.normal(size=(B, 9, proposer.cfg.fc_in_dim)), jnp.float32)
    dstate = proposer.extend(dparams, dstate, feats, lengths)
    bonus = jnp.asarray([3, 5], jnp.int32)
    target = nnx.merge(gd, params)

    def draft(routes):
        fn = lambda p, s: proposer.propose(p, s, target, bonus, s.lengths, routes=routes)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            text = str(jax.make_jaxpr(fn)(dparams, dstate))
            out = jax.jit(fn)(dparams, dstate)
        return out, text.count("name=tree_attention"), [w for w in caught if "drafter's attention" in str(w.message)]

    want, n_want, _ = draft(REFERENCE)
    got, n_got, warned = draft(INTERPRET)
    off, n_off, warned_off = draft(INTERPRET.replace(drafter_attention_kernel=False))
    assert n_want == 0 and n_got == proposer.cfg.num_layers and not warned
    assert n_off == 0 and warned_off and "drafter_attention_kernel is off" in str(warned_off[0].message)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(off), np.asarray(want), rtol=1e-5, atol=1e-5)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 10)), jnp.int32)
    lens = jnp.asarray([10, 6], jnp.int32)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=12)
    res = generate(gd, params, prompt, lens, proposer=proposer, drafter_params=dparams, mode="ddtree", budget=8,
                   max_new_tokens=12, routes=INTERPRET)
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))


@pytest.mark.parametrize("name", ["nemotron_h", "bamba"])
def test_one_mixer_blocks_add_the_residual_in_the_norm_kernel(name):
    """NemotronH's one-mixer blocks (and Bamba's mixer + MLP blocks) with kernels on: the residual
    adds run inside the next norm's add + RMSNorm kernel (decision 0072), which takes the mixers'
    split-K partials where their output products write them (the Mamba2 out_proj, an MLP block's
    down_proj): a decode step and a tree verify give the XLA adds' hidden states within float32
    rounding. One-mixer blocks fuse from routes.add_norm_one_mixer_min_tokens tokens a row (2: the
    verify, not the decode step; 1: both): one launch per layer with the final norm's (Bamba, whose
    blocks have an FFN, always: two per block)."""
    from tests.hf_mamba_models import make_jax_target

    heads = {"nemotron_h": dict(head_dim=16), "bamba": dict(num_attention_heads=2, num_key_value_heads=2)}[name]
    cfg, gd, params = make_jax_target(name, seed=7, overrides=heads)  # attention heads of 16 (the kernels')
    prompt = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    cache = decode.prefill(gd, params, init_target_cache(cfg, 2, CAP), prompt, jnp.asarray([9, 6], jnp.int32)).cache
    tok = jnp.asarray([3, 7], jnp.int32)
    nodes = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    tree = make_tree(nodes, jnp.asarray([[-1, 0, 0, 1, 2]] * 2, jnp.int32), jnp.ones((2, 5), bool), cache.lengths,
                     max_depth=4)

    def fn(p, c, routes):
        model = nnx.merge(gd, p)
        h, _, _ = model(tok[:, None], c, jnp.ones((2,), jnp.int32), chunked=False, routes=routes)
        return h, model.verify(nodes, c, tree, routes=routes)[0]

    def norms(routes):
        jaxpr = jax.make_jaxpr(lambda p, c: fn(p, c, routes))(params, cache).jaxpr
        return sum("add_rms_norm" in kernel_name(e) for e in equations(jaxpr) if e.primitive.name == "pallas_call")

    off, every_call = INTERPRET.replace(add_norm_kernel=False), INTERPRET.replace(add_norm_one_mixer_min_tokens=1)
    run = jax.jit(fn, static_argnums=2)
    want = run(params, cache, off)
    for routes in (INTERPRET, every_call):
        for got, w in zip(run(params, cache, routes), want):
            got, w = np.asarray(got), np.asarray(w)
            np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4 * float(np.abs(w).max()))
    per_call = (2 if cfg.block_ffn else 1) * cfg.num_layers
    assert norms(off) == 0 and norms(every_call) == 2 * per_call
    assert norms(INTERPRET) == (2 if cfg.block_ffn else 1) * per_call, (name, norms(INTERPRET))
