"""What the command-line tools show on stderr while they work, never on stdout: one line per
compilation with its time (always: the first run of a shape is silent for tens of seconds
otherwise), and on a terminal a line or bar while models load and a bar for long generations."""

from __future__ import annotations

import contextlib
import sys
import time

COMPILING = "compiling (first run of this shape)"
LONG_GENERATION = 256  # tokens from which a generation gets a progress bar on a terminal


_line_open = [False]  # a step's "label ..." is on stderr without its end yet


def line_open() -> bool:
    """Whether stderr's last line is an unfinished step (a message written now needs a newline first)."""
    return _line_open[0]


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def step(label: str, *, show: bool = True):
    """'label ...' on stderr, completed with ' done in X s' (or ' failed') when the block ends. On a
    terminal the line is rewritten whole at the end, so a progress bar drawn inside the block (which
    overwrites it) does not leave it half."""
    if not show:
        yield
        return
    err, tty = sys.stderr, stderr_is_terminal()
    err.write(f"{label} ...")
    err.flush()
    _line_open[0] = True
    t0 = time.perf_counter()
    head = f"\r{label} ..." if tty else ""
    try:
        yield
    except BaseException:
        err.write(f"{head} failed\n")
        raise
    else:
        err.write(f"{head} done in {time.perf_counter() - t0:.1f} s\n")
    finally:
        err.flush()
        _line_open[0] = False


def compiling():
    """The context manager ddtree_jax.engine.Engine.on_first_run takes from the CLIs."""
    return step(COMPILING)


def token_bar(total: int, streaming: bool):
    """A tqdm bar of generated tokens on stderr, or None: only on a terminal, for a long generation,
    and not when the text itself streams to a terminal (the two would interleave)."""
    if total < LONG_GENERATION or not stderr_is_terminal() or (streaming and stdout_is_terminal()):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generating", unit="tok", leave=False, dynamic_ncols=True, file=sys.stderr)
