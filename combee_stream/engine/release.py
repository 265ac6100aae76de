"""Releases: what agents are served of each version, decided from the traces they send back.

A trace says which ``prompt_version`` its agent ran with, which ``session`` it was served to,
and how it scored (``feedback.score``, else ``passed`` as 1/0). Producers are untrusted: any of
them can write a trace claiming any version, so a trace is a **live sample** of a version only
if the engine can attribute it: it names a version (a trace that names none is no sample of
any) and a session, and, while a canary runs, that session's arm (a keyed hash of the session,
:func:`combee_stream.kafka.history.canary_arm`, the split agents are served by) is served that
version. A trace naming the candidate or production whose session's arm serves the other one is
**forged**; one with no session is **unattributed**; both are counted
(``combee_live_traces_total{outcome}``) and neither is a sample. With ``gate.canary`` or
``gate.rollback`` the engine keeps live scores per version of each key and moves its labels
(:func:`combee_stream.kafka.history.engine_move`, recorded with why):

- **Live canary.** A new version becomes ``candidate`` and production is pinned where it was;
  subscribers given a session id in the canary share (``gate.canary_fraction``, sticky by an
  HMAC of the key and the session with ``gate.canary_secret_env``) are served the candidate.
  After every ``gate.live_min_samples`` new samples of the candidate (and as many of
  production since the canary began), a look compares their mean scores: promoted when the
  lower bound of (candidate - production) is above ``-gate.margin`` and each side's samples
  come from at least ``gate.live_min_sessions`` distinct sessions, refused when its upper bound
  is below ``-gate.margin`` or the last of ``gate.live_max_looks`` looks has not shown it
  non-inferior. A refused line is reverted: the key's next window is committed onto
  production's playbook. Versions published while a canary runs wait; the newest becomes the
  next candidate.
- **A canary whose scores cannot be trusted is stopped.** Once ``gate.live_min_samples``
  scored traces have named its candidate or production, a share of them above
  ``gate.live_max_unattributed`` forged or unattributed stops it: the candidate label goes,
  production stays, the move's why gives the figures (``prompts labels``), an error line and
  ``combee_gate_reviews_total{gate="canary",outcome="stopped"}`` say so. The line is not
  reverted (nothing was measured against it); the next version starts a new canary. So does a
  canary whose split was keyed with another secret (the engine's changed under it).
- **Automatic rollback.** Production (after a promotion, or each new version while production
  follows latest) is watched against the version it replaced: when the upper bound of (new -
  replaced) falls below 0, production moves back, and the next window starts from it. After an
  automatic rollback production stays pinned until a canary promotes or an operator does.
  Its samples need a session too (no split to check them against: every session is served
  production).

The bound is Welch's normal interval of a difference of two means, at the one-sided level
(1 - ``gate.confidence``) / ``gate.live_max_looks`` per look: a Bonferroni split of the error
over the looks, so a test with its looks errs at most 1 - ``gate.confidence`` (the simplest
valid sequential design; an alpha-spending or always-valid test would decide sooner).

Decisions the issue leaves open: the scores live in memory (a restarted or new owner starts
counting again and resumes a canary the labels show; the traces read before the labels are
are held, a bounded number, and counted once they are); production's canary samples are the
ones since the canary began (both arms under the same conditions), while the version a
rollback compares with is judged on all its samples; label writes use the per-key
transactional id operators use (serialised with theirs), checked against ownership of the
key's partition first.
"""

from __future__ import annotations

import fnmatch
import math
import statistics
from collections.abc import Callable, Collection, Mapping
from typing import Final, Literal

import anyio
from aiokafka.errors import KafkaError
from msgspec import Struct

from combee_stream.config import Config
from combee_stream.engine.metrics import EngineMetrics
from combee_stream.kafka.history import (
    CANDIDATE,
    PRODUCTION,
    KeyHistory,
    canary_arm,
    canary_key_id,
    engine_move,
    partition_of,
    read_history,
)
from combee_stream.logs import get_logger
from combee_stream.schemas import Labels, Playbook, PromptUpdate, Trace

log = get_logger(__name__)

_VERSIONS_KEPT: Final = 16  # live tallies per key (the newest versions)
_PENDING_KEPT: Final = 1000  # scored traces of a key held until its labels are read

Outcome = Literal["sample", "forged", "unattributed", "no_version"]


class Tally(Struct):
    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, score: float) -> None:
        self.n += 1
        self.total += score
        self.squares += score * score

    def since(self, start: Tally) -> Tally:
        return Tally(self.n - start.n, self.total - start.total, self.squares - start.squares)

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    @property
    def variance(self) -> float:
        if self.n < 2:
            return 0.0
        return max(0.0, (self.squares - self.total * self.total / self.n) / (self.n - 1))


def bounds(a: Tally, b: Tally, z: float) -> tuple[float, float]:
    """Welch's interval of mean(a) - mean(b) at ``z``."""
    d = a.mean - b.mean
    half = z * math.sqrt(a.variance / max(1, a.n) + b.variance / max(1, b.n))
    return d - half, d + half


def live_score(trace: Trace) -> float | None:
    """What a trace says of the version it ran with: its score, else passed as 1/0."""
    if trace.feedback.score is not None:
        return min(1.0, max(0.0, trace.feedback.score))
    if trace.feedback.passed is not None:
        return 1.0 if trace.feedback.passed else 0.0
    return None


class Claim(Struct, frozen=True):
    """What one scored trace says: the version it ran with, the session, the score."""

    version: int
    session: str | None
    score: float


class Trial(Struct):
    """One sequential test: the versions in (``lo``, ``hi``], pooled, against ``baseline``
    (its tally from ``start`` on). A canary tests its candidate alone; a rollback watch, while
    production follows latest, every version production has served since the baseline."""

    baseline: int
    lo: int
    hi: int
    start: Tally
    looks: int = 0
    # A canary's distinct sessions behind the samples (each side), up to gate.live_min_sessions.
    tested_sessions: set[str] = set()
    base_sessions: set[str] = set()
    # Scored traces that named the candidate or production since the canary began, by outcome.
    claims: dict[str, int] = {}

    @property
    def version(self) -> int:
        return self.hi

    @property
    def untrusted(self) -> int:
        return self.claims.get("forged", 0) + self.claims.get("unattributed", 0)

    @property
    def claimed(self) -> int:
        return self.untrusted + self.claims.get("sample", 0)


class KeyRelease:
    def __init__(self) -> None:
        self.labels: Labels | None = None  # as last read or written (None: not loaded yet)
        self.scores: dict[int, Tally] = {}
        self.newest = 0
        self.canary: Trial | None = None
        self.watch: Trial | None = None
        self.queued = False
        # A line was refused: versions still built on it are not candidates; the next one is
        # the version that starts from production's playbook again (stats.reverted_to).
        self.reverting = 0  # > 0: versions still to skip (at most the one being published)
        self.pending: list[Claim] = []  # read before the labels were: counted once they are

    def pooled(self, lo: int, hi: int) -> Tally:
        out = Tally()
        for version, tally in self.scores.items():
            if lo < version <= hi:
                out = Tally(out.n + tally.n, out.total + tally.total, out.squares + tally.squares)
        return out

    def established(self, below: int, samples: int) -> int | None:
        """The newest version before ``below`` with ``samples`` live scores."""
        known = [v for v, t in self.scores.items() if v < below and t.n >= samples]
        return max(known, default=None)

    def tally(self, version: int) -> Tally:
        found = self.scores.get(version)
        if found is None:
            found = self.scores[version] = Tally()
            for old in sorted(self.scores)[:-_VERSIONS_KEPT]:
                del self.scores[old]
        return found


Job = tuple[str, PromptUpdate | None]  # (key, a version just published, or None: a look)


class Releaser:
    def __init__(
        self,
        config: Config,
        metrics: EngineMetrics,
        *,
        revert: Callable[[str, int, Playbook], bool],
        owned: Callable[[str], bool],
        env: Mapping[str, str] | None = None,
        canary_secret: str | None = None,
    ) -> None:
        if config.gate.canary and not canary_secret:
            raise ValueError("the live canary needs the canary secret (gate.canary_secret_env)")
        self._config = config
        self._gate = config.gate
        # The key of the canary split (the agents' PromptClient holds the same) and its id,
        # which the labels record when a canary starts.
        self._secret = canary_secret
        self._key_id = canary_key_id(canary_secret) if canary_secret else ""
        self._metrics = metrics
        self._revert = revert
        self._owned = owned
        self._env = env
        self._keys: dict[str, KeyRelease] = {}
        self._send, self._recv = anyio.create_memory_object_stream[Job](10_000)
        looks = self._gate.live_max_looks
        self._z = statistics.NormalDist().inv_cdf(1 - (1 - self._gate.confidence) / looks)

    @property
    def enabled(self) -> bool:
        return self._gate.canary or self._gate.rollback

    def applies(self, key: str) -> bool:
        return self.enabled and any(fnmatch.fnmatchcase(key, p) for p in self._gate.keys)

    # ------------------------------------------------------------------ what it is told

    def observe(self, trace: Trace) -> None:
        """A trace read for its key: a live sample of the version it ran with if it can be
        attributed to it (cheap; no I/O)."""
        if not self.applies(trace.key):
            return
        score = live_score(trace)
        if score is None:
            return
        if trace.prompt_version is None:
            self._metrics.live_traces.labels("no_version").inc()
            return
        state = self._keys.setdefault(trace.key, KeyRelease())
        claim = Claim(trace.prompt_version, trace.session, score)
        if state.labels is None:  # which versions are under test is not known yet
            if len(state.pending) < _PENDING_KEPT:
                state.pending.append(claim)
            self._queue(trace.key, None, state)
            return
        self._count(state, claim)
        if self._due(state):
            self._queue(trace.key, None, state)

    def _count(self, state: KeyRelease, claim: Claim) -> Outcome:
        canary = state.canary
        tested = canary is not None and claim.version in (canary.version, canary.baseline)
        if canary is not None and tested:
            outcome = self._attribute(state, canary, claim)
            canary.claims[outcome] = canary.claims.get(outcome, 0) + 1
        else:
            outcome = "sample" if claim.session is not None else "unattributed"
        self._metrics.live_traces.labels(outcome).inc()
        if outcome != "sample":
            return outcome
        assert claim.session is not None
        if canary is not None and tested:
            sessions = (
                canary.tested_sessions if claim.version == canary.version else canary.base_sessions
            )
            if len(sessions) < self._gate.live_min_sessions:
                sessions.add(claim.session)
        state.tally(claim.version).add(claim.score)
        return outcome

    def _attribute(self, state: KeyRelease, canary: Trial, claim: Claim) -> Outcome:
        """Whether ``claim`` (of the candidate or production) is one its session was served."""
        if claim.session is None or state.labels is None:
            return "unattributed"
        arm = canary_arm(state.labels, claim.session, self._secret)
        if arm is None:
            return "unattributed"  # (a split of another secret: the canary is being stopped)
        served = canary.version if arm else canary.baseline
        return "sample" if served == claim.version else "forged"

    def published(self, update: PromptUpdate) -> None:
        """A version of the key is durable."""
        if self.applies(update.key):
            state = self._keys.setdefault(update.key, KeyRelease())
            state.newest = max(state.newest, update.version)
            self._offer((update.key, update))

    def forget(self, key: str) -> None:
        """``key`` was evicted (idle): its tallies go; its labels are read again if it returns."""
        self._keys.pop(key, None)

    def drop_partitions(self, partitions: Collection[int]) -> None:
        """Their keys left this instance (revoked): their next owner counts afresh."""
        count = self._config.kafka.partitions
        for key in [k for k in self._keys if partition_of(k, count) in partitions]:
            del self._keys[key]

    def _queue(self, key: str, update: PromptUpdate | None, state: KeyRelease) -> None:
        if not state.queued:
            state.queued = True
            self._offer((key, update))

    def _offer(self, job: Job) -> None:
        # Never blocks the engine's intake or publisher: with the label writer stuck (Kafka
        # down) and the queue full, a job is dropped; the key's next version or look asks again.
        try:
            self._send.send_nowait(job)
        except anyio.WouldBlock:
            log.warning("release queue full: a label decision waits", key=job[0])
            if (state := self._keys.get(job[0])) is not None:
                state.queued = False

    def _ready(self, state: KeyRelease, trial: Trial | None) -> bool:
        """Whether ``trial`` has the samples for its next look."""
        if trial is None:
            return False
        step = self._gate.live_min_samples
        tested = state.pooled(trial.lo, trial.hi).n
        base = state.tally(trial.baseline).since(trial.start).n
        return tested >= (trial.looks + 1) * step and base >= step

    def _distrusted(self, state: KeyRelease) -> bool:
        """Whether the running canary has too many traces it cannot attribute."""
        canary = state.canary
        if canary is None or canary.claimed < self._gate.live_min_samples:
            return False
        return canary.untrusted > self._gate.live_max_unattributed * canary.claimed

    def _due(self, state: KeyRelease) -> bool:
        return (
            self._distrusted(state)
            or self._ready(state, state.canary)
            or self._ready(state, state.watch)
        )

    # ------------------------------------------------------------------ what it does

    async def run(self) -> None:
        """One job at a time: label moves of a key never interleave. A job that cannot reach
        Kafka is tried again a second later (the labels stay as they were meanwhile)."""
        async for key, update in self._recv:
            state = self._keys.get(key)
            if state is None or not self._owned(key):
                continue
            state.queued = False
            try:
                await self._job(key, state, update)
            except KafkaError as exc:
                self._metrics.broker_failures.labels("label").inc()
                log.warning("label move failed, retrying", key=key, error=str(exc))
                await anyio.sleep(1.0)
                self._offer((key, update))

    async def _job(self, key: str, state: KeyRelease, update: PromptUpdate | None) -> None:
        if state.labels is None:
            await self._load(key, state)
        if update is not None:
            await self._on_published(key, state, update)
        while self._due(state):
            if self._distrusted(state):
                await self._stop(key, state)
            else:
                await self._look(key, state)

    async def _load(self, key: str, state: KeyRelease) -> None:
        history = await read_history(self._config.kafka, key, self._env)
        state.labels = history.labels
        state.newest = max(state.newest, history.newest or 0)
        candidate = history.labels.labels.get(CANDIDATE)
        if self._gate.canary and candidate is not None:
            production = self._production(history.labels, candidate)
            state.canary = _canary(candidate, production, state)
            log.info("canary resumed", key=key, candidate=candidate, production=production)
            if history.labels.canary_key != self._key_id:
                # Split by another key (or by the public hash of an older engine): no trace
                # of it can be attributed with this one.
                why = (
                    f"canary stopped: v{candidate}'s split was keyed with another canary "
                    f"secret than this engine's ({self._gate.canary_secret_env}); the next "
                    "version starts a canary on this one"
                )
                await self._stop(key, state, why)
        pending, state.pending = state.pending, []
        for claim in pending:
            self._count(state, claim)

    @staticmethod
    def _production(labels: Labels, newest: int) -> int:
        return labels.production if labels.production is not None else newest

    async def _on_published(self, key: str, state: KeyRelease, update: PromptUpdate) -> None:
        assert state.labels is not None
        labels = state.labels
        if state.reverting:
            state.reverting = 0 if update.stats.reverted_to is not None else state.reverting - 1
            if update.stats.reverted_to is None:
                return
        if self._gate.canary:
            if state.canary is None:
                await self._start_canary(key, state, update.version, update.parent_version)
        elif self._gate.rollback and labels.production is None and not labels.approval:
            # Production follows latest: it has served every version since the last one agents
            # used long enough to judge (the baseline), and is judged on all of them.
            if state.watch is not None:
                state.watch.hi = update.version
            else:
                base = state.established(update.version, self._gate.live_min_samples)
                if base is not None:
                    state.watch = Trial(base, base, update.version, Tally())

    async def _start_canary(self, key: str, state: KeyRelease, version: int, parent: int) -> None:
        assert state.labels is not None
        production = self._production(state.labels, max(0, parent))
        history = await self._move(
            key,
            {PRODUCTION: production, CANDIDATE: version},
            why=f"canary: v{version} to {self._gate.canary_fraction:.0%} of sessions",
            canary=self._gate.canary_fraction,
            canary_key=self._key_id,
            state=state,
        )
        if history is not None:
            state.canary = _canary(version, production, state)
            log.info("canary started", key=key, candidate=version, production=production)

    async def _look(self, key: str, state: KeyRelease) -> None:
        gate = self._gate
        canary, watch = state.canary, state.watch
        if canary is not None and self._ready(state, canary):
            canary.looks += 1
            tested = state.pooled(canary.lo, canary.hi)
            base = state.tally(canary.baseline).since(canary.start)
            low, high = bounds(tested, base, self._z)
            summary = (
                f"live score {tested.mean:.3f} (n={tested.n}) vs production v{canary.baseline} "
                f"{base.mean:.3f} (n={base.n}), difference in [{low:+.3f}, {high:+.3f}]"
            )
            need = gate.live_min_sessions
            sessions = min(len(canary.tested_sessions), len(canary.base_sessions))
            if sessions < need:
                summary += (
                    f"; sessions: {len(canary.tested_sessions)} on v{canary.version}, "
                    f"{len(canary.base_sessions)} on production, fewer than "
                    f"gate.live_min_sessions = {need}"
                )
            if low > -gate.margin and sessions >= need:
                await self._promote(key, state, canary, f"canary passed: {summary}")
            elif high < -gate.margin or canary.looks >= gate.live_max_looks:
                await self._refuse(key, state, canary, f"canary refused: {summary}")
            return
        if watch is not None and self._ready(state, watch):
            watch.looks += 1
            tested, base = state.pooled(watch.lo, watch.hi), state.tally(watch.baseline)
            low, high = bounds(tested, base, self._z)
            if high < 0:
                served = (
                    f"v{watch.hi}" if watch.hi == watch.lo + 1 else f"v{watch.lo + 1}-{watch.hi}"
                )
                why = (
                    f"rollback: production {served} live score {tested.mean:.3f} "
                    f"(n={tested.n}) below v{watch.baseline} {base.mean:.3f} (n={base.n}), "
                    f"difference in [{low:+.3f}, {high:+.3f}]"
                )
                await self._rollback(key, state, watch, why)
            elif watch.looks >= gate.live_max_looks:
                state.watch = None  # it held up: trusted
            return

    async def _promote(self, key: str, state: KeyRelease, trial: Trial, why: str) -> None:
        nxt = state.newest if state.newest > trial.version else None
        history = await self._move(
            key, {PRODUCTION: trial.version, CANDIDATE: nxt}, why=why, state=state
        )
        if history is None:
            return
        self._metrics.gate_reviews.labels("canary", "accepted").inc()
        log.info("candidate promoted", key=key, version=trial.version, why=why)
        state.canary = None
        if self._gate.rollback:
            state.watch = Trial(trial.baseline, trial.version - 1, trial.version, Tally())
        if nxt is not None:
            state.canary = _canary(nxt, trial.version, state)

    async def _stop(self, key: str, state: KeyRelease, why: str | None = None) -> None:
        """The canary's live scores cannot be trusted: no candidate, production stays, the line
        is not reverted (the next version is the next candidate)."""
        canary = state.canary
        assert canary is not None
        if why is None:
            c = canary.claims
            why = (
                f"canary stopped: {canary.untrusted} of {canary.claimed} scored traces naming "
                f"v{canary.version} or production v{canary.baseline} "
                f"({canary.untrusted / canary.claimed:.0%}) are no sample of it "
                f"({c.get('forged', 0)} forged: their session's arm is served the other version; "
                f"{c.get('unattributed', 0)} name no session), above "
                f"gate.live_max_unattributed = {self._gate.live_max_unattributed:g}: its live "
                f"scores cannot be trusted (agents without {self._gate.canary_secret_env}, "
                "or a producer claiming versions)"
            )
        history = await self._move(key, {CANDIDATE: None}, why=why, state=state)
        state.canary = None  # (not owned any more: its next owner judges)
        if history is None:
            return
        self._metrics.gate_reviews.labels("canary", "stopped").inc()
        log.error("canary stopped", key=key, version=canary.version, why=why)

    async def _refuse(self, key: str, state: KeyRelease, trial: Trial, why: str) -> None:
        history = await self._move(key, {CANDIDATE: None}, why=why, state=state)
        if history is None:
            return
        self._metrics.gate_reviews.labels("canary", "rejected").inc()
        log.warning("candidate refused", key=key, version=trial.version, why=why)
        state.canary = None
        self._revert_to(key, history, trial.baseline)

    async def _rollback(self, key: str, state: KeyRelease, trial: Trial, why: str) -> None:
        history = await self._move(
            key, {PRODUCTION: trial.baseline, CANDIDATE: None}, why=why, state=state
        )
        if history is None:
            return
        self._metrics.gate_reviews.labels("rollback", "rolled_back").inc()
        log.warning("production rolled back", key=key, to=trial.baseline, why=why)
        state.watch = state.canary = None
        self._revert_to(key, history, trial.baseline)

    def _revert_to(self, key: str, history: KeyHistory, version: int) -> None:
        target = history.versions.get(version)
        if target is None and version != 0:
            log.error("cannot revert: version no longer in the history", key=key, to=version)
            return
        playbook = target.playbook if target is not None else Playbook(key=key)
        # The pipeline commits its next window onto it; a version already committed and being
        # published when this is asked is the only one still built on the refused line.
        if self._revert(key, version, playbook):
            self._keys[key].reverting = 2

    async def _move(
        self,
        key: str,
        changes: dict[str, int | None],
        *,
        why: str,
        state: KeyRelease,
        canary: float | None = None,
        canary_key: str | None = None,
    ) -> KeyHistory | None:
        if not self._owned(key):
            return None
        history = await engine_move(
            self._config.kafka, key, changes, why=why, canary=canary, canary_key=canary_key,
            env=self._env,
        )  # fmt: skip
        state.labels = history.labels
        return history


def _canary(candidate: int, production: int, state: KeyRelease) -> Trial:
    """The candidate alone against production's scores from now on."""
    now = state.tally(production)
    return Trial(production, candidate - 1, candidate, Tally(now.n, now.total, now.squares))


__all__ = ["Releaser", "Tally", "bounds", "live_score"]
