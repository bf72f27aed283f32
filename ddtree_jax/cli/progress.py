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


class TokenBar:
    """A tqdm bar of generated tokens on stderr, shown only on a terminal, for a long generation, and
    not when the text itself streams to a terminal (the two would interleave). Drawn from the first
    tokens on, so the compilation before them (its own line) is not counted in its rate."""

    def __init__(self, total: int, streaming: bool):
        self.total = total
        self.show = total >= LONG_GENERATION and stderr_is_terminal() and not (streaming and stdout_is_terminal())
        self._bar = None

    def update(self, n: int) -> None:
        if not self.show:
            return
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, desc="generating", unit="tok", leave=False, dynamic_ncols=True,
                             file=sys.stderr)
        self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
