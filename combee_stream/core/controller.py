"""Batch-size policies: a fixed size, or the dynamic controller (Combee paper §3.3).

:func:`batch_policy` is the one constructor every driver uses (engine, offline ``learn``,
benchmarks): ``sequential`` always gets windows of one trace, a fixed ``learning.batch_size``
gets :class:`FixedBatch`, ``"auto"`` gets an :class:`OnlineController` within
``[learning.min_batch_size, learning.max_batch_size]``.

Rule: from a measured iteration delay ``d(bs)`` per candidate size and ``N`` training traces, the
epoch time is ``T(bs) = d(bs) * N / bs``. Fit ``T = A * bs**-alpha`` by least squares in log-log
space; the marginal saving is ``|dT/dbs| = alpha * A * bs**-(alpha + 1)``; stop growing where it
falls to ``tau = tau_fraction * peak slope``: ``bs* = (alpha * A / tau) ** (1 / (alpha + 1))``.

"Peak slope" is ``|dT/dbs|`` of the fit at the smallest candidate of the grid: a decreasing power
law is steepest at its smallest size, and the grid's lower end is the smallest size we would ever
run on purpose. Anchoring there (rather than at the smallest size that happened to be measured)
keeps ``tau`` stable when a stream window closes early with fewer traces. ``A`` then cancels:
``bs* = bs_1 * (1 / tau_fraction) ** (1 / (alpha + 1))``, i.e. ``bs_1 * 62.5 ** 0.5 ≈ 7.9 * bs_1``
for perfectly parallel windows (constant delay, alpha = 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec
from msgspec import Struct

from combee_stream.config import LearningConfig
from combee_stream.core.scan import strategy
from combee_stream.logs import get_logger

DEFAULT_CANDIDATES: tuple[int, ...] = (5, 10, 20, 40, 80)
_FLAT = 1e-9  # |alpha| below this is float noise on a flat epoch time, not a trend


class ControllerSettings(Struct, frozen=True, kw_only=True):
    """Bounds and knobs. ``candidates`` is filtered to ``[min_size, max_size]`` and sorted; if no
    candidate survives, the grid falls back to the bounds themselves."""

    min_size: int = 1
    max_size: int = 80
    candidates: tuple[int, ...] = DEFAULT_CANDIDATES
    tau_fraction: float = 0.016
    ewma: float = 0.3  # weight of the newest delay in the per-size moving average
    backlog_factor: float = 2.0  # grow windows once pending > backlog_factor * fitted size

    def __post_init__(self) -> None:
        if self.min_size < 1:
            raise ValueError(f"min_size must be >= 1, got {self.min_size}")
        if self.min_size > self.max_size:
            raise ValueError(f"min_size ({self.min_size}) must be <= max_size ({self.max_size})")
        if not self.candidates:
            raise ValueError("candidates must not be empty")
        if any(c < 1 for c in self.candidates):
            raise ValueError(f"candidates must be positive, got {self.candidates}")
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"candidates must not repeat, got {self.candidates}")
        if not 0.0 < self.tau_fraction < 1.0:
            raise ValueError(f"tau_fraction must be in (0, 1), got {self.tau_fraction}")
        if not 0.0 < self.ewma <= 1.0:
            raise ValueError(f"ewma must be in (0, 1], got {self.ewma}")
        if not 1.0 <= self.backlog_factor < math.inf:
            raise ValueError(f"backlog_factor must be finite and >= 1, got {self.backlog_factor}")
        grid = sorted(c for c in self.candidates if self.min_size <= c <= self.max_size)
        msgspec.structs.force_setattr(
            self, "candidates", tuple(grid or sorted({self.min_size, self.max_size}))
        )

    @property
    def smallest(self) -> int:
        return self.candidates[0]

    def clip(self, size: float) -> int:
        return min(self.max_size, max(self.min_size, round(size)))


class PowerLawFit(Struct, frozen=True):
    """``T(bs) = A * bs**-alpha``."""

    A: float
    alpha: float

    def epoch_time(self, bs: float) -> float:
        return float(self.A * bs**-self.alpha)

    def slope(self, bs: float) -> float:
        """``|dT/dbs|`` at ``bs``."""
        return float(self.alpha * self.A * bs ** -(self.alpha + 1))


class Decision(Struct, frozen=True, kw_only=True):
    """One controller decision with everything it was computed from."""

    batch_size: int
    reason: str
    fit: PowerLawFit | None = None
    tau: float | None = None
    target: float | None = None  # unrounded, unclipped bs*
    delays: dict[int, float] = {}
    n_train: int = 0


def _usable(x: float) -> bool:
    return math.isfinite(x) and x > 0


def fit_power_law(sizes: Sequence[float], epoch_times: Sequence[float]) -> PowerLawFit | None:
    """Least-squares fit of ``log T = log A - alpha * log bs``. Points with a non-positive or
    non-finite size or time are skipped; None if fewer than two distinct sizes remain."""
    if len(sizes) != len(epoch_times):
        raise ValueError("sizes and epoch_times must have the same length")
    pts = [
        (math.log(s), math.log(t))
        for s, t in zip(sizes, epoch_times, strict=True)
        if _usable(s) and _usable(t)
    ]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    slope = sxy / sxx
    try:
        A = math.exp(my - slope * mx)
    except OverflowError:  # absurdly steep data; callers see a non-finite A
        A = math.inf
    return PowerLawFit(A=A, alpha=-slope)


def choose_batch_size(
    delays: Mapping[int, float], n_train: int, settings: ControllerSettings
) -> Decision:
    """The paper's rule. Any bad input keeps the smallest candidate, with the reason."""
    inputs = {int(bs): float(d) for bs, d in delays.items()}

    def keep_smallest(why: str, fit: PowerLawFit | None = None) -> Decision:
        return Decision(
            batch_size=settings.clip(settings.smallest),
            reason=f"kept smallest size: {why}",
            fit=fit,
            delays=inputs,
            n_train=n_train,
        )

    if n_train < 1:
        return keep_smallest(f"n_train must be >= 1, got {n_train}")
    bad_sizes = sorted(bs for bs in inputs if bs < 1)
    if bad_sizes:
        return keep_smallest(f"non-positive batch sizes {bad_sizes}")
    bad = {bs: d for bs, d in sorted(inputs.items()) if not _usable(d)}
    if bad:
        return keep_smallest(f"timings not positive and finite: {bad}")
    if len(inputs) < 2:
        return keep_smallest(f"need timings for >= 2 sizes, got {len(inputs)}")
    sizes = sorted(inputs)
    fit = fit_power_law(sizes, [inputs[bs] * n_train / bs for bs in sizes])
    if fit is None:  # unreachable after the checks above; kept for type narrowing
        return keep_smallest("no fit")
    if not (math.isfinite(fit.A) and math.isfinite(fit.alpha)):
        return keep_smallest(f"fit out of float range (A={fit.A:.3g}, alpha={fit.alpha:.3g})", fit)
    if fit.alpha <= _FLAT:
        return keep_smallest(
            f"epoch time does not fall with batch size (alpha={fit.alpha:.3g})", fit
        )
    try:
        tau = settings.tau_fraction * fit.slope(settings.smallest)
        target = float((fit.alpha * fit.A / tau) ** (1 / (fit.alpha + 1)))
    except (OverflowError, ZeroDivisionError):
        return keep_smallest(f"fit out of float range (A={fit.A:.3g}, alpha={fit.alpha:.3g})", fit)
    if not math.isfinite(target):
        return keep_smallest(f"bs* out of float range (A={fit.A:.3g}, alpha={fit.alpha:.3g})", fit)
    size = settings.clip(target)
    clipped = (
        "" if size == round(target) else f", clipped to [{settings.min_size}, {settings.max_size}]"
    )
    return Decision(
        batch_size=size,
        reason=f"power-law fit alpha={fit.alpha:.3g}: bs*={target:.1f}{clipped}",
        fit=fit,
        tau=tau,
        target=target,
        delays=inputs,
        n_train=n_train,
    )


# A stream has no epoch: N only scales A, which cancels in bs*, so any positive N will do.
_STREAM_N = 1


class OnlineController:
    """Per-key controller for a stream: explore the grid (one window per candidate, in order),
    then settle on the fitted bs*; refit from per-size EWMAs of the observed window delays.
    ``backlog`` temporarily grows windows while traces pile up. Deterministic, no I/O besides logs.
    """

    def __init__(self, settings: ControllerSettings, *, key: str = "") -> None:
        self._settings = settings
        self._log = get_logger(__name__).bind(key=key)
        self._ewma: dict[int, float] = {}
        self._explored = 0  # windows of the grid observed so far
        self._fitted = settings.clip(settings.smallest)
        self._grown: int | None = None
        self.last: Decision | None = None

    @property
    def exploring(self) -> bool:
        return self._explored < len(self._settings.candidates)

    @property
    def fitted(self) -> int:
        return self._fitted

    def current(self) -> int:
        """The size the next window should close at."""
        if self.exploring:
            return self._settings.candidates[self._explored]
        return self._grown if self._grown is not None else self._fitted

    def observe(self, batch_size: int, delay_s: float) -> Decision | None:
        """Record one window (its actual size and delay). Returns a Decision when it refits."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not _usable(delay_s):
            # A broken clock must not poison the average; the window is not counted either.
            self._log.warning("controller_delay_rejected", batch_size=batch_size, delay_s=delay_s)
            return None
        a = self._settings.ewma
        old = self._ewma.get(batch_size)
        self._ewma[batch_size] = delay_s if old is None else a * delay_s + (1 - a) * old
        was_exploring = self.exploring
        if was_exploring:
            self._explored += 1
        if len(self._ewma) < 2:
            return None
        decision = choose_batch_size(self._ewma, _STREAM_N, self._settings)
        self.last = decision
        self._fitted = decision.batch_size
        self._log.info(
            "controller_decision",
            observed_size=batch_size,
            observed_delay_s=delay_s,
            batch_size=decision.batch_size,
            reason=decision.reason,
            A=decision.fit.A if decision.fit else None,
            alpha=decision.fit.alpha if decision.fit else None,
            tau=decision.tau,
            delays=decision.delays,
            exploring=self.exploring,
            next_size=self.current(),
        )
        if was_exploring and not self.exploring:
            self._log.info("controller_settled", batch_size=self._fitted, delays=decision.delays)
        return decision

    def backlog(self, pending: int) -> int:
        """Window size given ``pending`` traces queued for this key. Beyond ``backlog_factor``
        times the fitted size, grow to min(pending, max_size): bigger windows amortise the fixed
        LLM rounds (the tree costs two rounds whatever the size). Shrink back once it drains.
        Exploration windows are a measurement plan and are not resized."""
        if self.exploring:
            return self.current()
        s = self._settings
        grown = min(pending, s.max_size) if pending > s.backlog_factor * self._fitted else None
        if grown != self._grown:
            self._log.info(
                "controller_backlog",
                pending=pending,
                fitted=self._fitted,
                backlog_factor=s.backlog_factor,
                batch_size=grown if grown is not None else self._fitted,
            )
            self._grown = grown
        return self.current()


class BatchPolicy(Protocol):
    """Chooses each window's size for one key. The key's pipeline asks ``backlog(pending)``
    (streaming) or ``current()`` (offline) when a window fills, and reports every published
    window with ``observe``."""

    def current(self) -> int: ...

    def backlog(self, pending: int) -> int: ...

    def observe(self, batch_size: int, delay_s: float) -> Decision | None: ...


class FixedBatch:
    """Always the same size (``learning.batch_size = N``; ``sequential`` is FixedBatch(1))."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"batch size must be >= 1, got {size}")
        self.size = size

    def current(self) -> int:
        return self.size

    def backlog(self, pending: int) -> int:
        return self.size

    def observe(self, batch_size: int, delay_s: float) -> Decision | None:
        return None


def batch_policy(
    learning: LearningConfig,
    *,
    key: str = "",
    strategy_name: str | None = None,
    batch_size: int | None = None,
) -> BatchPolicy:
    """The batch-size policy of one key. ``batch_size`` overrides ``learning.batch_size``
    (None: take the config's, which may be ``"auto"``)."""
    spec = strategy(strategy_name or learning.strategy)
    if spec.window_size is not None:
        return FixedBatch(spec.window_size)
    size = batch_size if batch_size is not None else learning.batch_size
    if isinstance(size, int):
        return FixedBatch(size)
    settings = ControllerSettings(
        min_size=learning.min_batch_size, max_size=learning.max_batch_size
    )
    return OnlineController(settings, key=key)


__all__ = [
    "DEFAULT_CANDIDATES",
    "BatchPolicy",
    "ControllerSettings",
    "Decision",
    "FixedBatch",
    "OnlineController",
    "PowerLawFit",
    "batch_policy",
    "choose_batch_size",
    "fit_power_law",
]
