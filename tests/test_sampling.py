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


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_moe_target_sampled_at_temperature_1_follows_its_distribution(mode, moe_exact):
    stat, critical = chi2(sample(mode, PLAIN, seed=3, model=MOE_MODEL), moe_exact)
    assert stat < critical, f"{mode} on the MoE target: chi2 {stat:.1f} >= critical {critical:.1f} at alpha=0.001"


def test_the_test_rejects_a_wrong_distribution(exact):
    wrong = Sampling(temperature=1.4, top_k=5, top_p=0.95)
    stat, critical = chi2(sample("ddtree", wrong, seed=2), exact)
    assert stat > critical, "chi-square test too weak to notice a temperature change"


def test_sampling_settings_are_validated():
    for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match="invalid sampling"):
            Sampling(**bad)
