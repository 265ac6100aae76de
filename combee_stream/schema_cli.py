"""CLI: ``schema NAME`` prints the JSON Schema of a wire record, so producers can validate."""

from __future__ import annotations

import argparse
import json
from typing import Any

from combee_stream import schemas
from combee_stream.config import Config

SCHEMAS: dict[str, Any] = {
    "trace": schemas.Trace,
    "prompt-update": schemas.PromptUpdate,
    "reflection": schemas.Reflection,
    "delta": schemas.Delta,
    "playbook": schemas.Playbook,
}


def register(sub: Any) -> None:
    parser = sub.add_parser("schema", help="print the JSON Schema of a wire record")
    parser.add_argument("name", choices=sorted(SCHEMAS))
    parser.set_defaults(handler=_schema)


def _schema(args: argparse.Namespace, config: Config) -> int:
    print(json.dumps(schemas.json_schema(SCHEMAS[args.name]), indent=2))
    return 0


__all__ = ["SCHEMAS", "register"]
