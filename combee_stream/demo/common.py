"""What both demos share: their lines, the engine's logs in a file, a broker with fresh topics,
and a few words on what the publish gate did with a version."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec

from combee_stream.config import Config
from combee_stream.evaluation.lessons import NAME as LESSONS
from combee_stream.kafka.broker import start_broker
from combee_stream.kafka.topics import ensure_topics, run_topics
from combee_stream.logs import configure_logging
from combee_stream.schemas import PromptUpdate


def say(text: str) -> None:
    print(text, flush=True)


@contextlib.contextmanager
def engine_logs(config: Config) -> Iterator[Path]:
    """The engine's (and the clients') log lines into a file the demo names, not between its
    own lines; the process's logging is put back afterwards."""
    folder = Path(config.broker.state_dir).parent
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "demo.log"
    with path.open("w") as out:
        configure_logging(config.log.level, to=out)
        say(f"(engine logs: {path})")
        try:
            yield path
        finally:
            configure_logging(config.log.level, config.log.format)


async def fresh_kafka(config: Config) -> Config:
    """The local broker started, and ``config`` on topics of this run's own (every run learns
    from scratch)."""
    say("starting the local Kafka broker (the first run downloads its jars with Maven)")
    bootstrap = await anyio.to_thread.run_sync(start_broker, config.broker)
    run = f"demo.{uuid.uuid4().hex[:8]}"
    kafka = run_topics(config.kafka, run, bootstrap_servers=bootstrap)
    say(f"   broker ready at {bootstrap}; topics {run}.*")
    await ensure_topics(kafka)
    return msgspec.structs.replace(config, kafka=kafka)


def gate_note(update: PromptUpdate) -> str:
    """What the publish gate did with a version, in a few words (for the demos)."""
    stats = update.stats
    held = f", {len(stats.held_out)} held out" if stats.held_out else ""
    if stats.rejection is not None:
        return f"{held}; refused: {getattr(stats.rejection, 'reason', stats.rejection.kind)}"
    if stats.deferred:
        return f"{held}; {stats.deferred} lesson(s) wait for enough held-out tasks to be reviewed"
    if stats.gate is not None:
        g = stats.gate
        left = f", {g.left_out()}" if g.pruned else ""
        if g.gate == LESSONS:  # its tasks: the window's failures, retried with each new bullet
            fixed = round((g.candidate - g.current) * g.n)
            return f"{held}; lesson check: {fixed} of {g.n} failures fixed{left}"
        return f"{held}; gate passed ({g.current:.0%} -> {g.candidate:.0%} on {g.n} tasks{left})"
    return held


__all__ = ["engine_logs", "fresh_kafka", "gate_note", "say"]
