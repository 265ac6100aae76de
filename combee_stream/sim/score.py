"""How many of the lessons carried by a set of traces a learned playbook retained (per key)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec
from msgspec import Struct

from combee_stream.schemas import Playbook, Trace, decode
from combee_stream.sim.markers import find_lessons, retained_ids


class KeyScore(Struct):
    lessons_total: int = 0
    lessons_retained: int = 0


class Score(Struct):
    lessons_total: int
    lessons_retained: int
    by_key: dict[str, KeyScore]


def score(
    traces: Iterable[Trace], playbooks: Mapping[str, Playbook], key: str | None = None
) -> Score:
    """Distinct lessons (markers in ``feedback.text``) per key, and those whose marker occurs in a
    bullet of that key's playbook. ``key`` restricts the count to one key."""
    lessons: dict[str, set[str]] = {}
    for trace in traces:
        if key is not None and trace.key != key:
            continue
        found = lessons.setdefault(trace.key, set())
        found.update(lesson.id for lesson in find_lessons(trace.feedback.text or ""))
    by_key: dict[str, KeyScore] = {}
    for name in sorted(lessons):
        playbook = playbooks.get(name)
        kept = retained_ids(playbook) if playbook is not None else set()
        by_key[name] = KeyScore(len(lessons[name]), len(lessons[name] & kept))
    return Score(
        lessons_total=sum(s.lessons_total for s in by_key.values()),
        lessons_retained=sum(s.lessons_retained for s in by_key.values()),
        by_key=by_key,
    )


def load_traces(path: Path) -> list[Trace]:
    """Traces from a JSONL file (blank lines skipped); errors name the line."""
    traces = []
    with path.open("rb") as file:
        for number, line in enumerate(file, 1):
            if line.strip():
                try:
                    traces.append(decode(line, Trace))
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: {exc}") from exc
    return traces


def load_playbooks(out_dir: Path) -> dict[str, Playbook]:
    """``DIR/playbook.json`` of a learn run: key -> Playbook."""
    path = out_dir / "playbook.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=dict[str, Playbook])
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ValueError(f"{path}: {exc}") from exc


__all__ = ["KeyScore", "Score", "load_playbooks", "load_traces", "score"]
