"""Where the embedded demo pair (a small trained target + its DFlash drafter) lives."""

from __future__ import annotations

import os

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "demo")


def demo_paths() -> tuple[str, str]:
    """(target dir, drafter dir) of the embedded demo pair; a clear error if it is not installed."""
    target, drafter = os.path.join(DEMO_DIR, "target"), os.path.join(DEMO_DIR, "drafter")
    if not all(os.path.isfile(os.path.join(d, "config.json")) for d in (target, drafter)):
        raise FileNotFoundError(
            f"the embedded demo pair is missing from {DEMO_DIR}; pass --target DIR (and --drafter DIR) explicitly"
        )
    return target, drafter
