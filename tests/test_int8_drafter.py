"""int8 drafter (models/int8.py): the quantization's error bound, the int8 product (weight-only and
W8A8: which products take which),
every drafter Linear quantized and its head too, draft log-probs close to the float ones,
generation identical to plain decoding in every mode (alone and with a draft vocabulary, in
either order) and through the Engine and the CLI; misuse is named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from ddtree_jax.models import int8
from ddtree_jax.models.layers import Linear, quantize_linears
from ddtree_jax.speculative.draft_vocab import HotParams, first_ids
from ddtree_jax.speculative.generate import generate
from tests.test_dflash_generate import drafter_for
from tests.tiny_models import HYBRID, make_target


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-4, 1.0, 50.0]))
def test_quantize_keeps_each_weight_within_half_a_step(seed, scale):
    rng = np.random.default_rng(seed)
    w = rng.standard_t(3, size=(24, 10)) * scale  # heavy tails: one large weight sets a column's step
    w[:, 3] = 0.0  # an all-zero column
    q, s = int8.quantize(jnp.asarray(w, jnp.float32))
    assert q.dtype == jnp.int8 and q.shape == (10, 24) and s.dtype == jnp.float32 and s.shape == (10,)
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) <= int8.QMAX
    err = np.abs(np.asarray(int8.dequantize(q, s)) - w)
    assert np.all(err <= np.asarray(s)[None, :] * 0.5 * (1 + 1e-6) + 1e-30)
    np.testing.assert_array_equal(np.asarray(q[3]), 0)
    assert float(s[3]) == 1.0
    np.testing.assert_allclose(np.asarray(s), np.where(np.abs(w).max(0) > 0, np.abs(w).max(0) / 127, 1.0), rtol=1e-6)


@pytest.mark.parametrize("scheme", [int8.Int8Scheme(), int8.Int8Scheme(w8a8_min_out=1), int8.WEIGHT_ONLY])
def test_int8_linear_is_the_product_with_the_dequantized_kernel(scheme):
    lin = Linear(32, 12, bias=True, dtype="float32", rngs=nnx.Rngs(0))
    lin.bias[...] = jnp.arange(12, dtype=jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 32), jnp.float32)
    w = lin.kernel[...]
    assert quantize_linears(lin, scheme) == 1 and quantize_linears(lin, scheme) == 0  # once only
    assert lin.kernel[...].dtype == jnp.int8 and lin.kernel[...].shape == (12, 32)
    assert lin.w8a8 == (scheme.w8a8 and 12 >= scheme.w8a8_min_out)
    got = lin(x)
    assert got.dtype == x.dtype
    if not lin.w8a8:  # weight-only: the float product with the dequantized weight
        want = x @ int8.dequantize(lin.kernel[...], lin.scale[...]) + lin.bias[...]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w + lin.bias[...]), rtol=0.05, atol=0.05)


def test_w8a8_product_is_the_exact_integer_product_scaled():
    """The W8A8 product: per-row int8 activations (absmax / 127, round to nearest), int8 x int8
    summed exactly (int64 in numpy here), then row scale x column scale; a zero row stays zero."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 5, 96)).astype(np.float32) * np.array([1e-3, 30.0])[:, None, None].astype(np.float32)
    x[1, 2] = 0.0
    w = rng.normal(size=(96, 40)).astype(np.float32)
    q, sc = int8.quantize(jnp.asarray(w))
    got = np.asarray(int8.w8a8_product(jnp.asarray(x), q, sc))
    amax = np.abs(x).max(-1, keepdims=True)
    xs = np.where(amax > 0, amax / 127, 1.0).astype(np.float32)
    xq = np.clip(np.round(x / xs), -127, 127).astype(np.int64)
    want = (xq @ np.asarray(q, np.int64).T).astype(np.float32) * xs * np.asarray(sc)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.all(got[1, 2] == 0)
    xq_got, xs_got = int8.quantize_rows(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(xq_got), xq)
    # close to the float product: each activation within half a step of its row's absmax / 127
    exact = x @ w
    assert np.all(np.abs(got - exact) <= 0.05 * np.abs(exact).max(-1, keepdims=True))
    with pytest.raises(ValueError, match="overflow"):
        int8.w8a8_product(jnp.ones((1, 140_000)), jnp.ones((2, 140_000), jnp.int8), jnp.ones(2))


def test_wide_int8_products_take_w8a8_and_narrow_ones_stay_weight_only():
    """A scheme's W8A8 takes products with >= w8a8_min_out output columns through an int8 x int8
    -> int32 dot; narrower ones, or all under the weight-only scheme, widen the weight."""
    x = jnp.ones((3, 64), jnp.bfloat16)

    def imma(out_features, scheme):
        lin = Linear(64, out_features, dtype="bfloat16", rngs=nnx.Rngs(0))
        quantize_linears(lin, scheme)
        return "preferred_element_type=int32" in str(jax.make_jaxpr(lin)(x))

    scheme = int8.Int8Scheme(w8a8_min_out=32)
    assert imma(48, scheme) and not imma(16, scheme)
    assert not imma(48, int8.WEIGHT_ONLY)
    assert int8.Int8Scheme().takes_w8a8(2048) and not int8.Int8Scheme().takes_w8a8(1024)


def _pair(seed=7):
    cfg, gd, params = make_target(HYBRID, seed=seed)
    proposer, dparams = drafter_for(cfg)
    return cfg, gd, params, proposer, dparams


def test_with_int8_quantizes_every_drafter_linear_and_the_head():
    cfg, gd, params, proposer, dparams = _pair()
    target = nnx.merge(gd, params)
    q, qparams = proposer.with_int8(dparams, target)
    assert q.int8 and q.own_head and not q.draft_vocab and isinstance(qparams, HotParams)
    assert hash(q) != hash(proposer) and proposer.vocab_ids(dparams) is None and q.vocab_ids(qparams) is None
    model = nnx.merge(q.graphdef, qparams.drafter)
    linears = [n for _, n in nnx.iter_graph(model) if isinstance(n, Linear)]
    assert linears and all(n.kernel[...].dtype == jnp.int8 and n.scale is not None for n in linears)
    h, v = cfg.hidden_size, cfg.vocab_size
    assert q.int8 == int8.Int8Scheme() and qparams.vocab.head.dtype == jnp.int8 and qparams.vocab.head.shape == (v, h)
    # the float drafter's params are untouched
    assert all(x.dtype != jnp.int8 for x in jax.tree_util.tree_leaves(dparams))
    with pytest.raises(ValueError, match="int8 already"):
        q.with_int8(qparams, target)
    state = proposer.extend(dparams, proposer.init_state(dparams, 2, 32), jnp.ones((2, 3, 2 * cfg.hidden_size)),
                            jnp.asarray([3, 2], jnp.int32))
    bonus, start = jnp.asarray([5, 9], jnp.int32), state.lengths
    qstate = q.extend(qparams, q.init_state(qparams, 2, 32), jnp.ones((2, 3, 2 * cfg.hidden_size)),
                      jnp.asarray([3, 2], jnp.int32))
    want = np.asarray(jnp.exp(proposer.propose(dparams, state, target, bonus, start)))
    got = np.asarray(jnp.exp(q.propose(qparams, qstate, target, bonus, start)))
    assert got.shape == want.shape
    assert np.abs(got - want).sum(-1).max() < 0.1  # total variation of each draft distribution
    with pytest.raises(ValueError, match="HotParams"):
        q.propose(dparams, state, target, bonus, start)


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
@pytest.mark.parametrize("order", ["int8", "vocab_then_int8", "int8_then_vocab"])
def test_generation_with_an_int8_drafter_is_lossless(mode, order):
    """DDTree with the int8 drafter alone runs every drafter product and the draft head W8A8 (the
    tiny drafter's widths are below the default threshold, so the scheme lowers it); the other
    cases are weight-only."""
    w8a8 = (mode, order) == ("ddtree", "int8")
    scheme = int8.Int8Scheme(w8a8_min_out=1) if w8a8 else int8.Int8Scheme()
    cfg, gd, params, proposer, dparams = _pair()
    target = nnx.merge(gd, params)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    lens = jnp.asarray([10, 6], jnp.int32)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=40)
    ids = first_ids(cfg.vocab_size // 2, cfg.vocab_size)
    if order == "int8":
        p, pp = proposer.with_int8(dparams, target, scheme)
    elif order == "vocab_then_int8":
        p, pp = proposer.with_draft_vocab(dparams, target, ids)
        p, pp = p.with_int8(pp, target, scheme)
    else:
        p, pp = proposer.with_int8(dparams, target, scheme)
        p, pp = p.with_draft_vocab(pp, target, ids)
    jaxpr = str(jax.make_jaxpr(lambda: p.propose(pp, p.init_state(pp, 2, 32), target, jnp.asarray([5, 9]),
                                                  jnp.asarray([0, 0])))())
    assert jaxpr.count("preferred_element_type=int32") == (6 * p.cfg.num_layers + 1 if w8a8 else 0)
    if order != "int8":
        assert p.int8 and p.draft_vocab == len(ids) and pp.vocab.head.dtype == jnp.int8
        np.testing.assert_array_equal(np.asarray(p.vocab_ids(pp)), ids)
    res = generate(gd, params, prompt, lens, proposer=p, drafter_params=pp, mode=mode, budget=16, max_new_tokens=40)
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(res.drafter_state.lengths), np.asarray(res.cache.lengths))


@pytest.mark.slow  # ~18 s; the int8 drafter's lossless generation stays in the default run
def test_engine_and_cli_take_an_int8_drafter(capsys):
    from ddtree_jax.cli import generate as cli
    from ddtree_jax.engine import Engine

    cfg, gd, params, proposer, dparams = _pair()
    engine = Engine(cfg, gd, params, proposer=proposer, drafter_params=dparams, int8_drafter=True)
    assert engine.proposer.int8 == int8.Int8Scheme() and isinstance(engine.drafter_params, HotParams)
    engine = Engine(cfg, gd, params, proposer=proposer, drafter_params=dparams, int8_drafter="weight-only")
    assert engine.proposer.int8 == int8.WEIGHT_ONLY
    with pytest.raises(ValueError, match="int8_drafter must be"):
        Engine(cfg, gd, params, proposer=proposer, drafter_params=dparams, int8_drafter="int4")
    with pytest.raises(ValueError, match="needs a DFlash drafter"):
        Engine(cfg, gd, params, int8_drafter=True)
    # the demo pair through the CLI: the flag reaches the engine and the output matches plain decoding
    assert cli.main(["--prompt", "def add(a, b):", "--max-new-tokens", "16", "--int8-drafter", "weight-only",
                     "--compare-ar", "--no-stream", "--budget", "16"]) in (0, None)
    assert "output identical to plain decoding (sampled, seed 0): yes" in capsys.readouterr().err  # the demo samples
    from ddtree_jax.demo import demo_paths

    with pytest.raises(SystemExit):  # a target without a drafter: named, no traceback
        cli.main(["--target", demo_paths()[0], "--int8-drafter", "--prompt", "x", "--max-new-tokens", "2"])
    assert "an int8 drafter needs a DFlash drafter (--drafter)" in capsys.readouterr().err
