"""CLI: ``topics create``, ``produce``, ``subscribe`` (Kafka only; ``prompts`` and ``inspect``
live in :mod:`combee_stream.prompts_cli`)."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec

from combee_stream.config import Config, secret
from combee_stream.errors import DecodeError, UserError
from combee_stream.formats import trace_format
from combee_stream.kafka.dlq import replay_dead_letters
from combee_stream.kafka.producer import TraceProducer
from combee_stream.kafka.reader import TopicMissingError, content_digest
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.kafka.topics import ensure_topics
from combee_stream.retry import RetryPolicy
from combee_stream.schemas import PromptUpdate, Trace, encode


def register(sub: Any) -> None:
    topics = sub.add_parser("topics", help="manage the engine's Kafka topics")
    topics_sub = topics.add_subparsers(dest="topics_command", required=True)
    create = topics_sub.add_parser(
        "create",
        help="create the traces, prompts, history and dedup (compacted) and DLQ topics; idempotent",
    )
    create.set_defaults(handler=_topics_create)

    produce = sub.add_parser("produce", help="send traces from a JSONL file to the traces topic")
    produce.add_argument("file", help="JSONL file, one Trace per line ('-' for stdin)")
    produce.add_argument(
        "--raw", action="store_true", help="send lines unvalidated (to test bad input handling)"
    )
    produce.set_defaults(handler=_produce)

    subscribe = sub.add_parser("subscribe", help="print prompt updates as JSON lines")
    subscribe.add_argument("--key", action="append", help="only this key (repeatable)")
    subscribe.add_argument(
        "--once", action="store_true", help="print the current version per key, then exit"
    )
    which = subscribe.add_mutually_exclusive_group()
    which.add_argument(
        "--label",
        default=None,
        help="the version a label points at (default: production, what PromptClient serves; "
        "latest: the engine's newest version; candidate, ...)",
    )
    which.add_argument("--version", type=int, default=None, help="a pinned version")
    subscribe.add_argument(
        "--session",
        default=None,
        help="an agent's session or agent id: with --label production, a session in a live "
        "canary's share (keyed by the secret in gate.canary_secret_env) is served the candidate",
    )
    subscribe.set_defaults(handler=_subscribe)

    dlq = sub.add_parser("dlq", help="the dead-letter topic")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True)
    replay = dlq_sub.add_parser(
        "replay",
        help="re-send parked traces to the traces topic, once (after fixing the cause)",
    )
    replay.add_argument(
        "--stage",
        action="append",
        choices=["reflect", "curate", "decode", "size"],
        help="stages to replay (repeatable; default: reflect and curate)",
    )
    replay.add_argument("--key", default=None, help="only this key's traces")
    replay.set_defaults(handler=_dlq_replay)


async def _topics_create(args: argparse.Namespace, config: Config) -> int:
    for topic, state in (await ensure_topics(config.kafka)).items():
        print(f"{topic}: {state}")
    return 0


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    try:
        return Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None


async def _produce(args: argparse.Namespace, config: Config) -> int:
    lines = [(n, line) for n, line in enumerate(_read_lines(args.file), 1) if line.strip()]
    traces: list[Trace] = []
    if not args.raw:
        fmt = trace_format(config)
        errors = []
        for n, line in lines:
            try:
                traces.append(fmt.from_line(line))
            except DecodeError as exc:
                errors.append(f"{args.file}:{n}: {exc}")
        if errors:
            # Validate everything first: a half-sent file is harder to fix than a refused one.
            raise UserError("refusing to send, invalid traces:\n  " + "\n  ".join(errors))
    async with TraceProducer(config.kafka) as producer:
        if args.raw:
            for _, line in lines:
                await producer.send_raw(_raw_key(line), line.encode())
        else:
            for trace in traces:
                await producer.send(trace)
    print(f"sent {len(lines)} records to {config.kafka.traces_topic}", file=sys.stderr)
    return 0


def _raw_key(line: str) -> str | None:
    # Raw lines are keyed by their "key" field when they have one, like valid traces.
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None
    key = obj.get("key") if isinstance(obj, dict) else None
    return key if isinstance(key, str) else None


# Following: a missing prompts topic (not created yet, or deleted) is waited for, said once
# per attempt on stderr; capped, so it is back soon after the topic is.
SUBSCRIBE_RETRY = RetryPolicy(base_s=1.0, max_s=30.0)


async def _subscribe(args: argparse.Namespace, config: Config) -> int:
    """``--once``: the current version per key, or a non-zero exit saying what is missing.
    Following: reconnects with backoff while a topic is missing (printing each served version
    once: a version is printed again only if its content differs, as after a lost state)."""
    keys = set(args.key) if args.key else None
    out = sys.stdout
    printed: dict[str, bytes] = {}

    def emit(update: PromptUpdate) -> None:
        digest = content_digest(update)
        if printed.get(update.key) != digest:
            printed[update.key] = digest
            out.write(encode(update).decode() + "\n")

    rng, attempt = random.Random(), 0
    while True:
        try:
            async with PromptSubscriber(
                config.kafka,
                keys=keys,
                version=args.version,
                session=args.session,
                # One default for every way of reading prompts: production (PromptClient's).
                label=args.label or (None if args.version is not None else "production"),
                canary_secret=secret(config.gate.canary_secret_env),
            ) as prompts:
                attempt = 0
                served = (prompts.latest(k) for k in sorted(prompts.snapshot()))
                for update in (u for u in served if u is not None):
                    emit(update)
                out.flush()
                if args.once:
                    return 0
                async for update in prompts:
                    emit(update)
                    out.flush()
        except TopicMissingError as exc:
            if args.once:
                raise
            attempt += 1
            delay = SUBSCRIBE_RETRY.delay(attempt, rng)
            print(f"combee-stream: {exc}; trying again in {delay:.1f} s", file=sys.stderr)
            await anyio.sleep(delay)


async def _dlq_replay(args: argparse.Namespace, config: Config) -> int:
    stages = tuple(args.stage or ("reflect", "curate"))
    count = await replay_dead_letters(config.kafka, stages=stages, key=args.key)
    print(f"replayed {count} dead letter(s) to {config.kafka.traces_topic}", file=sys.stderr)
    return 0


__all__ = ["register"]
