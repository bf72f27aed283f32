"""Ctrl-C and SIGTERM for the command-line tools: one line on stderr and a fixed exit code, whatever
the command was doing (importing JAX, loading, compiling, generating, converting).

`run(prog, work, argv)` runs the command's work in a worker thread while the main thread only waits
in short joins, so Python's signal handler runs within milliseconds even while the worker is inside
C++ (XLA compiling, Orbax / TensorStore writing). The handler removes the temporary directories of
unfinished atomic writes (ddtree_jax.atomic), prints `prog: interrupted` and ends the process with
os._exit: no KeyboardInterrupt unwinding through JAX or Orbax (the 47-line traceback), no
interpreter teardown racing XLA's threads (the segmentation fault seconds after a Ctrl-C during
compilation) and no thread left writing.
"""

from __future__ import annotations

import os
import signal
import threading

from ddtree_jax import atomic
from ddtree_jax.cli import progress

# SIGINT: 130 (the shell's 128 + 2 for Ctrl-C); SIGTERM: 143 (128 + 15), so a caller can tell them apart.
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
POLL_S = 0.05  # how long the main thread waits in one join before Python checks for signals again


def _handler(prog: str):
    def handle(signum, frame):
        for sig in EXIT_CODES:  # a second Ctrl-C does not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        removed = atomic.discard_staged()
        note = "; the unfinished output was removed" if removed else ""
        # On a line of its own: a terminal may hold '^C' or half a line of streamed text, a log an
        # unfinished "compiling ..." line.
        lead = "\n" if _isatty(2) or progress.line_open() else ""
        os.write(2, f"{lead}{prog}: {WORDS[signum]}{note}\n".encode())
        os._exit(EXIT_CODES[signum])

    return handle


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def run(prog: str, work, *args):
    """work(*args) in a worker thread, returning its result or raising its exception (SystemExit
    included) here; a SIGINT / SIGTERM meanwhile ends the process as the module docstring says.
    Off the main thread (where Python cannot install signal handlers) work runs directly."""
    if threading.current_thread() is not threading.main_thread():
        return work(*args)
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = work(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread as it is
            outcome["error"] = e

    previous = {sig: signal.signal(sig, _handler(prog)) for sig in EXIT_CODES}
    try:
        worker = threading.Thread(target=target, name=prog, daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(POLL_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")

