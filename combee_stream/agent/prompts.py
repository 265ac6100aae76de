"""What an agent asks for before each task: the current prompt of its key.

``async with PromptClient(config.kafka, "support-bot", snapshot=Path("prompt.json")) as p:``
reads the key's newest version from the compacted prompts topic, then follows new versions in
the background (one task, scoped to the block). ``p.current()`` returns the newest prompt known,
at once, with its version and bullet ids. The broker may go away, or the prompts topic (deleted:
the engine's state lost): the client keeps serving the last version it had, says which topic is
missing, and reconnects with backoff (the one retry policy). Every new version is written to
the snapshot file, so an agent that starts while the broker is unreachable serves the snapshot
(or, without one, the fallback prompt you give) and says so in ``Prompt.source``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import anyio
from aiokafka.errors import KafkaError
from anyio.abc import TaskGroup
from msgspec import Struct

from combee_stream.config import KafkaConfig
from combee_stream.errors import DecodeError, UserError
from combee_stream.kafka.reader import TopicMissingError
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.logs import get_logger
from combee_stream.retry import RetryPolicy
from combee_stream.schemas import PromptUpdate, decode, encode

log = get_logger(__name__)

Source = Literal["broker", "snapshot", "fallback"]
RECONNECT = RetryPolicy(base_s=0.5, max_s=30.0)


class Prompt(Struct, frozen=True, kw_only=True):
    key: str
    text: str  # the system prompt
    version: int  # -1 for a fallback prompt
    bullet_ids: list[str]  # ids of the playbook bullets it carries
    source: Source  # where it came from
    # The session it was served to (the client's): traces of runs with it name it, so that the
    # live canary can check the version was this session's to run.
    session: str | None = None


def prompt_of(update: PromptUpdate, source: Source, session: str | None = None) -> Prompt:
    ids = [b.id for section in update.playbook.sections for b in section.bullets]
    return Prompt(
        key=update.key, text=update.prompt, version=update.version, bullet_ids=ids,
        source=source, session=session,
    )  # fmt: skip


class PromptClient:
    def __init__(
        self,
        kafka: KafkaConfig,
        key: str,
        *,
        snapshot: Path | str | None = None,
        fallback: str = "",
        connect_timeout_s: float = 15.0,
        env: Mapping[str, str] | None = None,
        label: str = "production",
        session: str | None = None,
        canary_secret: str | None = None,
    ) -> None:
        self._kafka = kafka
        self.key = key
        self.label = label  # which version to serve: production (default), latest, candidate...
        self.session = session  # a session or agent id: places it in or out of a live canary
        # The key of the canary split (default: $COMBEE_CANARY_SECRET), as the engine's.
        self._canary_secret = canary_secret
        self._snapshot = Path(snapshot) if snapshot is not None else None
        self._fallback = Prompt(
            key=key, text=fallback, version=-1, bullet_ids=[], source="fallback", session=session
        )
        self._connect_timeout_s = connect_timeout_s
        self._env = env
        self._current = self._fallback
        self._changed = anyio.Event()
        self._caught_up = anyio.Event()
        # Set once the first attempt has an answer: caught up, or a topic missing (waiting the
        # connect timeout for a topic that is not there serves nothing better).
        self._answered = anyio.Event()
        self._tg: TaskGroup | None = None
        self._rng = random.Random()
        self.connected = False
        self.missing: str | None = None  # the topic found missing at the last attempt

    async def __aenter__(self) -> Self:
        snapshot = self._read_snapshot()
        if snapshot is not None:
            self._current = snapshot
        self._tg = await anyio.create_task_group().__aenter__()
        self._tg.start_soon(self._follow)
        with anyio.move_on_after(self._connect_timeout_s):
            await self._answered.wait()
        if not self._caught_up.is_set():
            log.warning(
                "prompts topic unreachable: serving the last known prompt",
                key=self.key,
                source=self._current.source,
                version=self._current.version,
                missing=self.missing,
            )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(exc_type, exc, tb)

    def current(self) -> Prompt:
        """The newest prompt known (never blocks)."""
        return self._current

    async def next_version(self, after: int | None = None) -> Prompt:
        """Wait until a version newer than ``after`` (default: the current one) is known."""
        after = self._current.version if after is None else after
        while self._current.version <= after:
            await self._changed.wait()
        return self._current

    # ------------------------------------------------------------------ internals

    def _accept(self, update: PromptUpdate) -> None:
        if update.key != self.key:
            return
        # The subscriber yields the labelled version each time it changes (a rollback goes
        # down); "latest" never goes down.
        if (
            self.label == "latest"
            and self._current.source != "fallback"
            and update.version < self._current.version
        ):
            return
        self._current = prompt_of(update, "broker", self.session)
        self._write_snapshot(update)
        self._changed.set()
        self._changed = anyio.Event()

    async def _follow(self) -> None:
        attempt = 0
        while True:
            try:
                async with PromptSubscriber(
                    self._kafka, keys={self.key}, env=self._env, label=self.label,
                    session=self.session, canary_secret=self._canary_secret,
                ) as sub:  # fmt: skip
                    self.connected = True
                    self.missing = None
                    attempt = 0
                    latest = sub.latest(self.key)
                    if latest is not None:
                        self._accept(latest)
                    self._caught_up.set()
                    self._answered.set()
                    async for update in sub:
                        self._accept(update)
            except (KafkaError, UserError, OSError) as exc:
                self.connected = False
                attempt += 1
                delay = RECONNECT.delay(attempt, self._rng)
                if isinstance(exc, TopicMissingError):
                    self.missing = exc.topic
                    self._answered.set()
                    log.warning(
                        "prompts topic missing: serving the last known prompt, retrying",
                        key=self.key,
                        topic=exc.topic,
                        error=str(exc),
                        retry_s=round(delay, 1),
                    )
                else:
                    log.warning("prompts topic unreachable, retrying", key=self.key, error=str(exc))
                await anyio.sleep(delay)

    def _read_snapshot(self) -> Prompt | None:
        if self._snapshot is None or not self._snapshot.is_file():
            return None
        try:
            update = decode(self._snapshot.read_bytes(), PromptUpdate)
        except DecodeError as exc:
            log.warning(
                "unreadable prompt snapshot ignored", path=str(self._snapshot), error=exc.reason
            )
            return None
        return prompt_of(update, "snapshot", self.session) if update.key == self.key else None

    def _write_snapshot(self, update: PromptUpdate) -> None:
        if self._snapshot is None:
            return
        self._snapshot.parent.mkdir(parents=True, exist_ok=True)
        partial = self._snapshot.with_name(self._snapshot.name + ".tmp")
        partial.write_bytes(encode(update))
        os.replace(partial, self._snapshot)


__all__ = ["Prompt", "PromptClient", "Source", "prompt_of"]
