"""Public API: load a target from an HF safetensors directory or a converted (Orbax) directory,
and convert the former into the latter.

    cfg, graphdef, params = load_target("path/to/Qwen3.5-4B")            # HF dir, streamed
    convert_target("path/to/Qwen3.5-4B", "ckpt/qwen35-4b", dtype="bf16")  # once
    cfg, graphdef, params = load_target("ckpt/qwen35-4b")                # fast restore

A converted directory holds:
    config.json           copy of the HF config
    ddtree_manifest.json  format name + version, params dtype, source, model type, copied files
    params/               Orbax StandardCheckpointer directory of the params pytree
    tokenizer.json, ...   copies of the source's tokenizer, generation config and chat template
                          (GENERATION_FILES, those present), so the directory generates text alone
    CONVERSION_COMPLETE   written last; a directory without it is refused
It is written under a temporary sibling name (ddtree_jax.atomic.staged_dir) and renamed into place
only once complete, so a failed or interrupted conversion never leaves a directory that looks
finished; a leftover of a killed conversion is removed by the next conversion to the same place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Callable

import jax
import jax.numpy as jnp

from converters import dflash, orbax_io
from converters.keymap import CheckpointError
from converters.params import target_params_from_tensors
from converters.safetensors_io import SafetensorsCheckpoint
from ddtree_jax.atomic import staged_dir
from ddtree_jax.config import DTYPES, ConfigError, TargetConfig

log = logging.getLogger(__name__)

FORMAT_NAME = "ddtree-jax-target"
DRAFTER_FORMAT_NAME = "ddtree-jax-drafter"
FORMAT_VERSION = 1
MANIFEST_FILE = "ddtree_manifest.json"
MARKER_FILE = "CONVERSION_COMPLETE"
PARAMS_DIR = "params"
CONFIG_FILE = "config.json"
# What generation needs besides the weights, copied from the source when present: the tokenizer
# (fast tokenizer file, its config with the chat template and special tokens, or the vocabulary /
# merges / sentencepiece files it may be built from), the generation config, the chat template.
GENERATION_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "vocab.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja",
    "chat_template.json",
)

HF = "hf"
CONVERTED = "converted"

__all__ = [
    "AlreadyConvertedError",
    "CheckpointError",
    "ConfigError",
    "DestinationExistsError",
    "IncompleteConversionError",
    "checkpoint_kind",
    "convert_target",
    "convert_checkpoint",
    "convert_drafter",
    "is_drafter_dir",
    "load_drafter",
    "load_target",
    "resolve_dtype",
]


class IncompleteConversionError(ValueError):
    """A converted-checkpoint directory whose conversion never finished (no completion marker)."""


class DestinationExistsError(FileExistsError):
    """The conversion's destination exists; `replaceable`: it is a ddtree-jax conversion (or empty),
    which overwrite=True replaces (anything else is never deleted)."""

    def __init__(self, path: str, replaceable: bool):
        self.path, self.replaceable = path, replaceable
        super().__init__(f"{path} already exists; overwrite=True replaces it" if replaceable else
                         f"{path} exists and is not a ddtree-jax converted checkpoint; refusing to delete it "
                         "even with overwrite=True (choose another destination or remove it yourself)")


class AlreadyConvertedError(ValueError):
    """The conversion's source is itself a converted checkpoint (it loads as it is)."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(f"{path} is already a converted checkpoint; load it directly")


def resolve_dtype(dtype, cfg: TargetConfig | None = None) -> str:
    """'bf16' / 'bfloat16' / jnp.bfloat16 / None -> canonical name; None means the config's dtype."""
    if dtype is None:
        return cfg.dtype if cfg is not None else "float32"
    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: choose one of float32 (fp32), bfloat16 (bf16), float16 (fp16)")
    return DTYPES[name]


def _require_dir(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"{path} is a file, expected a directory (the model directory, not a file in it)")


def _read_config(path: str) -> tuple[dict, TargetConfig]:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(
            f"no {CONFIG_FILE} in {path} (a Hugging Face model directory has one next to its weights)")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError([f"not valid JSON: {e}"], cfg_path) from None
    return raw, TargetConfig.from_hf_dict(raw, source=cfg_path)


def _read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST_FILE)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise IncompleteConversionError(f"{path}: unreadable {MANIFEST_FILE} ({e}); convert the model again") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT_NAME, DRAFTER_FORMAT_NAME):
        raise IncompleteConversionError(f"{path}: {MANIFEST_FILE} is not a {FORMAT_NAME} manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise IncompleteConversionError(
            f"{path}: converted with format version {version!r}, this ddtree-jax reads up to {FORMAT_VERSION}; "
            "upgrade ddtree-jax or convert again"
        )
    return manifest


def checkpoint_kind(path: str | os.PathLike) -> str:
    """'converted' (complete ddtree conversion) or 'hf' (anything else, to be read as safetensors).

    Raises IncompleteConversionError for a conversion directory without its completion marker
    (an interrupted or still-running conversion, or a leftover temporary directory).
    """
    path = os.fspath(path)
    _require_dir(path)
    has_marker = os.path.isfile(os.path.join(path, MARKER_FILE))
    looks_converted = os.path.exists(os.path.join(path, MANIFEST_FILE)) or os.path.isdir(os.path.join(path, PARAMS_DIR))
    if has_marker:
        return CONVERTED
    if looks_converted:
        raise IncompleteConversionError(
            f"{path} is an incomplete conversion (no {MARKER_FILE} marker: the conversion failed, was "
            "interrupted or is still running); delete it and convert again"
        )
    return HF


def load_target(
    path: str | os.PathLike,
    dtype=None,
    *,
    progress: bool = False,
    on_tensor: Callable[[str], None] | None = None,
):
    """Load a target for decoding from a HF safetensors directory or a converted directory.

    dtype: params dtype ('float32'/'fp32', 'bfloat16'/'bf16', 'float16'/'fp16'); default: the
    converted params' dtype, or config.json's dtype for a HF directory. The returned cfg has
    `dtype` set to the params dtype (so caches made from it match).
    Returns (cfg, graphdef, params). Which kind of directory was found is logged (INFO) and
    available beforehand from `checkpoint_kind(path)`.
    """
    path = os.fspath(path)
    kind = checkpoint_kind(path)
    if kind == CONVERTED:
        log.info("loading converted (Orbax) checkpoint from %s", path)
        return _load_converted(path, dtype)
    log.info("loading Hugging Face safetensors checkpoint from %s", path)
    _, cfg = _read_config(path)
    want = resolve_dtype(dtype, cfg)
    graphdef, params, _ = _load_hf(path, cfg, want, progress=progress, on_tensor=on_tensor)
    return cfg.replace(dtype=want), graphdef, params


def _load_converted(path: str, dtype):
    manifest = _read_manifest(path)
    if manifest.get("format") == DRAFTER_FORMAT_NAME:
        raise ValueError(f"{path} is a converted DFlash drafter, not a target (pass it as the drafter)")
    _, cfg = _read_config(path)
    stored = manifest.get("dtype", cfg.dtype)
    want = resolve_dtype(dtype) if dtype is not None else resolve_dtype(stored)
    graphdef, params = orbax_io.restore_params(os.path.join(path, PARAMS_DIR), cfg, want)
    return cfg.replace(dtype=want), graphdef, params


def _load_hf(path: str, cfg: TargetConfig, dtype: str, *, progress: bool, on_tensor=None, desc="reading"):
    """Stream the safetensors into params; returns (graphdef, params, tensor count)."""
    with SafetensorsCheckpoint(path) as ckpt:
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ckpt), desc=desc, unit="tensor", dynamic_ncols=True)

        def tick(name: str) -> None:
            if bar is not None:
                bar.update(1)
            if on_tensor is not None:
                on_tensor(name)

        if ckpt.unreadable_unknown:  # every parameter would be listed as missing after it: say only the cause
            raise CheckpointError(ckpt.problems, path)
        problems = list(ckpt.problems)
        try:
            graphdef, params = target_params_from_tensors(
                cfg, ckpt.names, ckpt.load, dtype=dtype, source=path, on_tensor=tick, unavailable=ckpt.unavailable
            )
        except CheckpointError as e:
            problems.extend(e.problems)
        finally:
            if bar is not None:
                bar.close()
        if problems:
            raise CheckpointError(problems, path)
        return graphdef, params, len(ckpt)


def _is_replaceable(path: str) -> bool:
    """True for an empty directory or one made by convert_target (complete or not)."""
    if not os.path.isdir(path):
        return False
    entries = os.listdir(path)
    return not entries or MANIFEST_FILE in entries or MARKER_FILE in entries


def convert_target(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    dtype=None,
    overwrite: bool = False,
    progress: bool = True,
    *,
    on_tensor: Callable[[str], None] | None = None,
) -> str:
    """Convert a HF safetensors directory into a converted (Orbax) directory at dst; returns dst.

    dtype: params dtype to store (default: config.json's dtype). overwrite: replace an existing
    converted directory at dst (a non-empty directory that is not a ddtree conversion is never
    deleted). Atomic: nothing appears at dst unless the whole conversion succeeded.
    """
    src, dst = os.fspath(src), os.path.abspath(os.fspath(dst))
    _check_destination(dst, overwrite)
    _require_dir(src)
    if checkpoint_kind(src) == CONVERTED:
        raise AlreadyConvertedError(src)
    raw_cfg, cfg = _read_config(src)
    want = resolve_dtype(dtype, cfg)

    def read(progress_flag):
        _, params, count = _load_hf(src, cfg, want, progress=progress_flag, on_tensor=on_tensor, desc="converting")
        return params, count

    return _write_converted(src, dst, raw_cfg, FORMAT_NAME, cfg.model_type, want, read, progress)


def _check_destination(dst: str, overwrite: bool) -> None:
    ancestor = os.path.dirname(dst)
    while not os.path.lexists(ancestor) and os.path.dirname(ancestor) != ancestor:
        ancestor = os.path.dirname(ancestor)  # the nearest existing one must be a directory
    if not os.path.isdir(ancestor):
        raise NotADirectoryError(f"{ancestor} is a file, expected a directory (the destination {dst} goes inside it)")
    if os.path.lexists(dst):
        if not os.path.isdir(dst):
            raise NotADirectoryError(f"{dst} is a file, expected a directory (the converted checkpoint to create)")
        if not overwrite or not _is_replaceable(dst):
            raise DestinationExistsError(dst, replaceable=_is_replaceable(dst))


def _write_converted(src: str, dst: str, raw_cfg: dict, fmt: str, model_type: str, dtype: str, read, progress) -> str:
    """Atomically write config + manifest + Orbax params (from read(progress) -> (params, count)) and
    copies of the source's GENERATION_FILES at dst."""
    with staged_dir(dst) as tmp:  # removed on any error or interrupt; a killed one by the next conversion
        start = time.time()
        copied = [name for name in GENERATION_FILES if os.path.isfile(os.path.join(src, name))]
        manifest = {
            "format": fmt,
            "format_version": FORMAT_VERSION,
            "dtype": dtype,
            "model_type": model_type,
            "source": os.path.abspath(src),
            "created_unix": int(start),
            "copied_files": copied,
        }
        # The manifest goes first so a leftover temp directory is recognisable as an incomplete conversion.
        _write_json(os.path.join(tmp, MANIFEST_FILE), manifest)
        _write_json(os.path.join(tmp, CONFIG_FILE), raw_cfg)
        for name in copied:
            shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
        params, count = read(progress)
        orbax_io.save_params(os.path.join(tmp, PARAMS_DIR), params)
        manifest["num_source_tensors"] = count
        _write_json(os.path.join(tmp, MANIFEST_FILE), manifest)
        with open(os.path.join(tmp, MARKER_FILE), "w") as f:  # written last
            f.write(f"{fmt} v{FORMAT_VERSION} complete in {time.time() - start:.1f} s\n")
            f.flush()
            os.fsync(f.fileno())
    return dst


# ---- DFlash drafters ----------------------------------------------------------------------
def is_drafter_dir(path: str | os.PathLike) -> bool:
    """True when path/config.json describes a DFlash drafter (architectures or dflash_config)."""
    cfg_path = os.path.join(os.fspath(path), CONFIG_FILE)
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    archs = raw.get("architectures") or []
    return isinstance(raw, dict) and ("dflash_config" in raw or any("DFlash" in str(a) for a in archs))


def convert_drafter(src, dst, dtype=None, overwrite: bool = False, progress: bool = True) -> str:
    """Convert a z-lab DFlash drafter directory into a converted (Orbax) directory at dst (atomic)."""
    src, dst = os.fspath(src), os.path.abspath(os.fspath(dst))
    _check_destination(dst, overwrite)
    _require_dir(src)
    if checkpoint_kind(src) == CONVERTED:
        raise AlreadyConvertedError(src)
    with open(os.path.join(src, CONFIG_FILE)) as f:
        raw_cfg = json.load(f)

    def read(progress_flag):
        _, _, params = dflash.load_drafter(src, dtype=dtype)
        return params, len(jax.tree_util.tree_leaves(params))

    dcfg = dflash.DrafterConfig.from_hf_dict(raw_cfg, source=os.path.join(src, CONFIG_FILE))
    want = resolve_dtype(dtype) if dtype is not None else dcfg.dtype
    return _write_converted(src, dst, raw_cfg, DRAFTER_FORMAT_NAME, "dflash", want, read, progress)


def load_drafter(path, dtype=None):
    """(dcfg, graphdef, params) of a DFlash drafter from a z-lab HF directory or a converted one."""
    path = os.fspath(path)
    if checkpoint_kind(path) == HF:
        return dflash.load_drafter(path, dtype=dtype)
    manifest = _read_manifest(path)
    if manifest.get("format") != DRAFTER_FORMAT_NAME:
        raise ValueError(f"{path} is a converted target, not a drafter")
    with open(os.path.join(path, CONFIG_FILE)) as f:
        raw = json.load(f)
    dcfg = dflash.DrafterConfig.from_hf_dict(raw, source=os.path.join(path, CONFIG_FILE))
    want = resolve_dtype(dtype) if dtype is not None else resolve_dtype(manifest.get("dtype", dcfg.dtype))
    dcfg = dcfg.replace(dtype=want)
    graphdef, abstract = dflash.abstract_drafter(dcfg, want)
    params = orbax_io.restore_tree(os.path.join(path, PARAMS_DIR), abstract)
    return dcfg, graphdef, params


def convert_checkpoint(src, dst, dtype=None, overwrite: bool = False, progress: bool = True) -> tuple[str, str]:
    """Convert a target or a DFlash drafter (told apart by config.json); returns (kind, dst)."""
    if os.path.isdir(os.fspath(src)) and is_drafter_dir(src):
        return "drafter", convert_drafter(src, dst, dtype, overwrite, progress)
    return "target", convert_target(src, dst, dtype, overwrite, progress)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


