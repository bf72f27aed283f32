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
from ddtree_jax.speculative.generate import generate
from ddtree_jax.tree import make_tree, root_path
from tests.scripted_proposers import ScriptedProposer
from tests.tiny_models import HYBRID, make_target

B, N, CAP = 2, 17, 64  # N = root + 16: the GDN kernel peels the root (16 rows, not 32)
MODEL = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16), seed=31, base=HYBRID)


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"))
def verify_and_commit(graphdef, params, cache, tokens, parents, valid, path, count, impl):
    model = nnx.merge(graphdef, params)
    tree = make_tree(tokens, parents, valid, cache.lengths, max_depth=N - 1)
    h, _, pending = model.verify(tokens, cache, tree, impl=impl)
    return model.logits(h), model.commit(pending, path, count, cache, impl)


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
    ref_logits, ref_cache = verify_and_commit(*args, impl="xla")
    got_logits, got_cache = verify_and_commit(*args, impl="pallas_interpret")
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


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"))
def chain_verify_and_commit(graphdef, params, cache, tokens, count, impl):
    model = nnx.merge(graphdef, params)
    h, _, pending = model.verify(tokens, cache, None, impl=impl)
    path = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return model.logits(h), model.commit(pending, path, count, cache, impl)


def test_chain_through_the_kernels_matches_reference():
    """Linear DFlash verifies a chain (tree None): with kernels, its GDN layers run the tree
    kernel on the chain's ancestor bits (no root peel at 16 nodes) and equal the XLA form."""
    cfg, gd, params = MODEL
    rng = np.random.default_rng(2)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 10)), jnp.int32)
    cache = decode.prefill(gd, params, init_target_cache(cfg, B, CAP), prompt, jnp.asarray([10, 6], jnp.int32)).cache
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 16)), jnp.int32)
    count = jnp.asarray([16, 5], jnp.int32)
    ref_logits, ref_cache = chain_verify_and_commit(gd, params, cache, tokens, count, "xla")
    got_logits, got_cache = chain_verify_and_commit(gd, params, cache, tokens, count, "pallas_interpret")
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
                       max_new_tokens=24, kernels="pallas_interpret")
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens), err_msg=mode)


def test_plain_decoding_through_the_kernels():
    """Single-token steps with kernels attend through the tree-attention kernel (one node over the
    cache up to each row's length) and run the GDN core as one kernel (pallas_kernels/gdn_decode.py):
    a batch of two prompts of different lengths decodes the same greedy tokens as the XLA form, and
    one step's hidden states and caches (K / V, recurrent state, conv window) agree closely."""
    cfg, gd, params = MODEL
    rng = np.random.default_rng(2)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    lens = jnp.asarray([9, 5], jnp.int32)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=20)
    got = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=20, kernels="pallas_interpret")
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))

    cache = decode.prefill(gd, params, init_target_cache(cfg, 2, CAP), prompt, lens).cache
    step = jax.jit(lambda c, t, impl: nnx.merge(gd, params)(t[:, None], c, jnp.ones((2,), jnp.int32), chunked=False,
                                                            impl=impl), static_argnums=2)
    tok = jnp.asarray([3, 7], jnp.int32)
    (h_ref, _, c_ref), (h_got, _, c_got) = step(cache, tok, "xla"), step(cache, tok, "pallas_interpret")
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
    ref_logits, ref_cache = verify_and_commit(*args, impl="xla")
    got_logits, got_cache = verify_and_commit(*args, impl="pallas_interpret")
    scale = float(np.abs(np.asarray(ref_logits)).max())
    assert float(np.abs(np.asarray(got_logits) - np.asarray(ref_logits)).max()) <= 0.05 * scale
    recurrent = [(a, r) for a, r in zip(got_cache.layers, ref_cache.layers) if not isinstance(r, KVCache)]
    assert cfg.layer_types[0] == "gdn"
    first_got, first_ref = (np.asarray(x.state) for x in recurrent[0])
    assert float(np.abs(first_got - first_ref).max()) <= 0.01 * float(np.abs(first_ref).max())
    for a, r in recurrent[1:]:
        assert float(np.abs(np.asarray(a.state) - np.asarray(r.state)).max()) <= 0.02 * float(np.abs(np.asarray(r.state)).max())


def test_decode_kernel_switches_route_single_token_steps(monkeypatch):
    """attention.DECODE_KERNEL / gdn.DECODE_KERNEL (the A/B switches of `bench_e2e.py --override`)
    take a kernel out of plain decoding, with a warning: with both on a decode step traces the
    tree-attention and GDN decode kernels and warns of nothing, with either off only the other one."""
    from ddtree_jax.models import attention, gdn

    cfg, gd, params = MODEL
    cache = init_target_cache(cfg, 2, CAP)

    def kernels_traced():
        step = lambda c, t: nnx.merge(gd, params)(t[:, None], c, jnp.ones((2,), jnp.int32), chunked=False,
                                                  impl="pallas_interpret")
        text = str(jax.make_jaxpr(step)(cache, jnp.asarray([3, 7], jnp.int32)))
        return {name for name in ("tree_attention", "gdn_decode") if name in text}

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both kernels on: no route announced
        assert kernels_traced() == {"tree_attention", "gdn_decode"}
    monkeypatch.setattr(gdn, "DECODE_KERNEL", False)
    with pytest.warns(UserWarning, match="gdn.DECODE_KERNEL is False"):
        assert kernels_traced() == {"tree_attention"}
    monkeypatch.setattr(gdn, "DECODE_KERNEL", True)
    monkeypatch.setattr(attention, "DECODE_KERNEL", False)
    with pytest.warns(UserWarning, match="attention.DECODE_KERNEL is False"):
        assert kernels_traced() == {"gdn_decode"}


def test_merged_gate_up_layout_computes_the_same_mlp(monkeypatch):
    """layers.MERGED_GATE_UP (a layout switch, on by default): a SwiGLU built under it holds one
    [hidden, 2 * inter] weight; with the two separate weights concatenated into it, it computes
    the separate layout's output."""
    from ddtree_jax.models import layers

    monkeypatch.setattr(layers, "MERGED_GATE_UP", False)
    sep = layers.SwiGLU(16, 24, rngs=nnx.Rngs(0))
    monkeypatch.setattr(layers, "MERGED_GATE_UP", True)
    merged = layers.SwiGLU(16, 24, rngs=nnx.Rngs(1))
    assert merged.gate_up_proj.kernel.shape == (16, 48) and not hasattr(merged, "gate_proj")
    merged.gate_up_proj.kernel[...] = jnp.concatenate([sep.gate_proj.kernel[...], sep.up_proj.kernel[...]], axis=1)
    merged.down_proj.kernel[...] = sep.down_proj.kernel[...]
    x = jnp.asarray(np.random.default_rng(7).normal(size=(2, 3, 16)), jnp.float32)
    np.testing.assert_allclose(np.asarray(merged(x)), np.asarray(sep(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 37 s; its GDN layouts are no longer the default (MERGED_QKVZ_BA is: the next test)
def test_merged_qkv_and_ba_layouts_compute_the_same_model(monkeypatch):
    """attention.MERGED_QKV / gdn.MERGED_QKV_Z / gdn.MERGED_BA (layout switches, on by default):
    a target built under them holds one [hidden, q + k + v] attention weight, one [hidden, conv_dim
    + value_dim] qkv | z and one [hidden, 2 Hv] b | a weight per layer, and its decode step makes
    one product for q, k and v where the separate layout makes three;
    with the separate model's weights concatenated into them, a decode step (through the decode
    kernels) and a tree verify give the separate layout's outputs."""
    from ddtree_jax.models import attention, gdn

    from converters.layout import SWITCHES

    cfg = MODEL[0]
    for path in SWITCHES:  # gate | up stays separate in both (its own test above)
        monkeypatch.setattr(path, False)
    sep = type(nnx.merge(*MODEL[1:]))(cfg, rngs=nnx.Rngs(4))
    gd, params = nnx.split(sep)
    monkeypatch.setattr(attention, "MERGED_QKV", True)
    monkeypatch.setattr(gdn, "MERGED_BA", True)
    monkeypatch.setattr(gdn, "MERGED_QKV_Z", True)
    merged = type(sep)(cfg, rngs=nnx.Rngs(5))
    for ls, lm in zip(sep.layers, merged.layers):
        if ls.kind == "attention":
            a, m = ls.self_attn, lm.self_attn
            assert not hasattr(m, "q_proj")
            m.qkv_proj.kernel[...] = jnp.concatenate([a.q_proj.kernel[...], a.k_proj.kernel[...], a.v_proj.kernel[...]], 1)
            for name in ("o_proj", "q_norm", "k_norm"):
                nnx.update(getattr(m, name), nnx.state(getattr(a, name)))
        else:
            a, m = ls.linear_attn, lm.linear_attn
            assert not hasattr(m, "in_proj_a")
            m.in_proj_ba.kernel[...] = jnp.concatenate([a.in_proj_b.kernel[...], a.in_proj_a.kernel[...]], 1)
            assert not hasattr(m, "in_proj_z")
            m.in_proj_qkv_z.kernel[...] = jnp.concatenate([a.in_proj_qkv.kernel[...], a.in_proj_z.kernel[...]], 1)
            for name in ("out_proj", "norm"):
                nnx.update(getattr(m, name), nnx.state(getattr(a, name)))
            m.conv_weight[...], m.dt_bias[...], m.A_log[...] = a.conv_weight[...], a.dt_bias[...], a.A_log[...]
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            nnx.update(getattr(lm, name), nnx.state(getattr(ls, name)))
    nnx.update(merged.embed_tokens, nnx.state(sep.embed_tokens))
    nnx.update(merged.norm, nnx.state(sep.norm))
    if sep.lm_head is not None:
        nnx.update(merged.lm_head, nnx.state(sep.lm_head))
    gm, pm = nnx.split(merged)

    rng = np.random.default_rng(8)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 10)), jnp.int32)
    lens = jnp.asarray([10, 7], jnp.int32)
    caches = [decode.prefill(g, p, init_target_cache(cfg, B, CAP), prompt, lens).cache for g, p in ((gd, params), (gm, pm))]
    tok = jnp.asarray([3, 7], jnp.int32)
    steps = [lambda c, g=g, p=p: nnx.merge(g, p)(tok[:, None], c, jnp.ones((B,), jnp.int32), chunked=False,
                                                 impl="pallas_interpret")[0] for g, p in ((gd, params), (gm, pm))]
    outs = [jax.jit(step)(c) for step, c in zip(steps, caches)]
    dots = [str(jax.make_jaxpr(step)(c)).count("dot_general") for step, c in zip(steps, caches)]
    attn = sum(kind == "attention" for kind in cfg.layer_types)
    assert dots[0] - dots[1] == 2 * attn + (cfg.num_layers - attn)  # k, v ride q's product; z rides qkv's
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), rtol=1e-4, atol=1e-4)
    parents = jnp.asarray(np.stack([[-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, N)]] * B), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, N)), jnp.int32)
    paths, counts = jnp.zeros((B, N), jnp.int32), jnp.ones((B,), jnp.int32)
    got = [verify_and_commit(g, p, c, tokens, parents, jnp.ones((B, N), bool), paths, counts, impl="pallas_interpret")[0]
           for (g, p), c in zip(((gd, params), (gm, pm)), caches)]
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(got[0]), rtol=1e-4, atol=1e-4)


def test_qkvzba_layout_computes_the_same_model(monkeypatch):
    """gdn.MERGED_QKVZ_BA (the default): one [hidden, conv_dim + value_dim + 2 Hv] GDN weight, qkv |
    z | b | a. With a two-weight model's qkv | z and b | a weights joined into it, a decode step (the
    decode kernel reading the b / a products instead of multiplying x itself) and a tree verify +
    commit give the two-weight layout's outputs, and the verify makes one product fewer per GDN layer."""
    from ddtree_jax.models import gdn

    cfg = MODEL[0]
    monkeypatch.setattr(gdn, "MERGED_QKVZ_BA", False)
    base = type(nnx.merge(*MODEL[1:]))(cfg, rngs=nnx.Rngs(4))
    gd, params = nnx.split(base)
    monkeypatch.setattr(gdn, "MERGED_QKVZ_BA", True)
    whole = type(base)(cfg, rngs=nnx.Rngs(5))
    nnx.update(whole, nnx.state(base, lambda path, _: "in_proj" not in "/".join(map(str, path))))
    for lb, lw in zip(base.layers, whole.layers):
        if lb.kind == "gdn":
            a, m = lb.linear_attn, lw.linear_attn
            assert not hasattr(m, "in_proj_qkv_z") and not hasattr(m, "in_proj_ba")
            m.in_proj_qkvzba.kernel[...] = jnp.concatenate([a.in_proj_qkv_z.kernel[...], a.in_proj_ba.kernel[...]], 1)
            x = jnp.ones((1, 2, cfg.hidden_size))  # the layout-agnostic accessors agree too
            for w, o in zip((*a.ab_kernels(), *a.qkv_z_outputs(x)), (*m.ab_kernels(), *m.qkv_z_outputs(x))):
                np.testing.assert_array_equal(np.asarray(o), np.asarray(w))
    gw, pw = nnx.split(whole)
    models = ((gd, params), (gw, pw))

    rng = np.random.default_rng(9)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 10)), jnp.int32)
    lens = jnp.asarray([10, 7], jnp.int32)
    caches = [decode.prefill(g, p, init_target_cache(cfg, B, CAP), prompt, lens).cache for g, p in models]
    tok = jnp.asarray([3, 7], jnp.int32)
    step = lambda g, p, c: nnx.merge(g, p)(tok[:, None], c, jnp.ones((B,), jnp.int32), chunked=False,
                                           impl="pallas_interpret")
    outs = [jax.jit(step, static_argnums=0)(g, p, c) for (g, p), c in zip(models, caches)]
    for w, o in zip(jax.tree_util.tree_leaves(outs[0]), jax.tree_util.tree_leaves(outs[1])):
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(w, np.float32), rtol=1e-4, atol=1e-4)
    parents = jnp.asarray(np.stack([[-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, N)]] * B), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, N)), jnp.int32)
    paths = jnp.asarray(np.stack([root_path(np.asarray(parents[0]), N - 1)[:4] + [0] * (N - 4)] * B), jnp.int32)
    counts = jnp.asarray([4, 2], jnp.int32)
    args = (tokens, parents, jnp.ones((B, N), bool), paths, counts)
    got = [verify_and_commit(g, p, c, *args, impl="pallas_interpret") for (g, p), c in zip(models, caches)]
    for w, o in zip(jax.tree_util.tree_leaves(got[0]), jax.tree_util.tree_leaves(got[1])):
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(w, np.float32), rtol=1e-4, atol=1e-4)
    verify = lambda g, p, c: nnx.merge(g, p).verify(
        tokens, c, make_tree(tokens, parents, jnp.ones((B, N), bool), c.lengths, max_depth=N - 1), impl="pallas_interpret")
    dots = [str(jax.make_jaxpr(functools.partial(verify, g))(p, c)).count("dot_general") for (g, p), c in zip(models, caches)]
    assert dots[0] - dots[1] == sum(kind == "gdn" for kind in cfg.layer_types)


def test_drafter_attention_through_the_kernel(monkeypatch):
    """models.drafter.ATTENTION_KERNEL: with kernels, the DFlash drafter's (non-causal, unwindowed)
    layers attend through the tree-attention kernel as an all-visible block over the context up to
    each row's length: the same draft logits as the XLA form (float32), one kernel per layer, and
    with the switch off the XLA form, announced by a warning; a DDTree generation with the real
    drafter and kernels equals plain greedy."""
    import warnings

    from ddtree_jax.models import drafter as drafter_mod
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

    def draft(on, impl):
        monkeypatch.setattr(drafter_mod, "ATTENTION_KERNEL", on)
        fn = lambda p, s: proposer.propose(p, s, target, bonus, s.lengths, impl=impl)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            text = str(jax.make_jaxpr(fn)(dparams, dstate))
            out = jax.jit(fn)(dparams, dstate)
        return out, text.count("name=tree_attention"), [w for w in caught if "drafter's attention" in str(w.message)]

    want, n_want, _ = draft(True, "xla")
    got, n_got, warned = draft(True, "pallas_interpret")
    off, n_off, warned_off = draft(False, "pallas_interpret")
    assert n_want == 0 and n_got == proposer.cfg.num_layers and not warned
    assert n_off == 0 and warned_off and "ATTENTION_KERNEL is False" in str(warned_off[0].message)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(off), np.asarray(want), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(drafter_mod, "ATTENTION_KERNEL", True)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 10)), jnp.int32)
    lens = jnp.asarray([10, 6], jnp.int32)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=12)
    res = generate(gd, params, prompt, lens, proposer=proposer, drafter_params=dparams, mode="ddtree", budget=8,
                   max_new_tokens=12, kernels="pallas_interpret")
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))
