"""The replay gate: held-out tasks chosen by a keyed hash of the trace id, candidates tested on
them against the version they extend, a poisoned candidate refused, a good one published; in
process (the key pipeline and the simulator over in-process HTTP) and on the real broker (the
engine), also against a producer that mines trace ids to take the held-out set."""

from __future__ import annotations

import hashlib
import hmac
import random
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import anyio
import msgspec
import pytest
from engine_support import (
    HOLDOUT_SECRET,
    SECRETS,
    engine_config,
    learned_in_memory,
    produce,
    read_updates,
    sim_learner,
)

from combee_stream import Engine
from combee_stream.config import Config, ConfigError, GateConfig, LearningConfig
from combee_stream.core.gate import Candidate, Verdict
from combee_stream.core.holdout import HoldoutPolicy, rank
from combee_stream.core.learner import Learner
from combee_stream.core.playbook import render
from combee_stream.evaluation.replay import AgentEvaluator, ReplayGate, Score, lower_bound
from combee_stream.kafka.history import PRODUCTION, read_history
from combee_stream.llm import LLMClient
from combee_stream.schemas import (
    AddOp,
    Bullet,
    Delta,
    Feedback,
    HeldOutTask,
    Holdout,
    Playbook,
    PromptUpdate,
    Section,
    Trace,
)
from combee_stream.sim import (
    IN_PROCESS_BASE_URL,
    SimSettings,
    sim_http_client,
    sim_server,
    simulated_llm,
)
from combee_stream.sim.tasks import (
    poison_line,
    sim_tasks,
    task_lesson,
    task_traces,
    wrong_code,
)

KEY = "sim-k0"
# Small held-out sets for a test: 12 tasks, and a margin that a candidate changing none of them
# passes (bound -z/(n+2) = -0.12) while one losing a task fails (-0.23).
GATE = GateConfig(replay=True, holdout_fraction=0.3, min_samples=12, margin=0.15, scorer="exact")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_the_bound_rewards_gains_and_refuses_losses() -> None:
    def bound(n: int, lost: int, gained: int) -> float:
        rest = n - lost - gained
        before = [1.0] * lost + [0.0] * gained + [0.0] * rest
        after = [0.0] * lost + [1.0] * gained + [0.0] * rest
        return lower_bound(before, after, 0.95)

    assert bound(20, 0, 0) > -0.1  # agreeing everywhere passes the default margin
    assert bound(20, 1, 0) < -0.1  # losing one task of twenty does not
    assert bound(8, 0, 2) > bound(8, 0, 1) > bound(8, 0, 0)  # more gained, never worse
    assert bound(20, 2, 0) < bound(20, 1, 0)
    # Scores that are not 0/1: the mean paired difference.
    assert lower_bound([0.5] * 10, [0.5] * 10, 0.95) == 0.0
    assert lower_bound([0.8, 0.6] * 5, [0.4, 0.2] * 5, 0.95) < -0.3


def test_holdout_is_a_function_of_the_trace_id() -> None:
    policy = HoldoutPolicy(GATE, HOLDOUT_SECRET)
    traces = task_traces(sim_tasks(400, 1, 20))
    held = [t for t in traces if policy.held_out(t) is not None]
    assert 0.2 < len(held) / len(traces) < 0.4  # about holdout_fraction
    assert all(rank(t.trace_id, HOLDOUT_SECRET) < 0.3 * 2**64 for t in held)
    # Without a ground truth, or for a key the gate does not cover, nothing is held out.
    bare = msgspec.structs.replace(held[0], feedback=Feedback(passed=False))
    assert policy.held_out(bare) is None
    other = HoldoutPolicy(msgspec.structs.replace(GATE, keys=["support-*"]), HOLDOUT_SECRET)
    assert other.held_out(held[0]) is None
    # The sample is the lowest ranks, whatever the arrival order, and bounded.
    tasks = [policy.held_out(t) for t in held]
    small = HoldoutPolicy(msgspec.structs.replace(GATE, reservoir_size=10), HOLDOUT_SECRET)
    one, two = None, None
    for task in tasks:
        one = small.add(one, [task])  # type: ignore[list-item]
    shuffled = list(tasks)
    random.Random(3).shuffle(shuffled)
    two = small.add(None, shuffled)  # type: ignore[arg-type]
    assert one is not None and one == two and len(one.tasks) == 10
    assert [t.rank for t in one.tasks] == sorted(t.rank for t in tasks)[:10]  # type: ignore[union-attr]


def test_the_held_out_sample_takes_a_bounded_share_of_one_window() -> None:
    policy = HoldoutPolicy(GATE, HOLDOUT_SECRET)
    honest = [t for t in (policy.held_out(x) for x in task_traces(sim_tasks(400, 1, 20))) if t][:30]
    sample = policy.add(None, honest[:10])
    sample = policy.add(sample, honest[10:20])
    sample = policy.add(sample, honest[20:])
    assert len(sample.tasks) == 30
    # One window bringing 40 tasks that all rank below every task held (as mined ids would if
    # the hash were public): only gate.holdout_per_window of them join.
    burst = [HeldOutTask(trace_id=f"x-{i}", task="t", answer="a", rank=i) for i in range(40)]
    after = policy.add(sample, burst)
    assert sum(t.trace_id.startswith("x-") for t in after.tasks) <= GATE.holdout_per_window
    # Ranks are the policy's, not the record's: a task claiming rank 0 is ranked by its id.
    assert all(t.rank == policy.rank(t.trace_id) for t in after.tasks)
    # A trace id already in the sample keeps its task: a re-send cannot rewrite its answer.
    first = sample.tasks[0]
    forged = msgspec.structs.replace(first, answer="the attacker's answer")
    assert policy.add(sample, [forged]).tasks[0] == first
    # A rotated secret re-ranks what is kept.
    rotated = HoldoutPolicy(GATE, "another deployment secret")
    assert all(t.rank == rotated.rank(t.trace_id) for t in rotated.add(sample, []).tasks)


def test_neither_the_replay_gate_nor_the_canary_starts_without_its_secret() -> None:
    llm = simulated_llm(IN_PROCESS_BASE_URL)
    with pytest.raises(ConfigError, match=r"gate\.replay needs .* COMBEE_HOLDOUT_SECRET"):
        Engine(Config(llm=llm, gate=GATE), env={})
    canary = GateConfig(canary=True)
    with pytest.raises(ConfigError, match=r"gate\.canary needs .* COMBEE_CANARY_SECRET"):
        Engine(Config(llm=llm, gate=canary), env={"COMBEE_CANARY_SECRET": "too short"})


def gated_learner(gate: GateConfig = GATE) -> AbstractAsyncContextManager[Learner]:
    return sim_learner(Config(learning=LearningConfig(seed=0), gate=gate))


def poisoned_stream(good: int, poisoned: int, lessons: int = 12) -> list[Trace]:
    """``good`` failed runs teaching the key's lessons, then ``poisoned`` whose feedback
    carries a wrong rule for a lesson instead: for lessons some held-out task needs (what
    the replay gate can measure; a poison for a lesson no held-out task needs breaks nothing
    it can see, and bench gate reports that case)."""
    tasks = sim_tasks(good + poisoned * 4, 1, lessons)
    policy = HoldoutPolicy(GATE, HOLDOUT_SECRET)
    covered = {
        trace.metadata["lesson_id"]
        for trace in task_traces(tasks[:good])
        if policy.held_out(trace) is not None
    }
    late = [t for t in tasks[good:] if t.metadata["lesson"] in covered][:poisoned]
    assert len(late) == poisoned
    return task_traces([*tasks[:good], *late], poisoned={t.id for t in late})


def consumed(updates: list[PromptUpdate]) -> Counter[str]:
    return Counter(i for u in updates for i in [*u.stats.trace_ids, *u.stats.held_out])


@pytest.mark.anyio
async def test_a_poisoned_candidate_is_refused_and_a_good_one_published() -> None:
    traces = poisoned_stream(96, 12)
    async with gated_learner() as learner:
        updates = await learned_in_memory(learner, KEY, traces, 12)
    # Every trace consumed exactly once: learned, or held out (never both).
    assert consumed(updates) == Counter(t.trace_id for t in traces)
    held = {i for u in updates for i in u.stats.held_out}
    assert held and not held & {i for u in updates for i in u.stats.trace_ids}
    # No version ever carried the poison, though the poisoned traces were read and learned.
    assert all("poison." not in u.prompt for u in updates)
    reviewed = [u.stats.gate for u in updates if u.stats.gate is not None]
    accepted = [g for g in reviewed if g.accepted and not g.pruned]
    assert accepted and any(g.candidate > g.current for g in accepted)
    # The poisoned window: refused, then published without the bullets the agent cited on the
    # tasks they broke (the poison), its good part reviewed again.
    [cut] = [u for u in updates if u.stats.gate is not None and u.stats.gate.pruned]
    assert cut.stats.gate is not None and cut.stats.gate.accepted and cut.stats.rejection is None
    poisoned = {t.trace_id for t in traces if "poison." in (t.feedback.text or "")}
    assert poisoned & set(cut.stats.trace_ids)  # the poisoned traces are consumed, not lost
    # Tasks the poisoned candidate broke are kept as regressions for later candidates.
    assert cut.holdout is not None and cut.holdout.regressions
    assert not any(u.holdout and u.holdout.regressions for u in updates if u.version < cut.version)
    # Early windows, before the sample held min_samples tasks, were deferred: not published,
    # not refused either; their lessons waited and went into the first reviewed candidate.
    first = updates[0]
    assert first.stats.rejection is None and first.stats.gate is None
    assert first.stats.deferred > 0 and first.holdout is not None
    assert first.playbook.sections == [] or all(not s.bullets for s in first.playbook.sections)
    # (The simulator's lessons are tagged LESSON[id]; a later window may word one otherwise.)
    waited = {op.content.split(":")[0] for op in first.holdout.pending if isinstance(op, AddOp)}
    reviewed = next(u for u in updates if u.stats.gate is not None)
    assert reviewed.stats.deferred == 0 and reviewed.holdout is not None
    assert not reviewed.holdout.pending and reviewed.stats.gate is not None
    assert reviewed.stats.gate.accepted
    served = {b.content.split(":")[0] for s in reviewed.playbook.sections for b in s.bullets}
    assert waited and waited <= served


@pytest.mark.kafka
@pytest.mark.anyio
async def test_the_engine_never_serves_a_poisoned_candidate_across_a_restart(
    config: Config, unique: str
) -> None:
    traces = poisoned_stream(96, 12)
    good, bad = traces[:96], traces[96:]
    async with sim_server(SimSettings(seed=0)) as llm:
        cfg = engine_config(config, unique, llm.base_url, batch_size=12, max_wait_s=1.0)
        cfg = msgspec.structs.replace(
            cfg, gate=GATE, learning=msgspec.structs.replace(cfg.learning, seed=0)
        )
        learned = await engine_learns(cfg, good, {t.trace_id for t in good})
        # A restarted engine has the held-out tasks back from the key's newest version.
        updates = await engine_learns(cfg, bad, {t.trace_id for t in traces})
    keyed = sorted((u for u in updates if u.key == KEY), key=lambda u: u.version)
    assert consumed(keyed) == Counter(t.trace_id for t in traces)  # once each, none lost
    assert all("poison." not in u.prompt for u in keyed)
    good_lessons = lessons(learned)
    assert len(good_lessons) >= 6, good_lessons  # the good stream was learned and published
    after = [u for u in keyed if u.version > max(u.version for u in learned if u.key == KEY)]
    # The held-out sample came back with the restored version: the first window after the
    # restart was reviewed on it (not refused for want of tasks).
    assert after[0].stats.gate is not None and after[0].stats.gate.n >= GATE.min_samples
    # The poisoned windows were refused, or published without the bullets that broke tasks.
    caught = [u.stats.gate for u in after if u.stats.gate is not None]
    assert any(g.pruned or (not g.accepted and g.broke) for g in caught)
    # What agents are served (production) carries what was learned and no poison.
    history = await read_history(cfg.kafka, KEY)
    served = history.versions[history.resolve(PRODUCTION) or 0]
    assert "poison." not in served.prompt and lessons([served]) >= good_lessons


def mined(n: int, rank_of: Callable[[str], int], prefix: str) -> list[str]:
    """``n`` trace ids whose ``rank_of`` is below 0.0005 of the hash space (the ids the issue's
    attacker mined in 0.14 s against the unkeyed hash)."""
    below, found, i = int(0.0005 * 2**64), [], 0
    while len(found) < n:
        candidate = f"{prefix}-{i}"
        i += 1
        if rank_of(candidate) < below:
            found.append(candidate)
    return found


def public_rank(trace_id: str) -> int:
    """The held-out hash before it was keyed: sha256("holdout:" + trace id)."""
    return int.from_bytes(hashlib.sha256(f"holdout:{trace_id}".encode()).digest()[:8], "big")


def guessed_rank(trace_id: str) -> int:
    """The keyed hash with a secret the attacker guessed (not the deployment's)."""
    digest = hmac.new(b"a guess", f"holdout:{trace_id}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big")


@pytest.mark.kafka
@pytest.mark.anyio
async def test_mined_trace_ids_neither_take_the_held_out_set_nor_pass_a_poisoned_version(
    config: Config, unique: str
) -> None:
    """A producer mines 50 trace ids that rank first under the public hash and 50 under a
    guessed secret, and sends them with its own ground truth (the answers a poisoned prompt
    gives) and a poisoned lesson, for lessons the honest held-out tasks need. Before the hash
    was keyed, the 50 were all held out, evicted every honest task and a poisoned version
    passed the gate (current 0.0, candidate 1.0)."""
    honest = task_traces(sim_tasks(96, 1, 12))
    async with sim_server(SimSettings(seed=0)) as llm:
        cfg = engine_config(config, unique, llm.base_url, batch_size=12, max_wait_s=1.0)
        cfg = msgspec.structs.replace(
            cfg, gate=GATE, learning=msgspec.structs.replace(cfg.learning, seed=0)
        )
        learned = await engine_learns(cfg, honest, {t.trace_id for t in honest})
        before = max((u for u in learned if u.key == KEY), key=lambda u: u.version)
        assert before.holdout is not None and len(before.holdout.tasks) >= GATE.min_samples
        sample = {t.trace_id for t in before.holdout.tasks}
        covered = {task_lesson(t.task) for t in before.holdout.tasks}
        assert "poison." not in before.prompt and lessons([before])
        old_ids, guessed_ids = mined(50, public_rank, "m"), mined(50, guessed_rank, "g")
        tasks = [t for t in sim_tasks(300, 1, 12, start=5000) if t.metadata["lesson"] in covered]
        attack = [
            Trace(
                key=KEY,
                trace_id=trace_id,
                task=task.question,
                output=task.answer,
                feedback=Feedback(
                    passed=False,
                    score=0.0,
                    ground_truth=str(wrong_code(int(task.answer))),
                    text=poison_line(0, task.metadata["lesson"]),
                ),
            )
            for trace_id, task in zip([*old_ids, *guessed_ids], tasks, strict=False)
        ]
        assert len(attack) == 100
        ids = {t.trace_id for t in [*honest, *attack]}
        updates = await engine_learns(cfg, attack, ids)
    keyed = sorted((u for u in updates if u.key == KEY), key=lambda u: u.version)
    assert consumed(keyed) == Counter(ids)  # every trace consumed once
    held = {i for u in keyed for i in u.stats.held_out}
    # Mined ids are held out like any others (about gate.holdout_fraction of them), not all.
    assert len(held & set(old_ids)) <= 0.6 * len(old_ids)
    assert len(held & set(guessed_ids)) <= 0.6 * len(guessed_ids)
    # The honest held-out tasks are still most of what the gate tests on.
    newest = keyed[-1]
    assert newest.holdout is not None
    kept = {t.trace_id for t in newest.holdout.tasks}
    assert len(kept & sample) >= len(sample) / 2, (len(kept & sample), len(sample))
    assert len(kept & sample) > len(kept & {t.trace_id for t in attack})
    # No version carried the poison, and what agents are served never did.
    assert all("poison." not in u.prompt for u in keyed)
    caught = [u.stats.gate for u in keyed if u.version > before.version and u.stats.gate]
    assert any(g.pruned or (not g.accepted and g.broke) for g in caught)
    history = await read_history(cfg.kafka, KEY)
    served = history.versions[history.resolve(PRODUCTION) or 0]
    assert "poison." not in served.prompt


def lessons(updates: list[PromptUpdate]) -> set[str]:
    newest = max((u for u in updates if u.key == KEY), key=lambda u: u.version)
    return {line.split("LESSON[", 1)[1].split("]", 1)[0] for line in newest.prompt.splitlines()
            if "LESSON[" in line}  # fmt: skip


async def engine_learns(cfg: Config, traces: list[Trace], ids: set[str]) -> list[PromptUpdate]:
    """An engine run that sends ``traces`` and stops once ``ids`` are all consumed."""
    engine = Engine(cfg, env=SECRETS)
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        await engine.started.wait()
        await produce(cfg, traces)
        updates = await wait_consumed(cfg, ids)
        engine.stop()
    return updates


async def wait_consumed(cfg: Config, ids: set[str], limit_s: float = 180) -> list[PromptUpdate]:
    with anyio.fail_after(limit_s):
        while True:
            updates = await read_updates(cfg)
            if ids <= set(consumed(updates)):
                return updates
            await anyio.sleep(0.5)


@pytest.mark.anyio
async def test_the_llm_judge_scores_answers_against_the_reference() -> None:
    """gate.scorer = "judge": each answer goes to the judge role with the task and the
    reference; the verdict is the score (the simulator's judge compares the results)."""
    judge_gate = msgspec.structs.replace(GATE, scorer="judge")
    cfg = Config(llm=simulated_llm(IN_PROCESS_BASE_URL), gate=judge_gate)
    [task] = sim_tasks(1, 1, 1)
    held = HeldOutTask(trace_id="t", task=task.question, answer=task.answer, rank=0)
    async with sim_http_client(SimSettings(seed=0)) as http:
        llm = LLMClient(cfg.llm, http_client=http, env={})
        try:
            evaluator = AgentEvaluator(llm, "judge")
            assert await evaluator.judge(held, f"The code is {task.answer}.") is True
            assert await evaluator.judge(held, "The code is 1234.") is False
            lesson = task.metadata["feedback"]  # the prompt carries the lesson: right answer
            assert (await evaluator(f"[b-1] :: {lesson}", held)).value == 1.0
            assert (await evaluator("", held)).value == 0.0
            assert llm.usage()["judge"].calls == 4
        finally:
            await llm.aclose()


def _review(
    right_before: set[int], right_after: set[int], cited: dict[int, list[str]], n: int = 40,
    gate: GateConfig | None = None,
) -> Verdict:  # fmt: skip
    """The replay gate's verdict on a candidate adding bullets ``a`` and ``b`` to an empty
    parent, on ``n`` held-out tasks: task i right before / after as the sets say, the agent
    citing ``cited[i]`` under the candidate."""
    parent = Playbook(key=KEY, version=1)
    new = [Bullet(id="a", content="x"), Bullet(id="b", content="y")]
    book = Playbook(key=KEY, version=2, next_id=3, sections=[Section(name="S", bullets=new)])
    tasks = [HeldOutTask(trace_id=f"t{i}", task=f"task {i}", answer="1", rank=i) for i in range(n)]
    before = render(parent)

    async def evaluate(prompt: str, task: HeldOutTask) -> Score:
        i = int(task.trace_id[1:])
        if prompt == before:
            return Score(1.0 if i in right_before else 0.0)
        return Score(1.0 if i in right_after else 0.0, cited.get(i, []))

    candidate = Candidate(
        key=KEY, parent=parent, playbook=book, delta=Delta(key=KEY), reflections=[],
        holdout=Holdout(tasks=tasks),
    )  # fmt: skip
    return anyio.run(ReplayGate(gate or GateConfig(replay=True), evaluate).review, candidate)


def test_a_measured_loss_is_refused_even_where_the_bound_forgives_it() -> None:
    right = set(range(20))
    # One task lost of forty and none gained: within the default margin's bound...
    verdict = _review(right, right - {0}, {})
    assert verdict.report is not None and verdict.report.lower > -0.1
    # ...but fewer right than the version it extends: not published (gate.no_worse).
    assert not verdict.accepted and "no_worse" in verdict.reason
    assert verdict.report.broke == ["t0"]
    # One lost and one gained, or nothing changed: published.
    assert _review(right, (right - {0}) | {30}, {}).accepted
    assert _review(right, right, {}).accepted
    # With no_worse off, the bound alone decides.
    lenient = GateConfig(replay=True, no_worse=False)
    assert _review(right, right - {0}, {}, gate=lenient).accepted


def test_blame_falls_on_the_bullets_cited_on_the_tasks_a_candidate_broke() -> None:
    right = set(range(20))
    # "a" is cited everywhere (a general rule): on the 20 right answers and on 10 wrong ones;
    # "b" only on 5 tasks, all answered wrong (tasks 0-4, right before: a broken lesson).
    after = right - {0, 1, 2, 3, 4}
    cited = {i: ["a"] for i in range(30)}
    for i in range(5):
        cited[i] = ["a", "b"]
    verdict = _review(right, after, cited)
    assert not verdict.accepted
    assert verdict.blame == ["b"]
    # "a" broke one task the parent had right and kept one: not blamed.
    assert _review(right, right - {0}, {0: ["a"], 1: ["a"]}).blame == []


def test_a_general_rule_is_not_blamed_for_tasks_a_small_model_still_gets_wrong() -> None:
    """The real 1.5B run's window: the agent right on 4 of 10 held-out tasks with the parent
    and with the candidate, every new rule cited on all ten. The agent did no worse where it
    relied on them than anywhere: nothing is blamed (a rule that blamed bullets cited on more
    wrong answers than right pruned all four)."""
    right, ten = {0, 1, 2, 3}, GateConfig(replay=True, min_samples=10, margin=0.15)  # that run
    cited = {i: ["round", "units", "no-percent", "times"] for i in range(10)}
    verdict = _review(right, right, cited, n=10, gate=ten)
    assert verdict.accepted and verdict.blame == []
    # A rule cited only on tasks that both versions fail (a wrong rule for a case not learned
    # yet: nothing broke) is still blamed: the agent does worse where it relies on it (0 of 3)
    # than on the whole sample (4 of 10).
    verdict = _review(right, right, {**cited, 7: ["bad"], 8: ["bad"], 9: ["bad"]}, n=10, gate=ten)
    assert verdict.accepted and verdict.blame == ["bad"]
    # One task broken and one fixed: "times", cited on the broken one and on no kept one, is
    # blamed; "round", cited on the broken one and on the three kept, is not.
    cited = {0: ["round", "times"], 1: ["round"], 2: ["round"], 3: ["round"], 9: ["times"]}
    verdict = _review(right, (right - {0}) | {9}, cited, n=10, gate=ten)
    assert verdict.blame == ["times"]


def test_answers_a_bullet_fixes_do_not_excuse_the_confirmed_ones_it_breaks() -> None:
    """Tasks 0-9 right before (their answers confirmed by the parent), 10-39 wrong before.
    "b" breaks 0-2 and "fixes" 10-19 (a poisoned rule on held-out traces whose answers a
    producer forged: right and wrong no longer tell it apart); "a" keeps 3-9 right and is
    cited on task 0 too (a rule beside the broken one, not blamed for it)."""
    before = set(range(10))
    after = (before - {0, 1, 2}) | set(range(10, 20))
    cited = {i: ["b"] for i in [0, 1, 2, *range(10, 20)]}
    cited.update({i: ["a"] for i in range(3, 10)})
    cited[0] = ["a", "b"]
    verdict = _review(before, after, cited)
    assert verdict.blame == ["b"]  # 3 confirmed broken, 0 kept: though 10 right against 3 wrong
