"""Pin XLA's GEMM choices across processes with its per-fusion autotune cache.

Why: on the H200 XLA autotunes every GEMM fusion when a program compiles and picks among
near-equal cuBLAS / Triton candidates by timing them, so the same code compiled in two processes
ran the DDTree verify's GEMMs at times a few percent apart (docs/decisions/0002-xla-autotune-cache.md):
more than most changes being measured. With `--xla_gpu_per_fusion_autotune_cache_dir=DIR` XLA writes
each fusion's choice to DIR and later processes read it back instead of re-timing, so runs that
share DIR compare the same kernels. The flag is read when the backend starts (the first device
use, not `import jax`), so `use_autotune_cache` must run before that.
"""

from __future__ import annotations

import os

FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"


def use_autotune_cache(directory: str | os.PathLike) -> str:
    """Add the autotune-cache flag for `directory` (created if missing) to XLA_FLAGS; returns the
    absolute path. Refuses a second, different cache directory already in XLA_FLAGS."""
    path = os.path.abspath(os.fspath(directory))
    os.makedirs(path, exist_ok=True)
    flags = os.environ.get("XLA_FLAGS", "").split()
    given = [f.split("=", 1)[1] for f in flags if f.startswith(FLAG + "=")]
    if given and any(os.path.abspath(g) != path for g in given):
        raise ValueError(f"XLA_FLAGS already sets {FLAG}={given[0]}; not overriding it with {path}")
    if not given:
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"{FLAG}={path}"])
    return path


def add_argument(parser) -> None:
    parser.add_argument("--autotune-cache", default=None, metavar="DIR",
                        help="read / write XLA's per-fusion GEMM autotuning results in DIR, so runs that share "
                             "it compile the same kernels (XLA otherwise re-times near-equal candidates per "
                             "process)")
