"""The LLM layer end to end over real HTTP against the project's simulator (combee_stream.sim).

Faults are deterministic per (seed, request, attempt), and the simulator serves a request that
already failed ``max_faults_per_request`` times, so every expectation below is exact.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal, cast

import anyio
import httpx2
import msgspec
import pytest
from structlog.testing import capture_logs

from combee_stream.config import EmbeddingsConfig, LLMConfig, RoleConfig
from combee_stream.core.outputs import CuratorOutput, ReflectorOutput
from combee_stream.errors import UserError
from combee_stream.llm import (
    ChatMessage,
    Completion,
    LLMCallError,
    LLMClient,
    MissingEndpointError,
    Role,
)
from combee_stream.llm.memo import CompletionMemo, MemoEntry, endpoint_identity
from combee_stream.llm.structured import (
    bound_schema,
    decode_reply,
    extract_json,
    max_tokens_for,
    output_schema,
    schema_token_bound,
)
from combee_stream.retry import RetryPolicy
from combee_stream.schemas import AddOp
from combee_stream.sim.server import SimServer, sim_server
from combee_stream.sim.settings import FaultModel, LatencyModel, SimSettings

pytestmark = pytest.mark.anyio

FAST = RetryPolicy(base_s=0.01, max_s=0.05)  # keeps backoff out of the test's run time
PRICE_IN, PRICE_OUT = 2.5, 10.0
Mode = Literal["json_schema", "json_object", "text"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # sim_server runs uvicorn, which needs asyncio


def llm_config(base_url: str = "", mode: str = "json_schema", **overrides: Any) -> LLMConfig:
    role = RoleConfig(
        base_url=base_url,
        model="sim-llm",
        mode=cast(Mode, mode),
        price_in=PRICE_IN,
        price_out=PRICE_OUT,
    )
    fields: dict[str, Any] = {
        "reflector": role,
        "curator": role,
        "combiner": role,
        "embeddings": EmbeddingsConfig(base_url=base_url, model="sim-embed"),
        "timeout_s": 5.0,
        "max_attempts": 6,
        **overrides,
    }
    return LLMConfig(**fields)


def reflector_messages(n: int, passed: bool = True) -> list[ChatMessage]:
    trace = (
        f"task: task {n}\noutput: answer {n}\npassed: {str(passed).lower()}\n"
        f"feedback: LESSON[k0-l{n:03d}]: check the units of quantity {n}"
    )
    return [
        {"role": "system", "content": "You are the reflector."},
        {
            "role": "user",
            "content": f"<playbook>\n</playbook>\n<bullets_used>\n</bullets_used>\n"
            f"<trace>\n{trace}\n</trace>",
        },
    ]


def curator_messages(n: int) -> list[ChatMessage]:
    reflections = "\n".join(
        f"[Reflection {i}]\nkey_insight: LESSON[k1-l{n:03d}-{i}]: lesson {i} of batch {n}"
        for i in range(3)
    )
    return [
        {"role": "system", "content": "You are the curator."},
        {
            "role": "user",
            "content": f"<playbook>\n</playbook>\n<reflections>\n{reflections}\n</reflections>",
        },
    ]


def combiner_messages(n: int) -> list[ChatMessage]:
    op = {"type": "ADD", "section": "STRATEGIES & INSIGHTS", "content": f"LESSON[k2-l{n}]: x"}
    return [
        {"role": "system", "content": "You are the combiner."},
        {
            "role": "user",
            "content": f"<playbook>\n</playbook>\n<partial_updates>\n[Update 1]\n"
            f"{json.dumps(op)}\n</partial_updates>",
        },
    ]


@pytest.fixture
async def clean_sim() -> AsyncIterator[SimServer]:
    async with sim_server(SimSettings(), host="127.0.0.1", port=0) as srv:
        yield srv


def role_stats(srv: SimServer, role: str) -> dict[str, Any]:
    stats: dict[str, Any] = srv.stats()["roles"].get(role, {})
    return stats


def contents(output: CuratorOutput) -> list[str]:
    assert all(isinstance(op, AddOp) for op in output.operations)
    return [op.content for op in output.operations if isinstance(op, AddOp)]


class Recorder:
    """An httpx2 client that records each request body the LLM client sends."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.client = httpx2.AsyncClient(event_hooks={"request": [self._record]})

    async def _record(self, request: httpx2.Request) -> None:
        self.bodies.append(json.loads(request.content))


# --------------------------------------------------------------------------- structured output


@pytest.mark.parametrize("mode", ["json_schema", "json_object", "text"])
async def test_valid_structured_reply_in_each_mode(clean_sim: SimServer, mode: str) -> None:
    recorder = Recorder()
    async with (
        recorder.client,
        LLMClient(
            llm_config(clean_sim.base_url, mode), http_client=recorder.client, env={}, retry=FAST
        ) as llm,
    ):
        result = await llm.complete("reflector", reflector_messages(1), ReflectorOutput)

    assert isinstance(result.value, ReflectorOutput)
    assert result.value.key_insight == "LESSON[k0-l001]: check the units of quantity 1"
    assert (result.attempts, result.cached) == (1, False)
    assert result.tokens_in == role_stats(clean_sim, "reflector")["tokens_in"] > 0
    [body] = recorder.bodies
    fmt: dict[str, Any] = body.get("response_format") or {}
    if mode == "json_schema":
        assert fmt["type"] == "json_schema"
        assert fmt["json_schema"]["name"] == "ReflectorOutput"
        assert "key_insight" in fmt["json_schema"]["schema"]["required"]
    elif mode == "json_object":
        assert fmt["type"] == "json_object"
        assert "key_insight" in fmt["schema"]["required"]
    else:
        assert "response_format" not in body
        last = body["messages"][-1]["content"]
        assert last.startswith(reflector_messages(1)[-1]["content"])
        assert "JSON Schema" in last and '"key_insight"' in last


def test_text_mode_parses_fenced_reply_leniently() -> None:
    fenced = 'Here you go:\n```json\n{"a": {"b": "}"}}\n```\nAnything else? {not json}'
    assert json.loads(extract_json(fenced)) == {"a": {"b": "}"}}
    assert json.loads(extract_json('Use {x} style: {"a": 1}')) == {"a": 1}
    assert extract_json('{"a": [1, 2') == '{"a": [1, 2'  # left for validation to reject


# --------------------------------------------------------------------------- invalid replies


@pytest.mark.parametrize("fault", ["malformed", "schema_violation"])
async def test_invalid_replies_are_reasked_then_succeed(fault: str) -> None:
    faults = FaultModel(**{f"rate_{fault}": 1.0}, max_faults_per_request=1)
    recorder = Recorder()
    async with (
        sim_server(SimSettings(faults=faults)) as srv,
        recorder.client,
        LLMClient(llm_config(srv.base_url), http_client=recorder.client, env={}, retry=FAST) as llm,
    ):
        result = await llm.complete("curator", curator_messages(1), CuratorOutput)
        usage = llm.usage()["curator"]
        stats = srv.stats()

    assert contents(result.value) == [
        f"LESSON[k1-l001-{i}]: lesson {i} of batch 1" for i in range(3)
    ]
    assert result.attempts >= 2
    assert usage.invalid_replies == result.attempts - 1 == stats["faults"][fault]
    assert usage.retries == result.attempts - 1
    # The re-ask carries the bad reply and the validation error after the original request.
    reask = recorder.bodies[1]["messages"]
    assert reask[:2] == curator_messages(1)
    assert reask[2]["role"] == "assistant" and reask[2]["content"]
    assert reask[3]["role"] == "user" and "not valid" in reask[3]["content"]
    # Tokens of the invalid replies were paid for, and are accounted.
    assert usage.tokens_in == stats["roles"]["curator"]["tokens_in"] > result.tokens_in // 2


# --------------------------------------------------------------------------- transport retries


async def test_429_with_retry_after_is_retried() -> None:
    faults = FaultModel(rate_429=1.0, retry_after_s=0.05, max_faults_per_request=1)
    async with (
        sim_server(SimSettings(faults=faults)) as srv,
        LLMClient(llm_config(srv.base_url), env={}, retry=FAST) as llm,
    ):
        with capture_logs() as logs:
            result = await llm.complete("reflector", reflector_messages(2), ReflectorOutput)
        stats = srv.stats()

    assert result.attempts == 2
    assert stats["faults"]["429"] == 1 and stats["roles"]["reflector"]["completed"] == 1
    [retry] = [e for e in logs if e["event"] == "llm.retry"]
    assert retry["role"] == "reflector" and retry["attempt"] == 1
    assert retry["retry_after_s"] == pytest.approx(0.05)  # read from the response headers
    assert "429" in retry["reason"]
    assert llm.usage()["reflector"].retries == 1


async def test_500_is_retried() -> None:
    faults = FaultModel(rate_500=1.0, max_faults_per_request=2)
    async with (
        sim_server(SimSettings(faults=faults)) as srv,
        LLMClient(llm_config(srv.base_url), env={}, retry=FAST) as llm,
    ):
        result = await llm.complete("reflector", reflector_messages(3), ReflectorOutput)
        stats = srv.stats()

    assert result.attempts == 3
    assert stats["faults"]["500"] == 2 and stats["roles"]["reflector"]["requests"] == 3
    assert llm.usage()["reflector"].retries == 2


async def test_timeout_is_retried() -> None:
    # The simulator holds the reply far longer than the client's timeout, which gives up first.
    faults = FaultModel(rate_timeout=1.0, timeout_s=30.0, max_faults_per_request=1)
    async with (
        sim_server(SimSettings(faults=faults)) as srv,
        LLMClient(llm_config(srv.base_url, timeout_s=0.3), env={}, retry=FAST) as llm,
    ):
        with capture_logs() as logs:
            result = await llm.complete("reflector", reflector_messages(4), ReflectorOutput)

    assert result.attempts == 2
    assert [e["reason"] for e in logs if e["event"] == "llm.retry"] == ["timeout after 0.3s"]


async def test_gives_up_after_max_attempts_with_reason() -> None:
    faults = FaultModel(rate_500=1.0, max_faults_per_request=100)
    async with (
        sim_server(SimSettings(faults=faults)) as srv,
        LLMClient(llm_config(srv.base_url, max_attempts=3), env={}, retry=FAST) as llm,
    ):
        with pytest.raises(LLMCallError) as caught:
            await llm.complete("curator", curator_messages(2), CuratorOutput)
        stats = srv.stats()

    err = caught.value
    assert (err.role, err.attempts) == ("curator", 3)
    assert "HTTP 500" in err.reason and "HTTP 500" in str(err)
    assert stats["roles"]["curator"]["requests"] == 3
    usage = llm.usage()["curator"]
    assert (usage.calls, usage.failed_calls, usage.retries) == (1, 1, 2)


async def test_client_errors_are_not_retried(clean_sim: SimServer) -> None:
    # No <trace>/<reflections>/<partial_updates> block: the simulator answers 400.
    async with LLMClient(llm_config(clean_sim.base_url), env={}, retry=FAST) as llm:
        with pytest.raises(LLMCallError) as caught:
            await llm.complete("reflector", [{"role": "user", "content": "hi"}], ReflectorOutput)

    assert caught.value.attempts == 1 and "HTTP 400" in caught.value.reason
    assert clean_sim.stats()["bad_requests"] == 1


async def test_invalid_replies_exhaust_attempts() -> None:
    faults = FaultModel(rate_malformed=1.0, max_faults_per_request=100)
    async with (
        sim_server(SimSettings(faults=faults)) as srv,
        LLMClient(llm_config(srv.base_url, max_attempts=2), env={}, retry=FAST) as llm,
    ):
        with pytest.raises(LLMCallError) as caught:
            await llm.complete("reflector", reflector_messages(5), ReflectorOutput)

    assert caught.value.attempts == 2 and caught.value.reason.startswith("invalid reply")
    assert llm.usage()["reflector"].invalid_replies == 2


# --------------------------------------------------------------------------- memo


async def test_memo_makes_identical_call_free(clean_sim: SimServer) -> None:
    async with LLMClient(llm_config(clean_sim.base_url), env={}, retry=FAST) as llm:
        first = await llm.complete("reflector", reflector_messages(6), ReflectorOutput)
        requests = role_stats(clean_sim, "reflector")["requests"]
        second = await llm.complete("reflector", reflector_messages(6), ReflectorOutput)
        # Concurrent identical calls share one in-flight request (single-flight).
        results = []

        async def call() -> None:
            results.append(await llm.complete("reflector", reflector_messages(7), ReflectorOutput))

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(call)
        usage = llm.usage()["reflector"]

    assert requests == 1
    assert second.cached and not first.cached
    assert second.value == first.value
    assert (second.tokens_in, second.tokens_out, second.attempts) == (0, 0, 0)
    assert role_stats(clean_sim, "reflector")["requests"] == 2  # 6 once, 7 once
    assert sorted(r.cached for r in results) == [False, True, True, True, True]
    assert len({msgspec.json.encode(r.value) for r in results}) == 1
    assert (usage.calls, usage.cached_calls) == (7, 5)


async def test_memo_distinguishes_roles_and_settings(clean_sim: SimServer) -> None:
    async with LLMClient(llm_config(clean_sim.base_url), env={}, retry=FAST) as llm:
        await llm.complete("reflector", reflector_messages(8), ReflectorOutput)
    other_mode = llm_config(clean_sim.base_url, mode="json_object")
    async with LLMClient(other_mode, env={}, retry=FAST, memo=llm.memo) as llm2:
        result = await llm2.complete("reflector", reflector_messages(8), ReflectorOutput)
    assert not result.cached
    assert role_stats(clean_sim, "reflector")["requests"] == 2


async def test_memo_survives_restart_with_torn_last_line(
    clean_sim: SimServer, tmp_path: Path
) -> None:
    memo_path = tmp_path / "memo" / "completions.jsonl"
    config = llm_config(clean_sim.base_url, memo_path=str(memo_path))
    async with LLMClient(config, env={}, retry=FAST) as llm:
        before: list[Completion[Any]] = [
            await llm.complete("reflector", reflector_messages(10), ReflectorOutput),
            await llm.complete("curator", curator_messages(10), CuratorOutput),
        ]
    # A crash in the middle of an append leaves half a line behind.
    with memo_path.open("ab") as fh:
        fh.write(b'{"key":"deadbeef","role":"reflector","model":"sim-llm","value":{"reas')
    requests = clean_sim.stats()["roles"]

    async with LLMClient(config, env={}, retry=FAST) as llm:
        after: list[Completion[Any]] = [
            await llm.complete("reflector", reflector_messages(10), ReflectorOutput),
            await llm.complete("curator", curator_messages(10), CuratorOutput),
        ]
        fresh = await llm.complete("reflector", reflector_messages(11), ReflectorOutput)

    assert clean_sim.stats()["roles"]["curator"] == requests["curator"]  # no new request
    assert role_stats(clean_sim, "reflector")["requests"] == 2  # only the fresh call
    assert [a.cached for a in after] == [True, True] and not fresh.cached
    assert [a.value for a in after] == [b.value for b in before]
    # The torn tail was dropped, so the fresh entry landed on a line of its own.
    lines = memo_path.read_bytes().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["key"] for line in lines)
    assert len(CompletionMemo(memo_path)) == 3


async def test_memo_outlives_a_local_server_restarted_on_another_port(tmp_path: Path) -> None:
    # `bench quality --local` starts its model on a free port each run: a resumed run must
    # still find the calls it paid for.
    memo_path = tmp_path / "completions.jsonl"
    async with sim_server(SimSettings(), host="127.0.0.1", port=0) as first:
        config = llm_config(first.base_url, memo_path=str(memo_path))
        async with LLMClient(config, env={}, retry=FAST) as llm:
            before = await llm.complete("reflector", reflector_messages(12), ReflectorOutput)
    async with sim_server(SimSettings(), host="127.0.0.1", port=0) as second:
        assert second.base_url != first.base_url
        config = llm_config(second.base_url, memo_path=str(memo_path))
        async with LLMClient(config, env={}, retry=FAST) as llm:
            after = await llm.complete("reflector", reflector_messages(12), ReflectorOutput)
        assert role_stats(second, "reflector").get("requests", 0) == 0
    assert after.cached and after.value == before.value


def test_memo_keys_keep_the_port_of_a_remote_endpoint() -> None:
    assert endpoint_identity("http://127.0.0.1:33661/v1") == "http://127.0.0.1/v1"
    assert endpoint_identity("http://localhost:8080/v1") == "http://localhost/v1"
    assert endpoint_identity("http://[::1]:9/v1") == "http://[::1]/v1"
    # Elsewhere the port may be all that tells two providers of one model name apart.
    assert endpoint_identity("http://10.0.0.5:8000/v1") == "http://10.0.0.5:8000/v1"
    assert endpoint_identity("https://api.openai.com/v1") == "https://api.openai.com/v1"


# --------------------------------------------------------------------------- faults at scale


async def test_every_call_succeeds_under_20_percent_faults() -> None:
    faults = FaultModel(
        rate_429=0.04,
        retry_after_s=0.05,
        rate_500=0.04,
        rate_timeout=0.04,
        timeout_s=30.0,
        rate_malformed=0.04,
        rate_schema_violation=0.04,
    )
    calls: list[tuple[Role, list[ChatMessage], type[Any]]] = [
        *[
            ("reflector", reflector_messages(i, passed=i % 2 == 0), ReflectorOutput)
            for i in range(40)
        ],
        *[("curator", curator_messages(i), CuratorOutput) for i in range(15)],
        *[("combiner", combiner_messages(i), CuratorOutput) for i in range(10)],
    ]
    async with sim_server(SimSettings(seed=7, faults=faults)) as srv:
        config = llm_config(srv.base_url, timeout_s=0.5, max_attempts=8, concurrency=8)
        async with LLMClient(config, env={}, retry=FAST) as llm:
            results: dict[int, Any] = {}

            async def call(index: int, role: Role, messages: list[ChatMessage], t: type) -> None:
                results[index] = await llm.complete(role, messages, t)

            # Every request twice, concurrently: as a window retried while the first still runs.
            async with anyio.create_task_group() as tg:
                for index, (role, messages, t) in enumerate(calls * 2):
                    tg.start_soon(call, index, role, messages, t)
            # And once more after: a retried window.
            async with anyio.create_task_group() as tg:
                for index, (role, messages, t) in enumerate(calls):
                    tg.start_soon(call, 1000 + index, role, messages, t)
            usage = llm.usage()
        stats = srv.stats()

    assert len(results) == 3 * len(calls)
    assert all(
        isinstance(r.value, t) for (_, _, t), r in zip(calls * 3, _ordered(results), strict=True)
    )
    assert sum(stats["faults"].values()) > 0  # faults did happen
    # No request that finished was completed (paid for) twice.
    assert max(stats["completed_by_request"].values()) == 1
    for role, n in (("reflector", 40), ("curator", 15), ("combiner", 10)):
        u, s = usage[role], stats["roles"][role]
        assert (u.calls, u.cached_calls, u.failed_calls) == (3 * n, 2 * n, 0)
        assert s["completed"] == n
        assert s["requests"] == n + u.retries  # every attempt reached the server
        assert u.invalid_replies == s["faults"]["malformed"] + s["faults"]["schema_violation"]
        assert (u.tokens_in, u.tokens_out) == (s["tokens_in"], s["tokens_out"])
        expected_cost = (u.tokens_in * PRICE_IN + u.tokens_out * PRICE_OUT) / 1e6
        assert u.cost_usd == pytest.approx(expected_cost)


def _ordered(results: dict[int, Any]) -> list[Any]:
    return [results[k] for k in sorted(results)]


# --------------------------------------------------------------------------- endpoints


async def test_missing_endpoint_error_names_what_to_set() -> None:
    async with LLMClient(LLMConfig(), env={}) as llm:
        with pytest.raises(MissingEndpointError) as caught:
            await llm.complete("curator", curator_messages(1), CuratorOutput)
    message = str(caught.value)
    assert isinstance(caught.value, UserError)
    for needed in (
        "OPENAI_BASE_URL",
        "OPENAI_API_KEY",
        "llm.curator.base_url",
        "COMBEE__LLM__CURATOR__BASE_URL",
    ):
        assert needed in message
    # An API key alone is enough (the OpenAI API), as is a base URL alone (a local server).
    LLMClient(LLMConfig(), env={"OPENAI_API_KEY": "sk-test"}).require("reflector", "curator")
    with pytest.raises(MissingEndpointError, match=r"llm\.embeddings\.base_url"):
        LLMClient(LLMConfig(), env={}).require("embeddings")


async def test_openai_base_url_from_env_needs_no_key(clean_sim: SimServer) -> None:
    config = llm_config("")
    async with LLMClient(config, env={"OPENAI_BASE_URL": clean_sim.base_url}, retry=FAST) as llm:
        result = await llm.complete("combiner", combiner_messages(1), CuratorOutput)
    assert contents(result.value) == ["LESSON[k2-l1]: x"]
    assert role_stats(clean_sim, "combiner")["completed"] == 1


# --------------------------------------------------------------------------- embeddings


async def test_embeddings_are_batched_ordered_and_retried() -> None:
    faults = FaultModel(rate_500=0.3, max_faults_per_request=1)
    texts = [f"text number {i % 150}" for i in range(300)]
    async with (
        sim_server(SimSettings(faults=faults)) as srv,
        LLMClient(llm_config(srv.base_url), env={}, retry=FAST) as llm,
    ):
        vectors = await llm.embed(texts)
        assert await llm.embed([]) == []
        stats = srv.stats()["roles"]["embeddings"]
        usage = llm.usage()["embeddings"]

    assert len(vectors) == 300
    assert vectors[7] == vectors[157]  # same text, same vector, whichever batch it was in
    assert vectors[7] != vectors[8]
    assert stats["completed"] == 3  # 300 texts in batches of 128
    assert stats["requests"] == 3 + usage.retries
    assert usage.tokens_in == stats["tokens_in"]


async def test_embeddings_fail_with_a_plain_llm_call_error() -> None:
    faults = FaultModel(rate_500=1.0, max_faults_per_request=100)
    async with (
        sim_server(SimSettings(faults=faults)) as srv,
        LLMClient(llm_config(srv.base_url, max_attempts=2), env={}, retry=FAST) as llm,
    ):
        with pytest.raises(LLMCallError) as caught:
            await llm.embed([f"text {i}" for i in range(200)])
    assert caught.value.role == "embeddings" and caught.value.attempts == 2
    assert llm.usage()["embeddings"].failed_calls >= 1


async def test_rate_limits_on_still_complete_every_call(clean_sim: SimServer) -> None:
    config = llm_config(clean_sim.base_url, requests_per_minute=6000, tokens_per_minute=10**6)
    async with LLMClient(config, env={}, retry=FAST) as llm:
        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(llm.complete, "reflector", reflector_messages(i), ReflectorOutput)
        usage = llm.usage()["reflector"]
    assert (usage.calls, usage.failed_calls) == (20, 0)
    assert role_stats(clean_sim, "reflector")["completed"] == 20


def test_memo_keeps_only_the_newest_entries_when_bounded() -> None:
    memo = CompletionMemo(max_entries=3)
    for i in range(5):
        memo.put(
            MemoEntry(
                key=f"k{i}",
                role="curator",
                model="m",
                value=msgspec.Raw(b"{}"),
                tokens_in=1,
                tokens_out=1,
            )
        )
    assert len(memo) == 3
    assert "k0" not in memo and "k1" not in memo
    assert all(f"k{i}" in memo for i in (2, 3, 4))


def test_replies_with_raw_control_characters_in_strings_are_accepted() -> None:
    raw = '{"operations": [{"type": "ADD", "section": "OTHERS", "content": "one\ntwo"}]}'
    value = decode_reply(raw, CuratorOutput)
    assert value.operations[0].content == "one\ntwo"  # type: ignore[union-attr]
    with pytest.raises(msgspec.DecodeError):
        decode_reply('{"operations": [{"type": "ADD", "sec', CuratorOutput)
    with pytest.raises(msgspec.ValidationError):
        decode_reply('{"operations": 3}', CuratorOutput)


def test_bound_schema_limits_strings_and_lists_but_not_enums() -> None:
    schema = bound_schema(output_schema(CuratorOutput), 64, 2)
    text = json.dumps(schema)
    assert '"maxItems": 2' in text and '"maxLength": 64' in text
    # the op tag ("ADD" / "UPDATE" / "REMOVE") is an enum: left alone
    assert all("maxLength" not in node for node in _walk(schema) if "enum" in node)
    assert bound_schema(output_schema(CuratorOutput), 0, 0) == output_schema(CuratorOutput)


def _walk(node: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        found.append(node)
        for value in node.values():
            found.extend(_walk(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(_walk(value))
    return found


# --------------------------------------------------------------------------- outages (issue 10)


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (401, None, "outage"),  # the key was revoked
        (403, None, "outage"),
        (404, "model_not_found", "outage"),
        (429, "insufficient_quota", "outage"),
        (429, "rate_limit_exceeded", "retry"),
        (500, None, "outage"),
        (503, None, "outage"),
        (408, None, "retry"),
        (400, "context_length_exceeded", "fail"),  # the request itself: this trace only
        (422, None, "fail"),
    ],
)
def test_which_http_errors_are_an_outage(status: int, code: str | None, kind: str) -> None:
    from combee_stream.llm.status import status_kind

    assert status_kind(status, code) == kind


async def test_a_removed_model_waits_in_the_breaker_and_resumes_when_it_is_back() -> None:
    """404 model_not_found fails every call alike: the call waits (its attempts unspent, while
    the probe, a 1-token request for the same model, keeps failing) and completes once the
    model is served again. The model list, which still answers, does not close the breaker."""
    settings = SimSettings(models=("another-model",))
    async with sim_server(settings) as srv:
        cfg = llm_config(srv.base_url, max_attempts=2, breaker_threshold=1)
        async with LLMClient(cfg, env={}, retry=FAST) as llm:
            async with anyio.create_task_group() as tg:
                done: list[Completion[ReflectorOutput]] = []

                async def call() -> None:
                    done.append(
                        await llm.complete("reflector", reflector_messages(1), ReflectorOutput)
                    )

                tg.start_soon(call)
                with anyio.fail_after(30):
                    while not llm.outage:  # noqa: ASYNC110 - a flag the client sets
                        await anyio.sleep(0.01)
                await anyio.sleep(2.5)  # probes at 1 s backoff: several fail meanwhile
                assert llm.outage and not done
                srv.app.settings = SimSettings()  # the model is served again
    assert len(done) == 1 and not llm.outage


async def test_an_embeddings_call_waits_out_an_outage_like_a_chat_call() -> None:
    """One retry loop for every call kind: an embeddings batch whose model is gone waits in
    its breaker with its attempts unspent (two attempts would fail it at once otherwise) and
    completes once the model is served again."""
    settings = SimSettings(models=("sim-llm",))  # the embedding model removed
    async with sim_server(settings) as srv:
        cfg = llm_config(srv.base_url, max_attempts=2, breaker_threshold=1)
        async with LLMClient(cfg, env={}, retry=FAST) as llm:
            async with anyio.create_task_group() as tg:
                done: list[list[list[float]]] = []

                async def call() -> None:
                    done.append(await llm.embed(["check the units", "cite the ledger"]))

                tg.start_soon(call)
                with anyio.fail_after(30):
                    while not llm.outage:  # noqa: ASYNC110 - a flag the client sets
                        await anyio.sleep(0.01)
                await anyio.sleep(2.5)  # probes at 1 s backoff: several fail meanwhile
                assert llm.outage and not done
                srv.app.settings = SimSettings()  # the model is served again
    assert len(done) == 1 and len(done[0]) == 2 and not llm.outage
    usage = llm.usage()["embeddings"]
    assert usage.calls == 1 and usage.failed_calls == 0


async def test_a_huge_call_timing_out_while_others_succeed_does_not_open_the_breaker() -> None:
    """A call that times out while other calls of the endpoint are answered is that trace's
    problem (a huge prompt): it spends its attempts and fails; the breaker stays closed, so
    the other keys' calls (and the engine's intake) are not paused for it."""
    latency = LatencyModel(per_input_token_s=1e-4)  # 50k tokens: 5 s; a small call: ~10 ms
    async with sim_server(SimSettings(latency=latency)) as srv:
        cfg = llm_config(srv.base_url, timeout_s=1.0, max_attempts=2, breaker_threshold=2)
        async with LLMClient(cfg, env={}, retry=FAST) as llm:
            huge_failed: list[LLMCallError] = []
            small_done = 0
            stop = anyio.Event()

            async def huge(n: int) -> None:
                messages = reflector_messages(1000 + n)
                messages[-1]["content"] += "\n" + "padding " * 25_000
                try:
                    await llm.complete("reflector", messages, ReflectorOutput)
                except LLMCallError as exc:
                    huge_failed.append(exc)

            async def small(worker: int) -> None:
                nonlocal small_done
                n = 0
                while not stop.is_set():
                    n += 1
                    await llm.complete(
                        "reflector", reflector_messages(worker * 10_000 + n), ReflectorOutput
                    )
                    small_done += 1

            async with anyio.create_task_group() as tg:
                for worker in range(3):
                    tg.start_soon(small, worker)
                async with anyio.create_task_group() as huge_tg:
                    for n in range(6):
                        huge_tg.start_soon(huge, n)
                stop.set()
    assert len(huge_failed) == 6 and all("timeout" in e.reason for e in huge_failed)
    assert small_done > 0
    assert all(b.opened_at == 0.0 for b in llm._transport.breakers.values()), (
        "the breaker never opened"
    )


async def test_the_start_check_refuses_a_base_url_at_the_wrong_path(clean_sim: SimServer) -> None:
    """A reachable host at the wrong path (no /v1) answers 404 for /models: not taken for a
    server without a model list, since the chat request answers 404 too."""
    async with LLMClient(llm_config(clean_sim.root_url), env={}, retry=FAST) as llm:
        with pytest.raises(UserError) as caught:
            await llm.check("reflector")
    message = str(caught.value)
    assert "answers HTTP 404 for /models and for /chat/completions" in message
    assert "check llm.reflector.base_url" in message and "\n" not in message
    async with LLMClient(llm_config(clean_sim.base_url), env={}, retry=FAST) as llm:
        await llm.check("reflector", "embeddings")  # the right path passes


# --------------------------------------------------------------------------- length and cache


async def test_a_cut_reply_is_reasked_once_with_twice_the_cap(clean_sim: SimServer) -> None:
    async with LLMClient(llm_config(clean_sim.base_url), env={}, retry=FAST) as llm:
        full = await llm.complete("curator", curator_messages(7), CuratorOutput)
    # A cap the simulator's reply overflows, and that twice over it does not.
    cap = full.tokens_out * 2 // 3
    recorder = Recorder()
    role = RoleConfig(base_url=clean_sim.base_url, model="sim-llm", max_tokens=cap)
    async with (
        recorder.client,
        LLMClient(
            llm_config(clean_sim.base_url, curator=role),
            http_client=recorder.client,
            env={},
            retry=FAST,
        ) as llm,
    ):
        result = await llm.complete("curator", curator_messages(7), CuratorOutput)
        usage = llm.usage()["curator"]

    assert result.value == full.value
    assert [body["max_tokens"] for body in recorder.bodies] == [cap, 2 * cap]
    assert (usage.truncated_replies, usage.invalid_replies) == (1, 0)


async def test_a_reply_cut_twice_fails_the_call_and_no_request_is_sent_twice(
    clean_sim: SimServer,
) -> None:
    recorder = Recorder()
    role = RoleConfig(base_url=clean_sim.base_url, model="sim-llm", max_tokens=5)
    async with (
        recorder.client,
        LLMClient(
            llm_config(clean_sim.base_url, curator=role),
            http_client=recorder.client,
            env={},
            retry=FAST,
        ) as llm,
    ):
        with pytest.raises(LLMCallError) as caught:
            await llm.complete("curator", curator_messages(8), CuratorOutput)
        # The window is retried later: the same call goes out warmer, with another seed.
        with pytest.raises(LLMCallError):
            await llm.complete("curator", curator_messages(8), CuratorOutput)

    assert "reply cut at max_tokens=10" in caught.value.reason
    sent = [json.dumps(body, sort_keys=True) for body in recorder.bodies]
    assert len(sent) == 4 and len(set(sent)) == 4
    first, again = recorder.bodies[0], recorder.bodies[2]
    assert "seed" not in first and again["seed"] == 1
    assert again["temperature"] > first["temperature"]


def test_max_tokens_is_derived_from_the_bounded_schema() -> None:
    schema = bound_schema(output_schema(CuratorOutput), 300, 6)
    derived = max_tokens_for(RoleConfig(), schema)
    # Six operations of 300 characters at one token a character (a digit is a token).
    assert 6 * 300 < derived < 2 * 6 * 300
    assert max_tokens_for(RoleConfig(max_tokens=77), schema) == 77
    assert schema_token_bound(output_schema(CuratorOutput)) is None  # unbounded strings
    # No cap at all then: a fixed one would cut a hosted model's legitimately long reply.
    assert max_tokens_for(RoleConfig(), output_schema(CuratorOutput)) is None


async def test_cached_prompt_tokens_are_counted_from_the_simulator(clean_sim: SimServer) -> None:
    async with LLMClient(llm_config(clean_sim.base_url), env={}, retry=FAST) as llm:
        first = await llm.complete("curator", curator_messages(9), CuratorOutput)
        second = await llm.complete("curator", curator_messages(10), CuratorOutput)
        usage = llm.usage()["curator"]

    # The two prompts share their system message and the head of the user message.
    assert first.tokens_cached == 0 < second.tokens_cached < second.tokens_in
    assert usage.tokens_cached == second.tokens_cached


def _chat_reply(usage_extra: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    content = json.dumps({"operations": []})
    return {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105} | usage_extra,
        **extra,
    }


@pytest.mark.parametrize(
    ("usage_extra", "extra", "cached"),
    [
        ({"prompt_tokens_details": {"cached_tokens": 64}}, {}, 64),  # OpenAI
        ({}, {"timings": {"cache_n": 80, "prompt_n": 20}}, 80),  # llama-server
        ({}, {}, 0),  # a server that says nothing
    ],
)
async def test_cache_counters_are_read_from_openai_and_llama_server_replies(
    usage_extra: dict[str, Any], extra: dict[str, Any], cached: int
) -> None:
    # A canned HTTP reply: what is tested is the parse of two wire formats.
    def reply(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, json=_chat_reply(usage_extra, extra))

    client = httpx2.AsyncClient(transport=httpx2.MockTransport(reply))
    async with (
        client,
        LLMClient(
            llm_config("http://llm.invalid/v1"), http_client=client, env={}, retry=FAST
        ) as llm,
    ):
        result = await llm.complete("curator", curator_messages(11), CuratorOutput)
    assert result.tokens_cached == cached
