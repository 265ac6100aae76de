"""What the demos print: the publish gate's verdict (``demo.common.gate_note``), and where the
real-model demo's time and model requests went."""

from __future__ import annotations

from combee_stream.demo.common import gate_note
from combee_stream.demo.live import _time_note, _usage_note
from combee_stream.llm import RoleUsage
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


def test_the_time_note_counts_from_the_engine_start() -> None:
    # Engine up at 100 s; the agent done at 100+404, the base arm at 100+598, learning at
    # 100+911; the learned prompt's answers end at 100+1026, 115 s after the later of the two.
    times = {"start": 100.0, "worked": 504.0, "base": 698.0, "learned": 1011.0, "after": 1126.0}
    assert _time_note(times, tasks=16, held_out=20) == (
        "\ntime: 17:06 from the engine's start: the agent's 16 runs ended at 6:44, the engine had "
        "learned them at 15:11 (the base prompt's 20 answers alongside, done at 9:58), the "
        "learned prompt's 20 answers took 1:55"
    )


def test_the_usage_note_counts_requests_sent_not_memo_hits() -> None:
    engine = {
        "reflector": RoleUsage(calls=16, tokens_in=24_000, tokens_out=3_140),
        "agent": RoleUsage(calls=30, cached_calls=4, tokens_in=9_000, tokens_out=2_900),
        "curator": RoleUsage(),
        "embeddings": RoleUsage(calls=8, tokens_in=3_000),
    }
    demo = {"agent": RoleUsage(calls=56, tokens_in=24_500, tokens_out=6_100)}
    assert _usage_note(engine, demo) == (
        "model requests (tokens): engine: reflector 16 (24.0k in, 3.1k out), agent 26 (9.0k "
        "in, 2.9k out); agent at work and before/after: agent 56 (24.5k in, 6.1k out)"
    )
