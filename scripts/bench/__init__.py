"""Benchmarks: model shapes and random weights (shapes), shared timing and reports (common), the
end-to-end step (e2e), its kernel profile (profile), per-kernel timings (kernels) with their
PyTorch / FLA peers (peers), and plain decoding against HF transformers (hf).
Run from the repository root: `python -m scripts.bench.e2e ...`."""
