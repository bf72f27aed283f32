"""ddtree-jax: DFlash + DDTree tree speculative decoding for hybrid attention/recurrent LLMs."""

__version__ = "0.1.0"
