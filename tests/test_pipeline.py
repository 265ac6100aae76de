"""The key pipeline on its own (no Kafka, no files): windows, order, failures, the sink's say,
the gate and the batch policy, against the simulator in process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest

from combee_stream.config import Config, LearningConfig
from combee_stream.core.controller import Decision, FixedBatch
from combee_stream.core.gate import Candidate, Verdict
from combee_stream.core.learner import Learner
from combee_stream.core.pipeline import (
    KeyPipeline,
    MemorySink,
    Pending,
    PipelineSettings,
    Window,
    closed_inbox,
)
from combee_stream.core.prompts import ReflectionRecord
from combee_stream.core.results import FailedTrace, Proposal, WindowError, WindowStats
from combee_stream.core.versions import KeyChain
from combee_stream.llm import LLMClient
from combee_stream.schemas import GateRejection, Playbook, PromptUpdate, Source, Trace
from combee_stream.sim import (
    IN_PROCESS_BASE_URL,
    SimSettings,
    generate_traces,
    sim_http_client,
    simulated_llm,
)
from combee_stream.sim.markers import retained_ids
from combee_stream.wiring import build_learner, load_prompts

KEY = "sim-k0"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def config(**learning: Any) -> Config:
    return Config(
        llm=simulated_llm(IN_PROCESS_BASE_URL), learning=LearningConfig(seed=1, **learning)
    )


@asynccontextmanager
async def client() -> AsyncIterator[LLMClient]:
    async with sim_http_client(SimSettings(seed=1)) as http:
        llm = LLMClient(config().llm, http_client=http, env={})
        try:
            yield llm
        finally:
            await llm.aclose()


def items(n: int, lessons: int | None = None) -> list[tuple[Trace, Source]]:
    traces = generate_traces(n, 1, lessons or n, seed=1)
    return [(t, Source(t.trace_id, 0, i)) for i, t in enumerate(traces)]


class RecordingPolicy(FixedBatch):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.observed: list[int] = []

    def observe(self, batch_size: int, delay_s: float) -> Decision | None:
        assert delay_s > 0
        self.observed.append(batch_size)
        return None


SYNC = PipelineSettings(pipelined=False, max_windows_in_flight=1, attempts=2)
PIPELINED = PipelineSettings(pipelined=True, max_windows_in_flight=3, attempts=2)


def check_chain(updates: Sequence[PromptUpdate], learned: int) -> None:
    assert [u.version for u in updates] == list(range(1, len(updates) + 1))
    assert [u.parent_version for u in updates] == list(range(len(updates)))
    total = 0
    for u in updates:
        total += u.stats.window_traces
        assert u.stats.traces_learned == total
        assert u.playbook.version == u.version
    assert total == learned


@pytest.mark.anyio
@pytest.mark.parametrize("settings", [SYNC, PIPELINED], ids=["synchronous", "pipelined"])
async def test_windows_close_at_the_policy_size_and_publish_in_order(
    settings: PipelineSettings,
) -> None:
    async with client() as llm:
        sink, policy = MemorySink(), RecordingPolicy(4)
        chain = KeyChain(KEY, partition=0)
        learner = build_learner(config(), llm)
        pipeline = KeyPipeline(chain, learner, policy, sink, closed_inbox(items(10)), settings)
        await pipeline.run()
    check_chain(sink.updates, 10)
    assert [len(w.items) for w in sink.windows] == [4, 4, 2]  # the last one at end of input
    assert [u.stats.batch_size for u in sink.updates] == [4, 4, 4]
    assert policy.observed == [4, 4, 2], "the policy sees every published window"
    assert chain.newest == sink.updates[-1]
    assert chain.watermark == 9  # the highest offset learned, in the chain's partition
    assert len(retained_ids(chain.playbook)) == 10


@pytest.mark.anyio
async def test_window_closes_at_max_wait_with_what_it_has() -> None:
    async with client() as llm:
        sink = MemorySink()
        send, recv = anyio.create_memory_object_stream[Pending](10)
        settings = PipelineSettings(max_wait_s=0.3, attempts=1)
        learner = build_learner(config(), llm)
        pipeline = KeyPipeline(KeyChain(KEY), learner, FixedBatch(50), sink, recv, settings)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pipeline.run)
            for trace, source in items(3):
                send.send_nowait(Pending(trace, source, anyio.current_time()))
            with anyio.fail_after(10):
                while not sink.updates:  # noqa: ASYNC110 - a list the sink fills
                    await anyio.sleep(0.02)
            assert not pipeline.finished.is_set(), "the inbox is open: the pipeline waits on"
            send.close()
    assert [len(w.items) for w in sink.windows] == [3]
    assert sink.updates[0].stats.batch_size == 50


class SlowFirstWindow(Learner):
    """Reduces the first window slowly, so the second one is ready first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.finished: list[int] = []

    async def reduce(
        self,
        snapshot: Playbook,
        reflected: Sequence[ReflectionRecord],
        failed: Sequence[FailedTrace],
        stats: WindowStats,
        **kwargs: Any,
    ) -> Proposal:
        self.calls += 1
        number = self.calls
        if number == 1:
            await anyio.sleep(0.5)
        proposal = await super().reduce(snapshot, reflected, failed, stats, **kwargs)
        self.finished.append(number)
        return proposal


@pytest.mark.anyio
async def test_a_window_that_finishes_first_still_publishes_after_its_predecessor() -> None:
    async with client() as llm:
        sink = MemorySink()
        cfg = config()
        learner = SlowFirstWindow(llm, cfg.learning, prompts=load_prompts())
        batch = items(6)
        pipeline = KeyPipeline(
            KeyChain(KEY), learner, FixedBatch(3), sink, closed_inbox(batch), PIPELINED
        )
        await pipeline.run()
    check_chain(sink.updates, 6)
    assert learner.finished == [2, 1], "the second window was reduced first"
    first, second = ([p.trace.trace_id for p in w.items] for w in sink.windows)
    assert first == [t.trace_id for t, _ in batch[:3]]
    assert second == [t.trace_id for t, _ in batch[3:]]
    # the second window was computed on v0 too, then rebased onto v1: nothing lost
    assert len(retained_ids(sink.updates[-1].playbook)) == 6


class RefusingSink(MemorySink):
    """Takes ``accept`` versions, then answers that it no longer publishes for the key."""

    def __init__(self, accept: int) -> None:
        super().__init__()
        self.accept = accept
        self.refused: list[PromptUpdate] = []

    async def publish(self, chain: KeyChain, update: PromptUpdate, window: Window) -> bool:
        if len(self.updates) >= self.accept:
            self.refused.append(update)
            return False
        return await super().publish(chain, update, window)


@pytest.mark.anyio
async def test_a_refused_version_is_not_the_chains_and_nothing_after_it_is_published() -> None:
    async with client() as llm:
        sink, chain = RefusingSink(accept=1), KeyChain(KEY)
        learner = build_learner(config(), llm)
        pipeline = KeyPipeline(chain, learner, FixedBatch(2), sink, closed_inbox(items(8)), SYNC)
        await pipeline.run()
    assert [u.version for u in sink.updates] == [1]
    assert [u.version for u in sink.refused] == [2], "one try, then the pipeline stops"
    assert chain.version == 1 and chain.traces_learned == 2


class FlakyReflections(Learner):
    """Reflection of one trace always fails; curation fails ``curate_failures`` times."""

    def __init__(self, *args: Any, bad_trace: str, curate_failures: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bad_trace = bad_trace
        self.curate_failures = curate_failures
        self.reflect_calls: dict[str, int] = {}
        self.reduce_calls = 0

    async def reflect(
        self, snapshot: Playbook, trace: Trace, source: Source, stats: WindowStats
    ) -> ReflectionRecord | FailedTrace:
        self.reflect_calls[trace.trace_id] = self.reflect_calls.get(trace.trace_id, 0) + 1
        if trace.trace_id == self.bad_trace:
            return FailedTrace(source=source, reason="reflector said no")
        return await super().reflect(snapshot, trace, source, stats)

    async def reduce(self, *args: Any, **kwargs: Any) -> Proposal:
        self.reduce_calls += 1
        if self.reduce_calls <= self.curate_failures:
            raise WindowError(KEY, "curator said no")
        return await super().reduce(*args, **kwargs)


@pytest.mark.anyio
async def test_failed_reflections_and_curations_are_parked_after_their_attempts() -> None:
    batch = items(6)
    bad = batch[1][0].trace_id
    async with client() as llm:
        sink = MemorySink()
        # attempts = 2: the first window's curation fails twice (parked), the second's once.
        learner = FlakyReflections(
            llm, config().learning, prompts=load_prompts(), bad_trace=bad, curate_failures=3
        )
        pipeline = KeyPipeline(
            KeyChain(KEY), learner, FixedBatch(3), sink, closed_inbox(batch), SYNC
        )
        await pipeline.run()
    assert learner.reflect_calls[bad] == 2
    parked = [(f.source.trace_id, stage) for f, stage in sink.parked]
    assert parked[0] == (bad, "reflect")
    assert sorted(parked[1:]) == sorted(
        (t.trace_id, "curate") for t, _ in batch[:3] if t.trace_id != bad
    )
    assert learner.reduce_calls == 2 + 2
    # the second window was learned: its version is v1 of the chain, with only its traces
    check_chain(sink.updates, 3)
    assert sink.updates[0].stats.trace_ids == sorted(t.trace_id for t, _ in batch[3:])


class FlakyCommits(Learner):
    """Commit fails ``failures`` times (an embedding or gate call that keeps failing)."""

    def __init__(self, *args: Any, failures: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failures = failures
        self.commit_calls = 0

    async def commit(self, *args: Any, **kwargs: Any) -> Any:
        self.commit_calls += 1
        if self.commit_calls <= self.failures:
            raise WindowError(KEY, "embedding dedup: endpoint said no")
        return await super().commit(*args, **kwargs)


@pytest.mark.anyio
async def test_a_commit_that_keeps_failing_parks_its_window_and_the_key_goes_on() -> None:
    batch = items(6)
    async with client() as llm:
        sink = MemorySink()
        # attempts = 2: the first window's commit fails twice (parked), the second's not at all.
        learner = FlakyCommits(llm, config().learning, prompts=load_prompts(), failures=2)
        pipeline = KeyPipeline(
            KeyChain(KEY), learner, FixedBatch(3), sink, closed_inbox(batch), SYNC
        )
        await pipeline.run()
    assert learner.commit_calls == 2 + 1
    parked = sorted((f.source.trace_id, stage, f.reason) for f, stage in sink.parked)
    reason = "commit failed: embedding dedup: endpoint said no"
    assert parked == sorted((t.trace_id, "curate", reason) for t, _ in batch[:3])
    check_chain(sink.updates, 3)
    assert sink.updates[0].stats.trace_ids == sorted(t.trace_id for t, _ in batch[3:])


class RejectEveryOther:
    name = "every_other"

    def __init__(self) -> None:
        self.seen: list[Candidate] = []

    async def review(self, candidate: Candidate) -> Verdict:
        self.seen.append(candidate)
        if len(self.seen) % 2 == 0:
            return Verdict(accepted=False, reason="even windows are refused")
        return Verdict(accepted=True)


@pytest.mark.anyio
async def test_a_gate_rejection_learns_the_traces_but_keeps_the_parents_bullets() -> None:
    async with client() as llm:
        sink, gate = MemorySink(), RejectEveryOther()
        learner = build_learner(config(), llm, gate=gate)
        pipeline = KeyPipeline(
            KeyChain(KEY), learner, FixedBatch(3), sink, closed_inbox(items(9)), SYNC
        )
        await pipeline.run()
    check_chain(sink.updates, 9)
    v1, v2, v3 = sink.updates
    assert v1.stats.rejection is None and v3.stats.rejection is None
    assert v2.stats.rejection == GateRejection(
        gate="every_other", reason="even windows are refused"
    )
    assert v2.playbook.sections == v1.playbook.sections, "nothing of the refused window applied"
    assert len(v2.stats.trace_ids) == 3, "its traces are learned (and never learned again)"
    assert [c.parent.version for c in gate.seen] == [0, 1, 2]
    assert len(retained_ids(v3.playbook)) == 6


@pytest.mark.anyio
async def test_the_learner_defends_against_a_realistic_simulator() -> None:
    """Paraphrasing curators, reflectors that invent vague lessons or miss some: no near
    duplicate and no vague bullet reaches the playbook, and each refusal is counted."""
    from combee_stream.core.hygiene import content_words, near_duplicates
    from combee_stream.sim.settings import RealismModel

    realism = RealismModel(paraphrase=0.6, invent=0.4, miss=0.1)
    batch = items(36, lessons=12)  # every lesson three times: paraphrases meet their original
    async with sim_http_client(SimSettings(seed=2, realism=realism)) as http:
        llm = LLMClient(config().llm, http_client=http, env={})
        sink = MemorySink()
        pipeline = KeyPipeline(
            KeyChain(KEY),
            build_learner(config(), llm),
            FixedBatch(6),
            sink,
            closed_inbox(batch),
            SYNC,
        )
        await pipeline.run()
        await llm.aclose()
    final = sink.updates[-1].playbook
    bullets = [b.content for s in final.sections for b in s.bullets]
    bags = [frozenset(content_words(b)) for b in bullets]
    assert not any(near_duplicates(a, b) for i, a in enumerate(bags) for b in bags[i + 1 :]), (
        bullets
    )
    assert not any(b.startswith("LESSON[invented-") for b in bullets), bullets
    skipped: dict[str, int] = {}
    for update in sink.updates:
        for reason, count in update.stats.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + count
    assert skipped.get("near_duplicate", 0) > 0 and skipped.get("no_lesson", 0) > 0, skipped
    assert sum(u.stats.bullets_added for u in sink.updates) == len(bullets)
    # every lesson the reflectors did not miss everywhere is there, once
    assert 9 <= len(retained_ids(final)) <= 12


@pytest.mark.anyio
async def test_only_the_bullets_a_trace_cites_get_its_tags() -> None:
    from combee_stream.core.playbook import apply, new_playbook
    from combee_stream.schemas import AddOp, Delta
    from combee_stream.sim.settings import RealismModel

    book = new_playbook(KEY)
    ops = [
        AddOp(section="OTHERS", content=f"rule number {i} for the agent to use") for i in range(3)
    ]
    book = apply(book, Delta(key=KEY, operations=ops), token_budget=None).playbook
    cited = [b.id for s in book.sections for b in s.bullets][:1]
    trace, source = items(1)[0]
    trace = msgspec.structs.replace(trace, bullet_ids=cited)
    async with sim_http_client(SimSettings(seed=2, realism=RealismModel(uncited_tags=1.0))) as http:
        llm = LLMClient(config().llm, http_client=http, env={})
        learner = build_learner(config(), llm)
        stats = learner.new_stats()
        record = await learner.reflect(book, trace, source, stats)
        await llm.aclose()
    assert isinstance(record, ReflectionRecord)
    assert [t.bullet_id for t in record.reflection.bullet_tags] == cited
    assert stats.uncited_tags == 1  # the simulator also tagged a bullet the trace never cited
