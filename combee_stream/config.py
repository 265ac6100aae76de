"""Configuration in one typed place.

A TOML file (see ``configs/``) decoded into these Structs, then overridden by environment
variables ``COMBEE__SECTION__FIELD`` (double underscores separate the path, e.g.
``COMBEE__KAFKA__BOOTSTRAP_SERVERS=127.0.0.1:9092`` or ``COMBEE__LLM__CURATOR__MODEL=gpt-4o``).
Secrets are never read from files: a role names the *environment variable* that holds its key.
A bad file or override fails fast with ``ConfigError`` naming the file, the field and the reason.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from combee_stream.errors import ConfigError

ENV_PREFIX = "COMBEE__"
# Where the engine and the agents' SDK find the key of the live canary's split by default.
CANARY_SECRET_ENV = "COMBEE_CANARY_SECRET"
# The largest dedup record (engine.dedup_horizon at its bound: 8-byte digests, base64 in JSON,
# with the key and framing), the dedup topic's max.message.bytes when kafka.max_message_bytes
# is lower: a key's horizon never competes with the playbooks for that bound.
DEDUP_RECORD_BYTES = 1_000_000

Port = Annotated[int, Meta(ge=1, le=65535)]
Positive = Annotated[int, Meta(ge=1)]
PositiveFloat = Annotated[float, Meta(gt=0)]


class _Section(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class KafkaConfig(_Section):
    bootstrap_servers: str = "127.0.0.1:9092"
    client_id: str = "combee-stream"
    group_id: str = "combee-stream"
    traces_topic: str = "combee.traces"
    prompts_topic: str = "combee.prompts"
    dlq_topic: str = "combee.dlq"
    # Every version of every key (for a retention), its labels and their moves; compacted and
    # co-partitioned with the prompts topic (written by the engine in the same transaction).
    history_topic: str = "combee.history"
    # Per key, the last engine.dedup_horizon trace ids learned (as 8-byte digests): compacted,
    # co-partitioned, written in the same transaction as each version, so a re-send is
    # recognised after a restart, an eviction or a rebalance. Empty: the prompts topic's name
    # + ".dedup" (it is part of that topic's state, so a config that names its own prompts
    # topic gets its own dedup topic too). A topic of its own rather than the versions' ids
    # gathered back through the history: the history keeps kafka.history_versions versions
    # (that many windows, not dedup_horizon ids) and a key's restore would read one per version.
    dedup_topic: str = ""
    # Versions kept per key in the history topic (older ones are deleted by compaction).
    history_versions: Positive = 50
    # Outcomes sent after the run (FeedbackRecord, keyed by trace id); joined by the ingest stage.
    feedback_topic: str = "combee.feedback"
    partitions: Positive = 3
    replication_factor: Positive = 1
    # How records of the traces topic are decoded (combee_stream.formats); "native" is the
    # Trace JSON this package writes.
    traces_format: Literal["native"] = "native"
    # Bound on one produce or metadata request: how long one write attempt can take while the
    # broker is unreachable before the engine's retry policy takes over.
    request_timeout_ms: Annotated[int, Meta(ge=1000)] = 30_000
    # A crashed instance keeps its partitions until this expires (broker bounds apply).
    session_timeout_ms: Annotated[int, Meta(ge=1000)] = 10_000
    # Extra per-topic configs for the prompts topic (always compacted). Fast compaction for
    # tests lives in configs/local.toml, not here.
    prompts_topic_configs: dict[str, str] = {}
    # The largest PromptUpdate the engine publishes: a window whose version would encode
    # larger is rejected like a budget rejection. `topics create` sets it as the prompts
    # topic's max.message.bytes (the broker's message.max.bytes must allow it).
    max_message_bytes: Annotated[int, Meta(ge=65_536)] = 1_000_000
    # How long dead letters are kept (`topics create` sets the DLQ topic's retention.ms):
    # long enough to fix the cause and `dlq replay` them. Default 30 days.
    dlq_retention_ms: Annotated[int, Meta(ge=60_000)] = 30 * 24 * 3600 * 1000
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username_env: str = "COMBEE_KAFKA_USERNAME"
    sasl_password_env: str = "COMBEE_KAFKA_PASSWORD"

    @property
    def dedup_topic_name(self) -> str:
        return self.dedup_topic or f"{self.prompts_topic}.dedup"


class BrokerConfig(_Section):
    """The local development broker started by ``combee-stream kafka start``."""

    kafka_version: str = "4.4.0"
    host: str = "127.0.0.1"
    port: Port = 9092
    controller_port: Port = 9093
    state_dir: str = ".state/kafka"  # jars, data and logs; relative to the working directory
    heap: str = "512m"
    ready_timeout_s: PositiveFloat = 90.0


class LocalLLMConfig(_Section):
    """The local model server of ``combee-stream llm serve`` (and ``make demo``): llama.cpp's
    ``llama-server`` built from registry sources, serving a model assembled from registry
    wheels (see combee_stream/localllm)."""

    model: Literal["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"] = (
        "qwen2.5-coder-1.5b"
    )
    host: str = "127.0.0.1"
    port: Port = 8080
    parallel: Positive = 4  # slots served concurrently (continuous batching)
    ctx_size: Positive = 32768  # tokens of KV cache, shared by the slots
    threads: Positive = 2
    seed: int = 42
    # The models and server logs; relative to the working directory. (The llama-server build
    # is in the user-level build cache, shared by every clone: combee_stream.buildcache.)
    state_dir: str = ".state/llm"
    ready_timeout_s: PositiveFloat = 300.0
    # Semantic dedup of bullets (llm.embeddings) by a local embedding model, all-MiniLM-L6-v2
    # run in NumPy, served beside the chat model when NumPy, tokenizers and safetensors are
    # installed (the `local` extra). Its cosine scale is not OpenAI's: paraphrased rules score
    # about 0.6-0.85 with it, unrelated ones under 0.4, so its threshold is its own.
    embeddings: bool = True
    embeddings_port: Port = 8081
    embeddings_threshold: Annotated[float, Meta(gt=0, le=1)] = 0.8


class RoleConfig(_Section):
    """One LLM role's endpoint. ``base_url`` empty means: take ``OPENAI_BASE_URL``."""

    base_url: str = ""
    model: str = "gpt-4o-mini"
    temperature: float = 0.0
    # The reply's cap; 0: derived from the schema's bounds (its worst case, so a bounded reply
    # is never cut), none sent for an unbounded schema (the endpoint's own limit). A reply cut
    # at the cap is re-sent once with twice the cap (never the same request twice).
    max_tokens: Annotated[int, Meta(ge=0)] = 0
    api_key_env: str = "OPENAI_API_KEY"
    # json_schema: OpenAI / vLLM; json_object: llama.cpp (json_object + schema); text: parse.
    mode: Literal["json_schema", "json_object", "text"] = "json_schema"
    # Bounds added to the JSON Schema sent to the endpoint (0 = none). Grammar-constrained
    # small models (llama.cpp) can repeat themselves until max_tokens; bounded strings and
    # lists make every reply finish. Replies are still validated against the full types.
    max_string_chars: Annotated[int, Meta(ge=0)] = 0
    max_list_items: Annotated[int, Meta(ge=0)] = 0
    # USD per million tokens, for cost accounting only.
    price_in: float = 0.0
    price_out: float = 0.0


class EmbeddingsConfig(_Section):
    enabled: bool = False
    base_url: str = ""
    model: str = "text-embedding-3-small"
    api_key_env: str = "OPENAI_API_KEY"
    threshold: Annotated[float, Meta(gt=0, le=1)] = 0.9


class LLMConfig(_Section):
    reflector: RoleConfig = field(default_factory=RoleConfig)
    curator: RoleConfig = field(default_factory=RoleConfig)
    combiner: RoleConfig = field(default_factory=RoleConfig)
    # The example agent (combee_stream.evaluation.Answerer): `eval`, the quality benchmark, the
    # demo.
    agent: RoleConfig = field(default_factory=RoleConfig)
    # The LLM judge of the replay gate (gate.scorer = "judge"): is an answer right, given the
    # task and its reference answer? A separate role, so it can be a stronger model.
    judge: RoleConfig = field(default_factory=RoleConfig)
    embeddings: EmbeddingsConfig = field(default_factory=EmbeddingsConfig)
    concurrency: Positive = 16
    requests_per_minute: Annotated[int, Meta(ge=0)] = 0  # 0 = unlimited
    tokens_per_minute: Annotated[int, Meta(ge=0)] = 0
    timeout_s: PositiveFloat = 60.0
    max_attempts: Positive = 4  # per call, covering transport errors and invalid replies
    # Consecutive outage failures that open the circuit breaker (no answer, or one every call
    # gets alike: 5xx, 401/403, 404, 429 insufficient_quota; see llm.status.status_kind): calls
    # then wait for the endpoint (their attempts unspent) instead of failing their traces.
    breaker_threshold: Positive = 5
    memo_path: str = ""  # completion memo file; empty = in memory only
    # In memory; 0 = unbounded. Only recent calls are ever replayed (a retried or resumed
    # window), so a few thousand keep memory flat in a long-running engine.
    memo_max_entries: Annotated[int, Meta(ge=0)] = 4096


class LearningConfig(_Section):
    strategy: Literal["combee", "naive", "sequential"] = "combee"
    batch_size: Positive | Literal["auto"] = "auto"
    min_batch_size: Positive = 1
    max_batch_size: Positive = 80
    duplication: Positive = 2  # augmented shuffle factor p
    fan_in: Annotated[int, Meta(ge=0)] = 0  # 0 = k = floor(sqrt(n)) groups
    combine: Literal["union", "llm"] = "union"
    # With several curators in a window, the first is sent alone and the others once it has
    # answered. Their prompts share a head (instructions, then the playbook) that a server can
    # serve from its prompt cache only once one request has been processed: llama-server keeps
    # a slot's prompt when its reply ends, hosted APIs cache a prefix after a first request
    # (and bill cached input at a fraction). In a 1.5B run with two curators a window, 4% of
    # the curators' prompt tokens came from the cache sent at once, 22% warmed. It costs one
    # curator's latency per window on an endpoint with room for all; on a CPU server, where
    # processing the prompts is the bottleneck, it saved time (the curators' summed latency
    # 290 s against 722). False sends them all at once (the paper's parallel curators).
    warm_curator_cache: bool = True
    # With llm.embeddings on, a reflection whose key insight is at the dedup cosine
    # (llm.embeddings.threshold) of a bullet already in the playbook is not shown to the
    # curators (its tags and provenance count as ever; a reflection that blames that bullet is
    # shown): any ADD it led to would be refused as near_duplicate. ACE tells its curator to
    # keep only what the playbook lacks; a 1.5B curator shown the same rule again re-added it
    # in each of its 6 calls after the first window of a 24-trace run (the demo's tasks) and
    # never wrote the other lesson the reflections taught. A lesson stating a formula the
    # bullet lacks is not covered (core.playbook.says_more).
    skip_covered_lessons: bool = True
    token_budget: Positive = 80_000
    # When a window would leave the playbook above this share of token_budget (or its version
    # above this share of kafka.max_message_bytes: CJK text reaches bytes first), it is first
    # consolidated: per section, near-duplicate bullets are merged by the curator's endpoint
    # (keeping their specifics, their counts and provenance), and bullets whose harmful count
    # exceeds their helpful count by drop_harmful_margin or more are dropped. Nothing else is
    # rewritten and nothing is truncated. 0 = never (windows past the budget are rejected).
    consolidate_at: Annotated[float, Meta(ge=0, le=1)] = 0.8
    drop_harmful_margin: Positive = 3
    # Merge lessons that say the same thing for different cases: when a window adds a bullet
    # whose advice (its text after a leading "When <situation>," clause) has embedding cosine
    # at least this to another bullet's advice in its section, the consolidator (the curator's
    # endpoint) is shown that group alone and writes one bullet that keeps each case's
    # specifics, before the gate reviews the candidate. A small curator states one rule once
    # per formula ("When calculating the beta, ... round the result to 2 decimal places"; the
    # same for DSCR, for WACC): in a 1.5B run's playbooks, MiniLM cosine 0.90-0.96 between
    # such advice, at most 0.74 between different rules. Needs llm.embeddings; 0 = off
    # (consolidation only near the budget).
    merge_similar: Annotated[float, Meta(ge=0, le=1)] = 0.0
    # Each new bullet a curator writes from a window with a failed trace (one with a reference
    # answer) gets a worked example: one more call to the curator's endpoint, shown the bullet
    # and one such trace, writes the expression the agent should have written and the one it
    # wrote ("for 35.3 million and 22.3 million, write (35.3 - 22.3) * 1000000, not 35.3 -
    # 22.3"), appended after "Example:". A small agent follows examples where it ignores rules:
    # the real-model demo's 1.5B agent answered 4 of 20 held-out tasks with its curators' two
    # rules and 16 with the same rules each ending in one such example (docs/demo-runs.md).
    # The example carries that training task's numbers (a 1.5B model asked for numbers of its
    # own copies the task's), so a task's data reaches every agent of the key: off by default,
    # and for keys whose tasks carry nothing private. The review judges the rule before
    # "Example:" (an example is an instance by design); the whole text meets the content
    # policy and the length bound; the lesson check does not retry the task an example came
    # from (the example is its answer). With the gate's own agent (gate.evaluator = "agent"
    # and a string scorer), an example is kept only if its calculation, run by that agent's
    # calculator, scores right on its task by gate.scorer; told what it gave, the exemplifier
    # is asked once more, then the rule stays alone. A real run's one example neither rounded
    # nor kept "%" out of its expression, and its agent copied both (quality_18.md).
    worked_examples: bool = False
    # A proposed bullet longer than this is refused (skipped as too_long): a lesson is a rule,
    # not a document, and one trace must not fill the prompt of every agent of its key.
    max_bullet_chars: Positive = 2000
    # A trace whose task is longer than this is cut to it, the cut said at its end ("cut"),
    # or dead-lettered ("dead_letter"): in the traces topic, the ingest stage and offline
    # files alike. Traces are untrusted and the task goes whole into the reflector's prompt:
    # 900,000 characters are about 225k tokens, past any model's context, and paid on every
    # retry. 20,000 characters (about 5k tokens) hold any real task statement with its
    # context; a longer input is a document, not a task.
    max_task_chars: Positive = 20_000
    long_task: Literal["cut", "dead_letter"] = "cut"
    # Patterns (Python regular expressions, matched case-insensitively) that no bullet may
    # contain: a proposed ADD or UPDATE that matches one is refused (skipped as "policy").
    # Traces are untrusted (their task text comes from users) and bullets reach every agent of
    # the key, so the default policy (core/hygiene.py DEFAULT_POLICY: links, e-mail addresses,
    # instructions aimed at the model, system or role markers, card numbers, secret-like
    # strings) is on; these patterns are added to it, and default_content_policy = false
    # leaves only them (for a key whose lessons must quote links, say).
    content_policy: list[str] = []
    default_content_policy: bool = True
    # Bullets one trace's reflection may tag helpful or harmful (the first ones it cites): the
    # agent of ACE's examples uses one to three, and a trace citing every bullet must not move
    # every counter (five such traces made every bullet of a playbook harmful=5).
    max_tags_per_trace: Positive = 3
    # Which successful traces the reflector reads (failures always): "all" (ACE: every trace;
    # a success can carry a lesson and its tags), "cited" (only successes that cited bullets:
    # what they can teach is their tags), "none". A 1.5B reflector asked about a success that
    # cited nothing wrote "the formula should be A, not A" on most of them: "cited" spends
    # nothing on that (about half the calls on a stream that is half right). Skipped traces
    # are learned all the same (their offsets commit); they only cost no call.
    reflect_successes: Literal["all", "cited", "none"] = "all"
    # Tries of a trace's reflection, and of a window's curation, before their traces are parked
    # in the DLQ (each try is itself retried by the LLM client, llm.max_attempts). Both drivers.
    max_attempts: Positive = 3
    seed: int = 0
    prompts_dir: str = ""  # override prompt templates from this folder

    def __post_init__(self) -> None:
        if self.min_batch_size > self.max_batch_size:
            raise ValueError("min_batch_size must be <= max_batch_size")
        for pattern in self.content_policy:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(
                    f"content_policy: {pattern!r} is not a regular expression: {exc}"
                ) from None


class EngineConfig(_Section):
    processing_guarantee: Literal["at_least_once_watermark", "exactly_once"] = (
        "at_least_once_watermark"
    )
    max_wait_s: PositiveFloat = 5.0  # a window closes at the batch size or after this long
    max_windows_in_flight: Positive = 2  # per key
    # True: reflect each trace on arrival and overlap windows. False: the paper's synchronous
    # loop (reflect at window close, one window at a time), kept as a benchmark baseline.
    pipelined: bool = True
    # Traces buffered (read, not yet learned or parked) per partition before it is paused.
    queue_size: Positive = 1000
    # A key with no trace for this long is evicted: its pipeline stops and its playbook leaves
    # memory (its next trace reads its newest version back from the prompts topic).
    key_idle_s: PositiveFloat = 600.0
    # Keys with metric series of their own (the first seen, until evicted); the others are
    # counted under key="(other)", so /metrics stays bounded in the number of keys.
    key_metric_series: Annotated[int, Meta(ge=0)] = 100
    # Per key, a trace id among the last this many handed to it is skipped as a duplicate:
    # producers retry, agents re-send. The last this many learned are kept on the dedup topic
    # (kafka.dedup_topic) and read back with the key's version after a restart, an eviction or
    # a rebalance. Ids are held as 8-byte digests, whatever their length. Memory: about 130
    # bytes per id per active (not evicted) key: 10,000 ids ~ 1.3 MB a key, 1,000 active keys
    # ~ 1.3 GB; an evicted key costs nothing of it. On the topic: a record of about 11 bytes
    # per id per key (107 KB at 10,000), rewritten with every version. Lower it (or
    # engine.key_idle_s) for many keys. At most 90,000: a record must fit the dedup topic's
    # max.message.bytes (DEDUP_RECORD_BYTES, under the broker's default 1 MB).
    dedup_horizon: Annotated[int, Meta(ge=1, le=90_000)] = 10_000
    # While Kafka cannot be written (publish, DLQ) or read (restore), the engine retries with
    # capped backoff and reports not ready; after this many seconds of continuous failure it
    # stops with a non-zero exit, having committed nothing it did not publish. 0 = wait forever.
    broker_deadline_s: Annotated[float, Meta(ge=0)] = 300.0
    # SIGTERM (or stop()) ends the engine within this: open windows are flushed and in-flight
    # ones publish until this less the time kept for closing the Kafka clients (a quarter of
    # it, at most 5 s); what is left unpublished is read again by the next owner.
    shutdown_grace_s: PositiveFloat = 30.0
    # How often the engine checks that its topics still exist (one metadata request): a topic
    # deleted under it (its state, the prompts topic above all) stops it within two checks,
    # instead of retrying for engine.broker_deadline_s against a topic that is gone.
    topic_check_s: PositiveFloat = 2.0
    metrics_host: str = "127.0.0.1"
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 9464  # 0 = no metrics server


class IngestConfig(_Section):
    """``combee-stream ingest otel``: agent telemetry (OpenTelemetry spans, as the Collector's
    Kafka exporter writes them) assembled into traces and re-keyed into the traces topic."""

    spans_topic: str = "otlp_spans"  # the Collector kafka exporter's default
    logs_topic: str = "otlp_logs"  # evaluation results and message events as log records
    # A compacted topic of the trace ids written, in the same transaction: after a crash the
    # spans read again of a trace already written are recognised and not written twice.
    state_topic: str = "combee.ingest.state"
    encoding: Literal["otlp_proto", "otlp_json"] = "otlp_proto"
    group_id: str = "combee-ingest"
    # Whether a trace's spans, logs and feedback reach one partition number (the exporter keyed
    # by trace id: what several instances need). When false, one instance reads every
    # partition, and a trace completes only while this member holds them all (a restarted
    # one waits for the dead member's session to end: a trace split across partitions is
    # never written from part of its spans).
    spans_keyed: bool = False
    # A trace is complete when its root span has ended and no span of it arrived for this long.
    gap_s: PositiveFloat = 5.0
    # A trace with no root span after this long (since its first span) is dead-lettered. Keep
    # it well above kafka.session_timeout_ms: a run's spans may sit on every partition, and a
    # dead member's partitions are reassigned only after its session times out.
    trace_timeout_s: PositiveFloat = 300.0
    # Open traces with spans held at once; past it the spans topic's partitions are paused
    # (the logs and feedback topics are not: the traces waiting need their feedback).
    max_open_traces: Positive = 10_000
    # A trace with more spans than this is dead-lettered (a span flood bounds no memory else).
    max_spans_per_trace: Positive = 2_000
    # An *orphan* is an open trace with no ended root span yet: child spans whose root has not
    # come (or never will: a flood of spans of traces of their own), or a root sent unended.
    # Only a timeout frees one, so orphans are what a flood fills the stage with; when a bound
    # below is hit the stalest orphan (longest without a new span) is shed first: dead-lettered
    # as orphan_shed with the bound in its reason (its root, if it comes, is late_span).
    # Orphans held at once: half of max_open_traces, so orphans alone never pause the stage.
    max_orphan_traces: Positive = 5_000
    # Open traces (with spans) of one service (its first span's resource service.name) held at
    # once: past it the service's stalest orphan is shed, else its newest trace is refused
    # (service_flood). A quarter of max_open_traces and half of max_orphan_traces: one flooding
    # service sheds its own orphans and never reaches the bounds the others share.
    max_open_traces_per_service: Positive = 2_500
    # An orphan with no new span for this long is dead-lettered (no_root, or unended_root):
    # shorter than trace_timeout_s, since a flood's orphans never get another span, while a
    # live run sends a span at each step (a run's exporter sends every few seconds). A run with
    # one step longer than this (a reasoning model's minutes-long call) needs it raised.
    orphan_timeout_s: PositiveFloat = 60.0
    # How long a complete trace waits for feedback that arrives later (every item until then
    # is combined; a FeedbackRecord is final: written at once). 0: written once complete.
    feedback_wait_s: Annotated[float, Meta(ge=0)] = 0.0
    # A trace whose feedback never came: learned without it (ACE learns from the trajectory
    # alone) or dead-lettered.
    learn_without_feedback: bool = True
    # The prompt key: the first of these attributes a span of the trace carries (span, then
    # resource attributes).
    key_attributes: list[str] = field(
        default_factory=lambda: ["combee.prompt.key", "gen_ai.agent.name", "service.name"]
    )
    version_attribute: str = "combee.prompt.version"
    # The agent's session id (PromptClient's `session`, stamped by PromptSpanProcessor): the
    # live canary counts a trace only for the version its session was served.
    session_attribute: str = "combee.session.id"
    # An evaluation's or annotation's label that says the run passed / failed (compared
    # lowercased, spaces and dashes as underscores); any other label leaves `passed` unset.
    pass_labels: list[str] = field(
        default_factory=lambda: [
            "pass",
            "passed",
            "correct",
            "true",
            "yes",
            "success",
            "succeeded",
            "relevant",
            "good",
        ]
    )
    fail_labels: list[str] = field(
        default_factory=lambda: [
            "fail",
            "failed",
            "incorrect",
            "false",
            "no",
            "failure",
            "not_relevant",
            "irrelevant",
            "bad",
            "wrong",
        ]
    )
    # Step contents longer than this are cut (the engine's budgets count the whole trace).
    max_step_chars: Positive = 4_000
    # `ingest otel` alone serves /metrics, /healthz and /readyz here (on engine.metrics_host;
    # 0 = none). `run --ingest otel` puts the ingest metrics on the engine's endpoint instead.
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 9465


class GateConfig(_Section):
    """The publish gate (``combee_stream.core.gate``): what a candidate version must prove
    before agents get it. Off by default (every candidate within its budget is published)."""

    # Replay gate: every candidate is answered, with the agent role, on held-out tasks of its
    # key beside the version it extends, and published only if it is not worse.
    replay: bool = False
    # Keys the gate applies to (shell-style patterns); the others publish ungated.
    keys: list[str] = field(default_factory=lambda: ["*"])
    # The share of traces with a ground truth kept out of learning as held-out tasks, chosen
    # by a keyed hash of the trace id (the same traces on every instance, restart and replay).
    holdout_fraction: Annotated[float, Meta(gt=0, lt=1)] = 0.2
    # The environment variable holding the key of that hash (required with `replay`, at least
    # 16 characters, the same on every instance): without it a producer could mine trace ids
    # that are held out first and fill the test set with its own answers. Engine-side only:
    # agents never need it.
    holdout_secret_env: str = "COMBEE_HOLDOUT_SECRET"
    reservoir_size: Positive = 50  # held-out tasks kept per key (a bottom-k sample by hash)
    # At most this many held-out tasks of one window join the sample (its lowest hashes): a
    # burst of traces, which lands in few windows, moves a bounded part of the test set, and a
    # window is never tested mostly on tasks it brought itself (10 of the default 50).
    holdout_per_window: Positive = 10
    regression_size: Annotated[int, Meta(ge=0)] = 20  # tasks a refused candidate broke, kept
    # Lesson check (evaluation/lessons.py): each new bullet is retried, with the agent role, on
    # up to `lesson_tasks` of the failed tasks it was learned from (those with a reference
    # answer), and left out when it fixes none of those the parent still fails. Before the
    # replay gate when both are on; needs no held-out tasks and no secret.
    check_lessons: bool = False
    lesson_tasks: Positive = 4
    # Below this many held-out tasks the gate cannot judge, and defers: nothing unverified is
    # published, and the window's lessons wait (Holdout.pending, carried with the versions) to
    # be reviewed with the next window's candidate, rather than being thrown away.
    min_samples: Positive = 20
    # Non-inferiority: accept when the lower bound of the paired difference in accuracy
    # (candidate - current) at this one-sided confidence is above -margin (the statistic is in
    # evaluation/replay.py; with 20 tasks, a candidate that changes none passes at 0.1, one that
    # loses one fails).
    margin: Annotated[float, Meta(ge=0, le=1)] = 0.1
    # And never publish a candidate that answered fewer held-out tasks than the version it
    # extends, whatever the bound (which forgives a loss too small for the sample to see).
    no_worse: bool = True
    confidence: Annotated[float, Meta(gt=0.5, lt=1)] = 0.95
    # "agent": the engine answers each task itself through the llm.agent role (a single-call
    # agent), scored against the trace's ground truth with `scorer`. Or "module:function", an
    # async callable (prompt: str, task: HeldOutTask) -> score in [0, 1].
    evaluator: str = "agent"
    # "numeric" forgives 0.005 (and a relative 1e-4): 0.4923 is 0.49 to it. "formula" is ACE's
    # rule for its Formula rows (equal as floats once the commas are dropped): a task that asks
    # for 2 decimal places is wrong unrounded. The gate should score as the agents' own
    # environment does: bench quality gives it the task set's scorer. "judge": an LLM (the
    # llm.judge role) decides whether the answer matches the reference, for answers in words
    # that no string rule can compare.
    scorer: Literal["exact", "numeric", "formula", "contains", "judge"] = "numeric"
    # A trace whose task or ground truth is longer than this is never held out (the reservoir
    # travels with every version).
    max_task_chars: Positive = 2_000
    concurrency: Positive = 4  # evaluation calls in flight per review
    # Live canary: a new version is served as `candidate` to this share of agent sessions
    # (sticky, by a hash of the session id their subscriber is given) while production stays;
    # the traces' own prompt_version and score decide: promoted or refused by a sequential
    # test (engine/release.py). A refused line is reverted: the next version starts from
    # production's playbook.
    canary: bool = False
    canary_fraction: Annotated[float, Meta(gt=0, lt=1)] = 0.1
    # The environment variable holding the key of the canary split (required with `canary`,
    # at least 16 characters): a session's arm is a keyed hash of its id, so a producer without
    # the key cannot pick sessions in the arm it wants to claim. The agents' PromptClient reads
    # the same variable (COMBEE_CANARY_SECRET by default) to serve the candidate; an agent
    # without it is served production.
    canary_secret_env: str = CANARY_SECRET_ENV
    # Automatic rollback: production's live score significantly below the version it
    # replaced moves production back (recorded, with why) and the next version starts from it.
    rollback: bool = False
    # The sequential tests look after every this many new scored traces of the version under
    # test (and need as many of the one it is compared with), at most live_max_looks times; each
    # look tests at (1 - confidence) / live_max_looks, so the whole test errs at most 1 -
    # confidence (Bonferroni). A canary not shown non-inferior by its last look is refused.
    live_min_samples: Positive = 30
    live_max_looks: Positive = 5
    # A live sample is a trace naming a version and a session that was served that version
    # (while a canary runs: the session's arm). Promotion needs this many distinct sessions
    # behind the candidate's samples and behind production's: one session cannot decide.
    live_min_sessions: Positive = 5
    # While a canary runs, the share of scored traces naming the candidate or production that
    # are not samples (forged: the session's arm serves the other version; unattributed: no
    # session) above which the canary is stopped, its scores untrusted (judged once
    # live_min_samples such traces are in). Honest agents give a few at the canary's edges
    # (a task started before it began); a producer guessing arms gives about half.
    live_max_unattributed: Annotated[float, Meta(ge=0, le=1)] = 0.2

    def __post_init__(self) -> None:
        if self.evaluator != "agent" and ":" not in self.evaluator:
            raise ValueError(
                f"evaluator: {self.evaluator!r} is neither 'agent' nor 'module:function'"
            )


class LogConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class Config(_Section):
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    local_llm: LocalLLMConfig = field(default_factory=LocalLLMConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    learning: LearningConfig = field(default_factory=LearningConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    log: LogConfig = field(default_factory=LogConfig)


def _field_path(exc: msgspec.ValidationError) -> tuple[str, str]:
    """Split msgspec's ``reason - at `$.a.b``` into (``a.b``, reason)."""
    text = str(exc)
    if " - at `$" in text:
        reason, _, where = text.rpartition(" - at `$")
        return where.rstrip("`").lstrip(".") or "(root)", reason
    return "(root)", text


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """Apply overrides in place; return {dotted field path: environment variable}."""
    applied: dict[str, str] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"environment {name}: {part} is not a section")
        node[path[-1]] = _parse_env_value(value)
        applied[".".join(path)] = name
    return applied


def _parse_env_value(value: str) -> Any:
    # TOML scalar syntax lets overrides carry ints, floats, bools, arrays and tables;
    # anything that is not valid TOML is taken as a plain string.
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Load ``path`` (or the defaults when None), apply env overrides, validate everything."""
    env = os.environ if env is None else env
    source = str(path) if path else "(defaults)"
    raw: dict[str, Any] = {}
    if path:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{source}: file not found") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    from_env = _apply_env(raw, env)
    try:
        return msgspec.convert(raw, Config, strict=False)
    except msgspec.ValidationError as exc:
        where, reason = _field_path(exc)
        if where in from_env:
            source = f"environment {from_env[where]}"
        raise ConfigError(f"{source}: {where}: {reason}") from None


def secret(env_name: str, env: Mapping[str, str] | None = None) -> str | None:
    """Secrets come only from the environment."""
    value = (os.environ if env is None else env).get(env_name)
    return value or None


MIN_SECRET_CHARS = 16  # a keyed hash whose outputs are published must not be brute-forced


def required_secret(
    env_name: str,
    setting: str,
    env: Mapping[str, str] | None = None,
    *,
    where: str = "on every instance",
) -> str:
    """The secret in ``env_name`` that ``setting`` needs; ConfigError if unset or short."""
    value = secret(env_name, env)
    if value is None or len(value) < MIN_SECRET_CHARS:
        state = "is not set" if value is None else f"has fewer than {MIN_SECRET_CHARS} characters"
        raise ConfigError(
            f"{setting} needs a secret in the environment variable {env_name}, which {state}: "
            f"set it to the same random value {where} (e.g. `python -c 'import secrets; "
            f"print(secrets.token_hex(32))'`)"
        )
    return value


__all__ = [
    "CANARY_SECRET_ENV",
    "BrokerConfig",
    "Config",
    "ConfigError",
    "EmbeddingsConfig",
    "EngineConfig",
    "GateConfig",
    "IngestConfig",
    "KafkaConfig",
    "LLMConfig",
    "LearningConfig",
    "LocalLLMConfig",
    "LogConfig",
    "RoleConfig",
    "load_config",
    "required_secret",
    "secret",
]
