"""ddtree-serve: an OpenAI-compatible server with continuous batching (docs/serving.md).

slots.py (the device state of B slots), scheduler.py (the thread that moves requests through
them), text.py / chat.py (detokenization, stop strings, chat templates), protocol.py (requests
and responses), metrics.py and app.py (the FastAPI app). The HTTP stack is the `serve` extra:
`pip install 'ddtree-jax[serve]'`.
"""

from __future__ import annotations

import importlib

SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client", "jinja2")


def missing_dependencies() -> list[str]:
    """The serving packages that do not import here (empty: all there)."""
    missing = []
    for name in SERVE_EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing
