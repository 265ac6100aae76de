"""Progress of a long phase on stderr: plain lines naming the phase in a log (a ``nohup`` run of
``bench quality``), a bar on a terminal."""

from __future__ import annotations

import io

from combee_stream.progress import PhaseProgress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_phase_in_a_log_says_where_it_is_from_start_to_end() -> None:
    log = io.StringIO()
    with PhaseProgress("learn (combee)", 20, done=5, stream=log) as phase:
        for _ in range(15):
            phase.advance(tokens_out=40)
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("learn (combee): 5/20 ")
    assert lines[-1].startswith("learn (combee): 20/20 ") and "tok/s out" in lines[-1]
    # a line per tenth of the phase, not one per item
    assert 5 <= len(lines) < 15, lines


def test_a_phase_on_a_terminal_draws_a_bar() -> None:
    terminal = _Terminal()
    with PhaseProgress("train (base agent)", 2, stream=terminal) as phase:
        phase.advance(2)
    drawn = terminal.getvalue()
    assert "train (base agent)" in drawn and "2/2" in drawn and "━" in drawn
    assert "train (base agent): " not in drawn  # the bar, not the log's lines


def test_a_phase_between_two_items_shows_its_model_calls_once_a_minute() -> None:
    """A learn window takes many model calls: the log says they are being made (and at what
    rate) while no item has finished, a line a minute, not one per poll."""
    now = [0.0]
    log = io.StringIO()
    with PhaseProgress("learn (naive)", 60, stream=log, clock=lambda: now[0]) as phase:
        now[0] = 30.0
        phase.activity(calls=5, tokens_out=300)  # within the first minute: no line
        now[0] = 61.0
        phase.activity(calls=12, tokens_out=1220)
    lines = log.getvalue().splitlines()
    # 1220 tokens in 61 s = 20.0 tok/s; no item done, so no ETA yet
    minute = "learn (naive): 0/60 (0.0/min, 12 model calls, 20.0 tok/s out; 1.0 min, ETA ?)"
    assert lines == ["learn (naive): 0/60 (0.0/min; 0.0 min, ETA ?)", minute, minute]
