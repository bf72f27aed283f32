"""Test-wide settings: CPU, float32 matmuls at full precision, deterministic hypothesis profile."""

import os

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
