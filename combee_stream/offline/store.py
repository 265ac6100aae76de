"""The output folder of offline learning: ``history.jsonl`` (one PromptUpdate per version,
appended and fsynced after every window), ``playbook.json`` / ``playbook.md`` (the newest
playbook per key, replaced atomically), ``report.json`` and the completion memo."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import msgspec
from msgspec import Struct

from combee_stream.core.playbook import render
from combee_stream.errors import DecodeError, UserError
from combee_stream.logs import get_logger
from combee_stream.schemas import Playbook, PromptUpdate, decode, encode

log = get_logger(__name__)


class History(Struct):
    """What ``history.jsonl`` says: the newest version of every key and the traces learned."""

    newest: dict[str, PromptUpdate]
    learned: dict[str, set[str]]

    @property
    def playbooks(self) -> dict[str, Playbook]:
        return {key: update.playbook for key, update in self.newest.items()}


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


class OutputDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.history = root / "history.jsonl"
        self.playbook_json = root / "playbook.json"
        self.playbook_md = root / "playbook.md"
        self.report = root / "report.json"
        self.memo = root / "memo.jsonl"

    def prepare(self, resume: bool) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise UserError(f"--out {self.root} exists and is not a folder")
        self.root.mkdir(parents=True, exist_ok=True)
        if not resume and self.history.exists() and self.history.stat().st_size:
            raise UserError(
                f"{self.history} already holds a learn run: pass --resume to continue it, "
                "or choose another --out folder"
            )
        if not resume:
            for path in (self.memo, self.playbook_json, self.playbook_md, self.report):
                path.unlink(missing_ok=True)

    def load_history(self) -> History:
        """Newest version and learned trace ids per key. A torn last line (a crash in
        mid-write) is dropped and cut from the file; a bad line elsewhere is an error."""
        out = History(newest={}, learned={})
        if not self.history.exists():
            return out
        data = self.history.read_bytes()
        lines = data.split(b"\n")
        offset = 0
        for number, line in enumerate(lines, 1):
            start = offset
            offset += len(line) + 1
            if not line.strip():
                continue
            try:
                update = decode(line, PromptUpdate)
            except DecodeError as exc:
                if number == len(lines):  # no newline after it: torn by a crash
                    log.warning("learn.history_torn_line", line=number, reason=exc.reason)
                    with self.history.open("r+b") as handle:
                        handle.truncate(start)
                    break
                raise UserError(f"{self.history}:{number}: {exc.reason}") from None
            key = update.key
            known = out.newest.get(key)
            if known is not None and update.version <= known.version:
                raise UserError(
                    f"{self.history}:{number}: version {update.version} of key {key!r} "
                    f"after version {known.version}"
                )
            out.newest[key] = update
            out.learned.setdefault(key, set()).update(
                [*update.stats.trace_ids, *update.stats.held_out]
            )
        else:
            if data and not data.endswith(b"\n"):  # complete record, newline lost: restore it
                with self.history.open("ab") as handle:
                    handle.write(b"\n")
        return out

    def append_history(self, update: PromptUpdate) -> None:
        with self.history.open("ab") as handle:
            handle.write(encode(update) + b"\n")
            handle.flush()
            os.fsync(handle.fileno())

    def write_playbooks(self, playbooks: Mapping[str, Playbook]) -> None:
        ordered = {key: playbooks[key] for key in sorted(playbooks)}
        atomic_write(self.playbook_json, msgspec.json.format(encode(ordered)) + b"\n")
        parts = [f"# Playbooks\n\n_{len(ordered)} key(s), combee-stream learn._\n"]
        for key, book in ordered.items():
            parts.append(f"## Key `{key}` — version {book.version}\n\n```text\n{render(book)}```\n")
        atomic_write(self.playbook_md, "\n".join(parts).encode())

    def write_report(self, report: Struct) -> None:
        atomic_write(self.report, msgspec.json.format(encode(report)) + b"\n")


__all__ = ["History", "OutputDir", "atomic_write"]
