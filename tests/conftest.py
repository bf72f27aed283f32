"""Test-wide settings: CPU (unless the run selects GPU tests), float32 matmuls at full precision,
a deterministic hypothesis profile, and the kernel tests' `impl` / `gpu_impl` fixtures.

Kernel tests take `impl`: "pallas_interpret" in the default run (any machine), "pallas" under
`-m gpu`, where the same tests run natively on the GPU (`python -m pytest -m gpu` on the device),
as jax's own Pallas GPU tests do. Tests at the models' real layer shapes take `gpu_impl` instead:
"pallas" only, so they run under `-m gpu` alone (the interpreter would take minutes there).
Both are module-scoped (hypothesis refuses function-scoped fixtures), so a module runs its
interpreted cases first, then its native ones.
"""

import atexit
import gc
import importlib.metadata
import os
import re
import shutil
import sys
import tempfile

import pytest


def _selects_gpu(argv) -> bool:
    """Whether the command line's -m expression selects the gpu marker (not only 'not gpu')."""
    for i, arg in enumerate(argv):
        expr = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else arg[2:] if arg.startswith("-m") else None
        if expr and re.search(r"(?<!not )\bgpu\b", expr):
            return True
    return False


# xdist's workers do not see the command line's -m: the main process hands its answer down.
GPU_RUN = _selects_gpu(sys.argv) or os.environ.get("DDTREE_TEST_GPU_RUN") == "1"
if GPU_RUN:
    os.environ["DDTREE_TEST_GPU_RUN"] = "1"
else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # XLA:CPU compilation is about two thirds of the run: LLVM's O0 compiles ~20 % faster and the
    # tiny test models run just as fast (the tolerances cover any reordering of float sums).
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in _flags:
        _flags += " --xla_backend_optimization_level=0"
    # XLA:CPU's classic elemental emitters instead of its MLIR fusion emitters: ~30 % less backend
    # compilation (tests/test_dflash_generate.py: 37.0 against 25.9 s), the programs run about as
    # fast. Only on the jaxlib where it was measured: XLA aborts on a flag it does not know.
    if "xla_cpu_use_fusion_emitters" not in _flags and importlib.metadata.version("jaxlib").startswith("0.10."):
        _flags += " --xla_cpu_use_fusion_emitters=false"
    os.environ["XLA_FLAGS"] = _flags.strip()
# One persistent compilation cache per run, shared by the xdist workers (they inherit the main
# process's environment): modules and workers that build the same tiny models and loops compile
# them once. The main process creates it and removes it at exit; a cache given in the environment
# is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="ddtree-jax-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
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


def _native_pallas(request) -> str:
    if request.param == "pallas" and jax.default_backend() != "gpu":
        pytest.fail(f"native Pallas needs a GPU and jax sees {jax.default_backend()!r}: run -m gpu on the GPU "
                    "machine (the default run deselects these)")
    return request.param


@pytest.fixture(scope="module", params=["pallas_interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def impl(request):
    """The kernels' route under test: interpret mode on any machine, natively under -m gpu."""
    return _native_pallas(request)


@pytest.fixture(scope="module", params=[pytest.param("pallas", marks=pytest.mark.gpu)])
def gpu_impl(request):
    """Native Pallas only: the checks at real layer shapes (selected by -m gpu; they fail without a GPU)."""
    return _native_pallas(request)


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.triton)], ids=["lowering", "sm90"])
def sm90(request) -> bool:
    """An offline-compile test's scope: False (the default run) stops after its lowering to Triton
    IR, which needs no triton; True (-m triton) goes on to its sm_90 register / spill checks, and
    fails at once without pip's triton of the recorded version (tests/triton_limits.py)."""
    if request.param:
        from tests.triton_limits import require_recorded_triton
        require_recorded_triton()
    return request.param
