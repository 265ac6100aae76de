"""PNG plots of the benchmark reports (matplotlib, Agg backend: no display needed).

matplotlib is an optional dependency (the ``bench`` extra): it is imported only when plots are
asked for, and a missing install is a :class:`UserError` that says what to install.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from combee_stream.bench.report import SIMULATED
from combee_stream.errors import UserError

if TYPE_CHECKING:
    from combee_stream.bench.latency import LatencyReport
    from combee_stream.bench.overhead import OverheadReport
    from combee_stream.bench.quality import QualityReport
    from combee_stream.bench.saturation import SaturationReport
    from combee_stream.bench.scaling import ScalingReport

_COLOURS = {"sequential": "#555555", "naive": "#d95f02", "combee": "#1b9e77"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise UserError(
            "plots need matplotlib: pip install 'combee-stream[bench]' (or matplotlib), "
            "or leave out --out"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require_matplotlib() -> None:
    """Raise the install hint now rather than after a long run."""
    _pyplot()


def _plain_log_axis(axis: Any, ticks: Sequence[float] | None = None) -> None:
    """Log scale with plain numbers (5, 10, 20, not 2^k or 10^k notation)."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    if ticks is not None:
        axis.set_ticks(list(ticks))
    formatter = ScalarFormatter()
    formatter.set_scientific(False)
    axis.set_major_formatter(formatter)
    axis.set_minor_formatter(NullFormatter())


def _save(plt: Any, fig: Any, path: Path, subtitle: str, llm: str = SIMULATED) -> Path:
    fig.text(0.01, 0.005, f"{llm}\n{subtitle}", fontsize=7, color="#666666")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def scaling_plots(report: ScalingReport, out: Path, subtitle: str) -> list[Path]:
    plt = _pyplot()
    rows = report.results
    fixed = [r for r in rows if isinstance(r.batch_size, int) and not r.fan_in]
    auto = [r for r in rows if r.batch_size == "auto"]
    paths = []
    for name, field, ylabel, log in (
        ("scaling_speedup.png", "speedup_vs_sequential", "speedup vs sequential (x)", True),
        ("scaling_retention.png", "lessons_retained", "lessons retained (fraction)", False),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for strategy in ("naive", "combee"):
            pts = sorted(
                ((int(r.batch_size), getattr(r, field)) for r in fixed if r.strategy == strategy),
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", label=strategy, color=_COLOURS[strategy])
        seq = [r for r in fixed if r.strategy == "sequential"]
        if seq:
            ax.axhline(
                getattr(seq[0], field),
                ls="--",
                color=_COLOURS["sequential"],
                label="sequential (batch 1)",
            )
        for r in auto:
            mean = sum(r.window_sizes) / max(1, len(r.window_sizes))
            ax.plot(
                [mean],
                [getattr(r, field)],
                "*",
                ms=12,
                color="#7570b3",
                label="combee, controller (mean window)",
            )
        ax.set_xscale("log", base=2)
        _plain_log_axis(ax.xaxis, sorted({int(r.batch_size) for r in fixed} | {1}))
        if log:
            ax.set_yscale("log", base=2)
            top = max(getattr(r, field) for r in rows)
            _plain_log_axis(ax.yaxis, [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= 2 * top])
        ax.set_xlabel("batch size (traces per window)")
        ax.set_ylabel(ylabel)
        if not log:
            ax.set_ylim(0, 1.05)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(plt, fig, out / name, subtitle))

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for r in rows:
        colour = "#7570b3" if r.batch_size == "auto" else _COLOURS[r.strategy]
        marker = "*" if r.batch_size == "auto" else ("s" if r.fan_in else "o")
        ax.plot(
            [r.wall_s], [r.lessons_retained], marker, color=colour, ms=9 if marker == "*" else 6
        )
        label = f"{r.strategy[0]}{r.batch_size}" + (f"/f{r.fan_in}" if r.fan_in else "")
        ax.annotate(
            label,
            (r.wall_s, r.lessons_retained),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    for strategy, colour in _COLOURS.items():
        ax.plot([], [], "o", color=colour, label=strategy)
    ax.plot([], [], "*", color="#7570b3", label="combee, controller")
    ax.set_xscale("log")
    _plain_log_axis(ax.xaxis)
    ax.set_xlabel("wall time (model seconds, log)")
    ax.set_ylabel("lessons retained (fraction)")
    ax.set_ylim(0, 1.08)
    ax.set_title("quality vs delay (up and left is better)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    paths.append(_save(plt, fig, out / "scaling_quality_delay.png", subtitle))
    return paths


def saturation_plots(report: SaturationReport, out: Path, subtitle: str) -> list[Path]:
    plt = _pyplot()
    rows = report.results
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels = [f"L={r.latency_s:g}s\nC={r.concurrency}" for r in rows]
    xs = range(len(rows))
    ax.bar(
        [x - 0.2 for x in xs],
        [r.bound_traces_per_s for r in rows],
        0.4,
        label="bound C/(L·calls)",
        color="#bbbbbb",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [r.achieved_traces_per_s for r in rows],
        0.4,
        label="achieved (engine)",
        color=_COLOURS["combee"],
    )
    for x, r in zip(xs, rows, strict=True):
        ax.annotate(
            f"{r.saturation_ratio:.2f}",
            (x + 0.2, r.achieved_traces_per_s),
            ha="center",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("traces per model second")
    ax.set_title("throughput vs the LLM endpoint's bound")
    ax.legend(fontsize=8)
    return [_save(plt, fig, out / "saturation.png", subtitle)]


def overhead_plots(report: OverheadReport, out: Path, subtitle: str) -> list[Path]:
    plt = _pyplot()
    rows = report.results
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    for reader, colour in (("bare consumer", "#555555"), ("engine", _COLOURS["combee"])):
        pts = sorted((r.backlog, r.peak_rss_mb) for r in rows if r.reader == reader)
        if pts:
            right.plot(*zip(*pts, strict=True), "o-", label=reader, color=colour)
        tps = sorted((r.backlog, r.traces_per_s) for r in rows if r.reader == reader)
        if tps:
            left.plot(*zip(*tps, strict=True), "o-", label=reader, color=colour)
    left.set_xscale("log")
    left.set_yscale("log")
    _plain_log_axis(left.xaxis, sorted({r.backlog for r in rows}))
    _plain_log_axis(left.yaxis)
    left.set_xlabel("backlog (traces)")
    left.set_ylabel("traces per second (real)")
    left.set_title("throughput")
    right.set_xscale("log")
    _plain_log_axis(right.xaxis, sorted({r.backlog for r in rows}))
    right.set_ylim(bottom=0)
    right.set_xlabel("backlog (traces)")
    right.set_ylabel("peak RSS (MiB)")
    right.set_title("peak memory")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return [_save(plt, fig, out / "overhead.png", subtitle)]


def latency_plots(report: LatencyReport, out: Path, subtitle: str) -> list[Path]:
    plt = _pyplot()
    rows = report.results
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    groups = sorted({r.rate_per_s for r in rows})
    width = 0.13
    offsets: Sequence[tuple[str, str, float]] = (
        ("synchronous", "p50_s", -2.5),
        ("synchronous", "p95_s", -1.5),
        ("synchronous", "p99_s", -0.5),
        ("pipelined", "p50_s", 0.5),
        ("pipelined", "p95_s", 1.5),
        ("pipelined", "p99_s", 2.5),
    )
    for mode, field, off in offsets:
        values = [
            next((getattr(r, field) for r in rows if r.mode == mode and r.rate_per_s == g), 0.0)
            for g in groups
        ]
        colour = _COLOURS["naive"] if mode == "synchronous" else _COLOURS["combee"]
        alpha = {"p50_s": 1.0, "p95_s": 0.65, "p99_s": 0.35}[field]
        ax.bar(
            [i + off * width for i in range(len(groups))],
            values,
            width,
            color=colour,
            alpha=alpha,
            label=f"{mode} {field[:3]}",
        )
    ax.set_xticks(range(len(groups)), [f"{g:g} traces/s" for g in groups])
    ax.set_ylabel("trace-to-publish latency (model s)")
    ax.set_title("synchronous vs pipelined windows")
    ax.legend(fontsize=7, ncol=2)
    return [_save(plt, fig, out / "latency.png", subtitle)]


def quality_plots(report: QualityReport, out: Path, subtitle: str) -> list[Path]:
    """Held-out accuracy per prompt with its 95% interval."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = report.results
    xs = list(range(len(rows)))
    accuracy = [r.accuracy for r in rows]
    below = [r.accuracy - r.ci95[0] for r in rows]
    above = [r.ci95[1] - r.accuracy for r in rows]
    colours = [_COLOURS.get(r.prompt, "#7570b3") for r in rows]
    ax.bar(xs, accuracy, color=colours, alpha=0.8)
    ax.errorbar(xs, accuracy, yerr=[below, above], fmt="none", ecolor="black", capsize=4)
    ax.set_xticks(xs, [r.prompt for r in rows])
    ax.set_ylim(0, 1)
    ax.set_ylabel(f"held-out accuracy (n = {rows[0].n if rows else 0}, 95% Wilson CI)")
    ax.set_title(f"{report.settings.model}: base prompt vs learned playbooks", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    llm = f"Real model: {report.settings.model} (not simulated)."
    return [_save(plt, fig, out / "quality_accuracy.png", subtitle, llm)]


__all__ = [
    "latency_plots",
    "overhead_plots",
    "quality_plots",
    "require_matplotlib",
    "saturation_plots",
    "scaling_plots",
]
