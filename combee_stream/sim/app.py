"""The simulator as a plain ASGI app (no framework): OpenAI-compatible chat completions and
embeddings, plus ``/health``, ``/sim/stats`` and ``/sim/reset``.

All state (stats, how often each request was seen) lives on the ``SimApp`` instance. Handlers
run on one event loop and do not await between reading and updating that state, so no lock is
needed.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any

import anyio
import msgspec

from combee_stream.http import Receive, Scope, Send, read_body, send_json
from combee_stream.sim.embed import DIMENSIONS, embed, to_base64
from combee_stream.sim.faults import HTTP_FAULTS, decide_fault, malformed, schema_violation, unit
from combee_stream.sim.roles import identify_role, respond
from combee_stream.sim.settings import SimSettings, count_tokens
from combee_stream.sim.stats import SimStats

CHAT_MODEL = "sim-llm"
EMBEDDING_MODEL = "sim-embed"
_RESPONSE_FORMATS = frozenset({"text", "json_object", "json_schema"})


class _BadRequest(Exception):
    """A request the simulator cannot understand: answered with an OpenAI-style 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _error(message: str, type_: str, param: str | None = None, code: str | None = None) -> Any:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def _hold(receive: Receive, seconds: float) -> bool:
    """Wait ``seconds``; False if the client disconnected meanwhile (then nobody reads a reply)."""
    if seconds <= 0:
        return True
    with anyio.move_on_after(seconds):
        while (await receive())["type"] != "http.disconnect":
            pass
        return False
    return True


def _parse_object(body: bytes) -> dict[str, Any]:
    try:
        request = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise _BadRequest(f"could not parse the JSON body: {exc}") from exc
    if not isinstance(request, dict):
        raise _BadRequest("the request body must be a JSON object")
    return request


def _request_hash(path: str, request: dict[str, Any]) -> str:
    canonical = msgspec.json.encode(request, order="sorted")
    return hashlib.sha256(path.encode() + b"\n" + canonical).hexdigest()


def _message_text(message: Any) -> tuple[str, str]:
    """(role, text) of one chat message; text parts of a multi-part content are joined."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _BadRequest("each message must be an object with a string 'role'", "messages")
    content = message.get("content")
    if content is None:
        return message["role"], ""
    if isinstance(content, str):
        return message["role"], content
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ]
        return message["role"], "\n".join(texts)
    raise _BadRequest("message content must be a string or a list of parts", "messages")


_PROMPT_CACHE = 8


def _max_tokens(request: dict[str, Any]) -> int | None:
    cap = request.get("max_completion_tokens", request.get("max_tokens"))
    if cap is None:
        return None
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise _BadRequest("'max_tokens' must be a positive integer", "max_tokens")
    return cap


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisection on slice comparisons (C speed)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _check_chat_request(request: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise _BadRequest("'model' is required and must be a string", "model")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("'messages' must be a non-empty list", "messages")
    if request.get("stream"):
        raise _BadRequest("the simulator does not support streaming", "stream")
    if request.get("n", 1) != 1:
        raise _BadRequest("the simulator returns exactly one choice (n=1)", "n")
    response_format = request.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict)
        or response_format.get("type") not in _RESPONSE_FORMATS
    ):
        raise _BadRequest(
            "response_format.type must be one of text, json_object, json_schema", "response_format"
        )
    return model, [_message_text(message) for message in messages]


def _check_embeddings_request(request: dict[str, Any]) -> tuple[str, list[str], int, bool]:
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise _BadRequest("'model' is required and must be a string", "model")
    raw = request.get("input")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise _BadRequest("'input' must be a string or a non-empty list of strings", "input")
    dimensions = request.get("dimensions", DIMENSIONS)
    if not isinstance(dimensions, int) or not 1 <= dimensions <= 4096:
        raise _BadRequest("'dimensions' must be an integer in 1..4096", "dimensions")
    encoding = request.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise _BadRequest("'encoding_format' must be float or base64", "encoding_format")
    return model, texts, dimensions, encoding == "base64"


class SimApp:
    """ASGI app of the simulated LLM. ``stats()`` and ``reset()`` act on this instance only."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self._stats = SimStats()
        self._seen: dict[str, int] = {}
        # The prompts of the last few requests, for a prompt cache: what a server reuses of a
        # new prompt is its longest prefix shared with one it holds (llama-server keeps one
        # per slot; hosted APIs keep prefixes for minutes). A prompt joins it when its reply
        # is sent, as on a real server: requests sent at once share nothing.
        self._cached_prompts: list[str] = []

    def stats(self) -> dict[str, Any]:
        return self._stats.to_dict()

    def reset(self) -> None:
        """Clear stats and per-request attempt counts (a rerun then sees the same faults)."""
        self._stats = SimStats()
        self._seen.clear()
        self._cached_prompts.clear()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # uvicorn runs us with lifespan="off"; nothing else is served
        route = (scope["method"], scope["path"].rstrip("/") or "/")
        key = self.settings.api_key
        if key is not None and route[1].startswith("/v1/"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"").decode()
            if given != f"Bearer {key}":
                message = "Incorrect API key provided (simulated)."
                await send_json(send, 401, _error(message, "invalid_request_error"))
                return
        try:
            match route:
                case ("POST", "/v1/chat/completions"):
                    await self._chat(await read_body(receive), receive, send)
                case ("POST", "/v1/embeddings"):
                    await self._embeddings(await read_body(receive), receive, send)
                case ("GET", "/v1/models"):
                    await send_json(send, 200, self._models(self.settings.models))
                case ("GET", "/health"):
                    await send_json(send, 200, {"status": "ok", "simulated": True})
                case ("GET", "/sim/stats"):
                    await send_json(send, 200, self.stats())
                case ("POST", "/sim/reset"):
                    self.reset()
                    await send_json(send, 200, {"reset": True})
                case _:
                    status = 405 if route[1] in _KNOWN_PATHS else 404
                    text = "unknown route" if status == 404 else "method not allowed"
                    message = f"{text}: {route[0]} {route[1]}"
                    await send_json(send, status, _error(message, "invalid_request_error"))
        except _BadRequest as exc:
            self._stats.bad_requests += 1
            await send_json(send, 400, _error(exc.message, "invalid_request_error", exc.param))

    @staticmethod
    def _models(served: tuple[str, ...] | None) -> Any:
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "combee-sim"}
                for name in (served if served is not None else (CHAT_MODEL, EMBEDDING_MODEL))
            ],
        }

    async def _served(self, send: Send, model: str) -> bool:
        """Whether ``model`` is served; if not, the 404 a real endpoint answers (sent)."""
        served = self.settings.models
        if served is None or model in served:
            return True
        message = f"The model `{model}` does not exist or you do not have access to it."
        await send_json(send, 404, _error(message, "invalid_request_error", code="model_not_found"))
        return False

    def _prompt_cache(self, prompt: str) -> int:
        """Tokens of ``prompt`` served from the cache: its longest prefix shared with one of
        the last ``_PROMPT_CACHE`` prompts processed (whole 4-character tokens)."""
        shared = max((_common_prefix(prompt, held) for held in self._cached_prompts), default=0)
        return shared // 4

    def _processed(self, prompt: str) -> None:
        self._cached_prompts = [prompt, *self._cached_prompts[: _PROMPT_CACHE - 1]]

    def _attempt(self, request_hash: str) -> int:
        attempt = self._seen.get(request_hash, 0)
        self._seen[request_hash] = attempt + 1
        return attempt

    async def _http_fault(self, send: Send, kind: str) -> None:
        if kind == "429":
            retry_after = self.settings.faults.retry_after_s / self.settings.time_scale
            headers = [
                (b"retry-after", str(math.ceil(retry_after)).encode()),
                (b"retry-after-ms", str(round(retry_after * 1000)).encode()),
            ]
            message = "Simulated rate limit reached; retry after the Retry-After delay."
            payload = _error(message, "rate_limit_error", code="rate_limit_exceeded")
            await send_json(send, 429, payload, headers)
        else:
            await send_json(send, 500, _error("Simulated internal server error.", "server_error"))

    async def _chat(self, body: bytes, receive: Receive, send: Send) -> None:
        request = _parse_object(body)
        model, messages = _check_chat_request(request)
        cap = _max_tokens(request)
        if not await self._served(send, model):
            return
        prompt = "\n".join(text for role, text in messages if role == "user")
        role = identify_role(prompt)
        if role is None:
            raise _BadRequest(
                "the simulator cannot tell the role: no user message carries a <trace>, "
                "<reflections>, <partial_updates>, <section_bullets>, <judged_answer>, "
                "<failed_trace> or <question> block",
                "messages",
            )
        settings, stats = self.settings, self._stats
        request_hash = _request_hash("/v1/chat/completions", request)
        attempt = self._attempt(request_hash)
        stats.role(role).requests += 1
        fault = decide_fault(settings.faults, settings.seed, request_hash, attempt)
        if fault is not None:
            stats.fault(role, fault)
        if fault in ("429", "500"):
            await self._http_fault(send, fault)
            return
        system = "\n".join(text for role_, text in messages if role_ == "system")
        if settings.poison and settings.poison in prompt:
            # A request the model can never answer well: a fault of this trace, not an outage.
            fault = "schema_violation"
        content = respond(
            role,
            prompt,
            seed=settings.seed,
            capacity=settings.overload,
            realism=settings.realism,
            system=system,
        )
        if fault == "malformed":
            content = malformed(content)
        elif fault == "schema_violation":
            content = schema_violation(content)
        text, finish = content.decode(), "stop"
        if cap is not None and count_tokens(text) > cap:
            # As a real server does: decoding stops at the cap, mid-JSON.
            text, finish = text[: cap * 4], "length"
        sent = "\n".join(message for _, message in messages)
        tokens_in = count_tokens(sent)
        tokens_out = count_tokens(text)
        tokens_cached = self._prompt_cache(sent)
        delay = (
            settings.latency.seconds(
                tokens_in, tokens_out, unit(settings.seed, "jitter", request_hash, attempt)
            )
            / settings.time_scale
        )
        if fault == "timeout":
            delay += settings.faults.timeout_s
        if not await _hold(receive, delay):
            stats.role(role).disconnected += 1
            return
        self._processed(sent)
        await send_json(
            send,
            200,
            {
                "id": f"chatcmpl-sim-{request_hash[:20]}-{attempt}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "system_fingerprint": "combee-sim",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text, "refusal": None},
                        "finish_reason": finish,
                        "logprobs": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": tokens_in,
                    "completion_tokens": tokens_out,
                    "total_tokens": tokens_in + tokens_out,
                    "prompt_tokens_details": {"cached_tokens": tokens_cached},
                },
            },
        )
        stats.billed(role, tokens_in, tokens_out)
        if fault in (None, "timeout"):
            stats.completed(role, request_hash)

    async def _embeddings(self, body: bytes, receive: Receive, send: Send) -> None:
        request = _parse_object(body)
        model, texts, dimensions, as_base64 = _check_embeddings_request(request)
        if not await self._served(send, model):
            return
        settings, stats, role = self.settings, self._stats, "embeddings"
        request_hash = _request_hash("/v1/embeddings", request)
        attempt = self._attempt(request_hash)
        stats.role(role).requests += 1
        fault = decide_fault(settings.faults, settings.seed, request_hash, attempt)
        if fault not in HTTP_FAULTS:
            fault = None  # content faults do not apply to embeddings
        if fault is not None:
            stats.fault(role, fault)
        if fault in ("429", "500"):
            await self._http_fault(send, fault)
            return
        tokens_in = sum(count_tokens(text) for text in texts)
        delay = (
            settings.latency.seconds(
                tokens_in, 0, unit(settings.seed, "jitter", request_hash, attempt)
            )
            / settings.time_scale
        )
        if fault == "timeout":
            delay += settings.faults.timeout_s
        if not await _hold(receive, delay):
            stats.role(role).disconnected += 1
            return
        data = []
        for index, text in enumerate(texts):
            vector = embed(text, dimensions)
            encoded: Any = to_base64(vector) if as_base64 else vector
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        await send_json(
            send,
            200,
            {
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": tokens_in, "total_tokens": tokens_in},
            },
        )
        stats.billed(role, tokens_in, 0)
        stats.completed(role, request_hash)


_KNOWN_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health", "/sim/stats", "/sim/reset"}
)


__all__ = ["CHAT_MODEL", "EMBEDDING_MODEL", "SimApp"]
