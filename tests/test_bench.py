"""Benchmarks in their quickest form: they run, their JSON has the documented shape, and their
numbers are consistent with the strategies' definitions. No assertion on any time or speed."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from combee_stream.bench.latency import latency_settings, run_latency
from combee_stream.bench.overhead import overhead_settings, run_overhead
from combee_stream.bench.saturation import run_saturation, saturation_settings
from combee_stream.bench.scaling import expected_calls, expected_max_items, max_items_bound
from combee_stream.bench.vclock import VirtualClockLoop
from combee_stream.cli import main
from combee_stream.config import Config

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
LATENCY_KEYS = {"base_s", "per_input_token_s", "per_output_token_s", "jitter"}


def _windows(row: dict[str, Any], n: int) -> list[int]:
    if row["batch_size"] == "auto":
        return list(row["window_sizes"])
    size = 1 if row["strategy"] == "sequential" else row["batch_size"]
    return [size] * (n // size) + ([n % size] if n % size else [])


def test_virtual_clock_accounts_sleeps_without_waiting() -> None:
    async def sleepy() -> tuple[float, float]:
        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for delay in (30.0, 100.0, 70.0):
                tg.start_soon(anyio.sleep, delay)
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualClockLoop)
        return anyio.current_time() - start, loop.skipped_s

    elapsed, skipped = anyio.run(sleepy, backend_options={"loop_factory": VirtualClockLoop})
    assert elapsed >= 100.0  # the longest sleep, on the virtual clock
    assert 99.0 <= skipped <= elapsed  # and it was skipped, not slept


def test_scaling_quick_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "scaling", "--quick", "--json"]
    if HAS_MATPLOTLIB:
        argv += ["--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)

    assert report["suite"] == "scaling" and report["simulated"] is True
    assert LATENCY_KEYS <= set(report["latency_model"])
    settings = report["settings"]
    n, p = settings["traces"], settings["duplication"]
    assert n == 120
    rows = report["results"]
    expected = {("sequential", 1, 0), ("combee", "auto", 0)}
    expected |= {(s, b, 0) for s in ("naive", "combee") for b in (5, 10, 20, 40, 80)}
    expected.add(("combee", 40, settings["extra_fan_in"]))
    assert {(r["strategy"], r["batch_size"], r["fan_in"]) for r in rows} == expected

    for row in rows:
        windows = _windows(row, n)
        assert sum(windows) == n, row
        assert row["windows"] == len(windows)
        strategy, fan_in = row["strategy"], row["fan_in"]
        assert row["llm_calls"] == expected_calls(strategy, windows, p, fan_in), row
        assert row["max_curator_items"] == expected_max_items(strategy, windows, p, fan_in), row
        assert row["rounds"] == 2 * len(windows)  # Map + level-1 curators, union combine
        assert 0.0 <= row["lessons_retained"] <= 1.0
        assert row["lessons_total"] == settings["lessons"]
        assert row["tokens_in"] > 0 and row["tokens_out"] > 0
        assert row["wall_s"] > 0

    combee40 = next(
        r for r in rows if (r["strategy"], r["batch_size"], r["fan_in"]) == ("combee", 40, 0)
    )
    assert combee40["max_curator_items"] <= max_items_bound(40, p)  # the bound at 40
    seq = rows[0]
    assert seq["strategy"] == "sequential" and seq["speedup_vs_sequential"] == 1.0
    assert seq["lessons_retained"] == 1.0  # one reflection per curator call: never overloaded
    naive80 = next(r for r in rows if (r["strategy"], r["batch_size"]) == ("naive", 80))
    assert naive80["lessons_retained"] < 1.0  # 80 reflections overload the curator (C = 16)
    assert {t["name"] for t in report["targets"]} and all(
        isinstance(t["met"], bool) for t in report["targets"]
    )
    if HAS_MATPLOTLIB:
        for name in ("scaling_speedup", "scaling_retention", "scaling_quality_delay"):
            assert (tmp_path / f"{name}.png").read_bytes().startswith(b"\x89PNG")
        markdown = (tmp_path / "scaling.md").read_text()
        assert "Simulated LLM" in markdown and "Latency model:" in markdown
        assert json.loads((tmp_path / "scaling.json").read_text()) == report


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_saturation_quick(config: Config) -> None:
    # 5 traces per slot (quick: 20): the bounds below hold for a run of any length, and every
    # configuration still has windows of all keys and a compression of its own.
    settings = msgspec.structs.replace(saturation_settings(quick=True), traces_per_slot=5)
    report = await run_saturation(config, settings)
    assert report.suite == "saturation" and report.simulated
    assert [m.base_s for m in report.latency_model] == settings.latencies_s
    assert [(r.latency_s, r.concurrency) for r in report.results] == [
        (latency, c) for latency in settings.latencies_s for c in settings.concurrencies
    ]
    for r in report.results:
        assert r.traces == settings.traces_per_slot * r.concurrency
        windows_at_least = math.ceil(r.traces / settings.batch_size)
        # one reflector call per trace, at least one curator call per window, and at most
        # floor(sqrt(b)) per window of b
        assert r.traces + windows_at_least <= r.llm_calls
        assert r.llm_calls <= r.traces * 2
        # The physical limit holds: no run beats c / (L x calls per trace), which is what the
        # ratio is reported against (a bench that timed the wrong span would exceed it).
        assert 0 < r.saturation_ratio <= 1.05
        assert r.achieved_traces_per_s > 0 and r.time_scale <= settings.time_scale


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_latency_quick(config: Config) -> None:
    # One rate and 30 model seconds of arrivals (quick: 2 rates, 90 s): 60 traces, 6 windows
    # of 10 over 2 keys, in both modes; what is checked holds per trace and per version.
    settings = msgspec.structs.replace(
        latency_settings(quick=True), rates_per_s=[2.0], duration_s=30.0
    )
    report = await run_latency(config, settings)
    assert report.suite == "latency" and report.simulated
    assert {(r.rate_per_s, r.mode) for r in report.results} == {
        (rate, mode) for rate in settings.rates_per_s for mode in ("synchronous", "pipelined")
    }
    for r in report.results:
        assert r.traces == round(r.rate_per_s * settings.duration_s)
        assert 0 < r.p50_s <= r.p95_s <= r.p99_s
        assert r.versions * r.traces_per_version == pytest.approx(r.traces)  # each learned once
        assert r.traces_per_version <= settings.batch_size


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_overhead_quick(config: Config) -> None:
    # Backlogs of 320 and 1,280 (quick: 2,000 and 8,000) with engine.queue_size 500 (quick:
    # 1,000): the larger one still exceeds the queue, so the engine's intake pauses partitions
    # as in a real backlog; both are whole windows of every key (8 keys x batch 40), so no run
    # ends waiting engine.max_wait_s for a partial one.
    settings = msgspec.structs.replace(
        overhead_settings(quick=True), backlogs=[320, 1_280], queue_size=500
    )
    report = await run_overhead(config, settings)
    assert report.suite == "overhead" and report.simulated
    assert report.latency_model.base_s == 0
    assert {(r.backlog, r.reader) for r in report.results} == {
        (b, reader) for b in settings.backlogs for reader in ("bare consumer", "engine")
    }
    for r in report.results:
        assert r.traces_per_s > 0 and r.cpu_ms_per_trace > 0
        assert r.peak_rss_mb >= r.baseline_rss_mb > 0
    assert set(report.engine_vs_bare) == {str(b) for b in settings.backlogs}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_ingest_quick(config: Config) -> None:
    """Every synthetic trace is written by the stage, and the open ones are all held."""
    from combee_stream.bench.ingest import IngestSettings, markdown, run_ingest

    settings = IngestSettings(traces=300, open_traces=200)
    report = await run_ingest(config, settings)
    assert report.open_traces == 200 and all(t.met for t in report.targets)
    # (run_ingest returns only once the stage has written all 300 traces to the traces topic.)
    assert report.ratio > 0
    assert report.rss_open_mb > 0 and report.bytes_per_open_trace > 0
    assert "No LLM" in markdown(report)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_gate_quick(config: Config) -> None:
    """Both runs consume the whole stream; the stream's poison reaches the ungated run's
    versions, and the gated one publishes neither a poisoned version nor a regression beyond
    its margin (whether by refusing a window or by pruning the bullets it blames); its extra
    calls are the agent's."""
    from combee_stream.bench.gate import gate_settings, markdown, run_gate

    settings = gate_settings(quick=True, seed=0)
    report = await run_gate(config, settings)
    plain, gated = report.runs
    assert (plain.gate, gated.gate) == ("none", "replay")
    assert plain.llm_calls.get("agent", 0) == 0 < gated.llm_calls["agent"]
    assert plain.poisoned_versions > 0 and plain.regressions > 0
    assert gated.poisoned_versions == 0 and gated.regressions == 0
    # A new key holds out nothing at first: its first windows wait for the gate, none is lost.
    assert gated.deferred > 0 and plain.deferred == 0
    assert 0 <= gated.worse_share <= 1 and 0 <= plain.worse_share <= 1
    assert "Simulated LLM" in markdown(report)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_keys_quick(config: Config) -> None:
    """Every wave is published and evicted; the figures agree with each other: one version
    and one index entry per key seen, no live pipeline once idle, series not growing."""
    from combee_stream.bench.keys import KeysSettings, markdown, run_keys

    settings = KeysSettings(keys=90, waves=3, key_idle_s=1.0, key_metric_series=10)
    report = await run_keys(config, settings)
    assert [s.keys_seen for s in report.samples] == [30, 60, 90]
    for sample in report.samples:
        assert sample.versions_published == sample.index_entries == sample.keys_seen
        assert sample.live_pipelines == 0 and sample.rss_mb > 0
    assert len({s.metric_series for s in report.samples}) == 1, "series do not grow with keys"
    assert all(t.met for t in report.targets) and "Simulated LLM" in markdown(report)


def test_quality_gates_score_as_the_task_set_does() -> None:
    """``bench quality`` gives the gate (and the worked-example check) its tasks' scorer: ACE's
    Formula rows count an unrounded answer wrong, the default numeric rule does not."""
    from combee_stream.bench.quality import scored_as_tasks
    from combee_stream.config import GateConfig
    from combee_stream.evaluation.examples import example_check
    from combee_stream.schemas import HeldOutTask
    from combee_stream.tasks import Task

    def task(scorer: str) -> Task:
        return Task(id=scorer, family="f", question="q", answer="0.49", scorer=scorer)

    config = Config()
    formula = scored_as_tasks(config, [task("formula"), task("formula")])
    assert (config.gate.scorer, formula.gate.scorer) == ("numeric", "formula")
    check = example_check(formula.gate)
    held = HeldOutTask(trace_id="t", task="Round to 2 decimal places.", answer="0.49", rank=0)
    assert check is not None and check("64 / 130", held).calculation == "round(64 / 130, 2)"
    assert (
        check("70 / 130", held).problem
        == "70 / 130 gives 0.5384615385, and the reference answer is 0.49"
    )
    # Mixed scorers, the judge, a user's evaluator: the config's own choice stands.
    assert scored_as_tasks(config, [task("formula"), task("exact")]) is config
    for gate in (GateConfig(scorer="judge"), GateConfig(evaluator="mine:evaluate")):
        judged = msgspec.structs.replace(config, gate=gate)
        assert scored_as_tasks(judged, [task("formula")]) is judged


def test_quality_report_warns_when_arms_were_evaluated_apart() -> None:
    """Two evaluations of one prompt on llama-server differ on some answers, so a pair of arms
    evaluated by different invocations of ``bench quality`` (a base reused from an earlier
    session) is flagged; arms evaluated by the same one are not."""
    from combee_stream.bench.quality import UNRECORDED, PromptRow, _sessions_note

    def row(prompt: str, *runs: str) -> PromptRow:
        return PromptRow(
            prompt=prompt, accuracy=0.5, ci95=(0.4, 0.6), correct=50, n=100, by_family={},
            evaluated_by=list(runs),
        )  # fmt: skip

    one = "2026-12-06T15:40:00Z"
    assert _sessions_note([row("base", one), row("naive", one), row("combee", one)]) == ""
    note = _sessions_note(
        [row("base", "2026-12-05T09:00:00Z"), row("naive", one), row("combee", one)]
    )
    assert note.startswith("Evaluated in different invocations")
    assert "of naive, combee against base" in note
    # a base whose answers came from a folder that recorded no invocation is not vouched for
    unrecorded = [row("base", UNRECORDED), row("combee", UNRECORDED)]
    assert "base by an unrecorded earlier one" in _sessions_note(unrecorded)
    # an interrupted base finished by a second invocation spans both: flagged too
    assert "of combee against" in _sessions_note(
        [row("base", "2026-12-05T09:00:00Z", one), row("combee", one)]
    )


def test_quality_report_lists_what_each_arm_did_not_serve_with_its_text() -> None:
    from combee_stream.bench.quality import PromptRow, _not_served
    from combee_stream.offline import LeftOutReport

    def row(prompt: str, *out: LeftOutReport) -> PromptRow:
        return PromptRow(
            prompt=prompt, accuracy=0.5, ci95=(0.4, 0.6), correct=50, n=100, by_family={},
            not_served=list(out),
        )  # fmt: skip

    long = "When valuing a stock with the DDM, divide next year's dividend. " * 10
    text = _not_served(
        [
            row("base"),
            row("combee", LeftOutReport("k", 2, "lessons", long)),
            row("naive", LeftOutReport("k", 3, "restates_task", "When pricing a bond, discount.")),
        ]
    )
    assert "combee:\n\n- v2, lessons: When valuing a stock with the DDM" in text
    assert "naive:\n\n- v3, restates_task: When pricing a bond, discount." in text
    assert "base:" not in text
    # A long proposal is cut to a line a person reads, whole words and a mark that it was cut.
    [line] = [x for x in text.splitlines() if "lessons" in x]
    assert line.endswith("[...]") and len(line) < len(long)
    assert _not_served([row("base"), row("combee")]) == ""


def test_quality_phases_forget_an_evaluation_whose_answers_were_deleted() -> None:
    """Deleting an arm's answers file makes the next invocation answer every task again: the
    earlier invocations' time and names no longer describe those answers (the twentieth run's
    base, answered again beside combee, was reported as spanning two sessions and 22.7
    minutes); answers kept from an unrecorded version stay flagged as such."""
    from combee_stream.bench.quality import UNRECORDED, _Phases

    name = "eval-base-0123"
    phases = _Phases(eval_wall_s={name: 600.0}, eval_runs={name: ["2026-12-07T00:30:40Z"]})
    phases.kept(name, 100)
    assert phases.eval_runs[name] == ["2026-12-07T00:30:40Z"]
    assert phases.eval_wall_s[name] == 600.0
    phases.kept(name, 0)
    assert name not in phases.eval_runs and name not in phases.eval_wall_s
    phases.kept(name, 3)
    assert phases.eval_runs[name] == [UNRECORDED]


def test_quality_reuses_the_answers_of_an_arm_whose_prompt_the_agent_already_had() -> None:
    """A strategy that served no bullet renders an empty playbook: the agent's system message is
    then the base prompt's, byte for byte, so ``bench quality`` reuses the base answers (asking
    again measures only the server's noise, 5 to 8 answers of 100); one bullet makes it
    another agent."""
    from combee_stream.core.playbook import render
    from combee_stream.evaluation.answerer import system_message
    from combee_stream.schemas import Bullet, Playbook, Section

    empty = Playbook(key="finance")
    assert system_message(render(empty)) == system_message("")
    one = Playbook(
        key="finance",
        sections=[Section(name="lessons", bullets=[Bullet(id="calc-00001", content="Round.")])],
    )
    assert system_message(render(one)) != system_message("")
    assert "[calc-00001] Round." in system_message(render(one))


def test_quality_run_time_is_reported_against_the_floor_of_its_output_tokens() -> None:
    """60,000 output tokens at 25 tokens/s take 40 minutes at the least: a 100-minute run is
    2.5 times its floor (hand-computed)."""
    from combee_stream.bench.quality import Capacity, _run_time

    capacity = Capacity(single_tokens_per_s=12.5, parallel_tokens_per_s=25.0, parallel=4)
    line = _run_time(6000.0, 60_000, capacity)
    assert line.startswith("100.0 min, 2.5 times its floor: 60,000 output tokens take 40.0 min")
    assert line.endswith("25.0 output tokens/s with 4 requests at once")
    # a work folder begun before the tokens were recorded: the time alone, no floor
    assert _run_time(6000.0, 0, capacity) == (
        "100.0 min (endpoint: 25.0 output tokens/s with 4 requests at once)"
    )


def test_quality_report_names_an_arm_whose_answers_are_another_arms() -> None:
    """The report says which arm's answers an arm reuses, and "served no bullet" only when it
    is the base prompt's (two strategies may also learn the same playbook)."""
    from combee_stream.bench.quality import Capacity, PromptRow, QualityReport, QualitySettings
    from combee_stream.bench.quality import markdown as quality_markdown

    def row(prompt: str, answers_of: str = "") -> PromptRow:
        return PromptRow(
            prompt=prompt, accuracy=0.5, ci95=(0.4, 0.6), correct=50, n=100, by_family={},
            answers_of=answers_of,
        )  # fmt: skip

    report = QualityReport(
        settings=QualitySettings(
            model="m",
            train="t",
            train_n=60,
            held_out="h",
            held_out_n=100,
            strategies=["combee", "naive"],
            batch_size=15,
            concurrency=4,
        ),
        capacity=Capacity(single_tokens_per_s=12.5, parallel_tokens_per_s=25.0, parallel=4),
        train_accuracy=0.3,
        train_wall_s=540.0,
        results=[row("base"), row("combee", "base"), row("naive", "combee")],
        combee_vs_naive=None,
        targets=[],
        notes=[],
    )
    text = quality_markdown(report)
    assert (
        "combee gave the agent the base prompt's very text (it served no bullet): its answers "
        "are the base prompt's, not asked again." in text
    )
    assert (
        "naive gave the agent the combee prompt's very text: its answers are the combee "
        "prompt's, not asked again." in text
    )
