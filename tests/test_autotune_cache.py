"""ddtree_jax.autotune_cache: the flag lands in XLA_FLAGS once, a conflicting directory is refused,
and this jaxlib parses the flag (an unknown XLA flag aborts the process at backend start)."""

import os
import subprocess
import sys

import pytest

from ddtree_jax.autotune_cache import FLAG, use_autotune_cache


def test_flag_is_added_once_and_conflicts_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    path = use_autotune_cache(tmp_path / "cache")
    assert os.path.isdir(path)
    assert os.environ["XLA_FLAGS"] == f"--xla_gpu_enable_triton_gemm=true {FLAG}={path}"
    assert use_autotune_cache(path) == path and os.environ["XLA_FLAGS"].count(FLAG) == 1
    with pytest.raises(ValueError, match="already sets"):
        use_autotune_cache(tmp_path / "other")


def test_this_jaxlib_parses_the_flag(tmp_path):
    env = dict(os.environ, XLA_FLAGS=f"{FLAG}={tmp_path}", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "3.0", out.stderr[-500:]
