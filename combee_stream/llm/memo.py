"""Completion memo: a finished LLM call is never paid for twice.

Entries are keyed by a hash of the whole request (see ``request_key``). The memo lives in memory
and, when given a path, is also persisted as append-only JSONL that is reloaded on start, so a
window retried after a crash or a rebalance replays its finished calls for free. A crash can tear
the last line; loading drops it and truncates the file back to the last complete line so that the
next append starts on a clean line.

Concurrent identical requests are single-flighted: the first caller computes, the others wait for
its entry instead of paying for the same call.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import anyio
import msgspec

from combee_stream.logs import get_logger

log = get_logger(__name__)


class MemoEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One finished call: the validated reply (as JSON) and what it cost the first time."""

    key: str
    role: str
    model: str
    value: msgspec.Raw
    tokens_in: int
    tokens_out: int


def request_key(request: dict[str, Any]) -> str:
    """sha256 over canonical JSON (sorted keys, no whitespace) of everything that shapes a reply."""
    return hashlib.sha256(msgspec.json.encode(request, order="sorted")).hexdigest()


def endpoint_identity(base_url: str) -> str:
    """What names an endpoint in a memo key: its URL, without the port when it is on this
    machine. A local model server is started on a free port each run (``bench quality --local``,
    the tests' simulator), so a key holding the port made every resumed run miss its whole memo:
    a rerun of a real 1.5B ``bench quality`` (2026-12-07) asked the reflector again for traces
    it had already reflected on. On this machine the model name in the key tells servers apart;
    elsewhere the host and port do (two providers may serve one model name)."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback or parts.port is None:
        return base_url
    return parts._replace(netloc=f"[{host}]" if ":" in host else host).geturl()


_decoder = msgspec.json.Decoder(MemoEntry)
_encoder = msgspec.json.Encoder()


class CompletionMemo:
    """In-memory completion memo, optionally backed by an append-only JSONL file."""

    def __init__(self, path: str | Path | None = None, *, max_entries: int = 0) -> None:
        # A long-running engine makes calls forever: keep only the newest ``max_entries`` in
        # memory (0 = all). Retried windows are recent, so they still hit.
        self._max = max_entries
        self._entries: dict[str, MemoEntry] = {}
        self._inflight: dict[str, anyio.Event] = {}
        self._path = Path(path) if path else None
        self._file: BinaryIO | None = None
        if self._path is not None:
            self._load(self._path)
            self._file = self._path.open("ab")

    @property
    def path(self) -> Path | None:
        return self._path

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str) -> MemoEntry | None:
        return self._entries.get(key)

    def put(self, entry: MemoEntry) -> None:
        """Remember ``entry`` (first one wins) and append it to the file."""
        if entry.key in self._entries:
            return
        self._entries[entry.key] = entry
        if self._max and len(self._entries) > self._max:
            del self._entries[next(iter(self._entries))]  # the oldest (insertion order)
        if self._file is not None:
            # One write of one complete line, flushed at once: a crash loses at most this line,
            # which _load drops. A few KB to the page cache does not need a worker thread.
            self._file.write(_encoder.encode(entry) + b"\n")
            self._file.flush()

    async def get_or_compute(
        self, key: str, compute: Callable[[], Awaitable[MemoEntry]]
    ) -> tuple[MemoEntry, bool]:
        """Return ``(entry, hit)``; run ``compute`` only if no entry exists and none is in flight.

        If the caller computing the entry fails, one of the waiters takes over (each caller keeps
        its own retry budget); a waiter never sees another caller's error or cancellation.
        """
        while True:
            hit = self._entries.get(key)
            if hit is not None:
                return hit, True
            pending = self._inflight.get(key)
            if pending is None:
                break
            await pending.wait()
        done = anyio.Event()
        self._inflight[key] = done
        try:
            entry = await compute()
            self.put(entry)
            return entry, False
        finally:
            del self._inflight[key]
            done.set()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _load(self, path: Path) -> None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            return
        good_end = 0  # byte offset just past the last line that decoded
        offset = 0
        skipped = 0
        for line in data.splitlines(keepends=True):
            offset += len(line)
            if not line.endswith(b"\n"):
                break  # torn tail: written partially when the process died
            try:
                entry = _decoder.decode(line)
            except msgspec.DecodeError:
                skipped += 1
                continue
            self._entries.setdefault(entry.key, entry)
            good_end = offset
        if good_end < len(data):
            # Truncate the torn (or garbage) tail so appends start on a fresh line.
            with path.open("r+b") as fh:
                fh.truncate(good_end)
                fh.flush()
                os.fsync(fh.fileno())
            log.warning(
                "llm.memo.truncated_tail", path=str(path), dropped_bytes=len(data) - good_end
            )
        if skipped:
            log.warning("llm.memo.skipped_lines", path=str(path), lines=skipped)
        log.info("llm.memo.loaded", path=str(path), entries=len(self._entries))


__all__ = ["CompletionMemo", "MemoEntry", "endpoint_identity", "request_key"]
