"""HF / PyTorch checkpoint converters: key maps, safetensors streaming, Orbax save/restore."""
