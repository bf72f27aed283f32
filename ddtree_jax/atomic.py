"""Atomic writes: a reader sees the previous file or directory, or the complete new one, never
half of one (an interrupted export, conversion or benchmark leaves nothing that looks finished)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile


def _write_via_tmp(path: str | os.PathLike, mode: str, write) -> None:
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path: str | os.PathLike, obj, **dump_kwargs) -> None:
    """json.dump to a temporary sibling, then rename over `path`."""

    def write(f):
        json.dump(obj, f, **({"indent": 2} | dump_kwargs))
        f.write("\n")

    _write_via_tmp(path, "w", write)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`data` to a temporary sibling, then rename over `path`."""
    _write_via_tmp(path, "wb", lambda f: f.write(data))


def move_into_place(tmp: str, dst: str) -> None:
    """Rename directory `tmp` to `dst`, replacing a previous `dst` (put back if the rename fails)."""
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        return
    old = tempfile.mkdtemp(prefix=os.path.basename(dst) + ".old-", dir=os.path.dirname(os.path.abspath(dst)))
    os.rmdir(old)
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(dst: str | os.PathLike):
    """Yield a temporary sibling directory of `dst`; on success it replaces `dst`, on any error it
    is removed and `dst` is left as it was."""
    dst = os.path.abspath(os.fspath(dst))
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(dst) + ".tmp-", dir=parent)
    try:
        yield tmp
        move_into_place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
