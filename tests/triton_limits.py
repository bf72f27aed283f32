"""The Triton the offline-compile checks were written for. Their register / spill limits were
measured with the H200 image's triton (scripts.offline_triton_compile.TRITON_VERSION); another
version allocates registers differently (triton 3.8 spilled 7024 B in the GDN tree kernel where
3.6 spilled none), so with any other version installed the compile checks skip and say why; the
lowering to Triton IR before them runs everywhere."""

import pytest

from scripts.offline_triton_compile import TRITON_VERSION, installed_triton


def require_recorded_triton() -> None:
    """Skip the rest of the test unless pip's triton TRITON_VERSION.x is installed."""
    version = installed_triton()
    if version is None:
        pytest.skip(f"triton is not installed: the sm_90 compile checks need pip's triton {TRITON_VERSION}.x")
    if not version.startswith(TRITON_VERSION + "."):
        pytest.skip(f"triton {version} is installed; these register / spill limits were measured with "
                    f"triton {TRITON_VERSION}.x")
