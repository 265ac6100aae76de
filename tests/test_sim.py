"""The simulator over real HTTP (uvicorn on 127.0.0.1) with the openai client, plus its CLI.

Faults are drawn deterministically from (seed, request, attempt), so each count below is fixed
for the seed; the binomial bands only check that the configured rate is what comes out.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import openai
import pytest

from combee_stream.cli import build_parser
from combee_stream.cli import main as cli_main
from combee_stream.core.outputs import CuratorOutput, ReflectorOutput
from combee_stream.schemas import (
    AddOp,
    Bullet,
    Feedback,
    Playbook,
    RemoveOp,
    Section,
    Trace,
    UpdateOp,
    decode,
    encode,
)
from combee_stream.sim import (
    IN_PROCESS_BASE_URL,
    FaultModel,
    LatencyModel,
    SimServer,
    SimSettings,
    count_tokens,
    generate_traces,
    score,
    sim_app,
    sim_http_client,
    sim_server,
    sim_server_blocking,
)
from combee_stream.sim.cli import settings_from_args
from combee_stream.sim.embed import cosine
from combee_stream.sim.markers import Lesson, find_lessons
from combee_stream.sim.roles import CURATOR_SECTION

pytestmark = pytest.mark.anyio
SCHEMA_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "out", "schema": msgspec.json.schema(ReflectorOutput)},
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn needs asyncio


@pytest.fixture
async def srv() -> AsyncIterator[SimServer]:
    async with sim_server(SimSettings(seed=7), host="127.0.0.1", port=0) as server:
        yield server


def client(server: SimServer, timeout: float = 30.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.base_url, api_key="sim", max_retries=0, timeout=timeout
    )


def reflector_prompt(lessons: list[str], passed: bool, bullets: list[str] = []) -> str:  # noqa: B006
    used = "".join(f"[{b}] some advice\n" for b in bullets)
    feedback = "\n".join(f"LESSON[{lesson}]: text of {lesson}" for lesson in lessons)
    return (
        "<playbook>\n</playbook>\n"
        f"<bullets_used>\n{used}</bullets_used>\n"
        f"<trace>\ntask: add numbers\noutput: 42\npassed: {str(passed).lower()}\n"
        f"feedback: checked\n{feedback}\n</trace>"
    )


def curator_prompt(lessons: list[str], playbook_lessons: list[str] = []) -> str:  # noqa: B006
    bullets = "".join(
        f"[s-{i}] helpful=0 harmful=0 :: LESSON[{lesson}]: known\n"
        for i, lesson in enumerate(playbook_lessons)
    )
    reflections = "".join(
        f"[Reflection {i}]\nroot_cause: x\nkey_insight: LESSON[{lesson}]: text of {lesson}\n"
        for i, lesson in enumerate(lessons)
    )
    return (
        f"<playbook>\n## STRATEGIES & INSIGHTS\n{bullets}</playbook>\n"
        f"<reflections>\n{reflections}</reflections>"
    )


async def chat(llm: openai.AsyncOpenAI, prompt: str, **kwargs: Any) -> str:
    reply = await llm.chat.completions.create(
        model="sim-llm",
        messages=[
            {"role": "system", "content": "You are a role."},
            {"role": "user", "content": prompt},
        ],
        **kwargs,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    return reply.choices[0].message.content or ""


# --------------------------------------------------------------------------- roles


@pytest.mark.parametrize("passed", [True, False])
async def test_reflector_extracts_every_marker_and_tags_cited_bullets(
    srv: SimServer, passed: bool
) -> None:
    prompt = reflector_prompt(["k0-l001", "k0-l002"], passed, bullets=["s-3", "s-9"])
    async with client(srv) as llm:
        reply = await chat(llm, prompt, response_format=SCHEMA_FORMAT)
    out = msgspec.json.decode(reply, type=ReflectorOutput)
    assert out.key_insight.splitlines() == [
        "LESSON[k0-l001]: text of k0-l001",
        "LESSON[k0-l002]: text of k0-l002",
    ]
    tag = "helpful" if passed else "harmful"
    assert [(t.bullet_id, t.tag) for t in out.bullet_tags] == [("s-3", tag), ("s-9", tag)]
    assert srv.stats()["roles"]["reflector"]["completed"] == 1


async def test_curator_adds_distinct_new_lessons_and_skips_known_ones(srv: SimServer) -> None:
    prompt = curator_prompt(
        ["k0-l001", "k0-l002", "k0-l001", "k0-l003", "k0-l010"], playbook_lessons=["k0-l003"]
    )
    async with client(srv) as llm:
        reply = await chat(llm, prompt, response_format={"type": "json_object"})
    out = msgspec.json.decode(reply, type=CuratorOutput)
    # k0-l001 once (first occurrence), k0-l003 already known; k0-l010 is not k0-l001 or k0-l01*.
    assert out.operations == [
        AddOp(section=CURATOR_SECTION, content=f"LESSON[{lesson}]: text of {lesson}")
        for lesson in ("k0-l001", "k0-l002", "k0-l010")
    ]


@pytest.mark.parametrize(("capacity", "n"), [(3, 2), (3, 3), (3, 4), (3, 10), (5, 12), (4, 40)])
async def test_overloaded_curator_keeps_c_squared_over_n(capacity: int, n: int) -> None:
    seed = 11
    lessons = [f"k1-l{i:03d}" for i in range(n)]
    async with (
        sim_server(SimSettings(seed=seed, overload=capacity)) as server,
        client(server) as llm,
    ):
        out = msgspec.json.decode(await chat(llm, curator_prompt(lessons)), type=CuratorOutput)
    keep = n if n <= capacity else max(1, capacity * capacity // n)
    by_rank = sorted(lessons, key=lambda x: hashlib.sha256(f"{seed}:{x}".encode()).digest())
    expected = [lesson for lesson in lessons if lesson in set(by_rank[:keep])]
    assert [op.content.split("]")[0] + "]" for op in out.operations if isinstance(op, AddOp)] == [
        f"LESSON[{lesson}]" for lesson in expected
    ]


async def test_combiner_unions_partial_updates_without_exact_duplicates(srv: SimServer) -> None:
    a = AddOp(section="S", content="LESSON[k0-l001]: a")
    b = UpdateOp(bullet_id="s-1", content="better")
    c = RemoveOp(bullet_id="s-2")
    d = AddOp(section="S", content="LESSON[k0-l002]: d")
    lines = [
        "[Update 1]",
        encode(a).decode(),
        encode(b).decode(),
        "[Update 2]",
        encode(c).decode(),
        encode(a).decode(),  # exact duplicate of the first operation
        encode(d).decode(),
        '{"type": "NOPE"}',  # not an operation: skipped
    ]
    prompt = (
        "<playbook>\n</playbook>\n<partial_updates>\n" + "\n".join(lines) + "\n</partial_updates>"
    )
    async with client(srv) as llm:
        out = msgspec.json.decode(await chat(llm, prompt), type=CuratorOutput)
    assert out.operations == [a, b, c, d]
    assert set(srv.stats()["roles"]) == {"combiner"}


async def test_request_without_a_role_block_gets_an_openai_style_400(srv: SimServer) -> None:
    async with client(srv) as llm:
        with pytest.raises(openai.BadRequestError) as excinfo:
            await chat(llm, "Hello, who are you?")
        with pytest.raises(openai.BadRequestError):
            await chat(llm, reflector_prompt([], True), response_format={"type": "yaml"})
    body = excinfo.value.response.json()
    assert body["error"]["type"] == "invalid_request_error"
    assert "role" in body["error"]["message"]
    assert srv.stats()["bad_requests"] == 2 and srv.stats()["roles"] == {}


async def test_in_process_client_speaks_to_the_same_app() -> None:
    app = sim_app(SimSettings())
    async with sim_http_client(app) as http:
        llm = openai.AsyncOpenAI(
            base_url=IN_PROCESS_BASE_URL, api_key="sim", http_client=http, max_retries=0
        )
        out = msgspec.json.decode(
            await chat(llm, reflector_prompt(["k2-l005"], True)), type=ReflectorOutput
        )
    assert out.key_insight == "LESSON[k2-l005]: text of k2-l005"
    assert app.stats()["roles"]["reflector"]["completed"] == 1


# --------------------------------------------------------------------------- faults


def binomial_band(n: int, p: float, z: float = 4.0) -> tuple[float, float]:
    """n*p ± z standard deviations: a correct rate falls outside with probability < 1e-4."""
    sd = math.sqrt(n * p * (1 - p))
    return n * p - z * sd, n * p + z * sd


async def outcome(llm: openai.AsyncOpenAI, prompt: str) -> str:
    """What the client saw: an HTTP fault, a timeout, a bad reply, or a valid answer."""
    try:
        content = await chat(llm, prompt)
    except openai.RateLimitError as exc:
        assert float(exc.response.headers["retry-after-ms"]) >= 0
        return "429"
    except openai.InternalServerError:
        return "500"
    except openai.APITimeoutError:
        return "timeout"
    try:
        data = json.loads(content)
    except ValueError:
        return "malformed"
    try:
        msgspec.convert(data, ReflectorOutput)
    except msgspec.ValidationError:
        return "schema_violation"
    return "ok"


async def outcomes(llm: openai.AsyncOpenAI, prompts: list[str]) -> list[str]:
    results = [""] * len(prompts)
    limiter = anyio.CapacityLimiter(100)

    async def one(i: int) -> None:
        async with limiter:
            results[i] = await outcome(llm, prompts[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


def distinct_prompts(n: int) -> list[str]:
    return [reflector_prompt([f"k0-l{i:04d}"], i % 2 == 0) for i in range(n)]


async def test_each_fault_kind_occurs_at_its_rate_over_distinct_requests() -> None:
    n, rate = 500, 0.15
    faults = FaultModel(
        rate_429=rate,
        rate_500=rate,
        rate_timeout=rate,
        rate_malformed=rate,
        rate_schema_violation=rate,
        timeout_s=60.0,  # held far past the client's timeout: the client gives up first
    )
    async with (
        sim_server(SimSettings(seed=3, faults=faults)) as server,
        client(server, timeout=3.0) as llm,
    ):
        seen = Counter(await outcomes(llm, distinct_prompts(n)))
        # The server notices each abandoned (timed-out) call once the client's close reaches it.
        with anyio.fail_after(30):
            while server.stats()["roles"]["reflector"]["disconnected"] < seen["timeout"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        stats = server.stats()
    for kind in ("429", "500", "timeout", "malformed", "schema_violation"):
        low, high = binomial_band(n, rate)
        assert low <= stats["faults"][kind] <= high, (kind, stats["faults"])
        assert seen[kind] == stats["faults"][kind], (kind, seen, stats["faults"])
    low, high = binomial_band(n, 1 - 5 * rate)
    assert low <= seen["ok"] <= high
    reflector = stats["roles"]["reflector"]
    assert reflector["requests"] == n
    assert reflector["completed"] == seen["ok"] == sum(stats["completed_by_request"].values())
    assert reflector["disconnected"] == seen["timeout"]


async def test_faults_are_deterministic_for_a_seed_and_differ_across_seeds() -> None:
    faults = FaultModel(rate_429=0.2, rate_500=0.2, rate_malformed=0.1, rate_schema_violation=0.1)
    prompts = distinct_prompts(120)
    runs = []
    for seed in (5, 5, 6):
        async with (
            sim_server(SimSettings(seed=seed, faults=faults)) as server,
            client(server) as llm,
        ):
            runs.append(await outcomes(llm, prompts))
            server.reset()  # a reset server starts the same requests over at attempt 0
            assert await outcomes(llm, prompts) == runs[-1]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert set(runs[0]) == {"ok", "429", "500", "malformed", "schema_violation"}


async def test_retried_requests_eventually_succeed_and_completions_are_counted() -> None:
    faults = FaultModel(rate_429=0.3, rate_500=0.4, rate_malformed=0.2, max_faults_per_request=3)
    prompts = distinct_prompts(30)
    async with sim_server(SimSettings(seed=1, faults=faults)) as server, client(server) as llm:
        attempts = []
        for prompt in prompts:
            tries = 1
            while await outcome(llm, prompt) != "ok":
                tries += 1
            attempts.append(tries)
        assert max(attempts) <= 4 and max(attempts) > 1  # at most 3 faults, then an answer
        stats = server.stats()
        assert sorted(stats["completed_by_request"].values()) == [1] * len(prompts)
        assert stats["roles"]["reflector"]["requests"] == sum(attempts)
        # Paying for a finished call again shows up as a count of 2 for that request.
        assert await outcome(llm, prompts[0]) == "ok"
        assert sorted(server.stats()["completed_by_request"].values()) == [1] * 29 + [2]


# --------------------------------------------------------------------------- embeddings


async def test_embeddings_are_deterministic_and_near_duplicates_are_close(srv: SimServer) -> None:
    texts = [
        "Always check the units of a quantity before adding numbers.",
        "Always check the units of a quantity before adding numbers.",
        "Always check the units of quantities before adding the numbers!",
        "The refund window for premium customers is sixty days.",
    ]
    async with client(srv) as llm:
        default = await llm.embeddings.create(model="sim-embed", input=texts)  # base64 on wire
        floats = await llm.embeddings.create(
            model="sim-embed", input=texts, encoding_format="float"
        )
    vectors = [list(item.embedding) for item in default.data]
    assert [len(v) for v in vectors] == [256] * 4
    for got, want in zip(vectors, (item.embedding for item in floats.data), strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    assert cosine(vectors[0], vectors[1]) == pytest.approx(1.0)
    near, unrelated = cosine(vectors[0], vectors[2]), cosine(vectors[0], vectors[3])
    assert near > 0.5 > unrelated
    assert default.usage.prompt_tokens == sum(math.ceil(len(t) / 4) for t in texts)


# --------------------------------------------------------------------------- traces and score


def test_generated_traces_are_valid_deterministic_and_cover_every_lesson() -> None:
    traces = generate_traces(50, keys=3, lessons=7, seed=4)
    assert [encode(t) for t in traces] == [encode(t) for t in generate_traces(50, 3, 7, seed=4)]
    assert [encode(t) for t in traces] != [encode(t) for t in generate_traces(50, 3, 7, seed=5)]
    lessons = set()
    for trace in traces:
        assert decode(encode(trace), Trace) == trace  # strict decode: a valid record
        text = trace.feedback.text or ""
        markers = [line for line in text.splitlines() if line.startswith("LESSON[")]
        assert len(markers) == 1 and not trace.bullet_ids
        lesson_id = markers[0][len("LESSON[") :].split("]")[0]
        assert lesson_id.startswith(trace.key.removeprefix("sim-") + "-l")
        lessons.add((trace.key, lesson_id))
    assert lessons == {(f"sim-k{k}", f"k{k}-l{i:03d}") for k in range(3) for i in range(7)}
    assert {t.feedback.passed for t in traces} == {True, False}
    with pytest.raises(ValueError, match="cannot cover"):
        generate_traces(20, keys=3, lessons=7)


def test_sim_traces_cli_writes_the_generated_jsonl(tmp_path: Path) -> None:
    out = tmp_path / "traces.jsonl"
    assert cli_main(["sim", "traces", "--n", "12", "--keys", "2", "--lessons", "3",
                     "--seed", "9", "--out", str(out)]) == 0  # fmt: skip
    expected = b"".join(encode(t) + b"\n" for t in generate_traces(12, 2, 3, seed=9))
    assert out.read_bytes() == expected


def _trace(key: str, n: int, lesson: str) -> Trace:
    return Trace(
        key=key, trace_id=f"t{n}", task="t", feedback=Feedback(text=f"ok\nLESSON[{lesson}]: x")
    )


def test_score_counts_distinct_lessons_retained_per_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traces = [
        _trace("sim-k0", 1, "k0-l000"),
        _trace("sim-k0", 2, "k0-l001"),
        _trace("sim-k0", 3, "k0-l000"),  # same lesson again: counted once
        _trace("sim-k0", 4, "k0-l002"),
        _trace("sim-k1", 5, "k1-l000"),
        _trace("sim-k1", 6, "k1-l001"),
    ]
    bullets = [
        Bullet(id="s-1", content="LESSON[k0-l000]: x"),
        Bullet(id="s-2", content="merged: LESSON[k0-l002] and more"),
        Bullet(id="s-3", content="LESSON[k1-l000]: belongs to another key"),
        Bullet(id="s-4", content="LESSON[k0-l0011]: not k0-l001"),
    ]
    playbooks = {
        "sim-k0": Playbook(key="sim-k0", sections=[Section(name="S", bullets=bullets)]),
        "sim-k1": Playbook(key="sim-k1", sections=[Section(name="S", bullets=[bullets[3]])]),
    }
    result = score(traces, playbooks)
    assert (result.lessons_total, result.lessons_retained) == (5, 2)
    assert (result.by_key["sim-k1"].lessons_total, result.by_key["sim-k1"].lessons_retained) == (
        2,
        0,
    )

    (tmp_path / "traces.jsonl").write_bytes(b"".join(encode(t) + b"\n" for t in traces))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "playbook.json").write_bytes(encode(playbooks))
    argv = ["sim", "score", "--traces", str(tmp_path / "traces.jsonl"), "--playbook", str(out_dir)]
    assert cli_main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["lessons_total"], printed["lessons_retained"]) == (5, 2)
    assert cli_main([*argv, "--key", "sim-k0"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["lessons_total"], printed["lessons_retained"]) == (3, 2)


def test_llm_server_flags_build_the_settings() -> None:
    args = build_parser().parse_args(
        ["sim", "llm-server", "--port", "0", "--seed", "3", "--overload", "4",
         "--latency-base", "0.5", "--latency-per-in-token", "0.001", "--jitter", "0.2",
         "--time-scale", "10", "--fault-429", "0.1", "--fault-schema", "0.05"]
    )  # fmt: skip
    settings = settings_from_args(args)
    assert (settings.seed, settings.overload, settings.time_scale) == (3, 4, 10.0)
    assert settings.latency.base_s == 0.5 and settings.latency.per_input_token_s == 0.001
    assert settings.faults.rate_429 == 0.1 and settings.faults.rate_schema_violation == 0.05
    with pytest.raises(ValueError, match="sum to at most 1"):
        FaultModel(rate_429=0.6, rate_500=0.6)


def test_latency_model_scales_with_tokens_inside_the_jitter_band() -> None:
    model = LatencyModel(base_s=1.0, per_input_token_s=0.1, per_output_token_s=0.2, jitter=0.5)
    mean = 1.0 + 0.1 * 10 + 0.2 * 5
    assert model.seconds(10, 5, unit=0.5) == pytest.approx(mean)
    assert model.seconds(10, 5, unit=0.0) == pytest.approx(mean * 0.5)
    assert model.seconds(10, 5, unit=0.999999) == pytest.approx(mean * 1.5, rel=1e-5)
    assert count_tokens("") == 0 and count_tokens("abcd") == 1 and count_tokens("abcde") == 2


def test_blocking_server_serves_sync_clients_from_a_thread() -> None:
    with (
        sim_server_blocking(SimSettings()) as server,
        openai.OpenAI(base_url=server.base_url, api_key="sim", max_retries=0) as llm,
    ):
        reply = llm.chat.completions.create(
            model="sim-llm",
            messages=[{"role": "user", "content": reflector_prompt(["k0-l004"], True)}],
        )
        assert "LESSON[k0-l004]" in (reply.choices[0].message.content or "")
        assert server.stats()["roles"]["reflector"]["completed"] == 1


# --------------------------------------------------------------------------- agent, realism


def test_simulated_agent_is_right_exactly_when_its_prompt_carries_the_lesson() -> None:
    from combee_stream.sim.roles import answer
    from combee_stream.sim.tasks import sim_tasks, task_code
    from combee_stream.tasks import is_correct

    tasks = sim_tasks(6, keys=1, lessons=3, seed=4)
    assert [t.metadata["lesson"] for t in tasks] == ["k0-l000", "k0-l001", "k0-l002"] * 2
    prompt_with = (
        "## STRATEGIES & INSIGHTS\n"
        "[strat-00001] helpful=0 harmful=0 :: LESSON[k0-l001]: text of k0-l001\n"
    )
    for task in tasks:
        user = f"Answer.\n<question>\n{task.question}\n</question>"
        knows = task.metadata["lesson"] == "k0-l001"
        out = answer(prompt_with, user, seed=4)
        assert is_correct(task, out.final_answer) == knows, task.id
        assert out.bullet_ids == (["strat-00001"] if knows else [])
        assert not is_correct(task, answer("", user, seed=4).final_answer)
    assert task_code(4, "k0-l001") == int(tasks[1].answer)
    assert "LESSON[k0-l000]" in tasks[0].metadata["feedback"]


def test_realism_makes_the_simulated_roles_err_as_real_models_do() -> None:
    from combee_stream.sim.roles import curate, paraphrase, reflect
    from combee_stream.sim.settings import RealismModel

    lesson = Lesson(
        "k0-l001", "When the API returns an empty page, retry once with a smaller request."
    )
    assert paraphrase(lesson).text == lesson.text.replace("retry", "repeat", 1)
    # Each trace cited strat-00007; a realistic reflector sometimes also tags an id it never
    # saw (it is shown only the cited bullets).
    prompts = [
        reflector_prompt([f"k0-l{i:03d}"], False, bullets=["strat-00007"]) for i in range(400)
    ]
    off = [reflect(p, seed=1) for p in prompts]
    assert all(len(find_lessons(o.key_insight)) == 1 for o in off)
    assert all([t.bullet_id for t in o.bullet_tags] == ["strat-00007"] for o in off)
    real = RealismModel(miss=0.2, invent=0.3, uncited_tags=0.25)
    on = [reflect(p, seed=1, realism=real) for p in prompts]
    missed = sum(not any(x.id.startswith("k0-") for x in find_lessons(o.key_insight)) for o in on)
    vague = ("Be careful.", "Double-check the work.", "Read the task again.")
    invented = sum(o.key_insight.split("\n", 1)[0] in vague for o in on)
    tagged = sum(len(o.bullet_tags) > 1 for o in on)
    assert 40 <= missed <= 120 and 80 <= invented <= 160 and 60 <= tagged <= 140
    assert {t.bullet_id for o in on for t in o.bullet_tags} == {"strat-00007", "strat-00008"}
    reworded = curate(
        curator_prompt(["k0-l001"] * 2, playbook_lessons=[]),
        seed=1,
        capacity=None,
        realism=RealismModel(paraphrase=1.0),
    )
    (op,) = reworded.operations
    assert isinstance(op, AddOp) and "text of k0-l001" in op.content
