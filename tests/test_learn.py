"""``combee-stream learn`` end to end, against the SIMULATED LLM server over real HTTP."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from combee_stream import cli, run_learn
from combee_stream.config import Config, load_config
from combee_stream.core.gate import Candidate, Verdict
from combee_stream.core.learner import Learner
from combee_stream.core.playbook import new_playbook
from combee_stream.errors import UserError
from combee_stream.offline import LearnReport
from combee_stream.schemas import (
    BudgetRejection,
    GateRejection,
    PromptUpdate,
    Source,
    Trace,
    decode,
    encode,
)
from combee_stream.sim import (
    FaultModel,
    LatencyModel,
    SimSettings,
    generate_traces,
    score,
    sim_server,
    sim_server_blocking,
)
from combee_stream.sim.markers import find_lessons, retained_ids
from combee_stream.sim.score import load_playbooks
from combee_stream.wiring import build_learner, load_prompts

pytestmark = pytest.mark.timeout(240)


def write_traces(path: Path, traces: list[Trace], extra: bytes = b"") -> Path:
    path.write_bytes(b"".join(encode(t) + b"\n" for t in traces) + extra)
    return path


def complete_lines(path: Path) -> list[bytes]:
    """Lines that end in a newline (a process killed mid-write may leave a torn last one)."""
    return path.read_bytes().split(b"\n")[:-1] if path.exists() else []


def read_history(out: Path) -> list[PromptUpdate]:
    return [decode(line, PromptUpdate) for line in complete_lines(out / "history.jsonl")]


def check_history(out: Path, traces: list[Trace]) -> list[PromptUpdate]:
    """Versions 1..n per key, each parent the previous one; every trace learned exactly once."""
    updates = read_history(out)
    versions: dict[str, list[int]] = {}
    for update in updates:
        versions.setdefault(update.key, []).append(update.version)
        assert update.parent_version == update.version - 1
        assert update.playbook.version == update.version
    for key, seen in versions.items():
        assert seen == list(range(1, len(seen) + 1)), key
    learned = Counter((u.key, tid) for u in updates for tid in u.stats.trace_ids)
    assert learned == Counter((t.key, t.trace_id) for t in traces), "each trace exactly once"
    playbooks = load_playbooks(out)
    newest = {u.key: u for u in updates}
    assert {k: p.version for k, p in playbooks.items()} == {k: u.version for k, u in newest.items()}
    return updates


def sim_config(base_url: str, **env: str) -> tuple[Config, dict[str, str]]:
    environ = {"OPENAI_BASE_URL": base_url, **env}
    return load_config(None, env=environ), environ


async def learn(
    settings: SimSettings,
    traces_file: Path,
    out: Path,
    *,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> tuple[LearnReport, dict[str, Any]]:
    async with sim_server(settings) as server:
        config, environ = sim_config(server.base_url, **(env or {}))
        report = await run_learn(config, traces_file, out, env=environ, **kwargs)
        return report, server.stats()


def lesson_lines(traces: list[Trace], key: str) -> set[str]:
    return {
        lesson.line
        for t in traces
        if t.key == key
        for lesson in find_lessons(t.feedback.text or "")
    }


# --------------------------------------------------------------------------- strategies


@pytest.mark.parametrize("strategy", ["sequential", "naive", "combee"])
def test_each_strategy_learns_every_lesson_without_overload(tmp_path: Path, strategy: str) -> None:
    traces = generate_traces(48, keys=2, lessons=12, seed=3)
    path = write_traces(tmp_path / "traces.jsonl", traces)
    out = tmp_path / "out"
    report, stats = anyio.run(
        lambda: learn(SimSettings(seed=3), path, out, strategy=strategy, batch_size="12")
    )
    assert report.complete and report.failed_traces == 0 and report.learned == 48
    updates = check_history(out, traces)
    playbooks = load_playbooks(out)
    for key in ("sim-k0", "sim-k1"):
        bullets = {b.content for s in playbooks[key].sections for b in s.bullets}
        assert bullets == lesson_lines(traces, key), "exactly the key's lessons, nothing else"
    assert score(traces, playbooks).lessons_retained == 24
    per_key_windows = {"sequential": 24, "naive": 2, "combee": 2}[strategy]
    assert report.windows == len(updates) == 2 * per_key_windows
    assert report.batch_size == (1 if strategy == "sequential" else 12)
    assert report.per_role["reflector"].calls == 48
    curator_calls = {"sequential": 48, "naive": 4, "combee": 4 * 3}[strategy]  # k = isqrt(12)
    assert report.per_role["curator"].calls == curator_calls
    assert stats["roles"]["curator"]["completed"] == curator_calls
    assert report.max_curator_items == {"sequential": 1, "naive": 12, "combee": 8}[strategy]
    assert report.llm_calls == 48 + curator_calls
    assert report.tokens_in == sum(u.tokens_in for u in report.per_role.values()) > 0
    text = (out / "playbook.md").read_text()
    assert "## Key `sim-k0`" in text and "LESSON[k1-l000]" in text
    saved = msgspec.json.decode((out / "report.json").read_bytes(), type=LearnReport)
    assert saved.windows == report.windows and saved.strategy == strategy


def test_learn_says_how_many_model_calls_it_made_on_its_progress_line(tmp_path: Path) -> None:
    """A window is many calls and minutes on a small server: the progress line counts them as
    they are made. Its last line's count is the calls the simulator answered."""
    traces = generate_traces(24, keys=1, lessons=6, seed=5)
    path = write_traces(tmp_path / "traces.jsonl", traces)
    log = io.StringIO()
    report, stats = anyio.run(
        lambda: learn(SimSettings(seed=5), path, tmp_path / "out", strategy="combee", stderr=log)
    )
    answered = sum(role["completed"] for role in stats["roles"].values())
    assert report.complete and answered > 24  # a reflection per trace, and curators
    last = log.getvalue().splitlines()[-1]
    assert last.startswith("learn (combee): 24/24 ") and f", {answered} model calls, " in last


def test_the_first_curator_of_a_window_warms_the_prompt_cache_for_the_others(
    tmp_path: Path,
) -> None:
    traces = generate_traces(24, keys=1, lessons=12, seed=3)
    path = write_traces(tmp_path / "traces.jsonl", traces)
    # Every call takes 1 s, so curators sent at once overlap; the simulator's cache, like a
    # real server's, holds a prompt once its reply is sent.
    settings = SimSettings(seed=3, latency=LatencyModel(base_s=1.0))
    cached: dict[str, int] = {}
    for warm in ("true", "false"):
        report, _ = anyio.run(
            lambda w=warm: learn(  # type: ignore[misc]
                settings,
                path,
                tmp_path / w,
                env={"COMBEE__LEARNING__WARM_CURATOR_CACHE": w},
                strategy="combee",
                batch_size="12",
            )
        )
        assert report.windows == 2 and report.per_role["curator"].calls == 2 * 3  # k = 3
        cached[warm] = report.per_role["curator"].tokens_cached
    # What the curators of one window share at least: the template's head before the playbook.
    template = load_prompts("").curator
    head = len(template.system) + 1 + len(template.user.partition("{playbook}")[0])
    assert cached["true"] >= cached["false"] + 2 * (3 - 1) * (head // 4)


def test_combee_retains_clearly_more_lessons_than_naive_under_overload(tmp_path: Path) -> None:
    traces = generate_traces(120, keys=1, lessons=120, seed=1)
    path = write_traces(tmp_path / "traces.jsonl", traces)
    retained: dict[str, int] = {}
    largest: dict[str, int] = {}
    for strategy in ("naive", "combee"):
        out = tmp_path / strategy
        report, _ = anyio.run(
            lambda s=strategy, o=out: learn(  # type: ignore[misc]
                SimSettings(seed=1, overload=12), path, o, strategy=s, batch_size="40"
            )
        )
        check_history(out, traces)
        retained[strategy] = score(traces, load_playbooks(out)).lessons_retained
        largest[strategy] = report.max_curator_items
    # Counted from the traces sent, not from the simulator's overload formula: every lesson is
    # one the stream taught; a single curator call over 40 of them loses most (the premise, so
    # the comparison means something), Combee's small groups keep nearly all.
    sent = {lesson.id for t in traces for lesson in find_lessons(t.feedback.text or "")}
    assert len(sent) == 120
    assert retained["naive"] < len(sent) // 2
    assert retained["combee"] >= 3 * retained["naive"]
    assert retained["combee"] >= 100
    assert largest == {"naive": 40, "combee": 14}


def test_llm_combine_and_auto_batch_size(tmp_path: Path) -> None:
    traces = generate_traces(100, keys=1, lessons=50, seed=5)
    path = write_traces(tmp_path / "traces.jsonl", traces)
    out = tmp_path / "out"
    report, stats = anyio.run(
        lambda: learn(
            SimSettings(seed=5),
            path,
            out,
            env={"COMBEE__LEARNING__COMBINE": "llm"},
            batch_size="auto",
        )
    )
    check_history(out, traces)
    assert isinstance(report.batch_size, list) and sum(report.batch_size) >= 100
    assert report.batch_size[:3] == [5, 10, 20], "the controller explores its grid first"
    assert report.windows == len(report.batch_size)
    updates = read_history(out)
    multi_group = sum(1 for u in updates if u.stats.window_traces >= 4)
    assert report.per_role["combiner"].calls == multi_group
    assert stats["roles"]["combiner"]["completed"] == multi_group
    assert score(traces, load_playbooks(out)).lessons_retained == 50


def test_successes_that_cited_nothing_cost_no_reflection_and_are_still_learned_once(
    tmp_path: Path,
) -> None:
    traces = generate_traces(48, keys=1, lessons=12, seed=4)
    # A few successes cite a bullet id: those are read (their tags are what they teach).
    cited = {t.trace_id for t in traces if t.feedback.passed}
    cited = set(sorted(cited)[:3])
    traces = [
        msgspec.structs.replace(t, bullet_ids=["strat-00001"]) if t.trace_id in cited else t
        for t in traces
    ]
    path = write_traces(tmp_path / "traces.jsonl", traces)
    out = tmp_path / "out"
    report, stats = anyio.run(
        lambda: learn(
            SimSettings(seed=4),
            path,
            out,
            env={"COMBEE__LEARNING__REFLECT_SUCCESSES": "cited"},
            strategy="combee",
            batch_size="12",
        )
    )
    failures = sum(1 for t in traces if not t.feedback.passed)
    assert 0 < failures < len(traces)
    assert report.per_role["reflector"].calls == failures + len(cited)
    assert stats["roles"]["reflector"]["completed"] == failures + len(cited)
    assert report.learned == len(traces) and report.failed_traces == 0
    check_history(out, traces)  # every trace learned exactly once, read or not


def test_a_reflection_whose_lesson_is_none_goes_to_no_curator() -> None:
    from combee_stream.core.learner import teaches
    from combee_stream.schemas import Reflection

    source = Source("t", 0, 0)
    assert not teaches(Reflection(key="k", source=source, key_insight="None."))
    assert not teaches(Reflection(key="k", source=source, key_insight=""))
    assert teaches(Reflection(key="k", source=source, key_insight="When asked, round it."))


@pytest.mark.anyio
@pytest.mark.parametrize("skip", [True, False])
async def test_a_lesson_the_playbook_states_is_not_shown_to_the_curators(skip: bool) -> None:
    from combee_stream.config import LearningConfig
    from combee_stream.core.outputs import CuratorOutput, ReflectorOutput, ReflectorOutputNoTags
    from combee_stream.llm import Completion
    from combee_stream.schemas import Bullet, BulletTag, Feedback, Section

    millions = "When amounts are given in millions, multiply the result by 1,000,000."
    insights = {
        "t-said": "When amounts are stated in millions, multiply the result by 1,000,000.",
        "t-new": "When a rate is given in percent, divide it by 100 before using it.",
        "t-blames": "When amounts are given in millions, multiply the result by 1,000,000.",
    }

    class Scripted:
        def __init__(self) -> None:
            self.curator_prompts: list[str] = []

        async def complete(self, role: str, messages: list[Any], output_type: Any) -> Completion:  # type: ignore[type-arg]
            prompt = messages[-1]["content"]
            if role == "reflector":
                trace_id = next(t for t in insights if t in prompt)
                tags = [BulletTag("m-1", "harmful")] if trace_id == "t-blames" else []
                fields = dict(error_identification="e", root_cause_analysis="r",
                              correct_approach="c", key_insight=insights[trace_id])  # fmt: skip
                value: Any = (
                    ReflectorOutput(**fields, bullet_tags=tags)
                    if output_type is ReflectorOutput
                    else ReflectorOutputNoTags(**fields)
                )
            else:
                self.curator_prompts.append(prompt)
                value = CuratorOutput(operations=[])
            return Completion(value=value, tokens_in=1, tokens_out=1, cached=False, attempts=1,
                              latency_s=0.0)  # fmt: skip

    vocabulary = ("millions", "1,000,000", "percent", "100")

    async def embed(texts: list[str]) -> list[list[float]]:  # bag of words: rewordings match
        return [[float(w in t) for w in vocabulary] for t in texts]

    book = new_playbook("k")
    book.sections = [Section(name="OTHERS", bullets=[Bullet(id="m-1", content=millions)])]
    wrong = Feedback(passed=False, text="wrong")
    window = [
        (
            Trace(key="k", trace_id=tid, task=f"task {tid}", output="1", feedback=wrong,
                  bullet_ids=["m-1"] if tid == "t-blames" else []),
            Source("traces", 0, n),
        )
        for n, tid in enumerate(insights)
    ]  # fmt: skip
    llm = Scripted()
    config = LearningConfig(strategy="naive", skip_covered_lessons=skip)
    learner = Learner(llm, config, prompts=load_prompts(), embed=embed, dedup_threshold=0.8)
    proposal = await learner.propose(book, window)
    [shown] = llm.curator_prompts
    assert "divide it by 100" in shown  # a new lesson
    assert ("stated in millions" in shown) is not skip  # the bullet's rule, reworded
    assert "given in millions" in shown.split("<reflections>")[1]  # it blames the bullet
    assert proposal.stats.covered_lessons == (1 if skip else 0)
    # Provenance and tags of a covered lesson count as ever: every trace is learned.
    assert {s.offset for s in proposal.delta.sources} == {0, 1, 2}

    # A window whose every lesson a bullet states costs no curator call.
    llm.curator_prompts.clear()
    proposal = await learner.propose(book, window[:1])
    assert len(llm.curator_prompts) == (0 if skip else 1)
    assert proposal.stats.curator_calls == (0 if skip else 1)


@pytest.mark.anyio
async def test_a_bullet_carrying_its_tasks_reference_answer_is_refused() -> None:
    """The real-model demo of 2026-12-05 published a CAPM rule ending "0.1040, not 10.4": one
    training task's answer, which its task text does not contain."""
    from combee_stream.config import LearningConfig
    from combee_stream.core.outputs import CuratorOutput, ReflectorOutputNoTags
    from combee_stream.llm import Completion
    from combee_stream.schemas import AddOp, Feedback

    rule = "When using CAPM, write the rates as decimal fractions, not percentages"
    adds = [f"{rule}.", f"{rule}: the answer is 0.104, not 10.4.", f"{rule}: 0.05, not 5."]

    class Scripted:
        async def complete(self, role: str, messages: list[Any], output_type: Any) -> Completion:  # type: ignore[type-arg]
            value: Any = (
                ReflectorOutputNoTags(error_identification="e", root_cause_analysis="r",
                                      correct_approach="c", key_insight=rule)
                if role == "reflector"
                else CuratorOutput(operations=[AddOp(section="S", content=a) for a in adds])
            )  # fmt: skip
            return Completion(value=value, tokens_in=1, tokens_out=1, cached=False, attempts=1,
                              latency_s=0.0)  # fmt: skip

    task = "Rf is 3%, the market return 8% and beta 1.48. What is the expected return?"
    wrong = Feedback(passed=False, ground_truth="0.1040", text="expected 0.1040, got 10.4")
    trace = Trace(key="k", trace_id="t1", task=task, output="10.4", feedback=wrong)
    learner = Learner(Scripted(), LearningConfig(strategy="naive"), prompts=load_prompts())
    book = new_playbook("k")
    result = await learner.commit(await learner.propose(book, [(trace, Source("t", 0, 0))]), book)
    kept = [b.content for s in result.playbook.sections for b in s.bullets]
    # The answer, written "0.104" where the reference says "0.1040", is refused; a fraction
    # that is no number of this task or its answer is a rule's example and stays.
    assert kept == [adds[0], adds[2]]
    assert [(s.op, s.reason) for s in result.applied.skipped] == [
        (AddOp(section="S", content=adds[1]), "restates_task")
    ]


# --------------------------------------------------------------------------- faults, resume


def test_faults_lose_no_trace_and_complete_no_request_twice(tmp_path: Path) -> None:
    traces = generate_traces(80, keys=2, lessons=20, seed=7)
    path = write_traces(tmp_path / "traces.jsonl", traces)
    out = tmp_path / "out"
    faults = FaultModel(
        rate_429=0.05,
        retry_after_s=0.05,
        rate_500=0.05,
        rate_timeout=0.02,
        timeout_s=3.0,
        rate_malformed=0.04,
        rate_schema_violation=0.04,
    )
    report, stats = anyio.run(
        lambda: learn(
            SimSettings(seed=7, faults=faults),
            path,
            out,
            env={"COMBEE__LLM__TIMEOUT_S": "1.0"},
            batch_size="16",
        )
    )
    assert sum(stats["faults"].values()) > 20, "the fault model must actually bite"
    assert report.failed_traces == 0 and report.complete
    check_history(out, traces)
    assert max(stats["completed_by_request"].values()) == 1, "a finished call was paid twice"
    assert score(traces, load_playbooks(out)).lessons_retained == 40


def test_resume_after_kill_does_not_redo_finished_windows(tmp_path: Path) -> None:
    traces = generate_traces(60, keys=1, lessons=60, seed=11)
    path = write_traces(tmp_path / "traces.jsonl", traces)
    out = tmp_path / "out"
    settings = SimSettings(seed=11, latency=LatencyModel(base_s=0.15))
    with sim_server_blocking(settings) as server:
        env = {**os.environ, "OPENAI_BASE_URL": server.base_url}
        args = ["--traces", str(path), "--out", str(out), "--batch-size", "6"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "combee_stream", "learn", *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Kill once >= 2 windows are saved and the reflections of the next one are finished
        # (6 reflector + 2 curator calls per window of 6): its curators are then in flight.
        try:
            while proc.poll() is None:
                windows = len(complete_lines(out / "history.jsonl"))
                memo = len(complete_lines(out / "memo.jsonl"))
                if windows >= 2 and memo >= 8 * windows + 6:
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.01)
        finally:
            proc.kill()
            proc.wait()
        before = read_history(out)
        assert 2 <= len(before) < 10, "the run must be interrupted part-way"
        first_run = server.stats()

        os.environ["OPENAI_BASE_URL"] = server.base_url
        try:
            assert cli.main(["learn", *args, "--resume"]) == 0
        finally:
            del os.environ["OPENAI_BASE_URL"]
        stats = server.stats()

    updates = check_history(out, traces)
    assert updates[: len(before)] == before, "finished windows are kept as they were"
    report = msgspec.json.decode((out / "report.json").read_bytes(), type=LearnReport)
    learned_before = sum(len(u.stats.trace_ids) for u in before)
    assert report.already_learned == learned_before
    assert report.windows == 10 - len(before)
    assert report.per_role["reflector"].calls == 60 - learned_before
    assert report.per_role["reflector"].cached_calls >= 6, "the killed window's reflections"
    # Nothing finished was sent again: not the windows in history, not the calls of the window
    # in flight at the kill (replayed from DIR/memo.jsonl).
    assert max(stats["completed_by_request"].values()) == 1
    sent_again = (
        stats["roles"]["reflector"]["completed"] - first_run["roles"]["reflector"]["completed"]
    )
    assert (
        sent_again == report.per_role["reflector"].calls - report.per_role["reflector"].cached_calls
    )
    assert score(traces, load_playbooks(out)).lessons_retained == 60


def test_existing_run_needs_resume(tmp_path: Path) -> None:
    traces = generate_traces(8, keys=1, lessons=8)
    path = write_traces(tmp_path / "traces.jsonl", traces)
    out = tmp_path / "out"
    anyio.run(lambda: learn(SimSettings(), path, out, batch_size="4"))
    config, env = sim_config("http://127.0.0.1:9/v1")  # refused before any call is made
    with pytest.raises(UserError, match="--resume"):
        anyio.run(lambda: run_learn(config, path, out, env=env, batch_size="4"))
    report, stats = anyio.run(lambda: learn(SimSettings(), path, out, resume=True))
    assert report.already_learned == 8 and report.windows == 0 and report.llm_calls == 0
    assert stats["completed_by_request"] == {}


# --------------------------------------------------------------------------- input, config


def test_bad_lines_are_reported_with_numbers_and_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traces = generate_traces(10, keys=1, lessons=10, seed=2)
    bad = (
        b"{not json\n"
        + b'{"key": "sim-k0", "trace_id": "x1", "task": "t", "feedback": {}}\n'
        + encode(traces[0])
        + b"\n\n"
    )
    path = write_traces(tmp_path / "traces.jsonl", traces, bad)
    out = tmp_path / "out"
    with sim_server_blocking(SimSettings()) as server:
        os.environ["OPENAI_BASE_URL"] = server.base_url
        try:
            code = cli.main(
                ["learn", "--traces", str(path), "--out", str(out), "--batch-size", "5"]
            )
        finally:
            del os.environ["OPENAI_BASE_URL"]
    captured = capsys.readouterr()
    assert code == 0
    assert f"{path}:11: malformed JSON" in captured.err
    assert f"{path}:12: invalid Trace" in captured.err and "feedback" in captured.err
    assert f"{path}:13: duplicate trace_id" in captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["learned"] == 10 and summary["bad_lines"] == 2
    assert summary["duplicate_traces"] == 1
    # Ten reflections; the simulator's cache serves the prompt head they share after the first.
    reflector = summary["per_role"]["reflector"]
    assert reflector["calls"] == 10 and reflector["truncated_replies"] == 0
    assert 0 < reflector["tokens_cached"] < reflector["tokens_in"]
    report = json.loads((out / "report.json").read_text())
    assert [b["line"] for b in report["bad"]] == [11, 12, 13]
    check_history(out, traces)


def test_missing_endpoint_says_what_to_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    path = write_traces(tmp_path / "t.jsonl", generate_traces(2, keys=1, lessons=2))
    code = cli.main(["learn", "--traces", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert "OPENAI_BASE_URL" in err and "OPENAI_API_KEY" in err and "base_url" in err
    assert not (tmp_path / "out").exists(), "nothing is written without an endpoint"


def test_token_budget_rejection_is_recorded_and_traces_still_learned_once(
    tmp_path: Path,
) -> None:
    traces = generate_traces(12, keys=1, lessons=12, seed=4)
    path = write_traces(tmp_path / "traces.jsonl", traces)
    out = tmp_path / "out"
    budget = 80  # an empty playbook renders to about 40 tokens; 6 lessons do not fit
    report, _ = anyio.run(
        lambda: learn(
            SimSettings(seed=4),
            path,
            out,
            env={"COMBEE__LEARNING__TOKEN_BUDGET": str(budget)},
            batch_size="6",
        )
    )
    updates = check_history(out, traces)
    assert report.rejected_windows == 2
    for update in updates:
        reason = update.stats.rejection
        assert isinstance(reason, BudgetRejection) and reason.budget == budget
        assert reason.would_be > budget
        assert update.stats.rejected is None  # the legacy JSON text is no longer written
    assert all(not s.bullets for s in load_playbooks(out)["sim-k0"].sections)


class RefuseAll:
    """A gate of the user's own, given to run_learn (the engine takes one the same way)."""

    name = "refuse_all"

    def __init__(self) -> None:
        self.reviewed = 0

    async def review(self, candidate: Candidate) -> Verdict:
        self.reviewed += 1
        return Verdict(accepted=False, reason="not today")


def test_a_gate_of_ones_own_is_consulted_for_every_window(tmp_path: Path) -> None:
    traces = generate_traces(8, keys=1, lessons=8, seed=5)
    path = write_traces(tmp_path / "traces.jsonl", traces)
    gate = RefuseAll()
    report, _ = anyio.run(
        lambda: learn(SimSettings(seed=5), path, tmp_path / "out", batch_size="4", gate=gate)
    )
    updates = check_history(tmp_path / "out", traces)  # refused, yet every trace learned once
    assert gate.reviewed == len(updates) == 2 == report.rejected_windows
    for update in updates:
        assert update.stats.rejection == GateRejection(gate="refuse_all", reason="not today")
    assert all(not s.bullets for s in load_playbooks(tmp_path / "out")["sim-k0"].sections)


class BlameFirst:
    """A gate that leaves out the first new bullet of each window's candidate and passes the
    rest (its second look, without that bullet)."""

    name = "blame_first"

    def __init__(self) -> None:
        self.blamed: list[str] = []
        self.parents: set[int] = set()

    async def review(self, candidate: Candidate) -> Verdict:
        old = {b.id for s in candidate.parent.sections for b in s.bullets}
        new = [b for s in candidate.playbook.sections for b in s.bullets if b.id not in old]
        if not new or candidate.parent.version in self.parents:
            return Verdict(accepted=True)
        self.parents.add(candidate.parent.version)
        self.blamed.append(new[0].content)
        return Verdict(accepted=True, blame=[new[0].id])


def test_the_learn_report_keeps_the_text_of_what_was_not_served_across_a_resume(
    tmp_path: Path,
) -> None:
    traces = generate_traces(16, keys=1, lessons=16, seed=6)
    first, out = write_traces(tmp_path / "first.jsonl", traces[:8]), tmp_path / "out"
    gate = BlameFirst()
    anyio.run(lambda: learn(SimSettings(seed=6), first, out, batch_size="4", gate=gate))
    report, _ = anyio.run(
        lambda: learn(
            SimSettings(seed=6),
            write_traces(tmp_path / "all.jsonl", traces),
            out,
            batch_size="4",
            gate=gate,
            resume=True,
        )
    )
    updates = check_history(out, traces)
    blamed = [r for r in report.left_out if r.by == "blame_first"]
    # One a window, the first run's two kept through the resume, each with its window's version.
    assert len(gate.blamed) == len(updates) == 4
    assert [(r.version, r.content) for r in blamed] == list(
        zip([1, 2, 3, 4], gate.blamed, strict=True)
    )
    served = {b.content for u in updates for s in u.playbook.sections for b in s.bullets}
    assert not served & set(gate.blamed)


# --------------------------------------------------------------------------- prompts


def test_packaged_prompts_carry_the_contract_blocks() -> None:
    prompts = load_prompts()
    assert prompts.version == "v1"
    for template, tags in (
        (prompts.reflector, ("bullets_used", "trace")),
        (prompts.curator, ("playbook", "reflections")),
        (prompts.combiner, ("playbook", "partial_updates")),
        (prompts.exemplifier, ("lesson", "failed_trace")),
    ):
        lines = template.user.splitlines()
        for tag in tags:
            assert f"<{tag}>" in lines and f"</{tag}>" in lines
        # The exemplifier's is one user message, the wording a 1.5B model answered with the
        # two calculations asked for (core/outputs.py WorkedExample).
        assert bool(template.system) is (template is not prompts.exemplifier)
    # The reflector sees the bullets the trace cited, not the playbook (as in ACE).
    assert "<playbook>" not in prompts.reflector.user


def test_prompts_dir_overrides_and_is_checked(tmp_path: Path) -> None:
    (tmp_path / "curator.md").write_text(
        "<!-- system -->\nYou are terse.\n<!-- user -->\nBudget {token_budget}; {progress}\n"
        "{stats}\n<playbook>\n{playbook}\n</playbook>\n<reflections>\n{reflections}\n"
        '</reflections>\nJSON like {"operations": []}, {unknown} stays.\n'
    )
    prompts = load_prompts(tmp_path)
    assert prompts.curator.system == "You are terse."
    assert prompts.reflector == load_prompts().reflector
    filled = prompts.curator.fill(
        {
            "token_budget": "9",
            "progress": "p",
            "stats": "s",
            "playbook": "PB {stats}",
            "reflections": "R",
        }
    )
    assert filled[1]["content"].startswith("Budget 9; p\ns\n<playbook>\nPB {stats}\n")
    assert '{"operations": []}, {unknown} stays.' in filled[1]["content"]
    (tmp_path / "reflector.md").write_text("{playbook} {trace} {bullets_used}\n<trace>\n")
    with pytest.raises(UserError, match=r"reflector\.md.*<bullets_used>"):
        load_prompts(tmp_path)


def test_learner_uses_override_prompts_against_the_simulator(tmp_path: Path) -> None:
    (tmp_path / "curator.md").write_text(
        "Curate. {progress} {stats} {token_budget}\n<playbook>\n{playbook}\n</playbook>\n"
        "<reflections>\n{reflections}\n</reflections>\n"
    )
    traces = generate_traces(9, keys=1, lessons=9, seed=8)

    async def run() -> tuple[int, list[Source]]:
        async with sim_server(SimSettings(seed=8)) as server:
            config, env = sim_config(server.base_url, COMBEE__LEARNING__PROMPTS_DIR=str(tmp_path))
            from combee_stream.llm import LLMClient

            async with LLMClient(config.llm, env=env) as client:
                learner = build_learner(config, client, env=env)
                result = await learner.learn_window(
                    new_playbook("sim-k0"), [(t, Source(t.trace_id)) for t in traces]
                )
        return len(retained_ids(result.playbook)), result.learned

    retained, learned = anyio.run(run)
    assert retained == 9 and len(learned) == 9


def test_proposals_from_one_snapshot_commit_in_turn_with_rebase() -> None:
    """The streaming path: two windows proposed on the same snapshot, the second committed onto
    the version the first produced (rebased: its ADDs of lessons already present are dropped)."""
    traces = generate_traces(24, keys=1, lessons=8, seed=9)  # every lesson three times

    async def run() -> None:
        async with sim_server(SimSettings(seed=9)) as server:
            config, env = sim_config(server.base_url)
            from combee_stream.llm import LLMClient

            async with LLMClient(config.llm, env=env) as client:
                learner = Learner(client, config.learning, prompts=load_prompts())
                v0 = new_playbook("sim-k0")
                pairs = [(t, Source(t.trace_id)) for t in traces]
                first = await learner.propose(v0, pairs[:12])
                second = await learner.propose(v0, pairs[12:])
                one = await learner.commit(first, v0)
                two = await learner.commit(second, one.playbook)
                again = await learner.commit(first, v0)
                assert again.playbook == one.playbook, "commit is deterministic"
                later = await learner.propose(two.playbook, pairs[:2])
                with pytest.raises(ValueError, match="older version"):
                    await learner.commit(later, one.playbook)
        assert (one.playbook.version, two.playbook.version) == (1, 2)
        assert (one.stats.stale_by, two.stats.stale_by) == (0, 1)
        contents = [b.content for s in two.playbook.sections for b in s.bullets]
        assert len(contents) == len(set(contents)) == 8, "all 8 lessons, none twice"
        assert len(retained_ids(two.playbook)) == 8
        assert two.delta.base_version == 1 and len(two.learned) == 12
        proposed_adds = len(second.delta.operations)
        assert proposed_adds > len(two.applied.added), "rebase dropped lessons already present"

    anyio.run(run)


def test_prompts_are_stable_first_so_a_prefix_cache_reuses_them() -> None:
    """Two windows of one key: the second's playbook has one more bullet, its reflections,
    progress and statistics differ. Their curator prompts must agree on everything before the
    new bullet (instructions, the answer format, the playbook so far), and every window line
    must come after the playbook: a prefix cache then reuses all of that."""
    from combee_stream.core.playbook import apply
    from combee_stream.core.prompts import (
        ReflectionRecord,
        combiner_messages,
        curator_messages,
        reflector_messages,
    )
    from combee_stream.schemas import AddOp, Delta, Feedback, Reflection, Source, Trace

    prompts = load_prompts()
    first = apply(
        new_playbook("k"),
        Delta(key="k", operations=[AddOp(section="OTHERS", content="When A, do B.")]),
        token_budget=None,
    ).playbook
    second = apply(
        first,
        Delta(key="k", operations=[AddOp(section="OTHERS", content="When C, do D.")]),
        token_budget=None,
    ).playbook

    def record(i: int) -> ReflectionRecord:
        reflection = Reflection(key="k", source=Source(trace_id=f"t{i}"), key_insight=f"rule {i}")
        return ReflectionRecord(reflection=reflection, task=f"task {i}")

    one = curator_messages(prompts, first, [record(1)], progress="window 1", token_budget=900)
    two = curator_messages(prompts, second, [record(2)], progress="window 2", token_budget=900)
    assert one[0] == two[0]  # the system message
    a, b = one[1]["content"], two[1]["content"]
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    # They part exactly where the second playbook's new bullet starts...
    assert a[:common].endswith("When A, do B.\n")
    assert b[common:].startswith("[misc-00002]")
    # ...and the window's own lines (progress, statistics, records) come after the playbook.
    for text in (a, b):
        end = text.index("</playbook>")
        assert text.index("Progress:") > end and text.index("<reflections>") > end
        assert text.index("Playbook statistics:") > end
        assert text.index('"operations"') < text.index("<playbook>")  # the format is stable
    partial = Delta(key="k", operations=[AddOp(section="OTHERS", content="When E, do F.")])
    combined = combiner_messages(prompts, first, [partial], token_budget=900)[1]["content"]
    assert combined.index("<partial_updates>") > combined.index("</playbook>")
    # The reflector's prompt depends on the trace alone (the bullets it cited and the trace).
    trace = Trace(
        key="k", trace_id="t", task="What is 2 + 2?", output="4", feedback=Feedback(passed=True)
    )
    assert reflector_messages(prompts, first, trace) == reflector_messages(prompts, second, trace)


def test_the_agent_prompt_is_stable_first_so_two_playbooks_share_its_instructions() -> None:
    """The lesson check and the replay gate ask the same tasks under several playbooks at once:
    the agent's prompts for two playbooks must agree on the instructions and part only where
    the playbooks do, and the question must come after every playbook line."""
    from combee_stream.evaluation.answerer import Answerer

    agent = Answerer(None)  # type: ignore[arg-type]  # messages() needs no client
    parent = agent.messages("[calc-00001] When A, do B.", "What is 2 + 2?")
    child = agent.messages("[calc-00001] When A, do B.\n[calc-00002] When C, do D.", "What?")
    a, b = parent[0]["content"], child[0]["content"]
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert a[:common].endswith("When A, do B.\n")  # they part where the second playbook grows
    for words in ('"reasoning"', '"bullet_ids"', '"expression"', '"final_answer"'):
        assert a.index(words) < a.index("<playbook>"), words  # every instruction first
    for messages in (parent, child):
        assert [m["role"] for m in messages] == ["system", "user"]
        assert "<playbook>" not in messages[1]["content"]  # the user turn is the question alone
        assert "<question>" in messages[1]["content"]
    # The base arm's empty playbook sends the same instructions, as every arm does.
    empty = agent.messages("", "What is 2 + 2?")[0]["content"]
    assert empty[: empty.index("<playbook>")] == a[: a.index("<playbook>")]
