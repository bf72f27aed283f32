"""The XLA (jnp) math the models' reference forms and the kernels' references share: the Gated
DeltaNet delta rule, the Mamba2 SSD scan, the short causal conv, norms and RoPE. Pure jax; imports
nothing of the project."""
