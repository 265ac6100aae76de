"""Issue 18's smaller gaps under a hostile stream, each reproduced: a task of 900,000
characters, a record that names its key twice, overlapping `dlq replay` selections, and a
fenced producer's unretrieved futures. (The ingest stage's own gaps, orphan floods and wrong
roots, are in test_ingest.py and test_ingest_assembler.py.)"""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from engine_support import engine_config, produce, read_dlq, wait_until_learned

from combee_stream import Engine
from combee_stream.config import Config, load_config
from combee_stream.core.versions import seed_update
from combee_stream.errors import DecodeError
from combee_stream.formats import trace_format
from combee_stream.formats.otlp import decode_telemetry
from combee_stream.formats.phoenix import decode_annotations
from combee_stream.kafka.client import make_producer
from combee_stream.kafka.dlq import H_ERROR, H_STAGE, DeadLetter, replay_dead_letters
from combee_stream.kafka.producer import TraceProducer, send_update
from combee_stream.kafka.reader import read_to_end
from combee_stream.kafka.topics import ensure_topics
from combee_stream.offline.source import read_traces
from combee_stream.schemas import Feedback, FeedbackRecord, Trace, decode, encode
from combee_stream.sim import SimSettings, sim_server
from combee_stream.sim.markers import marker_line
from combee_stream.tokens import estimate_tokens

LONG_TASK = "Reconcile the ledger line by line. " * 26_000  # 910,000 characters


def lesson_trace(key: str, trace_id: str, lesson: str, task: str = "A task.") -> Trace:
    feedback = Feedback(passed=False, text=marker_line(lesson, f"rule {lesson} for the agent"))
    return Trace(key=key, trace_id=trace_id, task=task, feedback=feedback)


def twice_keyed(trace: Trace, other_key: str) -> bytes:
    """``trace`` as JSON naming ``key`` twice: first ``other_key``, last its own (the one
    msgspec, like most readers, keeps)."""
    body = encode(trace)
    return b'{"key":"' + other_key.encode() + b'",' + body[1:]


# --------------------------------------------------------------------------- decode


def test_an_object_naming_a_key_twice_is_refused_by_every_json_decoder_of_input() -> None:
    trace = lesson_trace("ka", "t1", "l1")
    with pytest.raises(DecodeError, match="duplicate JSON key 'key'"):
        trace_format(load_config(None, env={})).from_line(twice_keyed(trace, "kb"))
    # Nested objects too: the feedback's verdict, a metadata label.
    fb = b'{"key":"ka","trace_id":"t2","task":"A task.","feedback":{"passed":false,"passed":true}}'
    with pytest.raises(DecodeError, match="duplicate JSON key 'passed'"):
        decode(fb, Trace, unique_keys=True)
    assert decode(fb, Trace).feedback.passed is True, "what is read without the check"
    record = encode(FeedbackRecord(key="ka", trace_id="t1", feedback=Feedback(passed=True)))
    with pytest.raises(DecodeError, match="duplicate JSON key 'trace_id'"):
        decode(b'{"trace_id":"t0",' + record[1:], FeedbackRecord, unique_keys=True)
    otlp = b'{"resourceSpans":[],"resourceSpans":[{"scopeSpans":[]}]}'
    with pytest.raises(DecodeError, match="duplicate JSON key 'resourceSpans'"):
        decode_telemetry(otlp, "otlp_json", "traces")
    item = b'"annotator_kind":"HUMAN","name":"x","name":"y"'
    phoenix = b'{"data":[{"trace_id":"' + b"a" * 32 + b'",' + item + b"}]}"
    with pytest.raises(DecodeError, match="duplicate JSON key 'name'"):
        decode_annotations(phoenix, load_config(None, env={}).ingest)


def test_offline_files_apply_the_same_bounds(tmp_path: Path) -> None:
    """`learn` reads a file through the same format: a line naming a key twice is a bad line,
    a long task is cut (or the line refused, with long_task = dead_letter)."""
    path = tmp_path / "traces.jsonl"
    long = lesson_trace("ka", "t-long", "l1", task=LONG_TASK)
    path.write_bytes(twice_keyed(lesson_trace("ka", "t1", "l1"), "kb") + b"\n" + encode(long))
    cfg = load_config(None, env={})
    source = read_traces(path, trace_format(cfg))
    assert [(b.line, "duplicate JSON key 'key'" in b.reason) for b in source.bad] == [(1, True)]
    [(trace, _)] = source.traces
    limit = cfg.learning.max_task_chars
    assert trace.task.startswith(LONG_TASK[:limit]) and len(trace.task) < limit + 100
    assert trace.task.endswith("(learning.max_task_chars)]") and str(len(LONG_TASK)) in trace.task
    strict = msgspec.structs.replace(
        cfg, learning=msgspec.structs.replace(cfg.learning, long_task="dead_letter")
    )
    [bad] = read_traces(path, trace_format(strict)).bad[1:]
    assert bad.line == 2 and f"task of {len(LONG_TASK)} characters" in bad.reason


@pytest.mark.anyio
async def test_a_twice_keyed_record_is_dead_lettered_and_a_huge_task_reaches_the_reflector_cut(
    config: Config, unique: str
) -> None:
    """On the broker with the simulator: a record whose JSON names `key` twice (kb, then
    ka: read as ka, it would teach ka what a filter reading kb let through) is dead-lettered
    with the reason; a trace whose task has 910,000 characters is learned with its task cut at
    learning.max_task_chars, so the reflector is not sent its 227k tokens."""
    long = lesson_trace("ka", "t-long", "l-long", task=LONG_TASK)
    fine = lesson_trace("ka", "t-fine", "l-fine")
    forged = twice_keyed(lesson_trace("ka", "t-forged", "l-forged"), "kb")
    async with sim_server(SimSettings(seed=1)) as llm:
        cfg = engine_config(config, unique, llm.base_url, batch_size=2)
        engine = Engine(cfg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.started.wait()
            async with TraceProducer(cfg.kafka) as producer:
                await producer.send_raw("ka", forged)
            await produce(cfg, [long, fine])
            updates = await wait_until_learned(cfg, {"ka": 2})
            with anyio.fail_after(60):
                while not await read_dlq(cfg):  # noqa: ASYNC110 - another topic
                    await anyio.sleep(0.2)
            engine.stop()
        reflector = llm.stats()["roles"]["reflector"]
    [letter] = await read_dlq(cfg)
    headers = {k: v.decode() for k, v in letter.headers}
    assert headers[H_STAGE] == "decode" and "duplicate JSON key 'key'" in headers[H_ERROR]
    assert letter.value == forged, "kept byte for byte"
    learned = {t for u in updates for t in u.stats.trace_ids}
    assert learned == {"t-long", "t-fine"}
    assert reflector["tokens_in"] < estimate_tokens(LONG_TASK), reflector


# --------------------------------------------------------------------------- dlq replay


@pytest.mark.anyio
async def test_a_dead_letter_is_replayed_once_whatever_the_selections(
    config: Config, unique: str
) -> None:
    """Letters of two stages and two keys, replayed by overlapping selections: by stage, then
    both stages, then one key, then everything again. Each letter reaches the traces topic once
    (before, each selection had its own position, so every one re-sent what the others had)."""
    cfg = engine_config(config, unique, "http://127.0.0.1:9")
    await ensure_topics(cfg.kafka)
    letters = [
        DeadLetter(
            reason="parked",
            stage=stage,
            topic=cfg.kafka.traces_topic,
            partition=0,
            offset=n,
            key=key.encode(),
            value=encode(lesson_trace(key, f"{stage}-{key}-{n}", f"l{n}")),
        )
        for n, (stage, key) in enumerate(
            [(s, k) for s in ("reflect", "curate") for k in ("ka", "kb") for _ in range(3)]
        )
    ]
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for letter in letters:
            await producer.send_and_wait(
                cfg.kafka.dlq_topic, value=letter.value, key=letter.key, headers=letter.headers()
            )
    finally:
        await producer.stop()
    kafka = cfg.kafka
    counts = [
        await replay_dead_letters(kafka, stages=("reflect",)),
        await replay_dead_letters(kafka, stages=("reflect", "curate")),
        await replay_dead_letters(kafka, stages=("reflect", "curate"), key="ka"),
        await replay_dead_letters(kafka, stages=("curate",), key="kb"),
        await replay_dead_letters(kafka, stages=("reflect", "curate", "decode", "size")),
    ]
    assert counts == [6, 6, 0, 0, 0]
    sent = Counter(
        decode(r.value, Trace).trace_id for r in await read_to_end(kafka, kafka.traces_topic)
    )
    assert sent == Counter(
        decode(letter.value, Trace).trace_id for letter in letters if letter.value
    )
    # A letter parked after the replays is a new one: the next replay sends it.
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        again = letters[0]
        await producer.send_and_wait(
            kafka.dlq_topic, value=again.value, key=again.key, headers=again.headers()
        )
    finally:
        await producer.stop()
    assert await replay_dead_letters(kafka, stages=("reflect", "curate"), key="ka") == 1


# --------------------------------------------------------------------------- fencing


@pytest.mark.anyio
async def test_a_fenced_producer_leaves_no_future_exception_unretrieved(
    config: Config, unique: str
) -> None:
    """A zombie's transactional producer, fenced by a newer one of its id, fails its
    transaction (a version and its history records, and the plain sends of the ingest stage);
    once it is stopped and collected, asyncio has nothing to report. Before, each fenced
    transaction left 4 futures whose ProducerFenced nobody retrieved (the records' delivery
    futures, the batches' drain waiters and the transaction's waiter), each logged with a
    traceback as "Future exception was never retrieved"."""
    from aiokafka.errors import ProducerFenced

    cfg = engine_config(config, unique, "http://127.0.0.1:9")
    await ensure_topics(cfg.kafka)
    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        zombie = make_producer(cfg.kafka, transactional_id=f"z.{unique}")
        await zombie.start()
        async with zombie.transaction():  # it worked once: it holds its partitions
            await send_update(zombie, cfg.kafka, seed_update("bot", "first", None), 0)
        newer = make_producer(cfg.kafka, transactional_id=f"z.{unique}")
        await newer.start()
        with pytest.raises(ProducerFenced):
            async with zombie.transaction():
                await zombie.send(cfg.kafka.dlq_topic, value=b"a letter", partition=1)
                await send_update(zombie, cfg.kafka, seed_update("bot", "second", None), 0)
        await zombie.stop()
        await newer.stop()
        del zombie, newer
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0.05)
    finally:
        loop.set_exception_handler(previous)
    never = [c for c in reported if "never retrieved" in str(c.get("message"))]
    assert never == [], [repr(c.get("exception")) for c in never]
