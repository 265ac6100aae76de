"""Smoke test against a REAL model: SmolLM2-135M-Instruct behind llama.cpp's ``llama-server``,
started with the project's own ``combee-stream llm serve``.

The simulator tests cover the logic; these check the plumbing that only a real server exercises:
``json_object`` + ``schema`` (grammar-constrained) replies that msgspec accepts, real token usage,
the memo on a real reply, a full learner window producing a valid playbook, and one ``eval``
run of the example agent. The model is tiny and weak, so nothing here looks at what it wrote,
only at the shape.

The roles are exactly those ``local_llm_config`` gives a local model (what ``bench quality``,
``demo`` and ``llm serve`` users run), not smaller ones. Why it sets ``max_string_chars`` /
``max_list_items``: the grammar llama.cpp derives from a JSON Schema fixes the shape but not the
length. With unbounded strings and arrays, SmolLM2 at temperature 0 loops (``"15% of 80% of 20%
of ..."``, one more operation after another) until ``max_tokens`` cuts the JSON, and every
re-ask loops the same way. The LLM layer adds the bounds to the schema it sends (replies are
still validated against the full types) and derives each request's ``max_tokens`` from them, so
a reply the grammar allows always fits.

Needs the llama-server build and the model (``make llm-prepare``, i.e. ``combee-stream llm
prepare --model smollm2-135m``; a build in progress is waited for): skipped without them,
failed when CI=true. Run alone with ``.venv/bin/pytest -m realmodel``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Final, Literal, TypeVar

import anyio
import msgspec
import pytest
from ci_support import in_ci

from combee_stream.buildcache import wait_for_build
from combee_stream.config import LearningConfig, LLMConfig
from combee_stream.core.learner import Learner
from combee_stream.core.playbook import new_playbook, render
from combee_stream.core.results import WindowResult
from combee_stream.http import free_port
from combee_stream.llm import ChatMessage, Completion, LLMClient, RoleUsage
from combee_stream.localllm.build import CACHE_NAME, is_built
from combee_stream.localllm.server import LocalServer, local_llm_config
from combee_stream.schemas import (
    Feedback,
    Playbook,
    Source,
    Step,
    Trace,
    decode,
    encode,
)
from combee_stream.wiring import load_prompts

T = TypeVar("T")

REPO: Final = Path(__file__).resolve().parent.parent
STATE: Final = REPO / ".state" / "llm"
MODEL: Final = "smollm2-135m"
KEY: Final = "smoke"
BULLET_ID: Final = re.compile(r"^[a-z]+-\d{5}$")

Name = Annotated[str, msgspec.Meta(pattern=r'^[^\x00-\x1f"\\]{1,32}$')]


@pytest.fixture(scope="module")
def llama_build() -> None:
    """The llama-server build and the model; skipped without them, failed when CI=true."""
    wait_for_build(CACHE_NAME)  # `make test` builds it in the background meanwhile
    if not (is_built() and (STATE / "models" / f"{MODEL}.gguf").is_file()):
        reason = f"no llama-server build or no {MODEL} in {STATE}: run `make llm-prepare`"
        if in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def llama_url(tmp_path_factory: pytest.TempPathFactory, llama_build: None) -> Iterator[str]:
    """Base URL (without /v1) of ``combee-stream llm serve`` running SmolLM2 for this module."""
    log = tmp_path_factory.mktemp("llama") / "serve.log"
    port = free_port()
    command = [
        sys.executable, "-m", "combee_stream", "llm", "serve", "--model", MODEL,
        "--port", str(port), "--parallel", "1", "--state-dir", str(STATE),
    ]  # fmt: skip
    with log.open("wb") as err:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, cwd=REPO)
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode().strip()  # printed once it answers
        if not line.startswith("http://"):
            process.kill()
            pytest.fail(f"llm serve did not start:\n{log.read_text()[-3000:]}", pytrace=False)
        yield line.removesuffix("/v1")
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def llm_config(url: str) -> LLMConfig:
    """The roles exactly as ``local_llm_config`` sets them for a local model (its bounds and
    the caps derived from them), one request at a time: llama.cpp serializes them anyway."""
    server = LocalServer(model=MODEL, base_url=f"{url}/v1", log_path="", parallel=1)
    return local_llm_config(server, LLMConfig(timeout_s=300.0))


def traces() -> list[Trace]:
    """Three tiny hand-written traces: one failure, one success, one tool mistake."""
    return [
        Trace(
            key=KEY,
            trace_id="t1",
            task="What is 15% of 80?",
            output="15",
            feedback=Feedback(passed=False, ground_truth="12", text="Multiply 80 by 0.15."),
        ),
        Trace(
            key=KEY,
            trace_id="t2",
            task="Convert 2 hours to minutes.",
            output="120",
            feedback=Feedback(passed=True, score=1.0),
        ),
        Trace(
            key=KEY,
            trace_id="t3",
            task="Find the weather in Paris.",
            steps=[
                Step(kind="tool_call", name="weather", content='{"city": "Pari"}'),
                Step(kind="observation", name="weather", content="error: unknown city"),
            ],
            output="I could not find it.",
            feedback=Feedback(passed=False, text="The city name was misspelled."),
        ),
    ]


class Verdict(msgspec.Struct, forbid_unknown_fields=True):
    """A small typed reply: an enum, a bounded int and a bounded list, all in the grammar."""

    answer: Literal["yes", "no"]
    confidence: Annotated[int, msgspec.Meta(ge=0, le=10)]
    reasons: Annotated[list[Name], msgspec.Meta(max_length=2)]


@pytest.mark.realmodel
@pytest.mark.timeout(900)  # the server's start and a slow, contended machine
def test_json_object_schema_reply_validates_and_is_memoized(llama_url: str) -> None:
    messages: list[ChatMessage] = [
        {"role": "system", "content": "You answer in JSON."},
        {"role": "user", "content": "Is Paris in France? Give a confidence from 0 to 10."},
    ]

    async def run() -> tuple[Completion[Verdict], Completion[Verdict], dict[str, RoleUsage]]:
        async with LLMClient(llm_config(llama_url), env={}) as client:
            first = await client.complete("reflector", messages, Verdict)
            again = await client.complete("reflector", messages, Verdict)
            return first, again, client.usage()

    first, again, usage = anyio.run(run)
    assert isinstance(first.value, Verdict) and first.value.answer in ("yes", "no")
    assert 0 <= first.value.confidence <= 10
    assert not first.cached and first.attempts >= 1
    assert first.tokens_in > 0 and first.tokens_out > 0, "the server reported real usage"
    assert again.cached and again.value == first.value, "the same request is served from the memo"
    assert again.tokens_in == again.tokens_out == 0
    reflector = usage["reflector"]
    assert reflector.calls == 2 and reflector.cached_calls == 1 and reflector.failed_calls == 0
    assert reflector.tokens_in == first.tokens_in and reflector.tokens_out >= first.tokens_out


@pytest.mark.realmodel
@pytest.mark.timeout(900)  # the server's start and a slow, contended machine
def test_learner_window_on_real_model_yields_valid_playbook(llama_url: str) -> None:
    window = traces()
    sources = [Source(trace_id=t.trace_id) for t in window]

    async def run() -> tuple[WindowResult, dict[str, RoleUsage]]:
        async with LLMClient(llm_config(llama_url), env={}) as client:
            learner = Learner(
                client, LearningConfig(), prompts=load_prompts(), strategy_name="naive"
            )
            result = await learner.learn_window(
                new_playbook(KEY), list(zip(window, sources, strict=True))
            )
            return result, client.usage()

    result, usage = anyio.run(run)
    assert result.failed == [], f"reflections failed: {[f.reason for f in result.failed]}"
    assert sorted(result.learned) == sorted(sources), "every trace learned once"
    assert result.applied.applied

    playbook = result.playbook
    assert decode(encode(playbook), Playbook) == playbook, "msgspec round trip"
    assert playbook.key == KEY and playbook.version == 1
    bullets = [b for s in playbook.sections for b in s.bullets]
    ids = [b.id for b in bullets]
    assert len(set(ids)) == len(ids)
    for bullet in bullets:
        assert bullet.content.strip(), bullet
        assert BULLET_ID.match(bullet.id), bullet.id
        assert int(bullet.id.rsplit("-", 1)[1]) < playbook.next_id
    text = render(playbook)
    assert all(f"## {s.name}" in text for s in playbook.sections if s.bullets)
    assert all(b.content in text for b in bullets)

    reflector, curator = usage["reflector"], usage["curator"]
    assert reflector.calls == 3 and curator.calls == 1, "naive: 3 reflections, 1 curator call"
    for role in (reflector, curator):
        assert role.failed_calls == 0 and role.cached_calls == 0
        assert role.tokens_in > 0 and role.tokens_out > 0
    assert result.stats.tokens_in == reflector.tokens_in + curator.tokens_in
    assert result.stats.tokens_out == reflector.tokens_out + curator.tokens_out


@pytest.mark.realmodel
@pytest.mark.timeout(900)
def test_eval_runs_the_example_agent_on_the_real_model(llama_url: str) -> None:
    agent = llm_config(llama_url).agent  # the local model's own agent settings
    role = {
        "BASE_URL": agent.base_url,
        "MODEL": MODEL,
        "MODE": f'"{agent.mode}"',
        "MAX_TOKENS": str(agent.max_tokens),
        "MAX_STRING_CHARS": str(agent.max_string_chars),
        "MAX_LIST_ITEMS": str(agent.max_list_items),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMBEE__")}
    env.update({f"COMBEE__LLM__AGENT__{k}": v for k, v in role.items()})
    env.update({"COMBEE__LLM__TIMEOUT_S": "300", "COMBEE__LLM__CONCURRENCY": "1"})
    command = [
        sys.executable, "-m", "combee_stream", "--log-level", "warning", "eval",
        "--tasks", "generated:5", "--limit", "2", "--concurrency", "1", "--json",
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=800, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["n"] == 2, report
    assert report["errors"] == 0, report["failures"]
    assert 0.0 <= report["accuracy"] <= 1.0
    low, high = report["ci95"]
    assert 0.0 <= low <= report["accuracy"] <= high <= 1.0
    assert set(report["by_family"]) == {"compound_interest", "ratio_percent"}


def _jsonl_files(folder: Path) -> dict[str, bytes]:
    """Every JSONL file under ``folder`` by its relative path (memo and history sit in the
    strategy's folder, the traces and answers at the top)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*.jsonl")}


@pytest.mark.realmodel
@pytest.mark.timeout(1500)
def test_bench_quality_runs_end_to_end_and_a_rerun_reuses_every_finished_item(
    tmp_path: Path, datasets: Path, llama_build: None
) -> None:
    """``bench quality`` as a user runs it (``--local`` starts the model), combee with the LLM
    combine, at the smallest sizes (SmolLM2 often writes to the agent's token cap on these
    tasks); then the same command again with every role pointed at a closed port: the rerun
    can only finish if it reuses each training trace, each evaluated answer and the learned
    playbook instead of asking a model."""
    finance = datasets / "ace-finance"
    work, out = tmp_path / "work", tmp_path / "out"
    args = [
        "bench", "quality",
        "--train", f"formula:{finance / 'formula_train_subset_500.jsonl'}", "--train-n", "4",
        "--held-out", f"formula:{finance / 'formula_val_subset_300.jsonl'}", "--held-out-n", "2",
        "--batch-size", "4", "--strategies", "combee", "--combine", "llm",
        # One window of 4 reflections (no trace held out for a gate, every success reflected):
        # 2 groups, so the combiner is called.
        "--no-gate", "--reflect-successes", "all",
        "--work", str(work), "--json",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMBEE__")}
    command = [sys.executable, "-m", "combee_stream", "--log-level", "warning"]
    first = subprocess.run(
        [*command, *args, "--local", MODEL, "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=1400, cwd=REPO,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    report = json.loads(first.stdout.strip().splitlines()[-1])
    assert report["simulated"] is False and report["settings"]["model"] == MODEL
    assert report["settings"]["combine"] == "llm"
    assert any("one combiner call per window" in note for note in report["notes"])
    base, combee = report["results"]
    assert (base["prompt"], combee["prompt"]) == ("base", "combee")
    assert base["n"] == combee["n"] == 2
    assert 0 <= base["correct"] <= 2 and 0 <= combee["correct"] <= 2
    assert sum(n for n, _ in base["by_family"].values()) == base["correct"]
    # both arms answered by this one invocation: no warning that their pairing spans sessions
    assert len(base["evaluated_by"]) == 1 and combee["evaluated_by"] == base["evaluated_by"]
    assert not any(note.startswith("Evaluated in different") for note in report["notes"])
    assert combee["learn_calls"] > 0 and combee["learn_tokens_in"] > 0
    learned = msgspec.json.decode((work / "combee" / "report.json").read_bytes())
    assert learned["complete"] and learned["combine"] == "llm" and learned["traces"] == 4
    assert learned["learned"] + len(learned["failed"]) == 4
    roles = learned["per_role"]
    assert roles["reflector"]["calls"] == 4 and roles["curator"]["calls"] == 2, roles
    assert roles["combiner"]["calls"] == 1, roles
    assert len((work / "train_traces.jsonl").read_bytes().splitlines()) == 4
    assert (out / "quality.md").is_file() and "Nothing in this table is simulated" in (
        out / "quality.md"
    ).read_text()
    files = _jsonl_files(work)

    closed = f"http://127.0.0.1:{free_port()}/v1"
    for role in ("AGENT", "REFLECTOR", "CURATOR", "COMBINER", "EMBEDDINGS"):
        env[f"COMBEE__LLM__{role}__BASE_URL"] = closed
    env["COMBEE__LLM__AGENT__MODEL"] = MODEL  # the answers are kept by model, prompt and tasks
    again = subprocess.run(
        [*command, *args], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert again.returncode == 0, again.stderr[-3000:]
    rerun = json.loads(again.stdout.strip().splitlines()[-1])
    # wall_s too: an invocation that reuses every item adds no time to the run's
    assert report["wall_s"] > 0
    for field in ("results", "capacity", "train_accuracy", "train_wall_s", "wall_s", "targets"):
        assert rerun[field] == report[field], field
    assert _jsonl_files(work) == files, "nothing re-done"
