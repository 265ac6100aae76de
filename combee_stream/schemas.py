"""Wire contracts: every record that crosses Kafka or a file is one of these msgspec Structs.

JSON on the wire. Every record carries ``schema`` (its schema version). Changes are additive
only: a new field always has a default, so an older record still decodes. Decoding is strict
(unknown fields and wrong types are errors) and the error names the offending field, e.g.
``Expected `str`, got `int` - at `$.feedback.text```.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Annotated, Any, ClassVar, Final, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct, field

from combee_stream.errors import DecodeError, SchemaVersionError

SCHEMA_VERSION: Final = 1

# A prompt key names one playbook (tenant / agent / task family). It is also the Kafka key,
# so it must be printable and short.
Key = Annotated[str, Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/@-]+$")]
NonEmpty = Annotated[str, Meta(min_length=1)]
# Ids travel into prompts, logs and headers: printable in the str.isprintable() sense (no
# control, format (bidi, zero-width), line or paragraph separator characters, no space but
# U+0020) and no space at either end (two ids that look the same in a log are one id). The
# pattern is the part of that a JSON Schema can say; check_id() applies all of it at decode.
TraceId = Annotated[
    str, Meta(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f-\x9f\u2028\u2029]+$")
]
NonNegative = Annotated[int, Meta(ge=0)]
BulletTagKind = Literal["helpful", "harmful", "neutral"]


def check_id(value: str, field: str = "trace_id") -> None:
    """Raise ValueError unless ``value`` is a valid id (see ``TraceId``)."""
    if not value.isprintable() or value != value.strip(" "):
        raise ValueError(
            f"{field} must be printable (no control, format, line-separator or non-ASCII space "
            f"characters) with no space at either end: {ascii(value)[:80]}"
        )


def is_blank(text: str) -> bool:
    """Whether ``text`` has no visible character (only whitespace, control or format
    characters such as NUL, U+00A0, U+3000 or zero-width spaces)."""
    return not any(c.isprintable() and not c.isspace() for c in text)


class _Record(Struct, forbid_unknown_fields=True, omit_defaults=False):
    """Base for versioned records: rejects records from a newer, unknown schema."""

    def __post_init__(self) -> None:
        version = getattr(self, "schema", SCHEMA_VERSION)
        if not 1 <= version <= SCHEMA_VERSION:
            raise SchemaVersionError(
                f"unsupported schema version {version} (this build reads 1..{SCHEMA_VERSION})"
            )


# --------------------------------------------------------------------------- traces


class Step(Struct, forbid_unknown_fields=True):
    """One step of an agent's trajectory."""

    kind: Literal["thought", "action", "tool_call", "observation", "message"]
    content: str
    name: str | None = None  # tool name for tool_call / observation


class Feedback(Struct, forbid_unknown_fields=True):
    """How the task went. All optional, at least one must be present."""

    score: float | None = None
    passed: bool | None = None
    ground_truth: str | None = None
    text: str | None = None  # environment or user feedback in words

    def __post_init__(self) -> None:
        if self.score is None and self.passed is None and not self.ground_truth and not self.text:
            raise ValueError("feedback needs at least one of score, passed, ground_truth, text")


class Trace(_Record):
    """What an agent did on one task and how it went."""

    key: Key
    trace_id: TraceId
    task: NonEmpty
    feedback: Feedback
    output: str = ""
    steps: list[Step] = []
    # The version the agent ran with; None (or absent): not said, and then the trace is no live
    # sample of any version (0 is the key's empty playbook, or the fallback an agent served
    # before the key had a version).
    prompt_version: NonNegative | None = None
    bullet_ids: list[str] = []
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    metadata: dict[str, str] = {}
    # The agent session that was served the prompt (PromptClient's `session`): the live canary
    # counts a trace for a version only if that session's arm is served that version.
    session: TraceId | None = None
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        super().__post_init__()
        check_id(self.trace_id)
        if self.session is not None:
            check_id(self.session, "session")
        if is_blank(self.task):
            raise ValueError("task is blank (no visible character)")


class FeedbackRecord(_Record):
    """How a run went, sent after the fact (``TraceProducer.send_feedback``) to the feedback
    topic, keyed by trace id. The ingest stage joins it to the trace it assembles from that
    run's spans (``combee-stream ingest otel``)."""

    key: Key  # the prompt key the run used
    trace_id: TraceId
    feedback: Feedback
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        super().__post_init__()
        check_id(self.trace_id)


# --------------------------------------------------------------------------- learning


class Source(Struct, frozen=True, order=True, forbid_unknown_fields=True):
    """Where a trace came from. ``partition``/``offset`` are -1 for traces read from a file."""

    trace_id: str
    partition: int = -1
    offset: int = -1


class BulletTag(Struct, frozen=True, order=True, forbid_unknown_fields=True):
    bullet_id: str
    tag: BulletTagKind


class Reflection(_Record):
    """The reflector's diagnosis of one trace, with its provenance."""

    key: Key
    source: Source
    error_identification: str = ""
    root_cause: str = ""
    correct_approach: str = ""
    key_insight: str = ""
    bullet_tags: list[BulletTag] = []
    schema: int = SCHEMA_VERSION


class AddOp(Struct, frozen=True, tag="ADD", tag_field="type", forbid_unknown_fields=True):
    section: NonEmpty
    content: NonEmpty


class UpdateOp(Struct, frozen=True, tag="UPDATE", tag_field="type", forbid_unknown_fields=True):
    bullet_id: NonEmpty
    content: NonEmpty


class RemoveOp(Struct, frozen=True, tag="REMOVE", tag_field="type", forbid_unknown_fields=True):
    bullet_id: NonEmpty


Operation = AddOp | UpdateOp | RemoveOp


class Delta(_Record):
    """Playbook operations plus counter tags, with the provenance of the traces they cover."""

    key: Key
    operations: list[Operation] = []
    tags: list[BulletTag] = []
    sources: list[Source] = []
    base_version: NonNegative = 0  # playbook version the delta was computed against
    schema: int = SCHEMA_VERSION


class Bullet(Struct, forbid_unknown_fields=True, omit_defaults=True):
    id: NonEmpty
    content: NonEmpty
    helpful: NonNegative = 0
    harmful: NonNegative = 0
    # Provenance: trace ids (up to five) of the window whose version added the bullet, then of
    # the windows that changed its text, newest first. The Combee tree merges a window's deltas,
    # so a bullet is attributed to its window's traces, not to one. Never rendered.
    sources: list[str] = []


class Section(Struct, forbid_unknown_fields=True):
    name: NonEmpty
    bullets: list[Bullet] = []


class Playbook(_Record):
    """An ACE playbook: sections of bullets ``[id] helpful=h harmful=r :: text``."""

    key: Key
    version: NonNegative = 0
    base_prompt: str = ""  # operator's own system prompt, rendered above the bullets
    sections: list[Section] = []
    next_id: NonNegative = 1  # global bullet-id counter, as in ACE
    schema: int = SCHEMA_VERSION


# --------------------------------------------------------------------------- publishing


class BudgetRejection(Struct, frozen=True, tag="token_budget", tag_field="kind"):
    """The window's delta would have grown the playbook past its token budget."""

    kind: ClassVar[str] = "token_budget"  # the tag on the wire
    budget: int
    would_be: int
    current: int


class GateRejection(Struct, frozen=True, tag="gate", tag_field="kind"):
    """The publish gate (:mod:`combee_stream.core.gate`) refused the candidate playbook."""

    kind: ClassVar[str] = "gate"  # the tag on the wire
    gate: str  # which gate
    reason: str


class SizeRejection(Struct, frozen=True, tag="update_size", tag_field="kind"):
    """The version would have encoded larger than the prompts topic takes
    (``kafka.max_message_bytes``)."""

    kind: ClassVar[str] = "update_size"  # the tag on the wire
    limit: int
    would_be: int


Rejection = BudgetRejection | GateRejection | SizeRejection


class HeldOutTask(Struct, frozen=True, forbid_unknown_fields=True):
    """A trace kept out of learning to test candidates on (the replay gate): its task and the
    ground truth its feedback gave."""

    trace_id: str
    task: str
    answer: str
    rank: int  # the keyed hash of the trace id that chose it (the reservoir keeps the lowest)


class Holdout(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The replay gate's state of a key, carried by each of its versions (so restore and
    scale-out keep it): a bottom-k sample of its held-out traces, the tasks refused candidates
    broke, and the operations that wait for a review."""

    tasks: list[HeldOutTask] = []
    regressions: list[HeldOutTask] = []
    # Operations of windows the gate could not judge yet (fewer than gate.min_samples held-out
    # tasks): reviewed, and applied or refused, with the next window's candidate. Their traces
    # are learned; their lessons wait here, never served before a review passes.
    pending: list[Operation] = []


class GateReport(Struct, frozen=True, forbid_unknown_fields=True):
    """What the replay gate measured on a candidate: accuracy of the version it extends and of
    the candidate on the same ``n`` held-out tasks, and the lower confidence bound of their
    paired difference."""

    gate: str
    accepted: bool
    n: int
    current: float
    candidate: float
    lower: float
    broke: list[str] = []  # trace ids of the tasks right before and wrong under the candidate
    # Bullets of the window left out (the agent cited them on held-out tasks it answered
    # wrong, or, the lesson check, they fixed none of their failures): the rest of the window
    # was reviewed again, and this report is of that review.
    pruned: list[str] = []
    # The whole candidate was refused and ``pruned`` is its other part: earlier windows'
    # waiting lessons and this window's reviewed apart, this report of the part kept.
    split: bool = False
    # The gate whose blame left ``pruned`` out: in a chain, the report is of the second look
    # (say the replay gate's) while the blame may be the lesson check's. "" in versions
    # published before it was recorded.
    pruned_by: str = ""

    def left_out(self) -> str:
        """What the review left out, in a few words ("" when nothing)."""
        if not self.pruned:
            return ""
        if self.split:
            return f"left out {len(self.pruned)} new bullet(s) of one part (the whole was refused)"
        # (blamed by the replay gate for wrong answers, or by the lesson check for fixing none
        # of the failures they came from)
        by = f"the {self.pruned_by} gate" if self.pruned_by else "the gate"
        return f"left out {len(self.pruned)} new bullet(s) {by} blamed"


class Consolidation(Struct, frozen=True, forbid_unknown_fields=True):
    """What consolidating a playbook near its budget did (``learning.consolidate_at``)."""

    tokens_before: int
    tokens_after: int
    merged: list[list[str]] = []  # groups of bullet ids merged into the first of each
    dropped: list[str] = []  # bullets dropped for being clearly harmful
    refused: int = 0  # proposed merges not carried out (unknown ids, too long, policy)


class UpdateStats(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What one version learned and what its window cost (fields at their defaults are left
    out of the JSON, so a field added later does not trouble an older reader).

    Built in one place (:mod:`combee_stream.core.versions`) for every driver (the engine,
    offline ``learn``, ``prompts set``), so each field means the same thing wherever the version
    was written. Driver-specific by nature: ``delay_s`` (a wall time) and, on the update, the
    ``watermark`` (offline learning reads no offsets) and ``created_at``.
    """

    # Cumulative distinct traces the key's chain has learned, this version included.
    traces_learned: NonNegative = 0
    # Traces this version learned (``len(trace_ids)``); 0 for an operator's re-seed.
    window_traces: NonNegative = 0
    trace_ids: list[str] = []  # the traces this version learned, sorted by source
    strategy: str = ""  # sequential | naive | combee; "" for an operator's re-seed
    # The size the batch-size policy chose for the window; the window itself may close short
    # (max wait, end of input) or lose traces whose reflection failed (see window_traces).
    batch_size: NonNegative = 0
    llm_calls: NonNegative = 0  # LLM requests the window sent (memo hits excluded)
    cached_calls: NonNegative = 0  # calls of the window answered from the completion memo
    tokens_in: NonNegative = 0  # tokens paid by the window (0 for memo hits)
    tokens_out: NonNegative = 0
    # Wall seconds from the window's close (all its traces in hand) to its version being built:
    # what the batch-size controller minimises. Driver-specific.
    delay_s: float = 0.0
    bullets_added: NonNegative = 0  # new bullets this version added
    # Proposed operations and tags not carried out, by reason: duplicate, near_duplicate,
    # restates_task, no_lesson, missing_bullet, superseded, uncited_tag (see core/hygiene.py),
    # covered_lesson (reflections whose lesson a bullet already states; see core/learner.py).
    skipped: dict[str, int] = {}
    # Legacy (JSON text of a budget rejection, written by early builds); read, never written.
    rejected: str | None = None
    # Why the window's proposed delta was not applied; None when it was. Its traces are still
    # learned (listed in trace_ids), so they are never learned again.
    rejection: Rejection | None = None
    # Traces of the window kept out of learning as held-out tasks (the replay gate); they are
    # consumed by this version (in its watermark) but not learned.
    held_out: list[str] = []
    gate: GateReport | None = None  # what the replay gate measured, when it reviewed
    # This version started from version N's playbook instead of its parent's (the live canary
    # refused the parent's line, or production was rolled back to N): what the refused
    # versions had added is gone from the prompt; their traces stay learned, not re-learned.
    reverted_to: int | None = None
    consolidated: Consolidation | None = None  # the playbook was consolidated first
    # Operations waiting for the replay gate after this version (``holdout.pending``): the
    # gate could not judge yet, so the window's lessons wait for the next review.
    deferred: NonNegative = 0


class PromptUpdate(_Record, omit_defaults=True):
    """One published prompt version; the value of the compacted prompts topic, keyed by ``key``.

    ``watermark`` maps a traces-topic partition to the highest offset of this key's traces that
    this version (and its ancestors) learned from; -1 means none.
    """

    key: Key
    version: NonNegative
    playbook: Playbook
    prompt: str
    parent_version: int = -1  # -1 for a seed
    stats: UpdateStats = field(default_factory=UpdateStats)
    watermark: dict[int, int] = {}
    created_at: dt.datetime | None = None
    holdout: Holdout | None = None  # the key's held-out tasks (only with the replay gate)
    schema: int = SCHEMA_VERSION


class DedupHorizon(_Record):
    """The trace ids a key learned last (the dedup topic's record, keyed by ``key``), so a
    re-send is recognised after a restart, an eviction or a rebalance. Written in the same
    transaction as ``version``; ``ids`` packs 8-byte BLAKE2b digests of the trace ids
    (oldest first, at most ``engine.dedup_horizon``): a fixed size per id, whatever its
    length (base64 in JSON)."""

    key: Key
    version: NonNegative  # the version it was written with (it covers that version's ids)
    ids: bytes = b""
    schema: int = SCHEMA_VERSION


class Labels(_Record):
    """A key's movable labels (the history topic's ``KEY#labels`` record). ``production`` is
    what agents get by default: None means it follows the newest version (``latest``); a
    number pins it (after a rollback, or a promotion of one version)."""

    key: Key
    production: int | None = None
    labels: dict[str, int] = {}  # other labels (candidate, canary, an operator's own)
    previous: list[int | None] = []  # production's earlier targets, newest last (rollback)
    # Approval mode: production never follows latest; only `prompts promote` moves it.
    approval: bool = False
    # The live canary: agents whose session hashes below this share get `candidate` when they
    # ask for production (0: no canary). Written by the engine with the candidate label.
    canary: float = 0.0
    # The id of the key of that hash (kafka.history.canary_key_id of the canary secret), so an
    # agent knows whether it holds the same secret; "": the unkeyed hash of older engines.
    canary_key: str = ""
    seq: NonNegative = 0  # moves so far
    schema: int = SCHEMA_VERSION


class LabelMove(_Record):
    """One label move, kept for audit (the history topic's ``KEY#move#SEQ`` records)."""

    key: Key
    seq: NonNegative
    label: NonEmpty
    from_version: int | None  # the version it pointed at (None: the label did not exist)
    to_version: int | None  # None: production follows latest again; another label is removed
    by: str
    why: str = ""
    approval: bool | None = None  # set when the move switched approval mode on or off
    at: dt.datetime | None = None
    schema: int = SCHEMA_VERSION


# --------------------------------------------------------------------------- codecs

T = TypeVar("T")
_encoder = msgspec.json.Encoder()


def encode(record: Any) -> bytes:
    return _encoder.encode(record)


def decode(data: bytes | str, type_: type[T], *, unique_keys: bool = False) -> T:
    """Strictly decode one JSON record; raise ``DecodeError`` with a field-naming reason.
    ``unique_keys``: also refuse an object that names a key twice (:func:`check_unique_keys`;
    for input from producers)."""
    try:
        value = msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"invalid {type_.__name__}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise DecodeError(f"malformed JSON: {exc}") from exc
    if unique_keys:
        check_unique_keys(data)
    return value


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> None:
    if len(pairs) > 1 and len({key for key, _ in pairs}) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)


def check_unique_keys(data: bytes | str) -> None:
    """Raise ``DecodeError`` if an object of the JSON document ``data`` names a key twice.

    msgspec (like most JSON readers) keeps the last of two, so ``{"key": "a", ..., "key": "b"}``
    would be read as key b by one reader and key a by another (a proxy, a filter, a person):
    a producer could show one key and teach another. The standard library's C scanner reports
    every object's pairs in order; keeping none of them costs about one more decode (10 us
    for a trace of 1 KB, 0.2 ms for 300 KB). Call it on a document msgspec has decoded."""
    try:
        json.loads(data, object_pairs_hook=_refuse_duplicates)
    except _DuplicateKey as exc:
        raise DecodeError(
            f"duplicate JSON key {exc.key[:80]!r}: an object names it twice (which one would "
            "count is up to the reader)"
        ) from None
    except (ValueError, RecursionError) as exc:
        # msgspec read it but this reader cannot (nested past the recursion limit): unchecked
        # is not unique, so it is refused too.
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise DecodeError(f"cannot check the JSON for duplicate keys: {reason}") from None


def json_schema(type_: Any) -> dict[str, Any]:
    return msgspec.json.schema(type_)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


__all__ = [
    "SCHEMA_VERSION",
    "AddOp",
    "BudgetRejection",
    "Bullet",
    "BulletTag",
    "Consolidation",
    "DecodeError",
    "DedupHorizon",
    "Delta",
    "Feedback",
    "FeedbackRecord",
    "GateRejection",
    "GateReport",
    "HeldOutTask",
    "Holdout",
    "Operation",
    "Playbook",
    "PromptUpdate",
    "Reflection",
    "Rejection",
    "RemoveOp",
    "SchemaVersionError",
    "Section",
    "SizeRejection",
    "Source",
    "Step",
    "Trace",
    "UpdateOp",
    "UpdateStats",
    "check_unique_keys",
    "decode",
    "encode",
    "json_schema",
    "utcnow",
]
