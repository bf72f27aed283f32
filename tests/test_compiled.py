"""compiled.RoutedJit / FlatParams(options_arg=): the XLA compiler options a program's Routes
name reach jax.jit (one jitted function per option set, chosen from the static argument on every
call), and a generation compiled with them gives the same tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.compiled import ArgPicker, options_of, routed_jit
from ddtree_jax.flat_params import FlatParams
from ddtree_jax.routes import REFERENCE, Routes
from ddtree_jax.speculative import generate as gen
from tests.tiny_models import HYBRID, make_target


@dataclasses.dataclass(frozen=True)
class BadRoutes(Routes):
    """Routes naming an option XLA does not know: proves the options reach the compiler."""

    def compiler_options(self):
        return (("xla_no_such_option_here", True),)


@dataclasses.dataclass(frozen=True)
class Spec:
    routes: Routes = REFERENCE


def test_routes_name_their_compiler_options():
    assert REFERENCE.compiler_options() == () and options_of(None) == () and options_of(3) == ()
    pdl = Routes(xla_pdl=True)
    assert pdl.compiler_options() == (("xla_gpu_enable_pdl", True),)
    assert options_of(pdl) == options_of(Spec(pdl)) == pdl.compiler_options()
    assert pdl != REFERENCE and hash(pdl) != hash(REFERENCE)  # another program in the jit key
    assert Routes().with_settings(["xla_pdl=true"]).xla_pdl


def test_arg_picker_reads_positional_keyword_and_default():
    def f(a, b, spec=None, *, routes=REFERENCE):
        return a, b, spec, routes

    pick, kw_only = ArgPicker(f, "spec"), ArgPicker(f, "routes")
    assert pick((1, 2, "s"), {}) == "s" and pick((1, 2), {"spec": "k"}) == "k" and pick((1,), {}) is None
    assert kw_only((1, 2), {}) is REFERENCE
    with pytest.raises(ValueError, match="no argument 'nope'"):
        ArgPicker(f, "nope")


def test_routed_jit_compiles_once_per_option_set_and_passes_the_options():
    @routed_jit(static_argnames=("spec",))
    def double(x, spec):
        return x * 2

    x = jnp.arange(3.0)
    np.testing.assert_array_equal(double(x, Spec()), x * 2)
    np.testing.assert_array_equal(double(x, spec=Spec(Routes(xla_pdl=True))), x * 2)  # accepted on any backend
    assert set(double._by_options) == {(), (("xla_gpu_enable_pdl", True),)} and double._cache_size() == 2
    with pytest.raises(Exception, match="xla_no_such_option_here"):
        double(x, Spec(BadRoutes()))
    with pytest.raises(Exception, match="xla_no_such_option_here"):
        double.lower(x, Spec(BadRoutes())).compile()


def test_flat_params_takes_the_options_of_its_static_argument():
    def apply(params, x, *, spec):
        return x + params["w"]

    fn = FlatParams(apply, 1, options_arg="spec", static_argnames=("spec",))
    p = {"w": jnp.ones(3)}
    np.testing.assert_array_equal(fn(p, jnp.zeros(3), spec=Spec(Routes(xla_pdl=True))), np.ones(3))
    np.testing.assert_array_equal(fn(p, jnp.zeros(3), spec=Spec()), np.ones(3))
    assert len(fn._by_defs) == 2  # one jitted function per option set
    with pytest.raises(Exception, match="xla_no_such_option_here"):
        fn(p, jnp.zeros(3), spec=Spec(BadRoutes()))


def test_generation_with_pdl_routes_gives_the_same_tokens():
    """start / advance (RoutedJit), their bound forms (FlatParams) and generate (options from
    `routes`) under xla_pdl: the same greedy tokens as without (on a CPU the option is accepted
    and does nothing; on a GPU tests/test_generate.py's identities run under the resolved routes)."""
    cfg, gd, params = make_target(HYBRID, seed=3)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 6)), jnp.int32)
    lens = jnp.asarray([6], jnp.int32)
    want = gen.generate(gd, params, prompt, lens, mode="ar", max_new_tokens=8).tokens
    pdl = Routes(xla_pdl=True)
    got = gen.generate(gd, params, prompt, lens, mode="ar", max_new_tokens=8, routes=pdl).tokens
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    spec = gen.GenSpec("ar", 1, None, 8, gen.Sampling(), 0, None, pdl)
    key = jax.random.PRNGKey(0)
    for start, advance in ((lambda *a, **k: gen.start(gd, *a, **k), lambda *a, **k: gen.advance(gd, *a, **k)),
                           gen.bind(gd)):
        s = start(params, None, prompt, lens, None, key, spec=spec)
        s = advance(params, None, s, None, jnp.int32(100), spec=spec)
        np.testing.assert_array_equal(np.asarray(s.result().tokens), np.asarray(want))
    assert (("xla_gpu_enable_pdl", True),) in gen.advance._by_options
