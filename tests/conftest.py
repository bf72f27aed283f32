"""Test-wide settings: CPU, float32 matmuls at full precision, deterministic hypothesis profile."""

import gc
import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop every compiled executable after each test module. XLA:CPU maps memory for each one;
    a whole serial run kept them all and reached the kernel's limit of 65530 mappings a process
    (vm.max_map_count) two thirds of the way through, where XLA aborted or segfaulted."""
    yield
    jax.clear_caches()
    gc.collect()
