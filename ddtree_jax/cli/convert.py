"""ddtree-convert: turn a Hugging Face safetensors model directory into a fast-loading JAX checkpoint."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Convert a Hugging Face model directory (config.json + model.safetensors, or a sharded
model.safetensors.index.json with its shard files) into a ddtree-jax checkpoint directory
(config.json + Orbax params) that load_target() restores quickly.

Supported model types: qwen3, qwen3_5_text, qwen3_5 (text part), qwen3_next (dense or with
experts), qwen3_5_moe_text, qwen3_5_moe (text part; experts fused or one tensor per expert),
nemotron_h, bamba, mamba2, and z-lab DFlash drafters (DFlashDraftModel), told apart by config.json.
PyTorch .bin / pytorch_model weights are not supported: re-save them as safetensors first.
The conversion is atomic: DST appears only once everything has been written.
"""

EPILOG = """\
examples:
  ddtree-convert ~/models/Qwen3.5-4B ckpt/qwen35-4b
  ddtree-convert ~/models/Qwen3.5-4B ckpt/qwen35-4b-fp32 --dtype fp32 --force

in Python:
  from converters.load import load_target
  cfg, graphdef, params = load_target("ckpt/qwen35-4b")
"""

DTYPE_CHOICES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                 "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddtree-convert",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", metavar="SRC", help="Hugging Face model directory (with config.json and *.safetensors)")
    parser.add_argument("dst", metavar="DST", help="output directory to create (must not exist unless --force)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPE_CHOICES),
        default=None,
        metavar="{bf16,fp16,fp32}",
        help="dtype of the stored params (default: the dtype in config.json)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace DST if it is an existing ddtree-jax checkpoint (other directories are never deleted)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imported after argument parsing so `--help` answers at once.
    from converters.keymap import CheckpointError
    from converters.load import IncompleteConversionError, convert_checkpoint
    from ddtree_jax.config import ConfigError

    dtype = DTYPE_CHOICES[args.dtype] if args.dtype else None
    try:
        kind, dst = convert_checkpoint(args.src, args.dst, dtype=dtype, overwrite=args.force, progress=not args.quiet)
    except (ConfigError, CheckpointError, IncompleteConversionError, OSError, ValueError) as e:
        # Bad input: the message says what is wrong (every problem for config / checkpoint errors).
        print(f"ddtree-convert: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ddtree-convert: interrupted; nothing was written to DST", file=sys.stderr)
        return 130
    print(f"converted {kind} {args.src} -> {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
