"""Task sets and scorers: what agents answer, and what counts as right.

``load_tasks(SOURCE)`` reads the ``--tasks`` argument of ``combee-stream eval`` (and the quality
benchmark): ``generated`` or ``generated:SEED`` (financial word problems), ``formula:PATH`` and
``finer:PATH`` (ACE's finance files), ``gsm8k:PATH``. A file source may end in ``@N`` to skip
its first N rows (``formula:train.jsonl@60`` starts at the 61st), so a second run can learn
from rows the first never saw.
"""

from __future__ import annotations

from pathlib import Path

from combee_stream.errors import UserError
from combee_stream.tasks.base import SCORERS, Task, is_correct, parse_number, task_feedback
from combee_stream.tasks.generated import KEY, generate_tasks
from combee_stream.tasks.readers import read_finer, read_formula, read_gsm8k

_READERS = {"formula": read_formula, "finer": read_finer, "gsm8k": read_gsm8k}
GENERATED_DEFAULT = 200


def load_tasks(source: str, *, limit: int | None = None) -> list[Task]:
    kind, _, arg = source.partition(":")
    if kind == "generated":
        try:
            seed = int(arg) if arg else 0
        except ValueError:
            raise UserError(f"--tasks generated:SEED takes an integer seed, got {arg!r}") from None
        return generate_tasks(limit or GENERATED_DEFAULT, seed=seed)
    reader = _READERS.get(kind)
    if reader is None or not arg:
        raise UserError(
            f"--tasks {source!r}: expected generated[:SEED], formula:PATH, finer:PATH or "
            "gsm8k:PATH, a PATH optionally ending in @N (skip its first N rows)"
        )
    path, at, skip = arg.rpartition("@")
    if not at or not skip.isdigit():  # no "@N" suffix: the whole argument is the path
        path, skip = arg, "0"
    tasks = reader(Path(path))[int(skip) :]
    if not tasks and int(skip):
        raise UserError(f"--tasks {source!r}: no rows left after skipping {skip}")
    return tasks[:limit] if limit else tasks


__all__ = [
    "KEY",
    "SCORERS",
    "Task",
    "generate_tasks",
    "is_correct",
    "load_tasks",
    "parse_number",
    "read_finer",
    "read_formula",
    "read_gsm8k",
    "task_feedback",
]
