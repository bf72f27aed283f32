"""Speculative decoding: draft tree construction, tree verification, acceptance, commit, generation."""
