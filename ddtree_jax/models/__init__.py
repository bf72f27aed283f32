"""Flax NNX models: the hybrid target and (later) the DFlash drafter."""
