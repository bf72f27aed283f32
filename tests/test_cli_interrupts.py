"""Ctrl-C and SIGTERM sent to real ddtree-generate / ddtree-convert processes: one line on stderr,
exit 130 (SIGINT) or 143 (SIGTERM), no traceback, no crash afterwards, no temporary directory left;
a conversion killed outright (SIGKILL) leaves one, which the next conversion removes.

The phase a signal lands in is found from the command's own stderr (the "compiling ..." line) or
from a driver that pauses the conversion between its writes, never from sleeps, so the tests hold
on a loaded 2-core machine; the timeouts are generous for the same reason."""

import glob
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from converters.load import MARKER_FILE, checkpoint_kind
from ddtree_jax.cli.progress import COMPILING
from tests.cli_fixtures import write_target

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASE_TIMEOUT_S = 600  # import + load + compile of the tiny model on a loaded 2-core machine
EXIT_TIMEOUT_S = 60

# ddtree-convert with its parameters written but the conversion not yet finished (no marker):
# the driver says so on stderr and waits there, where the test sends its signal.
PAUSED_CONVERT = """
import sys, time
from converters import orbax_io
real_save = orbax_io.save_params

def save_then_wait(path, params):
    real_save(path, params)
    print("PARAMS WRITTEN", file=sys.stderr, flush=True)
    time.sleep(3600)

orbax_io.save_params = save_then_wait
from ddtree_jax.cli.convert import main
sys.exit(main(sys.argv[1:]))
"""


class Command:
    """A CLI subprocess whose stdout and stderr are collected as they come."""

    def __init__(self, *argv):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, *map(str, argv)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self._out, self._err = [], []
        self._readers = [threading.Thread(target=self._read, args=(s, buf), daemon=True)
                         for s, buf in ((self.proc.stdout, self._out), (self.proc.stderr, self._err))]
        for r in self._readers:
            r.start()

    @staticmethod
    def _read(stream, buf):
        for chunk in iter(lambda: stream.read1(4096), b""):
            buf.append(chunk)

    @property
    def out(self) -> str:
        return b"".join(self._out).decode(errors="replace")

    @property
    def err(self) -> str:
        return b"".join(self._err).decode(errors="replace")

    def wait_for(self, ready, what: str):
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while not ready():
            if self.proc.poll() is not None:
                pytest.fail(f"the command ended (exit {self.proc.returncode}) before {what}:\n{self.err}")
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"no {what} within {PHASE_TIMEOUT_S} s:\n{self.err}")
            time.sleep(0.02)

    def send(self, sig) -> int:
        assert self.proc.poll() is None, "the command ended before the signal"
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=EXIT_TIMEOUT_S)
        for r in self._readers:
            r.join(timeout=EXIT_TIMEOUT_S)
        return code


def assert_one_line(err: str, prog: str, word: str):
    """No traceback or ignored exception, and the command's last words are one line of its own."""
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.endswith(f"\n{prog}: {word}\n") or err == f"{prog}: {word}\n" or \
        err.endswith(f"{prog}: {word}; the unfinished output was removed\n"), err


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # A long context, so a generation can run long enough to be interrupted half way.
    return write_target(str(tmp_path_factory.mktemp("interrupts") / "target"), max_position_embeddings=16384)


def test_sigint_during_compilation(target):
    """Was: a 47-line KeyboardInterrupt traceback, then a segmentation fault 3-11 s later."""
    cmd = Command("-m", "ddtree_jax.cli.generate", "--target", target, "--mode", "ar", "--prompt", "def f(x):",
                  "--max-new-tokens", "8")
    cmd.wait_for(lambda: COMPILING in cmd.err, "compilation")
    assert "done in" not in cmd.err
    assert cmd.send(signal.SIGINT) == 130  # a crash during teardown would be -11 (SIGSEGV) or -6
    assert_one_line(cmd.err, "ddtree-generate", "interrupted")
    assert cmd.out == ""  # nothing of the prompt echoed before generation


def test_sigint_during_generation(target):
    cmd = Command("-m", "ddtree_jax.cli.generate", "--target", target, "--mode", "ar", "--prompt", "def f(x):",
                  "--max-new-tokens", "16000")
    cmd.wait_for(lambda: "done in" in cmd.err and cmd.out.startswith("def f(x):"), "streamed tokens")
    assert cmd.send(signal.SIGINT) == 130
    assert_one_line(cmd.err, "ddtree-generate", "interrupted")
    assert "tok/s" not in cmd.err  # stopped, not finished


@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_signal_mid_conversion_removes_the_temporary_directory(target, tmp_path, sig, code, word):
    """Was: sometimes swallowed (exit 0), or hundreds of lines of Orbax tracebacks, and DST.tmp-*
    left behind."""
    dst = tmp_path / "converted"
    cmd = Command("-c", PAUSED_CONVERT, target, dst, "-q")
    cmd.wait_for(lambda: "PARAMS WRITTEN" in cmd.err, "the parameters written")
    [tmp] = glob.glob(f"{dst}.tmp-*")
    assert os.path.isdir(os.path.join(tmp, "params"))
    assert cmd.send(sig) == code
    assert_one_line(cmd.err, "ddtree-convert", word)
    assert os.listdir(tmp_path) == []


def test_killed_conversion_is_cleaned_up_by_the_next(target, tmp_path, capsys):
    """SIGKILL leaves DST.tmp-*; the next conversion to DST removes it (its writer is gone) and says so."""
    dst = tmp_path / "converted"
    cmd = Command("-c", PAUSED_CONVERT, target, dst, "-q")
    cmd.wait_for(lambda: "PARAMS WRITTEN" in cmd.err, "the parameters written")
    assert cmd.send(signal.SIGKILL) == -signal.SIGKILL
    [left] = glob.glob(f"{dst}.tmp-*")
    assert not os.path.exists(os.path.join(left, MARKER_FILE))
    from ddtree_jax.cli import convert as convert_cli

    assert convert_cli.main([target, str(dst), "-q"]) == 0
    assert f"ddtree-convert: note: removed {left}, left by an earlier write" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["converted"] and checkpoint_kind(dst) == "converted"


@pytest.mark.slow
def test_sigterm_during_compilation_and_sigint_at_import(target):
    """SIGTERM while XLA compiles; SIGINT while the worker imports JAX (its first heavy step): the
    same one line, with 143 and 130."""
    cmd = Command("-m", "ddtree_jax.cli.generate", "--target", target, "--mode", "ar", "--prompt", "x")
    cmd.wait_for(lambda: COMPILING in cmd.err, "compilation")
    assert cmd.send(signal.SIGTERM) == 143
    assert_one_line(cmd.err, "ddtree-generate", "terminated")
    cmd = Command("-c", IMPORTING_GENERATE, "--target", target, "--prompt", "x")
    cmd.wait_for(lambda: "IMPORTING" in cmd.err, "the import")
    assert cmd.send(signal.SIGINT) == 130
    assert_one_line(cmd.err, "ddtree-generate", "interrupted")


# ddtree-generate whose worker says when it starts importing JAX.
IMPORTING_GENERATE = """
import sys
from ddtree_jax.cli import generate
real = generate.generate_main

def announced(argv):
    print("IMPORTING", file=sys.stderr, flush=True)
    import jax  # noqa: F401
    return real(argv)

generate.generate_main = announced
sys.exit(generate.main(sys.argv[1:]))
"""
