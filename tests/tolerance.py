"""Tolerances that scale with the compared quantity.

`scaled_error` is max |got - want| / max |want|: an absolute bound scaled by the magnitude of the
compared array. A fixed absolute bound fails on large values (recurrent states reach ~40: float32
rounding of a long sequential update on another CPU crossed 1e-5), and an elementwise relative
bound fails on entries near zero that come out of cancellation between large terms.

`by_impl` picks a kernel test's bound: the interpreter computes float32 products exactly, a GPU
in TF32 (or split-bf16) with approximate exp / rsqrt.
"""

import numpy as np


def scaled_error(got, want) -> float:
    """max |got - want| / max |want| (0 when both are all zeros)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    diff = float(np.abs(got - want).max(initial=0.0))
    return diff / max(float(np.abs(want).max(initial=0.0)), np.finfo(np.float32).tiny) if diff else 0.0


def assert_scaled_close(got, want, tol: float, what: str = "") -> None:
    """|got - want| <= tol * max |want| everywhere, and no NaN."""
    assert not np.isnan(np.asarray(got, np.float64)).any(), f"NaN in {what or 'the result'}"
    err = scaled_error(got, want)
    assert err <= tol, f"{what + ': ' if what else ''}error {err:.3g} of the magnitude > {tol:.3g}"


def by_impl(impl: str, interpret: float, native: float) -> float:
    """`interpret` for impl "pallas_interpret" (exact float32 products), else `native` (the GPU)."""
    return interpret if impl == "pallas_interpret" else native
