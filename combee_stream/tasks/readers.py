"""Readers of third-party task sets: ACE's Formula and FiNER files, and GSM8K.

They read the files where they are (``../shared/datasets/...`` here); nothing is copied. Each
task keeps the dataset's own prompt as its question and its own answer; the scorer is the one
the dataset's authors use (see ``tasks.base``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from combee_stream.errors import UserError
from combee_stream.tasks.base import Task

_FORMULA_NAME = re.compile(r"Use formula (.+?) to answer")


def _rows(path: Path) -> list[dict[str, str]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UserError(f"cannot read tasks {path}: {exc.strerror or exc}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{number}: not JSON: {exc}") from None
    return rows


def read_formula(path: Path) -> list[Task]:
    """ACE's Formula rows ``{"context", "target"}``; scored by ACE's float comparison."""
    tasks = []
    for i, row in enumerate(_rows(path)):
        found = _FORMULA_NAME.search(row["context"])
        tasks.append(
            Task(
                id=f"formula-{path.stem}-{i:04d}",
                question=row["context"],
                answer=str(row["target"]),
                scorer="formula",
                family=found.group(1) if found else "formula",
            )
        )
    return tasks


def read_finer(path: Path) -> list[Task]:
    """ACE's FiNER rows (4 tagging questions each); correct only when every tag is."""
    return [
        Task(
            id=f"finer-{path.stem}-{i:04d}",
            question=row["context"],
            answer=str(row["target"]),
            scorer="finer",
            family="finer",
        )
        for i, row in enumerate(_rows(path))
    ]


def read_gsm8k(path: Path) -> list[Task]:
    """GSM8K rows ``{"question", "answer"}``; the reference is the number after ``####``."""
    tasks = []
    for i, row in enumerate(_rows(path)):
        final = row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")
        tasks.append(
            Task(
                id=f"gsm8k-{path.stem}-{i:05d}",
                question=row["question"],
                answer=final,
                scorer="numeric",
                family="gsm8k",
            )
        )
    return tasks


__all__ = ["read_finer", "read_formula", "read_gsm8k"]
