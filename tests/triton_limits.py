"""The Triton the offline-compile checks were written for. Their register / spill limits were
measured with the H200 image's triton (scripts.offline_triton_compile.TRITON_VERSION); another
version allocates registers differently (triton 3.8 spilled 7024 B in the GDN tree kernel where
3.6 spilled none). The sm_90 compile checks are selected by `-m triton` (the `sm90` fixture of
tests/conftest.py) and fail there, saying why, without that triton; the default run checks the
lowering to Triton IR before them, which needs no triton (triton stays out of the test extra:
PyPI's torch 2.13.0 for Linux requires 3.7.1)."""

import pytest

from scripts.offline_triton_compile import TRITON_VERSION, installed_triton


def require_recorded_triton() -> None:
    """Fail the test (its sm_90 checks were asked for, -m triton) unless pip's triton
    TRITON_VERSION.x is installed."""
    version = installed_triton()
    if version is None:
        pytest.fail(f"triton is not installed: the sm_90 compile checks (-m triton) need pip's triton "
                    f"{TRITON_VERSION}.x (pip install triton=={TRITON_VERSION}.0)")
    if not version.startswith(TRITON_VERSION + "."):
        pytest.fail(f"triton {version} is installed; the sm_90 register / spill limits (-m triton) were "
                    f"measured with triton {TRITON_VERSION}.x")
