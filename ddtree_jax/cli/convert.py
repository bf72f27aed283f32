"""ddtree-convert: turn a Hugging Face safetensors model directory into a fast-loading JAX checkpoint."""

from __future__ import annotations

import argparse
import logging
import sys

from ddtree_jax.cli.common import EXIT_STATUS_HELP, INPUT_ERROR, RUNTIME_ERROR, die, note, run

PROG = "ddtree-convert"
DESCRIPTION = """\
Convert a Hugging Face model directory (config.json + model.safetensors, or a sharded
model.safetensors.index.json with its shard files) into a ddtree-jax checkpoint directory
(config.json + Orbax params) that load_target() restores quickly. The tokenizer files,
generation_config.json and the chat template are copied along, so ddtree-generate reads text
prompts with DST alone.

Supported model types: qwen3, qwen3_5_text, qwen3_5 (text part), qwen3_next (dense or with
experts), qwen3_5_moe_text, qwen3_5_moe (text part; experts fused or one tensor per expert),
nemotron_h, bamba, mamba2, and z-lab DFlash drafters (DFlashDraftModel), told apart by config.json.
PyTorch .bin / pytorch_model weights are not supported: re-save them as safetensors first.
The conversion is atomic: DST appears only once everything has been written (into DST.tmp-*
beside it, removed on failure or Ctrl-C; one left by a killed conversion is removed by the next
conversion to DST).
"""

EPILOG = """\
examples:
  ddtree-convert ~/models/Qwen3.5-4B ckpt/qwen35-4b
  ddtree-convert ~/models/Qwen3.5-4B ckpt/qwen35-4b-fp32 --dtype fp32 --force

in Python:
  from converters.load import load_target
  cfg, graphdef, params = load_target("ckpt/qwen35-4b")

""" + EXIT_STATUS_HELP.format(extra="")

DTYPE_CHOICES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                 "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
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
    """ddtree-convert; Ctrl-C / SIGTERM at any moment end it on one line (exit 130 / 143) with the
    temporary directory removed."""
    return run(PROG, convert_main, argv)


def convert_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imported after argument parsing so `--help` answers at once.
    from converters.keymap import CheckpointError
    from converters.load import (AlreadyConvertedError, DestinationExistsError, IncompleteConversionError,
                                 convert_checkpoint)
    from ddtree_jax.config import ConfigError

    dtype = DTYPE_CHOICES[args.dtype] if args.dtype else None
    atomic_log = logging.getLogger("ddtree_jax.atomic")  # its notes on leftovers of killed conversions
    atomic_log.addHandler(_Notes())
    atomic_log.propagate = False  # said once, as a note (absl puts a handler on the root logger)
    try:
        kind, dst = convert_checkpoint(args.src, args.dst, dtype=dtype, overwrite=args.force, progress=not args.quiet)
    except DestinationExistsError as e:
        die(f"{e.path} already exists; pass --force to replace it" if e.replaceable else
            f"{e.path} exists and is not a ddtree-jax converted checkpoint; refusing to delete it even with --force "
            "(choose another destination or remove it yourself)")
    except AlreadyConvertedError as e:
        die(f"{e.path} is already a converted checkpoint: pass it to ddtree-generate / ddtree-bench as it is")
    except (ConfigError, CheckpointError, IncompleteConversionError, FileNotFoundError, NotADirectoryError,
            IsADirectoryError, ValueError) as e:
        die(str(e), INPUT_ERROR)  # bad input: the message says what is wrong (every checkpoint problem)
    except OSError as e:  # the write failed (disk full, permissions): nothing was left at DST
        die(f"{e}; nothing was written to {args.dst}", RUNTIME_ERROR)
    finally:
        atomic_log.handlers.clear()
        atomic_log.propagate = True
    print(f"converted {kind} {args.src} -> {dst}")
    return 0


class _Notes(logging.Handler):
    """ddtree_jax.atomic's notes about leftover temporary directories, as `ddtree-convert: note:` lines."""

    def emit(self, record):
        note(record.getMessage())


if __name__ == "__main__":
    sys.exit(main())
