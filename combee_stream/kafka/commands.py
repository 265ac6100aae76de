"""CLI: ``topics create``, ``produce``, ``subscribe``, ``prompts set``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec

from combee_stream.config import Config
from combee_stream.errors import UserError
from combee_stream.kafka.producer import TraceProducer, make_producer, publish_update
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.kafka.topics import ensure_topics
from combee_stream.schemas import DecodeError, Playbook, PromptUpdate, Trace, decode, encode, utcnow


def register(sub: Any) -> None:
    topics = sub.add_parser("topics", help="manage the engine's Kafka topics")
    topics_sub = topics.add_subparsers(dest="topics_command", required=True)
    create = topics_sub.add_parser(
        "create", help="create the traces, prompts (compacted) and DLQ topics; idempotent"
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
        "--once", action="store_true", help="print the current latest version per key, then exit"
    )
    subscribe.set_defaults(handler=_subscribe)

    prompts = sub.add_parser("prompts", help="operate on prompt versions")
    prompts_sub = prompts.add_subparsers(dest="prompts_command", required=True)
    seed = prompts_sub.add_parser(
        "set", help="publish a seed prompt (version 0) for a key from your own system prompt"
    )
    seed.add_argument("key")
    seed.add_argument("file", help="text file holding the system prompt")
    seed.add_argument(
        "--force",
        action="store_true",
        help="key already has versions: publish the new base prompt as the next version, "
        "keeping the learned bullets",
    )
    seed.set_defaults(handler=_prompts_set)


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
        errors = []
        for n, line in lines:
            try:
                traces.append(decode(line, Trace))
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


async def _subscribe(args: argparse.Namespace, config: Config) -> int:
    keys = set(args.key) if args.key else None
    out = sys.stdout
    async with PromptSubscriber(config.kafka, keys=keys) as prompts:
        for update in sorted(prompts.snapshot().values(), key=lambda u: u.key):
            out.write(encode(update).decode() + "\n")
        out.flush()
        if args.once:
            return 0
        async for update in prompts:
            out.write(encode(update).decode() + "\n")
            out.flush()
    return 0


async def _prompts_set(args: argparse.Namespace, config: Config) -> int:
    try:
        text = await anyio.Path(args.file).read_text()
    except FileNotFoundError:
        raise UserError(f"{args.file}: file not found") from None
    update = await seed_prompt(config, args.key, text, force=args.force)
    print(encode(update).decode())
    return 0


async def seed_prompt(config: Config, key: str, text: str, *, force: bool = False) -> PromptUpdate:
    """Publish the operator's system prompt for ``key`` (version 0, or the next one with force)."""
    try:
        # Struct constructors skip constraint checks; a round trip applies them (key format).
        playbook = decode(encode(Playbook(key=key, base_prompt=text)), Playbook)
    except DecodeError as exc:
        raise UserError(f"invalid key {key!r}: {exc}") from None
    async with PromptSubscriber(config.kafka, keys={key}) as prompts:
        current = prompts.latest(key)
    if current is None:
        update = PromptUpdate(
            key=key, version=0, playbook=playbook, prompt=text, created_at=utcnow()
        )
    elif not force:
        raise UserError(
            f"key {key!r} already has version {current.version}; use --force to publish this "
            "base prompt as the next version (learned bullets are kept)"
        )
    else:
        from combee_stream.core.playbook import render

        version = current.version + 1
        learned = current.playbook
        playbook = Playbook(
            key=key,
            version=version,
            base_prompt=text,
            sections=learned.sections,
            next_id=learned.next_id,
        )
        update = PromptUpdate(
            key=key,
            version=version,
            parent_version=current.version,
            playbook=playbook,
            prompt=render(playbook),
            stats=current.stats,
            watermark=current.watermark,
            created_at=utcnow(),
        )
    producer = make_producer(config.kafka)
    await producer.start()
    try:
        await publish_update(producer, config.kafka.prompts_topic, update)
    finally:
        await producer.stop()
    return update


__all__ = ["register", "seed_prompt"]
