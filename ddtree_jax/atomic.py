"""Atomic writes: a reader sees the previous file or directory, or the complete new one, never
half of one (an interrupted export, conversion or benchmark leaves nothing that looks finished).

Temporary siblings of a directory being written are named `DST.tmp-PID@HOST-XXXXXXXX`: the writer's
process id and host are in the name from the moment the directory exists, so a later writer of the
same DST can tell a leftover of a killed process (SIGKILL, power loss: nothing could clean up) from
one that is still being written, and remove only the former (`sweep_stale`). While a write is under
way its temporary path is registered, so a signal handler can remove it before the process ends
(`discard_staged`, used by ddtree_jax.cli.interrupts).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"  # DST + TMP_MARK + ...: the temporary siblings of DST

_unfinished: set[str] = set()  # temporary files / directories of writes under way in this process
_unfinished_lock = threading.Lock()


def _register(path: str) -> None:
    with _unfinished_lock:
        _unfinished.add(path)


def _unregister(path: str) -> None:
    with _unfinished_lock:
        _unfinished.discard(path)


def discard_staged() -> list[str]:
    """Remove the temporary files / directories of every write under way in this process; returns
    the paths removed. For a signal handler that ends the process next: the writes themselves are
    not stopped, so a directory is removed again if a writer re-created part of it meanwhile."""
    with _unfinished_lock:
        paths = sorted(_unfinished)
    removed = []
    for path in paths:
        for _ in range(3):
            _remove(path)
            if not os.path.lexists(path):
                removed.append(path)
                break
    return removed


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


def _write_via_tmp(path: str | os.PathLike, mode: str, write) -> None:
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    _register(tmp)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    finally:
        _unregister(tmp)


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


# ---- temporary directories and their leftovers -------------------------------------------------
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"


def _writer_of(name: str, base: str) -> tuple[int, str] | None:
    """(pid, host) from a temporary sibling's name, None for names this module did not write."""
    m = re.fullmatch(re.escape(base + TMP_MARK) + r"(\d+)@([A-Za-z0-9._-]+)-[A-Za-z0-9_]+", name)
    return (int(m.group(1)), m.group(2)) if m else None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno != errno.ESRCH  # EPERM: alive, another user's
    return True


def sweep_stale(dst: str | os.PathLike) -> tuple[list[str], list[str]]:
    """Remove the temporary siblings of `dst` left by a writer process on this host that is gone;
    returns (removed, kept): kept are those that may still be written (their process is alive, or
    another host wrote them) or whose writer is unknown (not named by this module), for the caller
    to name."""
    dst = os.path.abspath(os.fspath(dst))
    parent, base = os.path.dirname(dst), os.path.basename(dst)
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(base + TMP_MARK))
    except OSError:
        return [], []
    removed, kept = [], []
    host = _host()
    for name in names:
        path = os.path.join(parent, name)
        with _unfinished_lock:
            ours = path in _unfinished
        writer = _writer_of(name, base)
        if ours or writer is None or writer[1] != host or _process_alive(writer[0]):
            kept.append(path)
            continue
        _remove(path)
        (kept if os.path.lexists(path) else removed).append(path)
    return removed, kept


def describe_kept(path: str, dst: str | os.PathLike) -> str:
    """Why sweep_stale(dst) left `path` alone, for a message that names it."""
    writer = _writer_of(os.path.basename(path), os.path.basename(os.path.abspath(os.fspath(dst))))
    if writer is None:
        return f"{path} looks like a leftover of an interrupted write (its writer is unknown); remove it " \
               "yourself if nothing is writing it"
    pid, host = writer
    if host != _host():
        return f"{path} is being written, or was left, by process {pid} on host {host}; remove it yourself " \
               "if that write is over"
    return f"{path} is being written by process {pid}, which is still running"


@contextlib.contextmanager
def staged_dir(dst: str | os.PathLike):
    """Yield a temporary sibling directory of `dst`; on success it replaces `dst`, on any error it
    is removed and `dst` is left as it was. Leftovers of killed earlier writers of `dst` are removed
    first (sweep_stale), the others logged."""
    dst = os.path.abspath(os.fspath(dst))
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    removed, kept = sweep_stale(dst)
    for path in removed:
        log.warning("removed %s, left by an earlier write of %s that was killed", path, dst)
    for path in kept:
        log.warning("%s", describe_kept(path, dst))
    tmp = tempfile.mkdtemp(prefix=f"{os.path.basename(dst)}{TMP_MARK}{os.getpid()}@{_host()}-", dir=parent)
    _register(tmp)
    try:
        yield tmp
        move_into_place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _unregister(tmp)
