"""Shared harness of the tree property tests (every target family): jitted tree / chain verify,
commit and the sequential oracle, random tree shapes inside fixed padded sizes (one compilation
serves every hypothesis example), and the committed-state comparison."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import strategies as st

from ddtree_jax import decode
from ddtree_jax.cache import KVCache, RecurrentCache, init_target_cache
from ddtree_jax.tree import make_tree
from ddtree_jax.routes import REFERENCE, Routes
from tests.tolerance import scaled_error

INTERPRET = Routes.resolve(impl="pallas_interpret")  # the kernels in interpret mode (any machine)


def routes_for(impl: str) -> Routes:
    """The routes of a kernel test's `impl` (conftest's fixture): this device's, with that impl."""
    return Routes.resolve(impl=impl)

B, PROMPT, N, CAP = 2, 9, 12, 40


@functools.partial(jax.jit, static_argnames=("graphdef",))
def tree_logits(graphdef, params, cache, tokens, parents, valid):
    model = nnx.merge(graphdef, params)
    tree = make_tree(tokens, parents, valid, cache.lengths, max_depth=N - 1)
    h, _, pending = model.verify(tokens, cache, tree)
    return model.logits(h), pending


@functools.partial(jax.jit, static_argnames=("graphdef", "routes"))
def chain_logits(graphdef, params, cache, tokens, routes=REFERENCE):
    model = nnx.merge(graphdef, params)
    h, _, pending = model.verify(tokens, cache, None, routes=routes)
    return model.logits(h), pending


@functools.partial(jax.jit, static_argnames=("graphdef",))
def commit(graphdef, params, pending, path, count, cache):
    return nnx.merge(graphdef, params).commit(pending, path, count, cache)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def sequential(graphdef, params, cache, tokens, count):
    """Decode tokens [B, P] one by one (rows stop after count[b]); logits after each token."""
    model = nnx.merge(graphdef, params)

    def body(cache, xs):
        tok, t = xs
        h, _, cache = model(tok[:, None], cache, (t < count).astype(jnp.int32), chunked=False)
        return cache, model.logits(h[:, 0])

    cache, logits = jax.lax.scan(body, cache, (tokens.T, jnp.arange(tokens.shape[1])))
    return cache, jnp.swapaxes(logits, 0, 1)


def committed_cache(model, seed):
    """Caches of B prompts of different lengths (1..PROMPT tokens) prefilled into `model` = (cfg, gd, params)."""
    cfg, gd, params = model
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, PROMPT)), jnp.int32)
    n_valid = jnp.asarray(rng.integers(1, PROMPT + 1, B), jnp.int32)  # different lengths per row
    return decode.prefill(gd, params, init_target_cache(cfg, B, CAP), prompt, n_valid).cache


@st.composite
def tree_shapes(draw):
    kind = draw(st.sampled_from(["random", "chain", "star", "deep", "wide", "single", "full"]))
    n = {"single": 1, "full": N}.get(kind, draw(st.integers(2, N)))
    if kind in ("chain", "deep"):
        parents = [-1] + list(range(n - 1))
    elif kind == "star":
        parents = [-1] + [0] * (n - 1)
    elif kind == "wide":
        parents = [-1] + [min(i // 4, i - 1) if i > 1 else 0 for i in range(1, n)]
    else:
        parents = [-1] + [draw(st.integers(max(0, i - 3), i - 1)) for i in range(1, n)]
    return parents


def path_to(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def pad_tree(parents_rows, rng, vocab):
    tokens = rng.integers(0, vocab, (B, N))
    parents = np.full((B, N), -1)
    valid = np.zeros((B, N), bool)
    for b, p in enumerate(parents_rows):
        parents[b, : len(p)] = p
        valid[b, : len(p)] = True
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32), jnp.asarray(valid)


def assert_same_committed_state(got, ref, tol=1e-5):
    np.testing.assert_array_equal(got.lengths, ref.lengths)
    lengths = np.asarray(ref.lengths)
    for layer_got, layer_ref in zip(got.layers, ref.layers):
        if layer_ref is None:
            assert layer_got is None
        elif isinstance(layer_ref, KVCache):
            for b, n in enumerate(lengths):
                np.testing.assert_allclose(layer_got.k[b, :, :n], layer_ref.k[b, :, :n], rtol=tol, atol=tol)
                np.testing.assert_allclose(layer_got.v[b, :, :n], layer_ref.v[b, :, :n], rtol=tol, atol=tol)
        else:
            assert isinstance(layer_ref, RecurrentCache) and layer_got.state.dtype == jnp.float32
            assert scaled_error(layer_got.state, layer_ref.state) <= tol  # of the state's magnitude
            assert scaled_error(layer_got.conv, layer_ref.conv) <= tol




def kernel_route_case(model_seed: int, rng_seed: int, n: int = 17, batch: int = 2):
    """A tiny hybrid target (kernel-friendly head dims of 16) with a prefilled cache, a random tree
    of n nodes (parents within 3 of each node), its tokens and a short accepted path: the common
    setup of the kernel-route tests (a route on vs off must give the same logits and caches)."""
    from tests.tiny_models import HYBRID, make_target

    cfg, gd, params = make_target(dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16),
                                  seed=model_seed, base=HYBRID)
    rng = np.random.default_rng(rng_seed)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, 9)), jnp.int32)
    lens = jnp.asarray([9, 6][:batch] + [9] * max(0, batch - 2), jnp.int32)
    cache = decode.prefill(gd, params, init_target_cache(cfg, batch, 64), prompt, lens).cache
    parents = jnp.asarray(np.stack([[-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, n)]] * batch),
                          jnp.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, n)), jnp.int32)
    path = jnp.asarray(np.stack([[0, 1, 2, 3] + [0] * (n - 4)] * batch), jnp.int32)
    counts = jnp.asarray([3, 1][:batch] + [2] * max(0, batch - 2), jnp.int32)
    return cfg, gd, params, cache, tokens, parents, path, counts


def verify_and_commit(gd, tokens, parents, path, counts, routes: Routes = INTERPRET):
    """fn(params, cache) -> (logits, committed cache) of a tree verify + commit over the tree of
    `kernel_route_case`. A fresh function per call: route switches are read when it is traced."""

    def fn(p, c):
        model = nnx.merge(gd, p)
        b, n = tokens.shape
        tree = make_tree(tokens, parents, jnp.ones((b, n), bool), c.lengths, max_depth=n - 1)
        h, _, pending = model.verify(tokens, c, tree, routes=routes)
        return model.logits(h), model.commit(pending, path, counts, c, routes)

    return fn


def batched_dot_count(jaxpr_text: str) -> int:
    """How many dot_generals with batch dimensions a jaxpr's text holds (split-K partial products)."""
    import re

    return len(re.findall(r"dimension_numbers=\(\(\[[^]]*\], \[[^]]*\]\), \(\[\d", jaxpr_text))


def tie_heavy_rows(seed: int, shape, levels: int, p: float = 0.05) -> np.ndarray:
    """float32 normal rows with ties: values rounded to 1 / levels (0: no rounding), and a fraction p
    of the entries each set to -inf, -0.0 and +0.0 (lax.top_k's order puts -0.0 below +0.0)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32)
    if levels:
        x = np.round(x * levels) / levels
    for value in (-np.inf, -0.0, 0.0):
        x[rng.random(x.shape) < p] = value
    return x
