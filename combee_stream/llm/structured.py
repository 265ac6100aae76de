"""Structured output: the JSON Schema a role's reply must match (from a msgspec type, bounded per
role), the cap a reply gets (its schema's worst case), how it is asked for per endpoint mode,
and how a reply is read back and validated.

Modes (``RoleConfig.mode``): ``json_schema`` (OpenAI's structured outputs, vLLM),
``json_object`` with the schema as an extra field (llama.cpp's server constrains its grammar by
it), and ``text``: the schema in the prompt, the first JSON object of the reply taken.
"""

from __future__ import annotations

import json
from typing import Any, Final, TypeVar

import msgspec

from combee_stream.config import RoleConfig
from combee_stream.llm.types import ChatMessage

T = TypeVar("T")


class _InvalidReply(Exception):
    pass


def output_schema(output_type: type[Any]) -> dict[str, Any]:
    """msgspec's JSON Schema with the root ``$ref`` inlined (OpenAI wants an object at the root)."""
    schema = msgspec.json.schema(output_type)
    ref = schema.get("$ref")
    defs = schema.get("$defs", {})
    if isinstance(ref, str) and ref.startswith("#/$defs/") and len(schema) == 2:
        root = dict(defs[ref.removeprefix("#/$defs/")])
        if len(defs) > 1 or _refers_to(root, ref):
            root["$defs"] = defs
        return root
    return schema


# Fields that hold a name or an id, never prose: bounded tighter than ``max_string_chars`` so
# that the worst case of a reply (what ``max_tokens`` must leave room for) is not inflated by
# room no real value needs.
SHORT_FIELDS: Final = {"section": 64, "bullet_id": 32, "tag": 16}


def bound_schema(schema: Any, max_string_chars: int, max_list_items: int) -> Any:
    """A copy of ``schema`` whose strings and arrays carry ``maxLength`` / ``maxItems``
    (0 leaves that kind unbounded); enums and existing tighter bounds are kept, and the
    properties named in ``SHORT_FIELDS`` get their own, smaller bound."""
    if isinstance(schema, list):
        return [bound_schema(item, max_string_chars, max_list_items) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bound_schema(v, max_string_chars, max_list_items) for k, v in schema.items()}
    if out.get("type") == "string" and max_string_chars and "enum" not in out:
        out["maxLength"] = min(out.get("maxLength", max_string_chars), max_string_chars)
    if out.get("type") == "array" and max_list_items:
        out["maxItems"] = min(out.get("maxItems", max_list_items), max_list_items)
    properties = out.get("properties")
    if max_string_chars and isinstance(properties, dict):
        for name, limit in SHORT_FIELDS.items():
            field = properties.get(name)
            if isinstance(field, dict) and field.get("type") == "string" and "enum" not in field:
                field["maxLength"] = min(field.get("maxLength", limit), limit)
    return out


# Worst-case characters per token of a JSON reply. English prose is about 4, but Qwen's and
# SmolLM's tokenizers give every digit a token of its own, and a Formula lesson is digits and
# operators: a 135M model's reflections were cut at a 3-characters-a-token cap. At 1 a reply
# the grammar allows always fits (only a \uXXXX escape, one character of maxLength, can
# exceed it; the one re-ask at twice the cap covers that). The cap costs nothing when the
# model stops early; it only bounds one that rambles.
_CHARS_PER_TOKEN: Final = 1


def schema_token_bound(schema: Any, defs: dict[str, Any] | None = None) -> int | None:
    """Tokens of the longest reply ``schema`` allows (keys, punctuation and values), or None
    when it has an unbounded string or array. ``$ref`` is resolved against ``$defs``."""
    if defs is None:
        defs = schema.get("$defs", {}) if isinstance(schema, dict) else {}
    if not isinstance(schema, dict):
        return 1
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return schema_token_bound(defs[ref.removeprefix("#/$defs/")], defs)
    for union in ("anyOf", "oneOf"):
        if union in schema:
            bounds = [schema_token_bound(option, defs) for option in schema[union]]
            return None if any(b is None for b in bounds) else max(b or 0 for b in bounds)
    if "enum" in schema:
        return max((len(str(v)) // _CHARS_PER_TOKEN + 2 for v in schema["enum"]), default=2)
    kind = schema.get("type")
    if kind == "string":
        limit = schema.get("maxLength")
        return None if limit is None else -(-int(limit) // _CHARS_PER_TOKEN) + 2
    if kind == "array":
        items, limit = schema.get("items", {}), schema.get("maxItems")
        item = schema_token_bound(items, defs)
        return None if limit is None or item is None else int(limit) * (item + 1) + 2
    if kind == "object":
        total = 2
        for name, sub in schema.get("properties", {}).items():
            bound = schema_token_bound(sub, defs)
            if bound is None:
                return None
            total += bound + len(name) // _CHARS_PER_TOKEN + 3
        return total
    return 8  # a number, a boolean, null


def max_tokens_for(rc: RoleConfig, schema: dict[str, Any]) -> int | None:
    """The cap a role's request gets: its ``max_tokens`` when set, else the worst case of its
    (bounded) schema, else none (an unbounded schema: a hosted model stops at the end of its
    JSON, and any fixed cap would cut a legitimately long reply)."""
    if rc.max_tokens:
        return rc.max_tokens
    return schema_token_bound(schema)


def _refers_to(node: object, ref: str) -> bool:
    if isinstance(node, dict):
        return node.get("$ref") == ref or any(_refers_to(v, ref) for v in node.values())
    if isinstance(node, list):
        return any(_refers_to(v, ref) for v in node)
    return False


def extract_json(text: str) -> str:
    """Lenient parse for ``text`` mode: the first complete JSON object in the reply, so code
    fences and prose around it do not matter; else everything from the first ``{`` to the last
    ``}`` (which then fails validation with a precise error for the re-ask)."""
    starts = [i for i, char in enumerate(text) if char == "{"]
    if not starts:
        raise _InvalidReply("the reply contains no JSON object")
    for start in starts[:_MAX_JSON_STARTS]:
        try:
            value, end = _raw_json.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return text[start:end]
    end = text.rfind("}")
    return text[starts[0] : end + 1] if end > starts[0] else text[starts[0] :]


_raw_json = json.JSONDecoder()

_MAX_JSON_STARTS = 64  # bounds the work on a long reply full of braces


def response_format(mode: str, name: str, schema: dict[str, Any]) -> dict[str, Any] | None:
    """The ``response_format`` of a request in ``mode`` (None in ``text`` mode: the schema goes
    into the prompt, see :func:`with_instruction`)."""
    if mode == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    if mode == "json_object":
        # llama.cpp rejects json_schema but constrains json_object by this extra "schema".
        return {"type": "json_object", "schema": schema}
    return None


def schema_instruction(schema: dict[str, Any]) -> str:
    return (
        "\n\nReply with only one JSON object, no prose and no code fences, that matches this "
        "JSON Schema:\n" + msgspec.json.encode(schema).decode()
    )


def reask(error: str) -> str:
    return (
        f"Your previous reply was not valid: {error}\n"
        "Reply again with only the corrected JSON object that matches the required schema."
    )


def decode_reply(text: str, output_type: type[T]) -> T:
    """Validate a reply. Raw control characters inside JSON strings (a raw newline, say) are
    tolerated: grammar-constrained servers such as llama.cpp let them through, and rejecting a
    reply for them would only make the model repeat it."""
    try:
        return msgspec.json.decode(text, type=output_type)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError as strict_error:
        try:
            loose = json.loads(text, strict=False)
        except ValueError:
            raise strict_error from None
        return msgspec.convert(loose, output_type)


def with_instruction(messages: list[ChatMessage], instruction: str) -> list[ChatMessage]:
    """Append ``instruction`` to the last user message (or add one if there is none)."""
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") == "user":
            message["content"] = message.get("content", "") + instruction
            return out
    out.append({"role": "user", "content": instruction.lstrip()})
    return out


__all__ = [
    "SHORT_FIELDS",
    "bound_schema",
    "decode_reply",
    "extract_json",
    "max_tokens_for",
    "output_schema",
    "reask",
    "response_format",
    "schema_instruction",
    "schema_token_bound",
    "with_instruction",
]
