"""The LLM layer: typed, rate-limited, retried, memoized calls to OpenAI-compatible endpoints.

``LLMClient.complete(role, messages, OutputType)`` sends one chat request with the role's model
and endpoint, asks for JSON matching ``msgspec.json.schema(OutputType)`` (per role ``mode``),
validates the reply with msgspec and re-asks the model with its own bad reply and the error when
it does not validate. Transport failures (429, 5xx, timeouts, connection errors) are retried
with exponential backoff and full jitter; all attempts share one ``max_attempts`` budget. A
failure every call would meet alike is an outage (see ``status_kind``): the endpoint's circuit
breaker (``llm.breaker``) makes callers wait for it instead of failing.
Every finished call is stored in a ``CompletionMemo``, so the same request is never paid twice.

A reply cut at ``max_tokens`` (``finish_reason`` "length") is its own outcome: it is not
re-asked as an invalid reply with the same cap (that would only be cut again), but sent once more
with twice the cap; a second cut fails the call. ``max_tokens`` 0 (the default) is derived from
the schema's bounds (:func:`schema_token_bound`), so a bounded role's worst case always fits.
A request that failed for good and is asked again (a retried window) is sent at a higher
temperature and another seed: identical requests would only fail identically.
"""

from __future__ import annotations

import email.utils
import json
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Generic, Literal, NoReturn, Self, TypeVar, cast

import anyio
import httpx2
import msgspec
import openai
from openai.types.chat import ChatCompletionMessageParam

from combee_stream.config import EmbeddingsConfig, LLMConfig, RoleConfig
from combee_stream.errors import CombeeError, UserError
from combee_stream.llm.breaker import Breaker
from combee_stream.llm.memo import CompletionMemo, MemoEntry, request_key
from combee_stream.logs import get_logger
from combee_stream.retry import RetryPolicy
from combee_stream.tokens import estimate_tokens

log = get_logger(__name__)

T = TypeVar("T")
R = TypeVar("R")

Role = Literal["reflector", "curator", "combiner", "agent", "judge"]
ROLES: Final[tuple[Role, ...]] = ("reflector", "curator", "combiner", "agent", "judge")
EMBEDDINGS: Final = "embeddings"  # the usage() entry for embedding calls
ChatMessage = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}

OPENAI_DEFAULT_BASE_URL: Final = "https://api.openai.com/v1"
# Local servers (llama.cpp, vLLM, Ollama) accept any key, but the openai client wants one.
PLACEHOLDER_API_KEY: Final = "not-needed"
EMBED_BATCH: Final = 128
PROBE_TEXT: Final = "ping"  # the breaker's probe: a 1-token request for the same model

StatusKind = Literal["outage", "retry", "fail"]


def status_kind(status: int, code: str | None) -> StatusKind:
    """What an HTTP error answer means for a call (OpenAI's statuses and error codes, which
    compatible servers follow):

    ======================  ======================================  =========================
    status (code)           means                                   kind
    ======================  ======================================  =========================
    401, 403                the key was revoked or is not allowed   outage
    404                     the model was removed, or a wrong path  outage
    429 insufficient_quota  the quota or the billing is exhausted   outage
    429 (other codes)       a rate limit (Retry-After is honoured)  retry
    408, 409                a timeout or a conflict on the server   retry
    5xx                     the server is failing                   outage
    other 4xx               the request itself (400 context too     fail (this call only)
                            long, 413, 422)
    ======================  ======================================  =========================

    An outage fails every trace alike: the breaker opens, callers wait (their attempts
    unspent), the engine pauses intake and probes until it is fixed. Failing this call only
    parks the trace (after its attempts) while the others go on."""
    if status in (401, 403, 404) or status >= 500:
        return "outage"
    if status == 429:
        return "outage" if code == "insufficient_quota" else "retry"
    if status in (408, 409):
        return "retry"
    return "fail"


# --------------------------------------------------------------------------- public types


class Completion(msgspec.Struct, Generic[T], frozen=True, kw_only=True):
    """A validated reply. Tokens are what *this* call paid: 0 when served from the memo."""

    value: T
    tokens_in: int
    tokens_out: int
    cached: bool  # served from the memo (no request)
    tokens_cached: int = 0  # of tokens_in, served from the server's prompt cache
    attempts: int  # HTTP requests made by this call (0 when cached)
    latency_s: float


class RoleUsage(msgspec.Struct, kw_only=True):
    """Per role accounting. ``calls`` counts complete() calls; cached and failed are subsets."""

    calls: int = 0
    cached_calls: int = 0
    failed_calls: int = 0
    retries: int = 0  # attempts beyond the first, for any reason
    invalid_replies: int = 0  # replies that did not validate against the schema
    truncated_replies: int = 0  # replies cut at max_tokens (finish_reason "length")
    tokens_in: int = 0
    # Prompt tokens the server served from its prompt cache (usage.prompt_tokens_details.
    # cached_tokens, which OpenAI and llama-server fill): a subset of tokens_in.
    tokens_cached: int = 0
    tokens_out: int = 0
    cost_usd: float = 0.0
    latency_s: float = 0.0  # summed wall time of the calls, waits included


class LLMCallError(CombeeError):
    """An LLM call failed for good: attempts exhausted, or a non-retryable HTTP error."""

    def __init__(self, role: str, reason: str, attempts: int) -> None:
        super().__init__(f"LLM call for role {role!r} failed after {attempts} attempt(s): {reason}")
        self.role = role
        self.reason = reason
        self.attempts = attempts


class MissingEndpointError(UserError):
    """No base URL and no API key for a role: nothing to call."""

    def __init__(self, section: str, api_key_env: str) -> None:
        env_path = "COMBEE__" + section.upper().replace(".", "__") + "__BASE_URL"
        key_hint = (
            "OPENAI_API_KEY"
            if api_key_env == "OPENAI_API_KEY"
            else f"{api_key_env} (named by {section}.api_key_env)"
        )
        super().__init__(
            f"no LLM endpoint for {section}: set {section}.base_url in the config file "
            f"(or the environment variable {env_path}), or OPENAI_BASE_URL for every role, "
            f"to use an OpenAI-compatible server; or set {key_hint} to use the OpenAI API."
        )
        self.section = section


# --------------------------------------------------------------------------- internals


class _Endpoint(msgspec.Struct, frozen=True):
    base_url: str
    api_key: str


# Added to a role's temperature each time the very same request failed for good before.
RETRY_WARMING: Final = 0.3
_MAX_FAILED_KEYS: Final = 10_000


class _Sampling(msgspec.Struct, frozen=True):
    temperature: float
    seed: int | None
    max_tokens: int


class _Reply(msgspec.Struct, frozen=True):
    text: str
    finish_reason: str
    tokens_in: int
    tokens_out: int
    tokens_cached: int


class _Sent(msgspec.Struct):
    """A validated value and what every attempt of its call paid."""

    value: Any
    tokens_in: int
    tokens_out: int
    tokens_cached: int
    attempts: int


class _Transient(Exception):
    """A failure worth retrying; ``retry_after`` is the server's hint in seconds, if any;
    ``outage``: the endpoint did not answer, or answered what every call would get (see
    ``status_kind``): the circuit breaker counts it."""

    def __init__(self, reason: str, retry_after: float | None = None, outage: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.outage = outage


class _Fatal(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _InvalidReply(Exception):
    pass


class _RateLimiter:
    """Requests- and tokens-per-minute token buckets plus a shared Retry-After barrier.

    Callers queue on a fair lock, so admission is FIFO. A 429 with Retry-After moves the barrier
    and every caller, queued or arriving later, waits until that moment.
    """

    def __init__(self, requests_per_minute: int, tokens_per_minute: int) -> None:
        self._rpm = float(requests_per_minute)
        self._tpm = float(tokens_per_minute)
        self._requests = self._rpm
        self._tokens = self._tpm
        self._stamp: float | None = None  # set on first use: the clock needs a running loop
        self._blocked_until = 0.0
        self._lock = anyio.Lock()

    def block_until(self, moment: float) -> None:
        self._blocked_until = max(self._blocked_until, moment)

    def settle(self, estimated: int, actual: int) -> None:
        """Correct a reservation with the tokens the server reported (may go into debt)."""
        if self._tpm:
            self._refill()
            self._tokens = min(self._tpm, self._tokens + estimated - actual)

    async def acquire(self, tokens: int) -> None:
        async with self._lock:
            while True:
                now = anyio.current_time()
                if now < self._blocked_until:
                    await anyio.sleep(self._blocked_until - now)
                    continue
                self._refill()
                # A request larger than the whole bucket is admitted when the bucket is full.
                need_tokens = min(float(tokens), self._tpm)
                wait = 0.0
                if self._rpm and self._requests < 1:
                    wait = max(wait, (1 - self._requests) * 60.0 / self._rpm)
                if self._tpm and self._tokens < need_tokens:
                    wait = max(wait, (need_tokens - self._tokens) * 60.0 / self._tpm)
                if wait <= 0:
                    if self._rpm:
                        self._requests -= 1
                    if self._tpm:
                        self._tokens -= need_tokens
                    return
                await anyio.sleep(wait)

    def _refill(self) -> None:
        now = anyio.current_time()
        elapsed = 0.0 if self._stamp is None else now - self._stamp
        self._stamp = now
        if self._rpm:
            self._requests = min(self._rpm, self._requests + elapsed * self._rpm / 60.0)
        if self._tpm:
            self._tokens = min(self._tpm, self._tokens + elapsed * self._tpm / 60.0)


def _retry_after(response: httpx2.Response) -> float | None:
    """Seconds from ``retry-after-ms`` / ``retry-after`` (delta seconds or an HTTP date)."""
    headers = response.headers
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            return max(0.0, float(raw_ms) / 1000.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


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
_DEFAULT_MAX_TOKENS: Final = 2048  # an unbounded schema's cap


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


def max_tokens_for(rc: RoleConfig, schema: dict[str, Any]) -> int:
    """The cap a role's request gets: its ``max_tokens`` when set, else the worst case of its
    (bounded) schema, else a default for unbounded schemas."""
    if rc.max_tokens:
        return rc.max_tokens
    bound = schema_token_bound(schema)
    return bound if bound is not None else _DEFAULT_MAX_TOKENS


def _cached_tokens(response: object, usage: object) -> int | None:
    """Prompt tokens the server served from its cache: OpenAI's (and newer llama-server's)
    ``usage.prompt_tokens_details.cached_tokens``, else llama-server's own ``timings.cache_n``
    (an extra field the SDK keeps)."""
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None)
    if isinstance(cached, int):
        return cached
    timings = (getattr(response, "model_extra", None) or {}).get("timings")
    cached = timings.get("cache_n") if isinstance(timings, dict) else None
    return cached if isinstance(cached, int) else None


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


def _schema_instruction(schema: dict[str, Any]) -> str:
    return (
        "\n\nReply with only one JSON object, no prose and no code fences, that matches this "
        "JSON Schema:\n" + msgspec.json.encode(schema).decode()
    )


def _reask(error: str) -> str:
    return (
        f"Your previous reply was not valid: {error}\n"
        "Reply again with only the corrected JSON object that matches the required schema."
    )


# --------------------------------------------------------------------------- client


class LLMClient:
    """One client for all roles; safe to share between concurrent tasks of one event loop."""

    def __init__(
        self,
        config: LLMConfig,
        *,
        http_client: httpx2.AsyncClient | None = None,
        env: Mapping[str, str] | None = None,
        memo: CompletionMemo | None = None,
        retry: RetryPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self._env: Mapping[str, str] = os.environ if env is None else env
        self._http_client = http_client
        self._owns_memo = memo is None
        self._memo = (
            memo
            if memo is not None
            else CompletionMemo(config.memo_path or None, max_entries=config.memo_max_entries)
        )
        self._retry = retry or RetryPolicy()
        self._rng = rng or random.Random()
        self._limiter = anyio.CapacityLimiter(config.concurrency)
        # One per endpoint client and model (a removed model is an outage of its calls only),
        # with the probe that finds it back.
        self._breakers: dict[tuple[object, str], Breaker] = {}
        self._probes: dict[Breaker, Callable[[], Awaitable[object]]] = {}
        self._rate = _RateLimiter(config.requests_per_minute, config.tokens_per_minute)
        self._clients: dict[_Endpoint, openai.AsyncOpenAI] = {}
        self._usage: dict[str, RoleUsage] = {role: RoleUsage() for role in ROLES}
        self._schemas: dict[type[Any], dict[str, Any]] = {}  # msgspec's schema costs ~0.3 ms
        self._failed: dict[str, int] = {}  # request key -> times it failed for good
        self._closed = False

    # ---------------------------------------------------------------- endpoints

    def _breaker(self, client: openai.AsyncOpenAI, model: str, embeddings: bool = False) -> Breaker:
        breaker = self._breakers.get((client, model))
        if breaker is None:
            breaker = self._breakers[client, model] = Breaker(self._config.breaker_threshold)
            timeout = self._config.timeout_s

            # A tiny request for the same model with the same key: what every call needs. (The
            # model list would not do: it answers while a removed model's calls all fail.)
            async def probe() -> object:
                if embeddings:
                    return await client.embeddings.create(
                        model=model, input=[PROBE_TEXT], timeout=timeout
                    )
                return await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": PROBE_TEXT}],
                    max_tokens=1,
                    timeout=timeout,
                )

            self._probes[breaker] = probe
        return breaker

    @property
    def outage(self) -> bool:
        """Whether an endpoint of this client is down (its circuit breaker is open)."""
        return any(b.open for b in self._breakers.values())

    async def probe(self) -> None:
        """Probe each endpoint whose breaker is open, at its next probe slot: an answer that is
        not an outage failure closes it. Callers waiting in the breaker probe it themselves;
        this is for when none is left. The engine calls it while intake is paused for an
        outage: once the calls that saw the endpoint down are gone (cancelled with a revoked
        partition, or all timed out at once in a process frozen and thawed), nothing else would
        ever find out that it is back."""
        for breaker in list(self._breakers.values()):
            if breaker.open and await breaker.admit():
                await self._probe(breaker)

    async def _probe(self, breaker: Breaker) -> None:
        """Send the breaker's probe (this caller holds its probe slot) and report the outcome.
        A probe, not the caller's own request: a huge request that times out would keep the
        breaker open however healthy the endpoint is."""
        started = anyio.current_time()
        try:
            await self._send_once(self._probes[breaker], 1)
        except _Transient as exc:
            if exc.outage:
                breaker.failed(exc.reason, since=started)
                return
        except _Fatal:
            pass  # an answer: the endpoint is up (a server may refuse max_tokens=1, say)
        except BaseException:
            breaker.abandoned()
            raise
        breaker.answered()

    @property
    def memo(self) -> CompletionMemo:
        return self._memo

    def require(self, *roles: Role | Literal["embeddings"]) -> None:
        """Fail fast (MissingEndpointError) if any of ``roles`` has no endpoint."""
        for role in roles:
            if role == EMBEDDINGS:
                self._endpoint(self._config.embeddings, "llm.embeddings")
            else:
                self._endpoint(self._role_config(role), f"llm.{role}")

    async def check(self, *roles: Role | Literal["embeddings"]) -> None:
        """Before any real work: every endpoint of ``roles`` answers, accepts its key and
        serves its model. Raises UserError with one line naming the setting to fix (a mistyped
        base_url or an unset key variable would otherwise fail every trace, one by one)."""
        self.require(*roles)
        listed: dict[_Endpoint, set[str] | None] = {}
        for role in dict.fromkeys(roles):
            rc: RoleConfig | EmbeddingsConfig = (
                self._config.embeddings if role == EMBEDDINGS else self._role_config(role)
            )
            section = f"llm.{role}"
            endpoint = self._endpoint(rc, section)
            if endpoint not in listed:
                listed[endpoint] = await self._served_models(endpoint, section, rc)
            served = listed[endpoint]
            if served is not None and rc.model not in served:
                raise UserError(
                    f"model {rc.model!r} is not served at {endpoint.base_url} (it serves: "
                    f"{', '.join(sorted(served)) or 'nothing'}): set {section}.model"
                )

    async def _served_models(
        self, endpoint: _Endpoint, section: str, rc: RoleConfig | EmbeddingsConfig
    ) -> set[str] | None:
        """The model ids the endpoint lists; None when it does not list models but answers a
        request of the role's kind (some servers have no /models; llama.cpp's older builds,
        say). A host that answers neither (a base_url without its /v1: 404; a web page) is a
        UserError naming the setting, not a failure of every trace later."""
        client = self._client(endpoint)
        try:
            with anyio.fail_after(min(30.0, self._config.timeout_s)):
                raw = await client.models.with_raw_response.list()
        except (TimeoutError, openai.APIConnectionError) as exc:
            raise self._unreachable(endpoint, section, exc) from None
        except (openai.AuthenticationError, openai.PermissionDeniedError) as exc:
            raise self._refused(endpoint, section, rc, exc.status_code) from None
        except openai.APIStatusError:
            pass  # no model listing here: the request below tells whether the API is
        else:
            served = _model_ids(raw.http_response)
            if served is not None:
                return served
        await self._check_answers(client, endpoint, section, rc)
        return None

    async def _check_answers(
        self,
        client: openai.AsyncOpenAI,
        endpoint: _Endpoint,
        section: str,
        rc: RoleConfig | EmbeddingsConfig,
    ) -> None:
        """A 1-token request of the role's own kind answers as an OpenAI-compatible API."""
        embeddings = isinstance(rc, EmbeddingsConfig)
        path = "/embeddings" if embeddings else "/chat/completions"
        try:
            with anyio.fail_after(min(30.0, self._config.timeout_s)):
                if embeddings:
                    raw: Any = await client.embeddings.with_raw_response.create(
                        model=rc.model, input=[PROBE_TEXT]
                    )
                else:
                    raw = await client.chat.completions.with_raw_response.create(
                        model=rc.model,
                        messages=[{"role": "user", "content": PROBE_TEXT}],
                        max_tokens=1,
                    )
        except (TimeoutError, openai.APIConnectionError) as exc:
            raise self._unreachable(endpoint, section, exc) from None
        except (openai.AuthenticationError, openai.PermissionDeniedError) as exc:
            raise self._refused(endpoint, section, rc, exc.status_code) from None
        except openai.APIStatusError as exc:
            if exc.status_code == 404:
                raise UserError(
                    f"the LLM endpoint at {endpoint.base_url} answers HTTP 404 for /models and "
                    f"for {path} (model {rc.model!r}): check {section}.base_url (an "
                    f"OpenAI-compatible API's usually ends in /v1) and {section}.model"
                ) from None
            return  # an answer about the request (a 400 for max_tokens=1, say): the API is there
        if _json_body(raw.http_response) is None:
            raise UserError(
                f"the LLM endpoint at {endpoint.base_url} does not answer as an "
                f"OpenAI-compatible API (no JSON from /models or {path}): check {section}.base_url"
            )

    @staticmethod
    def _unreachable(endpoint: _Endpoint, section: str, exc: BaseException) -> UserError:
        return UserError(
            f"cannot reach the LLM endpoint at {endpoint.base_url} ({type(exc).__name__}): "
            f"check {section}.base_url"
        )

    def _refused(
        self, endpoint: _Endpoint, section: str, rc: RoleConfig | EmbeddingsConfig, status: int
    ) -> UserError:
        key_env = rc.api_key_env
        unset = "" if self._env.get(key_env) else " (it is not set)"
        return UserError(
            f"the LLM endpoint at {endpoint.base_url} refused the API key (HTTP {status}): "
            f"check the variable {key_env}{unset}, named by {section}.api_key_env"
        )

    def _role_config(self, role: Role) -> RoleConfig:
        if role not in ROLES:
            raise ValueError(f"unknown LLM role {role!r} (expected one of {', '.join(ROLES)})")
        rc: RoleConfig = getattr(self._config, role)
        return rc

    def _endpoint(self, rc: RoleConfig | EmbeddingsConfig, section: str) -> _Endpoint:
        base_url = rc.base_url or self._env.get("OPENAI_BASE_URL", "")
        api_key = self._env.get(rc.api_key_env, "")
        if not base_url and not api_key:
            raise MissingEndpointError(section, rc.api_key_env)
        return _Endpoint(
            base_url=(base_url or OPENAI_DEFAULT_BASE_URL).rstrip("/"),
            api_key=api_key or PLACEHOLDER_API_KEY,
        )

    def _client(self, endpoint: _Endpoint) -> openai.AsyncOpenAI:
        if self._closed:
            raise RuntimeError("LLMClient is closed")
        client = self._clients.get(endpoint)
        if client is None:
            client = openai.AsyncOpenAI(
                base_url=endpoint.base_url,
                api_key=endpoint.api_key,
                max_retries=0,  # retries, backoff and Retry-After are handled here
                timeout=self._config.timeout_s,
                http_client=self._http_client,
            )
            self._clients[endpoint] = client
        return client

    # ---------------------------------------------------------------- chat

    async def complete(
        self, role: Role, messages: list[ChatMessage], output_type: type[T]
    ) -> Completion[T]:
        """One structured call; raises LLMCallError when it cannot get a valid reply."""
        rc = self._role_config(role)
        endpoint = self._endpoint(rc, f"llm.{role}")
        schema = self._schemas.get(output_type)
        if schema is None:
            schema = self._schemas[output_type] = output_schema(output_type)
        if rc.max_string_chars or rc.max_list_items:
            schema = bound_schema(schema, rc.max_string_chars, rc.max_list_items)
        key = request_key(
            {
                "role": role,
                "model": rc.model,
                "base_url": endpoint.base_url,
                "temperature": rc.temperature,
                "max_tokens": rc.max_tokens,
                "mode": rc.mode,
                "messages": messages,
                "schema": schema,
            }
        )
        usage = self._usage[role]
        started = anyio.current_time()
        attempts = 0
        cached_tokens = 0
        # A request that already failed for good in this client (a retried window) is varied:
        # the same request would only fail the same way (temperature 0 is deterministic).
        retry = self._failed.get(key, 0)

        async def compute() -> MemoEntry:
            nonlocal attempts, cached_tokens
            sent = await self._call_until_valid(
                role, rc, endpoint, messages, output_type, schema, retry=retry
            )
            attempts, cached_tokens = sent.attempts, sent.tokens_cached
            return MemoEntry(
                key=key,
                role=role,
                model=rc.model,
                value=msgspec.Raw(msgspec.json.encode(sent.value)),
                tokens_in=sent.tokens_in,
                tokens_out=sent.tokens_out,
            )

        try:
            entry, hit = await self._memo.get_or_compute(key, compute)
        except LLMCallError:
            self._failed[key] = retry + 1
            if len(self._failed) > _MAX_FAILED_KEYS:  # parked for good: forget the oldest
                del self._failed[next(iter(self._failed))]
            usage.calls += 1
            usage.failed_calls += 1
            usage.latency_s += anyio.current_time() - started
            raise
        self._failed.pop(key, None)
        latency = anyio.current_time() - started
        usage.calls += 1
        usage.latency_s += latency
        if hit:
            usage.cached_calls += 1
        value = msgspec.json.decode(entry.value, type=output_type)
        return Completion(
            value=value,
            tokens_in=0 if hit else entry.tokens_in,
            tokens_out=0 if hit else entry.tokens_out,
            cached=hit,
            tokens_cached=0 if hit else cached_tokens,
            attempts=0 if hit else attempts,
            latency_s=latency,
        )

    async def _call_until_valid(
        self,
        role: Role,
        rc: RoleConfig,
        endpoint: _Endpoint,
        messages: list[ChatMessage],
        output_type: type[T],
        schema: dict[str, Any],
        *,
        retry: int = 0,
    ) -> _Sent:
        """Attempts until a reply validates. ``retry``: how often this very request already
        failed for good (it is then sent warmer and with another seed)."""
        request = list(messages)
        response_format: dict[str, Any] | None = None
        if rc.mode == "json_schema":
            response_format = {
                "type": "json_schema",
                "json_schema": {"name": output_type.__name__, "schema": schema},
            }
        elif rc.mode == "json_object":
            # llama.cpp rejects json_schema but constrains json_object by this extra "schema".
            response_format = {"type": "json_object", "schema": schema}
        else:
            request = _with_instruction(request, _schema_instruction(schema))
        sampling = _Sampling(
            temperature=min(1.0, rc.temperature + RETRY_WARMING * retry),
            seed=retry or None,
            max_tokens=max_tokens_for(rc, schema),
        )
        conversation = request
        usage = self._usage[role]
        client = self._client(endpoint)
        spent = _Sent(value=None, tokens_in=0, tokens_out=0, tokens_cached=0, attempts=0)
        reason = ""
        attempt = 0
        widened = False
        while attempt < self._config.max_attempts:
            attempt += 1
            if attempt > 1:
                usage.retries += 1
            try:
                reply = await self._send_chat(client, rc, conversation, response_format, sampling)
            except _Transient as exc:
                reason = exc.reason
                if exc.outage and self._breaker(client, rc.model).open:
                    attempt -= 1  # an outage spends no attempt: the call waits it out
                elif attempt < self._config.max_attempts:
                    await self._backoff(role, attempt, exc)
                continue
            except _Fatal as exc:
                self._fail(role, exc.reason, attempt)
            spent.tokens_in += reply.tokens_in
            spent.tokens_out += reply.tokens_out
            spent.tokens_cached += reply.tokens_cached
            usage.tokens_in += reply.tokens_in
            usage.tokens_out += reply.tokens_out
            usage.tokens_cached += reply.tokens_cached
            usage.cost_usd += (
                reply.tokens_in * rc.price_in + reply.tokens_out * rc.price_out
            ) / 1e6
            if reply.finish_reason == "length":
                # Cut at the cap: the same request would be cut again. Once more with twice
                # the room; a reply that does not fit that either fails the call.
                usage.truncated_replies += 1
                log.warning(
                    "llm.reply_cut", role=role, attempt=attempt, max_tokens=sampling.max_tokens
                )
                reason = f"reply cut at max_tokens={sampling.max_tokens}"
                if widened:
                    break
                widened = True
                sampling = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens * 2)
                continue
            try:
                text = extract_json(reply.text) if rc.mode == "text" else reply.text
                value = decode_reply(text, output_type)
            except (_InvalidReply, msgspec.DecodeError) as exc:
                usage.invalid_replies += 1
                reason = f"invalid reply: {exc}"
                log.warning("llm.invalid_reply", role=role, attempt=attempt, error=str(exc)[:300])
                # Keep only the latest bad reply so the conversation does not grow per attempt.
                conversation = [
                    *request,
                    {"role": "assistant", "content": reply.text},
                    {"role": "user", "content": _reask(str(exc))},
                ]
                continue
            return _Sent(
                value=value,
                tokens_in=spent.tokens_in,
                tokens_out=spent.tokens_out,
                tokens_cached=spent.tokens_cached,
                attempts=attempt,
            )
        self._fail(role, reason, attempt)

    def _fail(self, role: str, reason: str, attempts: int) -> NoReturn:
        log.error("llm.call_failed", role=role, attempts=attempts, reason=reason)
        raise LLMCallError(role, reason, attempts)

    async def _send_chat(
        self,
        client: openai.AsyncOpenAI,
        rc: RoleConfig,
        conversation: list[ChatMessage],
        response_format: dict[str, Any] | None,
        sampling: _Sampling,
    ) -> _Reply:
        """One HTTP request and what it returned."""
        estimate = estimate_tokens("".join(m.get("content", "") for m in conversation))
        extra_body = {"response_format": response_format} if response_format else None

        async def send() -> Any:
            return await client.chat.completions.create(
                model=rc.model,
                messages=cast("list[ChatCompletionMessageParam]", conversation),
                temperature=sampling.temperature,
                max_tokens=sampling.max_tokens,
                seed=sampling.seed if sampling.seed is not None else openai.omit,
                extra_body=extra_body,
                timeout=self._config.timeout_s,
            )

        response = await self._send(send, estimate, self._breaker(client, rc.model))
        usage = getattr(response, "usage", None)
        choices = getattr(response, "choices", None) or []
        message = getattr(choices[0], "message", None) if choices else None
        finish = getattr(choices[0], "finish_reason", None) if choices else None
        reply = getattr(message, "content", None)
        if not isinstance(reply, str):
            reply = ""
        tokens_in = getattr(usage, "prompt_tokens", None)
        tokens_out = getattr(usage, "completion_tokens", None)
        tokens_in = tokens_in if isinstance(tokens_in, int) else estimate
        tokens_out = tokens_out if isinstance(tokens_out, int) else estimate_tokens(reply)
        cached = _cached_tokens(response, usage)
        self._rate.settle(estimate, tokens_in + tokens_out)
        return _Reply(
            text=reply,
            finish_reason=finish if isinstance(finish, str) else "",
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            tokens_cached=min(cached, tokens_in) if isinstance(cached, int) else 0,
        )

    async def _send(self, send: Callable[[], Awaitable[R]], estimate: int, breaker: Breaker) -> R:
        """Run one request under the endpoint's circuit breaker, the concurrency and rate
        limits; classify its failure."""
        while await breaker.admit():  # waits while the endpoint is down (not holding a slot)
            await self._probe(breaker)  # this caller's turn to probe it
        started = anyio.current_time()
        try:
            result = await self._send_once(send, estimate)
        except _Transient as exc:
            if exc.outage:
                breaker.failed(exc.reason, since=started)
            else:
                breaker.answered()
            raise
        except _Fatal:
            breaker.answered()
            raise
        breaker.answered()
        return result

    async def _send_once(self, send: Callable[[], Awaitable[R]], estimate: int) -> R:
        async with self._limiter:
            await self._rate.acquire(estimate)
            try:
                # The openai timeout bounds each socket phase; this bounds the whole request.
                with anyio.fail_after(self._config.timeout_s):
                    return await send()
            except TimeoutError:
                raise _Transient(
                    f"timeout after {self._config.timeout_s:g}s", outage=True
                ) from None
            except openai.APITimeoutError:
                raise _Transient(
                    f"timeout after {self._config.timeout_s:g}s", outage=True
                ) from None
            except openai.APIConnectionError as exc:
                raise _Transient(f"connection error: {exc}", outage=True) from None
            except openai.APIStatusError as exc:
                self._rate.settle(estimate, 0)
                status = exc.status_code
                detail = f"HTTP {status}: {_short(exc.message)}"
                kind = status_kind(status, exc.code)
                if kind == "fail":
                    raise _Fatal(detail) from None
                retry_after = _retry_after(exc.response)
                if retry_after is not None:
                    self._rate.block_until(anyio.current_time() + retry_after)
                raise _Transient(detail, retry_after, outage=kind == "outage") from None
            except openai.APIError as exc:
                # e.g. a 200 whose body is not JSON: the server misbehaved, try again.
                raise _Transient(f"bad response: {_short(str(exc))}") from None

    async def _backoff(self, role: str, attempt: int, exc: _Transient) -> None:
        delay = self._retry.delay(attempt, self._rng)
        log.warning(
            "llm.retry",
            role=role,
            attempt=attempt,
            reason=exc.reason,
            retry_after_s=exc.retry_after,
            backoff_s=round(delay, 3),
        )
        # A Retry-After moment is enforced by the rate limiter for every caller; the jitter
        # spreads the retries that were all released at that moment.
        await anyio.sleep(delay)

    # ---------------------------------------------------------------- embeddings

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Embed ``texts`` in batches of EMBED_BATCH (concurrently, within the limits)."""
        if not texts:
            return []
        ec = self._config.embeddings
        client = self._client(self._endpoint(ec, "llm.embeddings"))
        batches = [list(texts[i : i + EMBED_BATCH]) for i in range(0, len(texts), EMBED_BATCH)]
        results: list[list[list[float]]] = [[] for _ in batches]
        usage = self._usage.setdefault(EMBEDDINGS, RoleUsage())
        started = anyio.current_time()

        failure: LLMCallError | None = None

        async def run(index: int, batch: list[str]) -> None:
            nonlocal failure
            try:
                results[index] = await self._embed_batch(client, ec, batch, usage)
            except LLMCallError as exc:
                # Raise the plain error (not an ExceptionGroup) and stop the other batches.
                failure = failure or exc
                tg.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                for index, batch in enumerate(batches):
                    tg.start_soon(run, index, batch)
        finally:
            usage.latency_s += anyio.current_time() - started
        if failure is not None:
            raise failure
        return [vector for batch in results for vector in batch]

    async def _embed_batch(
        self,
        client: openai.AsyncOpenAI,
        ec: EmbeddingsConfig,
        batch: list[str],
        usage: RoleUsage,
    ) -> list[list[float]]:
        estimate = estimate_tokens("".join(batch))

        async def send() -> Any:
            return await client.embeddings.create(
                model=ec.model, input=batch, timeout=self._config.timeout_s
            )

        usage.calls += 1
        breaker = self._breaker(client, ec.model, embeddings=True)
        reason = ""
        attempt = 0
        while attempt < self._config.max_attempts:
            attempt += 1
            if attempt > 1:
                usage.retries += 1
            try:
                response = await self._send(send, estimate, breaker)
            except _Transient as exc:
                reason = exc.reason
                if exc.outage and breaker.open:
                    attempt -= 1  # an outage spends no attempt: the call waits it out
                elif attempt < self._config.max_attempts:
                    await self._backoff(EMBEDDINGS, attempt, exc)
                continue
            except _Fatal as exc:
                usage.failed_calls += 1
                self._fail(EMBEDDINGS, exc.reason, attempt)
            tokens = getattr(getattr(response, "usage", None), "prompt_tokens", None)
            tokens = tokens if isinstance(tokens, int) else estimate
            self._rate.settle(estimate, tokens)
            usage.tokens_in += tokens
            data = sorted(response.data, key=lambda item: item.index)
            if len(data) != len(batch):
                reason = f"invalid reply: {len(data)} embeddings for {len(batch)} inputs"
                usage.invalid_replies += 1
                continue
            return [list(item.embedding) for item in data]
        usage.failed_calls += 1
        self._fail(EMBEDDINGS, reason, self._config.max_attempts)

    # ---------------------------------------------------------------- accounting, lifecycle

    def usage(self) -> dict[str, RoleUsage]:
        """A snapshot per role (plus ``embeddings`` once used); safe to keep and serialize."""
        return {name: msgspec.structs.replace(u) for name, u in self._usage.items()}

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        # A caller-provided http_client belongs to the caller: closing an AsyncOpenAI closes it.
        if self._http_client is None:
            for client in clients:
                await client.close()
        if self._owns_memo:
            self._memo.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


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


def _with_instruction(messages: list[ChatMessage], instruction: str) -> list[ChatMessage]:
    """Append ``instruction`` to the last user message (or add one if there is none)."""
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") == "user":
            message["content"] = message.get("content", "") + instruction
            return out
    out.append({"role": "user", "content": instruction.lstrip()})
    return out


def _json_body(response: httpx2.Response) -> object | None:
    try:
        body: object = response.json()
    except ValueError:
        return None
    return body


def _model_ids(response: httpx2.Response) -> set[str] | None:
    """The ids of an OpenAI model list; None when the answer is not one (a web page)."""
    body = _json_body(response)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    return {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


__all__ = [
    "EMBEDDINGS",
    "ROLES",
    "ChatMessage",
    "Completion",
    "LLMCallError",
    "LLMClient",
    "MissingEndpointError",
    "Role",
    "RoleUsage",
    "bound_schema",
    "decode_reply",
    "extract_json",
    "output_schema",
]
