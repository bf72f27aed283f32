"""Speculative sampling is lossless: the distribution of generated sequences equals the target's.

Tiny vocabulary (6 tokens), 3 generated tokens (216 sequences). The exact target distribution
(with temperature, top-k and top-p applied) is enumerated with the plain decode step; samples
from plain sampling, DFlash linear and DDTree (one generate call, one row per seed) are compared
with it by a chi-square goodness-of-fit test at significance level alpha = 0.001 (cells with
expected count < 5 pooled). The same test rejects samples drawn at a wrong temperature, so it
has the power to catch a biased sampler. The same test runs at temperature 1 (no filtering) on a
mixture-of-experts target (Qwen3.5-MoE, 4 experts, top 2: the verify's nodes share experts).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import decode
from ddtree_jax.cache import init_target_cache
from ddtree_jax.speculative.generate import generate
from ddtree_jax.speculative.sampling import Sampling, filtered_logits
from tests.scripted_proposers import ScriptedProposer
from tests.tiny_models import HYBRID, HYBRID_MOE, make_target

V, NEW, SAMPLES = 6, 3, 6000
SETTINGS = Sampling(temperature=0.9, top_k=5, top_p=0.95)
MODEL = make_target({"vocab_size": V}, seed=21, base=HYBRID)
MOE_MODEL = make_target({"vocab_size": V}, seed=23, base=HYBRID_MOE)
PLAIN = Sampling(temperature=1.0)
PROMPT = jnp.asarray([[1, 4, 2, 5]], jnp.int32)


def chi2_critical(dof: int, z: float = 3.0902) -> float:
    """Upper alpha = 0.001 quantile of chi-square (Wilson-Hilferty approximation)."""
    return dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


def exact_distribution(sampling: Sampling, model=MODEL) -> np.ndarray:
    """P(t1, t2, t3) over V**3 sequences by enumeration with the plain decode step."""
    cfg, gd, params = model
    n = V * V
    prompt = jnp.repeat(PROMPT, n, axis=0)
    pre = decode.prefill(gd, params, init_target_cache(cfg, n, 16), prompt, jnp.full((n,), 4, jnp.int32))
    probs = lambda logits: np.asarray(jax.nn.softmax(filtered_logits(logits, sampling), axis=-1), np.float64)
    p1 = probs(pre.logits[0])
    t1 = jnp.asarray(np.repeat(np.arange(V), V), jnp.int32)
    t2 = jnp.asarray(np.tile(np.arange(V), V), jnp.int32)
    s1 = decode.decode_step(gd, params, pre.cache, t1)
    p2 = probs(s1.logits)  # row r: P(t2 | t1 = r // V)
    s2 = decode.decode_step(gd, params, s1.cache, t2)
    p3 = probs(s2.logits)  # row r: P(t3 | t1 = r // V, t2 = r % V)
    joint = np.zeros((V, V, V))
    for a in range(V):
        for b in range(V):
            joint[a, b, :] = p1[a] * p2[a * V + b, b] * p3[a * V + b]
    return joint.reshape(-1)


def sample(mode: str, sampling: Sampling, seed: int, model=MODEL) -> np.ndarray:
    cfg, gd, params = model
    proposer = ScriptedProposer(3, V, error_rate=0.5, seed=seed)
    res = generate(gd, params, jnp.repeat(PROMPT, SAMPLES, axis=0), jnp.full((SAMPLES,), 4, jnp.int32),
                   proposer=None if mode == "ar" else proposer, mode=mode, budget=5, max_new_tokens=NEW,
                   sampling=sampling, key=jax.random.PRNGKey(seed))
    toks = np.asarray(res.tokens)
    assert (toks >= 0).all()
    return np.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V**3)


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, chi2_critical(int(keep.sum()) - 1)


@pytest.fixture(scope="module")
def exact():
    return exact_distribution(SETTINGS)


@pytest.mark.parametrize("mode", ["ar", "dflash", "ddtree"])
def test_sampled_sequences_follow_the_target_distribution(mode, exact):
    stat, critical = chi2(sample(mode, SETTINGS, seed=1), exact)
    assert stat < critical, f"{mode}: chi2 {stat:.1f} >= critical {critical:.1f} at alpha=0.001"


@pytest.fixture(scope="module")
def moe_exact():
    return exact_distribution(PLAIN, MOE_MODEL)


# DFlash on the MoE target under -m slow (~32 s): its sampling is the dense targets' (checked above),
# the MoE target's own path is checked by the DDTree case
@pytest.mark.parametrize("mode", [pytest.param("dflash", marks=pytest.mark.slow), "ddtree"])
def test_moe_target_sampled_at_temperature_1_follows_its_distribution(mode, moe_exact):
    stat, critical = chi2(sample(mode, PLAIN, seed=3, model=MOE_MODEL), moe_exact)
    assert stat < critical, f"{mode} on the MoE target: chi2 {stat:.1f} >= critical {critical:.1f} at alpha=0.001"


@pytest.mark.slow  # ~29 s: checks the statistical test's power, not the product (keeps .ci/run under 20 min)
def test_the_test_rejects_a_wrong_distribution(exact):
    wrong = Sampling(temperature=1.4, top_k=5, top_p=0.95)
    stat, critical = chi2(sample("ddtree", wrong, seed=2), exact)
    assert stat > critical, "chi-square test too weak to notice a temperature change"


def test_sampling_settings_are_validated():
    for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match="invalid sampling"):
            Sampling(**bad)


OTHER = Sampling(temperature=1.3, top_p=0.8)  # no top-k: another code path per row


@pytest.mark.slow  # ~45 s; the default run keeps test_per_row_filters_equal_the_single_setting_form
def test_mixed_rows_share_a_batch_and_keep_each_rows_distribution(exact):
    """One compiled program, rows interleaved: SETTINGS, OTHER and greedy rows (with filters set,
    which greedy ignores). Each sampled group follows its own target distribution; every greedy
    row is plain greedy decoding."""
    from ddtree_jax.speculative import generate as gen
    from ddtree_jax.speculative.sampling import RowSampling, SamplingCode, seed_key

    cfg, gd, params = MODEL
    n_greedy = 8
    kinds = np.random.default_rng(0).permutation([0] * SAMPLES + [1] * SAMPLES + [2] * n_greedy)
    settings = [(SETTINGS, OTHER, Sampling(top_k=2, top_p=0.5))[k] for k in kinds]
    b = len(settings)
    code = SamplingCode.covering(settings)
    assert code == SamplingCode(sample=True, top_k=5, top_p=True)
    rows = gen.RowControls(RowSampling.of(settings, [seed_key(s) for s in range(b)]),
                           jnp.full((b,), NEW, jnp.int32), jnp.zeros((b, 0), jnp.int32))
    spec = gen.GenSpec("ddtree", 5, None, NEW, code, 0, ScriptedProposer(3, V, error_rate=0.5, seed=4))
    eos = jnp.zeros((0,), jnp.int32)
    s = gen.start(gd, params, None, jnp.repeat(PROMPT, b, axis=0), jnp.full((b,), 4, jnp.int32), eos, None, spec,
                  rows=rows)
    toks = np.asarray(gen.advance(gd, params, None, s, eos, jnp.int32(2**30), spec).out)
    assert (toks >= 0).all()
    cells = toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2]
    for kind, settings_k, probs in ((0, SETTINGS, exact), (1, OTHER, exact_distribution(OTHER))):
        stat, critical = chi2(np.bincount(cells[kinds == kind], minlength=V**3), probs)
        assert stat < critical, f"{settings_k}: chi2 {stat:.1f} >= critical {critical:.1f} at alpha=0.001"
    greedy = generate(gd, params, PROMPT, jnp.asarray([4], jnp.int32), mode="ar", max_new_tokens=NEW)
    assert (toks[kinds == 2] == np.asarray(greedy.tokens)).all()


def test_per_row_filters_equal_the_single_setting_form():
    """filtered_rows with each row's settings == filtered_logits row by row."""
    from ddtree_jax.speculative.sampling import RowSampling, SamplingCode, filtered_rows

    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 2, (6, 3, 40)), jnp.float32)
    settings = [Sampling(0.7, 5, 0.9), Sampling(1.0), Sampling(1.5, 0, 0.6), Sampling(0.5, 12), Sampling(2.0, 1),
                Sampling(1.0, 40, 0.999)]
    code = SamplingCode.covering(settings)
    got = np.asarray(filtered_rows(logits, code, RowSampling.of(settings, np.zeros((6, 2)))))
    for r, s in enumerate(settings):
        np.testing.assert_array_equal(got[r], np.asarray(filtered_logits(logits[r], s)))
    assert SamplingCode.covering([Sampling(), Sampling(top_k=3)]) == SamplingCode()  # greedy needs no code
    assert not SamplingCode(True, 4, False).serves(Sampling(1.0, 5)) and SamplingCode(True, 4, True).serves(
        Sampling(1.0, 4, 0.5))


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_a_seeded_speculative_sample_is_the_plain_sample(mode):
    """Each position's draw uses its own key (the row's key folded with the position: generate.
    position_keys), so with the same seed speculative sampling writes plain sampling's tokens, not
    only tokens from the same distribution: what the CLI's --compare-ar checks for sampled output."""
    cfg, gd, params = make_target(dict(vocab_size=64), seed=25, base=HYBRID)
    rng = np.random.default_rng(2)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    lens = jnp.asarray([6, 4], jnp.int32)
    settings, key = Sampling(temperature=1.0, top_p=0.9), jax.random.PRNGKey(7)
    ref = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=20, sampling=settings, key=key)
    table = np.zeros((2, 64), np.int32)  # the proposer drafts plain sampling's tokens, 30 % of them wrong
    for r, n in enumerate(np.asarray(lens)):
        table[r, :n], table[r, n : n + 20] = np.asarray(prompt[r, :n]), np.asarray(ref.tokens[r])
    proposer = ScriptedProposer(5, cfg.vocab_size, error_rate=0.3, seed=1)
    got = generate(gd, params, prompt, lens, proposer=proposer, drafter_params=jnp.asarray(table), mode=mode,
                   budget=8, max_new_tokens=20, sampling=settings, key=key)
    assert int(got.steps.max()) < 20  # drafts were accepted: the speculative path was exercised
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    other = generate(gd, params, prompt, lens, mode="ar", max_new_tokens=20, sampling=settings,
                     key=jax.random.PRNGKey(8))
    assert not np.array_equal(np.asarray(other.tokens), np.asarray(ref.tokens))  # the seed matters
