"""Progress of long phases on stderr: plain lines naming their phase in a log, one live display
for phases that run at once on a terminal (``bench quality`` learns while it evaluates)."""

from __future__ import annotations

import io
import re

from combee_stream.progress import PhaseProgress, ProgressBoard


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_phases_at_once_in_a_log_each_say_which_they_are() -> None:
    log = io.StringIO()
    with ProgressBoard(log) as board:
        with board.phase("learn (combee)", 2) as learn, board.phase("evaluate (base)", 1) as ev:
            ev.advance(tokens_out=40)
            learn.advance()
            learn.advance()
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("learn (combee): 0/2")
    assert lines[1].startswith("evaluate (base): 0/1")
    assert any(line.startswith("evaluate (base): 1/1") for line in lines)
    assert lines[-1].startswith("learn (combee): 2/2"), lines


def test_phases_at_once_on_a_terminal_share_one_display() -> None:
    """Each phase a bar of the board's display: its last frame shows both, finished (two
    displays would each draw only their own)."""
    terminal = _Terminal()
    with ProgressBoard(terminal) as board:
        with board.phase("learn (combee)", 3, done=1) as learn:
            with board.phase("evaluate (base)", 2) as ev:
                ev.advance(2)
            learn.advance(2)
    # The display redraws from the start of its line: after the last carriage return, its
    # final frame (escape codes stripped).
    last = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.getvalue().rsplit("\r", 1)[-1])
    assert "learn (combee)" in last and "3/3" in last, last
    assert "evaluate (base)" in last and "2/2" in last, last


def test_a_phase_alone_keeps_its_own_display_on_a_terminal() -> None:
    terminal = _Terminal()
    with PhaseProgress("train (base agent)", 2, stream=terminal) as phase:
        phase.advance(2)
    assert "train (base agent)" in terminal.getvalue() and "2/2" in terminal.getvalue()
