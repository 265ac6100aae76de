"""The lesson check: each new bullet retried on the failed tasks it was learned from, and left
out when it fixes none; with a stub agent (what is right under which prompt is given) and with
the simulator behind a learner, where poisoned traces teach a wrong rule."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest
from engine_support import learned_in_memory, sim_learner

from combee_stream.config import Config, GateConfig, LearningConfig
from combee_stream.core.gate import Candidate, GateChain, Verdict
from combee_stream.core.playbook import normalize, render
from combee_stream.evaluation.lessons import LessonGate, relevant
from combee_stream.schemas import Bullet, Delta, HeldOutTask, Playbook, Section
from combee_stream.sim.tasks import sim_tasks, task_traces

KEY = "sim-k0"
OLD = Bullet(id="old", content="When the answer is a rate, give it as a decimal fraction.")
RULE = Bullet(id="rule", content="When computing the gross margin, divide gross profit by revenue.")
VAGUE = Bullet(id="vague", content="When computing a margin, use the right formula.")


def task(i: int, text: str) -> HeldOutTask:
    return HeldOutTask(trace_id=f"t{i}", task=text, answer="1", rank=0)


TASKS = [task(0, "gross margin of a shop"), task(1, "gross margin of a mill"), task(2, "NPV")]


def candidate(*new: Bullet, sources: dict[str, list[str]] | None = None) -> Candidate:
    parent = Playbook(key=KEY, version=1, sections=[Section(name="S", bullets=[OLD])])
    book = Playbook(key=KEY, version=2, sections=[Section(name="S", bullets=[OLD, *new])])
    traces = sources or {normalize(b.content): [t.trace_id for t in TASKS] for b in new}
    return Candidate(
        key=KEY, parent=parent, playbook=book, delta=Delta(key=KEY), reflections=[],
        add_traces=traces, retries=TASKS,
    )  # fmt: skip


def review(gate: LessonGate | GateChain, c: Candidate) -> Verdict:
    return anyio.run(gate.review, c)


def stub(
    right: dict[str, set[str]],
    asked: Counter[tuple[str, str]] | None = None,
    config: GateConfig | None = None,
) -> LessonGate:
    """A lesson gate whose agent answers task ``t`` right under a prompt iff ``t`` is in
    ``right`` of the bullet id the prompt adds to the parent (``""``: the parent alone)."""

    async def evaluate(prompt: str, held: HeldOutTask) -> float:
        added = [b for b in (RULE.id, VAGUE.id) if f"[{b}]" in prompt]
        which = added[0] if added else ""
        assert len(added) <= 1, "a bullet is tried alone"
        if asked is not None:
            asked[which, held.trace_id] += 1
        return 1.0 if held.trace_id in right.get(which, set()) else 0.0

    return LessonGate(config or GateConfig(check_lessons=True, lesson_tasks=2), evaluate)


def test_a_bullet_that_fixes_none_of_its_failures_is_blamed() -> None:
    asked: Counter[tuple[str, str]] = Counter()
    # The parent gets t1 right already; the rule fixes t0, the vague bullet nothing.
    gate = stub({"": {"t1"}, "rule": {"t0", "t1"}, "vague": {"t1"}}, asked)
    verdict = review(gate, candidate(RULE, VAGUE))
    assert verdict.accepted and verdict.blame == ["vague"]
    assert "vague (0 of 1)" in verdict.reason
    # Each bullet tried on its 2 tasks sharing most words ("gross margin" before "NPV"), and
    # only where the parent fails: t1 was never retried with a bullet.
    assert set(asked) == {("", "t0"), ("", "t1"), ("rule", "t0"), ("vague", "t0")}
    assert verdict.report is not None and verdict.report.gate == "lessons"
    assert (verdict.report.n, verdict.report.current, verdict.report.candidate) == (2, 0.5, 1.0)


NPV = Bullet(id="npv", content="When computing NPV, discount each cash flow by its own year.")


def joint_stub(right: dict[frozenset[str], set[str]], asked: list[frozenset[str]]) -> LessonGate:
    """A lesson gate whose agent answers a task right iff it is in ``right`` of the set of new
    bullets its prompt carries (a set absent from ``right``: nothing right)."""

    async def evaluate(prompt: str, held: HeldOutTask) -> float:
        added = frozenset(b for b in (RULE.id, NPV.id) if f"[{b}]" in prompt)
        asked.append(added)
        return 1.0 if held.trace_id in right.get(added, set()) else 0.0

    return LessonGate(GateConfig(check_lessons=True, lesson_tasks=2), evaluate)


def test_bullets_that_help_alone_are_kept_together_only_if_together_they_help_more() -> None:
    rule, npv, both = frozenset({"rule"}), frozenset({"npv"}), frozenset({"rule", "npv"})
    # Alone the margin rule fixes both margin tasks and the NPV rule the NPV task; together
    # the agent follows neither (a small agent given two rules).
    asked: list[frozenset[str]] = []
    gate = joint_stub({rule: {"t0", "t1"}, npv: {"t2"}}, asked)
    verdict = review(gate, candidate(RULE, NPV))
    assert verdict.accepted and verdict.blame == ["npv"]
    assert "npv (1 of 2 alone)" in verdict.reason and "beside rule" in verdict.reason
    # Joined most fixes first: the margin rule alone and then both, on all 3 failures.
    assert asked.count(both) == 3 and asked.count(rule) == 2 + 3
    assert verdict.report is not None and verdict.report.candidate == round(2 / 3, 4)
    # Together they fix all three: both kept, and the report counts what they fix together.
    asked.clear()
    gate = joint_stub({rule: {"t0", "t1"}, npv: {"t2"}, both: {"t0", "t1", "t2"}}, asked)
    verdict = review(gate, candidate(RULE, NPV))
    assert verdict.accepted and verdict.blame == [] and verdict.reason == ""
    assert verdict.report is not None and verdict.report.candidate == 1.0


def test_on_a_tie_the_bullet_showing_a_worked_example_is_joined_first() -> None:
    # Both fix the same two failures alone and nothing more together: one is crowded out, and
    # it is the rule alone, although it comes first in the playbook.
    shown = Bullet(
        id="npv",
        content="When computing a ratio, round as asked. Example: write round(3 / 4, 2), not 3 / 4",
    )
    rule, npv, both = frozenset({"rule"}), frozenset({"npv"}), frozenset({"rule", "npv"})
    fixes = {"t0", "t1"}
    asked: list[frozenset[str]] = []
    verdict = review(
        joint_stub({rule: fixes, npv: fixes, both: fixes}, asked), candidate(RULE, shown)
    )
    assert verdict.accepted and verdict.blame == ["rule"]
    assert "beside npv" in verdict.reason
    # Without the example the playbook's order decides, as before.
    plain = Bullet(id="npv", content="When computing a ratio, round it as asked.")
    verdict = review(joint_stub({rule: fixes, npv: fixes, both: fixes}, []), candidate(RULE, plain))
    assert verdict.blame == ["npv"]


def test_what_cannot_be_tried_is_not_judged() -> None:
    gate = stub({})  # nothing is ever right
    # A bullet whose sources carry no failed task with a reference answer: not judged.
    verdict = review(gate, candidate(VAGUE, sources={normalize(VAGUE.content): ["elsewhere"]}))
    assert verdict.accepted and verdict.blame == [] and verdict.report is None
    # Every source task right under the parent already: nothing to fix, nothing blamed.
    verdict = review(stub({"": {"t0", "t1", "t2"}}), candidate(VAGUE))
    assert verdict.accepted and verdict.blame == []
    # A task over gate.max_task_chars is not retried (nothing left to try: not judged).
    assert review(stub({}), candidate(VAGUE)).blame == ["vague"]  # (the tasks are short)
    short = stub({}, config=GateConfig(check_lessons=True, max_task_chars=2))
    assert review(short, candidate(VAGUE)).blame == []
    # Keys outside gate.keys are not checked.
    other = LessonGate(GateConfig(check_lessons=True, keys=["prod-*"]), lambda p, t: 0.0)  # type: ignore[arg-type,return-value]
    assert review(other, candidate(VAGUE)) == Verdict(accepted=True)


def test_relevant_tasks_come_first() -> None:
    picked = relevant("When computing NPV, discount each cash flow.", TASKS, 1)
    assert [t.trace_id for t in picked] == ["t2"]
    assert [t.trace_id for t in relevant("unrelated words", TASKS, 2)] == ["t0", "t1"]


class Fixed:
    def __init__(self, name: str, verdict: Verdict) -> None:
        self.name, self.verdict, self.reviews = name, verdict, 0

    async def review(self, candidate: Candidate) -> Verdict:
        self.reviews += 1
        return self.verdict


def test_a_chain_stops_at_the_first_refusal_and_turns_an_early_blame_into_one() -> None:
    c = candidate(RULE)
    blamed = Fixed("lessons", Verdict(accepted=True, blame=["rule"], reason="fixed none"))
    later = Fixed("replay", Verdict(accepted=True))
    verdict = review(GateChain([blamed, later]), c)
    # Accepting would publish what the later gate never saw: refused, the blame kept, so the
    # learner reviews the candidate without it through the whole chain.
    assert not verdict.accepted and verdict.blame == ["rule"] and later.reviews == 0
    refused = Fixed("replay", Verdict(accepted=False, reason="worse"))
    chain = GateChain([Fixed("lessons", Verdict(accepted=True)), refused])
    assert chain.name == "lessons+replay" and review(chain, c).reason == "worse"
    # The last gate's blame on an acceptance is its own (the blame-prune tries without it).
    last = Fixed("replay", Verdict(accepted=True, blame=["rule"]))
    assert review(GateChain([Fixed("lessons", Verdict(accepted=True)), last]), c).accepted


@pytest.mark.anyio
async def test_the_learner_leaves_out_the_poisoned_rules_and_keeps_the_lessons() -> None:
    """Failed runs teaching 6 lessons, every third with a wrong rule in its feedback instead:
    without the check the poison is published; with it (no held-out tasks, no secret), no
    version carries it and the lessons are served."""
    tasks = sim_tasks(36, 1, 6)
    traces = task_traces(tasks, poisoned={t.id for t in tasks[2::3]})

    async def learned(check: bool) -> list[str]:
        cfg = Config(learning=LearningConfig(seed=0), gate=GateConfig(check_lessons=check))
        async with sim_learner(cfg) as learner:
            updates = await learned_in_memory(learner, KEY, traces, 12)
        # Every trace learned once either way: a left-out bullet loses no trace.
        assert Counter(i for u in updates for i in u.stats.trace_ids) == Counter(
            t.trace_id for t in traces
        )
        if check:
            pruned = [u.stats.gate for u in updates if u.stats.gate and u.stats.gate.pruned]
            assert pruned, "the poisoned bullets were blamed and left out"
        return [render(u.playbook) for u in updates]

    unchecked, checked = await learned(False), await learned(True)
    assert any("poison." in p for p in unchecked)  # the stream does poison an unchecked key
    assert not any("poison." in p for p in checked)
    assert checked[-1].count("LESSON[") >= 4, checked[-1]


def test_the_config_builds_the_check_before_the_replay_gate() -> None:
    from combee_stream.core.gate import AcceptAll
    from combee_stream.evaluation.replay import ReplayGate
    from combee_stream.llm import LLMClient
    from combee_stream.sim import IN_PROCESS_BASE_URL, simulated_llm
    from combee_stream.wiring import build_gate

    def built(gate: GateConfig) -> object:
        cfg = Config(gate=gate, llm=simulated_llm(IN_PROCESS_BASE_URL))
        return build_gate(cfg, LLMClient(cfg.llm, env={}))

    assert isinstance(built(GateConfig()), AcceptAll)
    assert isinstance(built(GateConfig(check_lessons=True)), LessonGate)
    assert isinstance(built(GateConfig(replay=True)), ReplayGate)
    chain = built(GateConfig(check_lessons=True, replay=True))
    assert isinstance(chain, GateChain) and chain.name == "lessons+replay"
