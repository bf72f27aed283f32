"""What the commands show while they work: a step line with its time (rewritten whole on a terminal,
where a bar may have overwritten it), and a token bar only where it cannot mix with streamed text."""

import pytest

from ddtree_jax.cli import progress


def test_step_line_in_a_log_and_on_a_terminal(capsys, monkeypatch):
    with progress.step("compiling (first run of this shape)"):
        assert progress.line_open()
    assert not progress.line_open()
    err = capsys.readouterr().err
    assert err.startswith("compiling (first run of this shape) ... done in ") and err.endswith(" s\n")
    assert "\r" not in err
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    with pytest.raises(RuntimeError):
        with progress.step("loading x"):
            raise RuntimeError
    assert capsys.readouterr().err == "loading x ...\rloading x ... failed\n"
    with progress.step("hidden", show=False):
        pass
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("stderr_tty,stdout_tty,streaming,total,shown", [
    (True, True, True, 1000, False),  # the text streams to the terminal: no bar between its lines
    (True, False, True, 1000, True),  # text to a file or pipe, bar on the terminal
    (True, True, False, 1000, True),  # --json / --no-stream
    (True, True, False, 100, False),  # short: no bar
    (False, False, False, 1000, False),  # a log: no bar
])
def test_token_bar_only_where_it_cannot_mix_with_the_text(monkeypatch, capsys, stderr_tty, stdout_tty, streaming,
                                                          total, shown):
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: stderr_tty)
    monkeypatch.setattr(progress, "stdout_is_terminal", lambda: stdout_tty)
    bar = progress.TokenBar(total, streaming=streaming)
    assert bar.show == shown
    bar.update(10)
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == "" and ("generating" in captured.err) == shown
