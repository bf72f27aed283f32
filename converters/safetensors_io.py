"""Stream tensors out of a Hugging Face safetensors checkpoint directory, without torch.

Supports the two layouts `save_pretrained` writes:
  * `model.safetensors` (one file), or
  * `model.safetensors.index.json` whose `weight_map` sends each tensor name to a shard file.

Opening the checkpoint reads only the file headers (names, dtypes, shapes) and records every
structural problem (missing shard files, tensors the index lists but the shard lacks, unreadable
headers) in `problems`, so the caller can report them together with the key-mapping problems.
`load(name)` then reads one tensor at a time (`safe_open(framework="numpy")`, memory-mapped);
bf16 tensors come back as ml_dtypes bfloat16.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors hands it out)
import numpy as np
from safetensors import safe_open

from converters.keymap import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype tags this converter reads; anything else (int8, fp8, ...) is a problem.
SUPPORTED_STORED_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _describe_dir(directory: str, limit: int = 12) -> str:
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return "(unreadable)"
    if not entries:
        return "(empty)"
    shown = ", ".join(entries[:limit])
    return shown + (f", ... ({len(entries) - limit} more)" if len(entries) > limit else "")


def _size(path: str) -> str:
    try:
        return f"{os.path.getsize(path):,} bytes"
    except OSError:
        return "size unknown"


def no_safetensors_message(directory: str) -> str:
    present = _describe_dir(directory)
    msg = (
        f"no safetensors weights in {directory}: expected '{SINGLE_FILE}' or a sharded checkpoint "
        f"with '{INDEX_FILE}' (found: {present})"
    )
    try:
        entries = os.listdir(directory)
    except OSError:
        entries = []
    if any(e.endswith(".bin") or e.startswith("pytorch_model") or e.endswith(".pt") for e in entries):
        msg += (
            "; PyTorch .bin / pytorch_model files are not supported: re-save the model with "
            "`model.save_pretrained(dir, safe_serialization=True)` to get safetensors"
        )
    elif any(e.endswith(".safetensors") for e in entries):
        msg += f"; other .safetensors files are present but without '{INDEX_FILE}' the tensor layout is unknown"
    return msg


class SafetensorsCheckpoint:
    """Lazy, header-only view of an HF safetensors checkpoint directory.

    names: every readable tensor name, grouped by shard (each shard is opened once while streaming).
    problems: structural problems found while reading the headers (may be non-empty).
    unavailable: names the index lists that cannot be read (already covered by `problems`).
    unreadable_unknown: a file whose tensor names nothing else lists (the single model.safetensors)
    could not be read, so which tensors are missing because of it is unknown: its problem is the
    root cause of every missing parameter and the only one worth reporting.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        self.problems: list[str] = []
        self.unavailable: list[str] = []
        self.unreadable_unknown = False
        self._file_of: dict[str, str] = {}
        self._dtype_of: dict[str, str] = {}
        self._shape_of: dict[str, tuple[int, ...]] = {}
        self._open_file: str | None = None
        self._handle = None

        index_path = os.path.join(self.directory, INDEX_FILE)
        single_path = os.path.join(self.directory, SINGLE_FILE)
        if os.path.isfile(index_path):
            self.layout = "sharded"
            by_file = self._read_index(index_path)
        elif os.path.isfile(single_path):
            self.layout = "single"
            by_file = {SINGLE_FILE: None}
        else:
            raise FileNotFoundError(no_safetensors_message(self.directory))
        for fname, wanted in by_file.items():
            self._scan_file(fname, wanted)

    # ---- header scan -------------------------------------------------------------------
    def _read_index(self, index_path: str) -> dict[str, list[str]]:
        try:
            with open(index_path) as f:
                index = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError([f"cannot read {INDEX_FILE}: {e}"], self.directory) from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError([f"{INDEX_FILE} has no 'weight_map' object naming the shard of each tensor"],
                                  self.directory)
        by_file: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str):
                self.problems.append(f"{INDEX_FILE} maps '{name}' to {fname!r}, not a file name")
                continue
            by_file.setdefault(fname, []).append(name)
        return dict(sorted(by_file.items()))

    def _scan_file(self, fname: str, wanted: list[str] | None) -> None:
        path = os.path.join(self.directory, fname)
        if not os.path.isfile(path):
            count = len(wanted or [])
            self.problems.append(
                f"shard file '{fname}' is missing ({INDEX_FILE} maps {count} tensor(s) to it, "
                f"e.g. '{(wanted or ['?'])[0]}')"
            )
            self.unavailable.extend(wanted or [])
            return
        try:
            handle = safe_open(path, framework="numpy")
            present = list(handle.keys())
            present_set = set(present)
            names = present if wanted is None else [n for n in wanted if n in present_set]
            for name in names:
                sl = handle.get_slice(name)
                self._file_of[name] = fname
                self._dtype_of[name] = sl.get_dtype()
                self._shape_of[name] = tuple(sl.get_shape())
        except Exception as e:  # safetensors raises its own SafetensorError (not an OSError)
            self.problems.append(f"cannot read '{fname}' ({_size(path)}): {e} - the file is truncated or corrupt "
                                 "(copy or download it again)")
            self.unavailable.extend(n for n in (wanted or []) if n not in self._file_of)
            self.unreadable_unknown |= wanted is None
            return
        if wanted is not None:
            for name in wanted:
                if name not in present_set:
                    self.problems.append(
                        f"{INDEX_FILE} lists tensor '{name}' in '{fname}', but that file does not contain it")
                    self.unavailable.append(name)

    # ---- access ------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def stored_dtype(self, name: str) -> str:
        return self._dtype_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape_of[name]

    def load(self, name: str) -> np.ndarray:
        """Read one tensor. Raises ValueError (collected as a problem by map_checkpoint) for
        stored dtypes other than bf16/fp16/fp32."""
        if name not in self._file_of:
            raise ValueError("not present in any safetensors file of this checkpoint")
        tag = self._dtype_of[name]
        if tag not in SUPPORTED_STORED_DTYPES:
            raise ValueError(
                f"unsupported dtype {tag} (supported stored dtypes: {', '.join(SUPPORTED_STORED_DTYPES)}; "
                "quantised checkpoints are not supported)"
            )
        fname = self._file_of[name]
        if fname != self._open_file:
            self._handle = None  # drop the previous shard's mapping before opening the next one
            self._handle = safe_open(os.path.join(self.directory, fname), framework="numpy")
            self._open_file = fname
        return self._handle.get_tensor(name)

    def close(self) -> None:
        self._handle = None
        self._open_file = None

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
