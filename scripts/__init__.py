"""User tools (hot_tokens, build_demo_pair, pick_autotune_cache, offline_triton_compile) and the
benchmark package (scripts.bench). Run from the repository root: `python -m scripts.NAME ...`."""
