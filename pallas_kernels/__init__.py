"""Pallas GPU kernels, one per file next to its pure-jnp reference (impl= switch)."""
