"""What the demos print about the publish gate (``demo.common.gate_note``)."""

from __future__ import annotations

from combee_stream.demo.common import gate_note
from combee_stream.schemas import GateReport, Playbook, PromptUpdate, UpdateStats


def update(stats: UpdateStats) -> PromptUpdate:
    return PromptUpdate(key="k", version=1, playbook=Playbook(key="k"), prompt="", stats=stats)


def test_the_note_says_which_gate_measured_what() -> None:
    replay = GateReport(gate="replay", accepted=True, n=20, current=0.4, candidate=0.55, lower=0)
    assert gate_note(update(UpdateStats(gate=replay))) == "; gate passed (40% -> 55% on 20 tasks)"
    # The lesson check's tasks are failures the window learned from: 1 of 4 right under the
    # parent, 3 under the candidate, so its bullets fixed 2; one bullet that fixed none is out.
    lessons = GateReport(
        gate="lessons", accepted=True, n=4, current=0.25, candidate=0.75, lower=0,
        pruned=["calc-00002"], pruned_by="lessons",
    )  # fmt: skip
    assert gate_note(update(UpdateStats(gate=lessons))) == (
        "; lesson check: 2 of 4 failures fixed, left out 1 new bullet(s) the lessons gate blamed"
    )
    assert gate_note(update(UpdateStats(held_out=["t1", "t2"]))) == ", 2 held out"
