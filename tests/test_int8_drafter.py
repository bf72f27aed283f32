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
from ddtree_jax.models.layers import Linear
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
    assert q.dtype == jnp.int8 and s.dtype == jnp.float32 and s.shape == (10,)
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) <= int8.QMAX
    err = np.abs(np.asarray(int8.dequantize(q, s)) - w)
    assert np.all(err <= np.asarray(s)[None, :] * 0.5 * (1 + 1e-6) + 1e-30)
    np.testing.assert_array_equal(np.asarray(q[:, 3]), 0)
    assert float(s[3]) == 1.0
    np.testing.assert_allclose(np.asarray(s), np.where(np.abs(w).max(0) > 0, np.abs(w).max(0) / 127, 1.0), rtol=1e-6)


@pytest.mark.parametrize("layout", int8.LAYOUTS)
def test_int8_linear_is_the_product_with_the_dequantized_kernel(monkeypatch, layout):
    monkeypatch.setattr(int8, "LAYOUT", layout)
    lin = Linear(32, 12, bias=True, dtype="float32", rngs=nnx.Rngs(0))
    lin.bias[...] = jnp.arange(12, dtype=jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 32), jnp.float32)
    w = lin.kernel[...]
    assert int8.quantize_linears(lin) == 1 and int8.quantize_linears(lin) == 0  # once only
    assert lin.kernel[...].dtype == jnp.int8 and lin.int8_layout == layout
    assert lin.kernel[...].shape == ((32, 12) if layout == "in_out" else (12, 32))
    q = lin.kernel[...] if layout == "in_out" else lin.kernel[...].T
    want = x @ int8.dequantize(q, lin.scale[...]) + lin.bias[...]
    got = lin(x)
    assert got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w + lin.bias[...]), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("layout", int8.LAYOUTS)
def test_w8a8_product_is_the_exact_integer_product_scaled(layout):
    """The W8A8 product: per-row int8 activations (absmax / 127, round to nearest), int8 x int8
    summed exactly (int64 in numpy here), then row scale x column scale; a zero row stays zero."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 5, 96)).astype(np.float32) * np.array([1e-3, 30.0])[:, None, None].astype(np.float32)
    x[1, 2] = 0.0
    w = rng.normal(size=(96, 40)).astype(np.float32)
    q, sc = int8.quantize(jnp.asarray(w))
    got = np.asarray(int8.w8a8_product(jnp.asarray(x), int8.stored(q, layout), sc, layout=layout))
    amax = np.abs(x).max(-1, keepdims=True)
    xs = np.where(amax > 0, amax / 127, 1.0).astype(np.float32)
    xq = np.clip(np.round(x / xs), -127, 127).astype(np.int64)
    want = (xq @ np.asarray(q, np.int64)).astype(np.float32) * xs * np.asarray(sc)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.all(got[1, 2] == 0)
    xq_got, xs_got = int8.quantize_rows(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(xq_got), xq)
    # close to the float product: each activation within half a step of its row's absmax / 127
    exact = x @ w
    assert np.all(np.abs(got - exact) <= 0.05 * np.abs(exact).max(-1, keepdims=True))
    with pytest.raises(ValueError, match="overflow"):
        int8.w8a8_product(jnp.ones((1, 140_000)), jnp.ones((140_000, 2), jnp.int8), jnp.ones(2))


def test_wide_int8_products_take_w8a8_and_narrow_ones_stay_weight_only(monkeypatch):
    """ACT_INT8 routes products with >= ACT_INT8_MIN_OUT output columns (either storage) through
    an int8 x int8 -> int32 dot; narrower ones, or all with ACT_INT8 off, widen the weight."""
    x = jnp.ones((3, 64), jnp.bfloat16)
    wide, narrow = jnp.ones((64, 48), jnp.int8), jnp.ones((64, 16), jnp.int8)

    def imma(q, layout="in_out"):
        n_out = q.shape[1] if layout == "in_out" else q.shape[0]
        jaxpr = jax.make_jaxpr(lambda a, w: int8.product(a, w, jnp.ones((n_out,)), layout=layout))(x, q)
        return "preferred_element_type=int32" in str(jaxpr)

    monkeypatch.setattr(int8, "ACT_INT8_MIN_OUT", 32)
    assert imma(wide) and imma(wide.T, "out_in") and not imma(narrow) and not imma(narrow.T, "out_in")
    assert not int8.takes_w8a8(narrow) and int8.takes_w8a8(narrow, "out_in")  # read [out, in]: 64 outputs
    monkeypatch.setattr(int8, "KERNEL", True)  # the weight-only kernel route does not take W8A8 products: named
    with pytest.warns(UserWarning, match="KERNEL is on but this product is W8A8"):
        jax.make_jaxpr(lambda a, w: int8.product(a, w, jnp.ones((48,)), impl="pallas_interpret"))(x, wide)
    monkeypatch.setattr(int8, "KERNEL", False)
    monkeypatch.setattr(int8, "ACT_INT8", False)
    assert not imma(wide) and not imma(wide.T, "out_in")


def _pair(seed=7):
    cfg, gd, params = make_target(HYBRID, seed=seed)
    proposer, dparams = drafter_for(cfg)
    return cfg, gd, params, proposer, dparams


@pytest.mark.parametrize("layout", int8.LAYOUTS)
def test_with_int8_quantizes_every_drafter_linear_and_the_head(monkeypatch, layout):
    monkeypatch.setattr(int8, "KEEP_FLOAT", ())
    monkeypatch.setattr(int8, "LAYOUT", layout)
    cfg, gd, params, proposer, dparams = _pair()
    target = nnx.merge(gd, params)
    q, qparams = proposer.with_int8(dparams, target)
    assert q.int8 and q.own_head and not q.draft_vocab and isinstance(qparams, HotParams)
    assert hash(q) != hash(proposer) and proposer.vocab_ids(dparams) is None and q.vocab_ids(qparams) is None
    model = nnx.merge(q.graphdef, qparams.drafter)
    linears = [n for _, n in nnx.iter_graph(model) if isinstance(n, Linear)]
    assert linears and all(n.kernel[...].dtype == jnp.int8 and n.scale is not None and n.int8_layout == layout
                           for n in linears)
    h, v = cfg.hidden_size, cfg.vocab_size
    assert q.head_layout == layout and qparams.vocab.head.dtype == jnp.int8
    assert qparams.vocab.head.shape == ((h, v) if layout == "in_out" else (v, h))
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
def test_generation_with_an_int8_drafter_is_lossless(monkeypatch, mode, order):
    """DDTree with the int8 drafter alone runs every drafter product and the draft head W8A8 (the
    tiny drafter's widths are below the default threshold); the other cases are weight-only."""
    w8a8 = (mode, order) == ("ddtree", "int8")
    if w8a8:
        monkeypatch.setattr(int8, "ACT_INT8_MIN_OUT", 1)
    cfg, gd, params, proposer, dparams = _pair()
    target = nnx.merge(gd, params)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    lens = jnp.asarray([10, 6], jnp.int32)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=40)
    ids = first_ids(cfg.vocab_size // 2, cfg.vocab_size)
    if order == "int8":
        p, pp = proposer.with_int8(dparams, target)
    elif order == "vocab_then_int8":
        p, pp = proposer.with_draft_vocab(dparams, target, ids)
        p, pp = p.with_int8(pp, target)
    else:
        p, pp = proposer.with_int8(dparams, target)
        p, pp = p.with_draft_vocab(pp, target, ids)
    assert p.head_layout == int8.LAYOUT
    jaxpr = str(jax.make_jaxpr(lambda: p.propose(pp, p.init_state(pp, 2, 32), target, jnp.asarray([5, 9]),
                                                  jnp.asarray([0, 0])))())
    assert jaxpr.count("preferred_element_type=int32") == (6 * p.cfg.num_layers + 1 if w8a8 else 0)
    if order != "int8":
        assert p.int8 and p.draft_vocab == len(ids) and pp.vocab.head.dtype == jnp.int8
        np.testing.assert_array_equal(np.asarray(p.vocab_ids(pp)), ids)
    res = generate(gd, params, prompt, lens, proposer=p, drafter_params=pp, mode=mode, budget=16, max_new_tokens=40)
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(res.drafter_state.lengths), np.asarray(res.cache.lengths))


def test_engine_and_cli_take_an_int8_drafter(capsys):
    from ddtree_jax.cli import generate as cli
    from ddtree_jax.engine import Engine

    cfg, gd, params, proposer, dparams = _pair()
    engine = Engine(cfg, gd, params, proposer=proposer, drafter_params=dparams, int8_drafter=True)
    assert engine.proposer.int8 and isinstance(engine.drafter_params, HotParams)
    with pytest.raises(ValueError, match="needs a DFlash drafter"):
        Engine(cfg, gd, params, int8_drafter=True)
    # the demo pair through the CLI: the flag reaches the engine and the output matches plain decoding
    assert cli.main(["--prompt", "def add(a, b):", "--max-new-tokens", "16", "--int8-drafter", "--compare-ar",
                     "--no-stream"]) in (0, None)
    assert "output identical to plain decoding: yes" in capsys.readouterr().err
    from ddtree_jax.demo import demo_paths

    with pytest.raises(SystemExit):  # a target without a drafter: named, no traceback
        cli.main(["--target", demo_paths()[0], "--int8-drafter", "--prompt", "x", "--max-new-tokens", "2"])
    assert "an int8 drafter needs a DFlash drafter (--drafter)" in capsys.readouterr().err


def test_keep_float_leaves_the_named_products_in_their_dtype(monkeypatch):
    cfg, gd, params, proposer, dparams = _pair()
    monkeypatch.setattr(int8, "KEEP_FLOAT", ("gate_up_proj", "lm_head"))
    q, qparams = proposer.with_int8(dparams, nnx.merge(gd, params))
    model = nnx.merge(q.graphdef, qparams.drafter)
    kinds = {path[-1]: n.kernel[...].dtype for path, n in nnx.iter_graph(model) if isinstance(n, Linear)}
    assert kinds["gate_up_proj"] != jnp.int8 and kinds["down_proj"] == jnp.int8 and kinds["q_proj"] == jnp.int8
    assert qparams.vocab.scale is None and qparams.vocab.head.dtype != jnp.int8 and qparams.vocab.ids is None


def test_int8_products_take_the_skinny_kernel_with_kernels_on(monkeypatch):
    """With kernels on, every int8 product of a draft (each layer's q, k, v, o, gate | up, down and
    the draft head) and of a context extension (fc, each layer's k and v) runs the skinny matmul
    kernel, and the draft distributions equal XLA's int8 products' to accumulation order; with
    int8.KERNEL off (the default: it lost to XLA's int8 GEMMs on the H200), or past KERNEL_MAX_ROWS
    rows, none does."""
    monkeypatch.setattr(int8, "KEEP_FLOAT", ())
    monkeypatch.setattr(int8, "KERNEL", True)
    cfg, gd, params, proposer, dparams = _pair()
    target = nnx.merge(gd, params)
    q, qparams = proposer.with_int8(dparams, target)
    layers = q.cfg.num_layers
    feats = jnp.ones((2, 3, 2 * cfg.hidden_size))
    n_valid = jnp.asarray([3, 2], jnp.int32)
    state = q.extend(qparams, q.init_state(qparams, 2, 32), feats, n_valid)
    bonus = jnp.asarray([5, 9], jnp.int32)

    def propose(impl):
        return q.propose(qparams, state, target, bonus, state.lengths, impl=impl)

    def extend(impl):
        return q.extend(qparams, q.init_state(qparams, 2, 32), feats, n_valid, impl=impl)

    count = lambda f, impl: str(jax.make_jaxpr(lambda: f(impl))()).count("name=skinny_matmul")
    assert count(propose, "pallas_interpret") == 6 * layers + 1
    assert count(extend, "pallas_interpret") == 1 + 2 * layers
    assert count(propose, "xla") == 0
    got, want = np.exp(np.asarray(jax.jit(lambda: propose("pallas_interpret"))())), np.exp(np.asarray(propose("xla")))
    assert np.abs(got - want).sum(-1).max() < 1e-2
    ks, kx = jax.jit(lambda: extend("pallas_interpret"))(), extend("xla")
    for a, b in zip(jax.tree_util.tree_leaves(ks), jax.tree_util.tree_leaves(kx)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(int8, "KERNEL_MAX_ROWS", 1)  # a drafted block has 2 x (Bs - 1) rows
    assert count(propose, "pallas_interpret") == 0
    monkeypatch.setattr(int8, "KERNEL_MAX_ROWS", 128)
    monkeypatch.setattr(int8, "KERNEL", False)
    assert count(propose, "pallas_interpret") == 0


@pytest.mark.slow  # 13 s; the route is opt-in (int8.KERNEL) and its products are checked above
def test_generation_through_the_int8_kernel_is_lossless(monkeypatch):
    """DDTree with every kernel on (a target and drafter the tree kernels take: head_dim 16)."""
    monkeypatch.setattr(int8, "KERNEL", True)
    cfg, gd, params = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16), seed=31,
                                  base=HYBRID)
    proposer, dparams = drafter_for(cfg, head_dim=16)
    p, pp = proposer.with_int8(dparams, nnx.merge(gd, params))
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    lens = jnp.asarray([10, 7], jnp.int32)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=24)
    res = generate(gd, params, prompt, lens, proposer=p, drafter_params=pp, mode="ddtree", budget=16,
                   max_new_tokens=24, kernels="pallas_interpret")
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))
