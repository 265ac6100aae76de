"""The learning core: one window of traces -> one new playbook version (Map, Shuffle, Reduce).

Used by offline learning (``combee-stream learn``), the Kafka engine and the benchmarks, so it
does no I/O besides LLM (and optional embedding) calls.

One window:

1. **Map** — reflect every trace in parallel against the frozen snapshot. A trace whose
   reflector call fails after the client's retries lands in ``WindowResult.failed`` with the
   reason (the caller decides whether to retry it in a later window); it is never dropped.
2. **Tags** — all bullet tags of the window are collected once; the curators see the snapshot
   with them applied (as the reference ACE-batch code does), the final delta carries them.
3. **Shuffle + tree** (:mod:`combee_stream.core.scan`) on the frozen snapshot; each curator's
   ADDs get their worked examples there (:mod:`combee_stream.core.worked_examples`).
4. **Apply** the merged delta (tags, operations, provenance) with the token budget and the
   optional semantic dedup: the commit ladder (:mod:`combee_stream.core.commit`), whose
   consolidation is :mod:`combee_stream.core.consolidation`.

``learn_window`` = ``propose`` (steps 1-3, all the LLM work, on a frozen snapshot) + ``commit``
(step 4). A streaming caller can propose window w+1 while window w is still in flight and commit
each proposal onto the newest version: ``commit`` rebases a delta computed on an older snapshot
(drops operations on bullets that are gone and ADDs already present) before applying it.

Decisions (Combee notes §8):

- **Determinism.** Records are sorted by source before the shuffle and the RNG is seeded from
  (seed, key, snapshot version, the window's trace ids), so a retried or resumed window groups
  exactly as before and every LLM request is replayed from the completion memo.
- **The first curator warms the cache.** The paper sends a window's k curators at once; here
  the others wait for the first one's reply (``learning.warm_curator_cache``), so the head
  their prompts share (instructions, then the playbook) is in the server's prompt cache. The
  requests are the same either way; only when they are sent changes.
- **Failures (§8.10).** A failed reflector call costs only its trace (reported). A failed
  curator, combiner or embedding call fails the window (:class:`WindowError`) and nothing is
  applied: dropping a group would silently lose lessons. Retrying the window is cheap because
  the client memoizes finished calls.
- **Budget rejection.** If the merged delta would exceed the token budget it is rejected with its
  structured reason; the window still records its traces and tags (a tags-only delta, or an
  empty one if even that does not fit), so every window yields exactly one new version and the
  traces are not learned twice.
- **Size.** A version must fit the prompts and history topics (``kafka.max_message_bytes``):
  ``update_size`` (given with ``max_update_bytes``: the wiring's is
  :func:`~combee_stream.kafka.sizes.update_bytes`, a record batch) and the driver's chain give
  the exact bytes of the version a result makes (its encoded ``PromptUpdate``, held-out tasks
  and JSON escaping included). A candidate over it falls back like a
  budget rejection, with a ``SizeRejection``, before the gate reviews it; whatever the fallbacks
  and the gate made is measured again, and if it is over, the window becomes its smallest
  version (:meth:`Learner.size_rejected`). So no window can block its key on a record the
  broker refuses.
- **Gate.** A delta that fits goes to the publish gate (:mod:`combee_stream.core.gate`). A
  refused candidate falls back to provenance only (no operations, no tags: nothing of the
  refused window reaches the prompt), again one version, its traces learned-and-rejected.
- **Held out.** With the replay gate, some traces with a ground truth are not learned
  (:mod:`combee_stream.core.holdout`): the window's version consumes them (its watermark and
  ``stats.held_out``) and carries them in the key's held-out tasks; a window of held-out traces
  only still yields a version (unchanged playbook), so their offsets are committed like any.

:func:`combee_stream.wiring.build_learner` is the one constructor of a configured learner
(strategy, scan parameters, prompts, embeddings, gate, size bound); a driver is handed it as a
:data:`LearnerFactory`.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import anyio
import msgspec

from combee_stream.config import Config, LearningConfig
from combee_stream.core.calls import LLM, CurationContext, LearnerCalls
from combee_stream.core.commit import Commit, size_rejected
from combee_stream.core.consolidation import Consolidator
from combee_stream.core.delta import canonical, empty, merge
from combee_stream.core.gate import AcceptAll, PublishGate
from combee_stream.core.holdout import HoldoutPolicy
from combee_stream.core.hygiene import (
    DEFAULT_POLICY,
    NO_LESSON,
    as_rule,
    compile_policy,
    review_adds,
    review_edits,
    without_rendered_prefix,
)
from combee_stream.core.outputs import (
    CuratorOutput,
    ExampleCheck,
    ReflectorOutput,
    ReflectorOutputNoTags,
)
from combee_stream.core.playbook import (
    ApplyResult,
    EmbedFn,
    SkippedOp,
    SkipReason,
    apply,
    apply_semantic,
    covered_lessons,
    normalize,
)
from combee_stream.core.prompts import (
    Prompts,
    ReflectionRecord,
    combiner_messages,
    curator_messages,
    reflector_messages,
)
from combee_stream.core.results import (
    FailedTrace,
    Proposal,
    UpdateSize,
    WindowError,
    WindowResult,
    WindowStats,
)
from combee_stream.core.scan import (
    ScanParams,
    StrategySpec,
    augmented_shuffle,
    plan,
    reduce_tree,
    strategy,
)
from combee_stream.core.worked_examples import Exemplifier
from combee_stream.llm import LLMCallError, LLMClient, Role
from combee_stream.logs import get_logger
from combee_stream.schemas import (
    AddOp,
    BulletTag,
    Delta,
    HeldOutTask,
    Holdout,
    Operation,
    Playbook,
    Reflection,
    RemoveOp,
    Source,
    Trace,
    UpdateOp,
)

log = get_logger(__name__)


def _window_rng(seed: int, key: str, version: int, sources: Sequence[Source]) -> random.Random:
    material = f"{seed}|{key}|{version}|" + ",".join(s.trace_id for s in sources)
    return random.Random(int.from_bytes(hashlib.sha256(material.encode()).digest()[:8], "big"))


def required_roles(config: Config, strategy_name: str | None = None) -> list[Role | str]:
    """The LLM roles (and ``embeddings``) a learner with these settings calls."""
    spec = strategy(strategy_name or config.learning.strategy)
    roles: list[Role | str] = ["reflector", "curator"]
    if config.learning.combine == "llm" and not spec.single_group:
        roles.append("combiner")
    if config.llm.embeddings.enabled:
        roles.append("embeddings")
    if (config.gate.replay or config.gate.check_lessons) and config.gate.evaluator == "agent":
        roles.append("agent")  # the gate answers held-out (or retried) tasks itself
        if config.gate.scorer == "judge":
            roles.append("judge")
    return roles


class Learner:
    """Learns one window at a time; holds no playbook state (the caller owns the versions).
    Everything it works with is given: the LLM, the prompts, the gate, the size bound."""

    def __init__(
        self,
        llm: LLM,
        learning: LearningConfig,
        *,
        prompts: Prompts,
        embed: EmbedFn | None = None,
        dedup_threshold: float = 0.9,
        strategy_name: str | None = None,
        gate: PublishGate | None = None,
        holdout: HoldoutPolicy | None = None,
        max_update_bytes: int | None = None,
        update_size: UpdateSize | None = None,
        string_bounds: Mapping[str, int] | None = None,
        check_example: ExampleCheck | None = None,
    ) -> None:
        if (max_update_bytes is None) != (update_size is None):
            raise ValueError("max_update_bytes and update_size bound a version together")
        self._calls = LearnerCalls(llm)
        self.holdout = holdout
        self.max_update_bytes = max_update_bytes  # what a version may take (None: unbounded)
        self.update_size = update_size  # how many bytes a version takes (what bounds it)
        self._config = learning
        defaults = DEFAULT_POLICY if learning.default_content_policy else ()
        self._policy = compile_policy([*defaults, *learning.content_policy])
        self._embed = embed
        self._threshold = dedup_threshold
        self._gate: PublishGate = gate or AcceptAll()
        # The longest string each role's reply grammar allows (llm.<role>.max_string_chars):
        # a text that long ending mid-sentence was cut there (see tidied).
        self._bounds = dict(string_bounds or {})
        self._prompts = prompts
        context = CurationContext(
            self._calls, learning, prompts, self._policy, self._bounds.get("curator", 0)
        )
        self._exemplifier = Exemplifier(context, check=check_example)
        # Public: what the commit ladder consolidates with, and a test or tool can too.
        self.consolidator = Consolidator(context, embed=embed)
        self.spec: StrategySpec = strategy(strategy_name or learning.strategy)
        self.params = ScanParams(
            duplication=learning.duplication,
            fan_in=learning.fan_in,
            combine=learning.combine,
            single_group=self.spec.single_group,
        )

    async def learn_window(
        self,
        playbook: Playbook,
        traces: Sequence[tuple[Trace, Source]],
        *,
        progress: str = "",
    ) -> WindowResult:
        """Propose on ``playbook`` and commit onto it: the offline, one-window-at-a-time path."""
        return await self.commit(await self.propose(playbook, traces, progress=progress), playbook)

    async def propose(
        self,
        playbook: Playbook,
        traces: Sequence[tuple[Trace, Source]],
        *,
        progress: str = "",
    ) -> Proposal:
        """All the LLM work of a window (Map, tags, Shuffle, Reduce) on the frozen ``playbook``;
        nothing is applied. Raises :class:`WindowError` if the tree cannot be reduced."""
        started = anyio.current_time()
        key = playbook.key
        for trace, _ in traces:
            if trace.key != key:
                raise ValueError(
                    f"trace {trace.trace_id!r} of key {trace.key!r} in window of {key!r}"
                )
        if self.spec.window_size is not None and len(traces) > self.spec.window_size:
            raise ValueError(
                f"strategy {self.spec.name!r} learns {self.spec.window_size} trace(s) per window, "
                f"got {len(traces)}"
            )
        stats = WindowStats(strategy=self.spec.name, traces=len(traces))
        snapshot = playbook

        # ---- Map: reflect every trace against the frozen snapshot.
        outcomes: list[ReflectionRecord | FailedTrace] = []

        async def reflect(trace: Trace, source: Source) -> None:
            outcomes.append(await self.reflect(snapshot, trace, source, stats))

        async with anyio.create_task_group() as tg:
            for trace, source in traces:
                tg.start_soon(reflect, trace, source)
        records = [o for o in outcomes if isinstance(o, ReflectionRecord)]
        failed = [o for o in outcomes if isinstance(o, FailedTrace)]
        return await self.reduce(
            snapshot, records, failed, stats, progress=progress, started=started
        )

    async def reflect(
        self, snapshot: Playbook, trace: Trace, source: Source, stats: WindowStats
    ) -> ReflectionRecord | FailedTrace:
        """Map, one trace: the reflector's diagnosis against ``snapshot``. The streaming engine
        calls this the moment a trace arrives; a failure after the client's retries is returned
        (never raised, never dropped)."""
        if self._unread(trace):
            # Learned all the same (its provenance joins the window's), at no call.
            return ReflectionRecord.of(trace, Reflection(key=snapshot.key, source=source))
        messages = reflector_messages(self._prompts, snapshot, trace)
        try:
            if trace.bullet_ids:
                out = await self._calls("reflector", messages, ReflectorOutput, stats)
            else:
                bare = await self._calls("reflector", messages, ReflectorOutputNoTags, stats)
                out = ReflectorOutput(**msgspec.structs.asdict(bare))
        except LLMCallError as exc:
            return FailedTrace(source=source, reason=str(exc))
        # Only the bullets the agent says it used can be credited or blamed: a reflector that
        # tags others (real models do) would pile counts on bullets no agent ever read.
        cited = set(list(dict.fromkeys(trace.bullet_ids))[: self._config.max_tags_per_trace])
        tags = [t for t in dict.fromkeys(out.bullet_tags) if t.bullet_id in cited]
        stats.uncited_tags += len(out.bullet_tags) - len(tags)
        reflection = Reflection(
            key=snapshot.key,
            source=source,
            error_identification=out.error_identification,
            root_cause=out.root_cause_analysis,
            correct_approach=out.correct_approach,
            # The curator copies the insight: what is no part of the rule goes before it does.
            key_insight=as_rule(out.key_insight, self._bounds.get("reflector", 0)),
            bullet_tags=tags,
        )
        return ReflectionRecord.of(trace, reflection, keep_trace=self._config.worked_examples)

    def _unread(self, trace: Trace) -> bool:
        """A success the reflector does not read (``learning.reflect_successes``)."""
        which = self._config.reflect_successes
        if which == "all" or trace.feedback.passed is not True:
            return False
        return which == "none" or not trace.bullet_ids

    def new_stats(self, traces: int = 0) -> WindowStats:
        return WindowStats(strategy=self.spec.name, traces=traces)

    async def reduce(
        self,
        snapshot: Playbook,
        reflected: Sequence[ReflectionRecord],
        failed: Sequence[FailedTrace],
        stats: WindowStats,
        *,
        progress: str = "",
        started: float | None = None,
    ) -> Proposal:
        """Tags, Shuffle and Reduce of a window's reflections on the frozen ``snapshot`` (the
        reflections may come from older snapshots: tags of bullets that are gone are skipped
        on apply). Raises :class:`WindowError` if the tree cannot be reduced."""
        started = anyio.current_time() if started is None else started
        key = snapshot.key
        records = sorted(reflected, key=lambda rec: rec.reflection.source)
        failed = sorted(failed, key=lambda f: f.source)
        stats.reflected = len(records)
        stats.failed = len(failed)
        done = [rec.reflection for rec in records]
        # Only reflections with a lesson go to the curators (a success the reflector did not
        # read, or whose lesson is "none", adds its tags and provenance, not a record).
        lessons = await self._uncovered(
            snapshot, [rec for rec in records if teaches(rec.reflection)], stats
        )
        if records and not lessons:
            nothing = Delta(
                key=key,
                tags=[t for rec in records for t in rec.reflection.bullet_tags],
                sources=[rec.reflection.source for rec in records],
                base_version=snapshot.version,
            )
            stats.rounds = 1
            stats.delay_s = anyio.current_time() - started
            return Proposal(
                key, snapshot.version, canonical(nothing), failed, done, stats,
                tasks=[rec.reviewed for rec in records if rec.task],
            )  # fmt: skip
        if not records:
            stats.rounds = 1 if failed else 0  # a Map whose every reflection failed
            stats.delay_s = anyio.current_time() - started
            return Proposal(
                key, snapshot.version, empty(key, snapshot.version), failed, done, stats
            )

        # ---- Tags: applied once; the curators see the tagged snapshot.
        sources = [rec.reflection.source for rec in records]
        tags: list[BulletTag] = [t for rec in records for t in rec.reflection.bullet_tags]
        base = Delta(key=key, tags=tags, sources=sources, base_version=snapshot.version)
        tagged = apply(snapshot, Delta(key=key, tags=tags), token_budget=None).playbook

        # ---- Shuffle + tree (of the reflections with a lesson).
        window_plan = plan(len(lessons), self.params)
        stats.groups, stats.duplication = window_plan.groups, window_plan.duplication
        rng = _window_rng(self._config.seed, key, snapshot.version, sources)
        groups = augmented_shuffle(lessons, window_plan.duplication, window_plan.groups, rng)
        budget = self._config.token_budget

        add_tasks: dict[str, list[str]] = {}
        add_traces: dict[str, list[str]] = {}
        remove_votes: Counter[str] = Counter()
        # The first curator warms the server's prompt cache for the others (see
        # LearningConfig.warm_curator_cache): they wait for its reply, answered or not.
        warm = self._config.warm_curator_cache and window_plan.groups > 1
        warmed = anyio.Event()
        first_sent = False

        async def curate(group: Sequence[ReflectionRecord]) -> Delta:
            nonlocal first_sent
            messages = curator_messages(
                self._prompts, tagged, group, progress=progress, token_budget=budget
            )
            if warm and first_sent:
                await warmed.wait()
            first_sent = True
            try:
                out = await self._calls("curator", messages, CuratorOutput, stats)
            finally:
                warmed.set()
            operations = tidied(out.operations, self._bounds.get("curator", 0))
            if self._config.worked_examples:
                operations, shown = await self._exemplifier.exemplified(operations, group, stats)
            else:
                shown = {}
            group_tasks = [rec.reviewed for rec in group if rec.task]
            group_traces = [rec.reflection.source.trace_id for rec in group]
            for op in operations:
                if isinstance(op, AddOp):
                    norm = normalize(op.content)
                    add_tasks.setdefault(norm, []).extend(group_tasks)
                    # The lesson check does not retry the task an example answers.
                    traces = [t for t in group_traces if t != shown.get(norm)]
                    add_traces.setdefault(norm, []).extend(traces)
            remove_votes.update({op.bullet_id for op in operations if isinstance(op, RemoveOp)})
            return Delta(
                key=key,
                operations=operations,
                sources=sorted({rec.reflection.source for rec in group}),
                base_version=snapshot.version,
            )

        async def combine(partials: Sequence[Delta]) -> Delta:
            messages = combiner_messages(self._prompts, tagged, partials, token_budget=budget)
            out = await self._calls("combiner", messages, CuratorOutput, stats)
            return Delta(
                key=key,
                operations=tidied(out.operations, self._bounds.get("combiner", 0)),
                base_version=snapshot.version,
            )

        try:
            tree_delta, tree = await reduce_tree(
                key,
                groups,
                curate,
                combine=combine if self.params.combine == "llm" else None,
                fan_in=self.params.fan_in,
            )
        except LLMCallError as exc:
            raise WindowError(key, str(exc)) from exc
        stats.max_curator_items = tree.max_curator_items
        stats.max_combiner_items = tree.max_combiner_items
        stats.rounds = 1 + 1 + tree.combine_rounds  # the Map, level 1, LLM combine levels
        stats.delay_s = anyio.current_time() - started
        tasks = [rec.reviewed for rec in records if rec.task]
        # A union keeps any one curator's REMOVE: with k groups a bullet would have k chances
        # per window to be deleted. A REMOVE stands only when at least half the groups that
        # saw the playbook propose it (each sees it whole, so each could have).
        minority = [
            op
            for op in tree_delta.operations
            if isinstance(op, RemoveOp) and 2 * remove_votes[op.bullet_id] < window_plan.groups
        ]
        if minority:
            kept_ops = [op for op in tree_delta.operations if op not in minority]
            tree_delta = msgspec.structs.replace(tree_delta, operations=kept_ops)
        return Proposal(
            key, snapshot.version, merge(base, tree_delta), failed, done, stats, tasks=tasks,
            quoted=list(dict.fromkeys(q for rec in records for q in rec.quoted)),
            add_tasks={k: list(dict.fromkeys(v)) for k, v in add_tasks.items()},
            skipped=[SkippedOp(op=op, reason="minority_remove") for op in minority],
            add_traces={k: list(dict.fromkeys(v)) for k, v in add_traces.items()},
            retries=[task for rec in lessons if (task := rec.retry) is not None],
        )  # fmt: skip

    async def _uncovered(
        self, snapshot: Playbook, lessons: list[ReflectionRecord], stats: WindowStats
    ) -> list[ReflectionRecord]:
        """The lessons the playbook does not state yet (``learning.skip_covered_lessons``):
        those whose key insight a bullet states (the dedup's measure and threshold) are not
        shown to the curators; counted in ``stats.covered_lessons``."""
        if self._embed is None or not self._config.skip_covered_lessons or not lessons:
            return lessons
        blamed = [
            {t.bullet_id for t in rec.reflection.bullet_tags if t.tag == "harmful"}
            for rec in lessons
        ]
        insights = [rec.reflection.key_insight for rec in lessons]
        try:
            covered = set(
                await covered_lessons(snapshot, insights, self._embed, self._threshold, blamed)
            )
        except (LLMCallError, ValueError) as exc:
            raise WindowError(snapshot.key, f"embedding lessons: {exc}") from exc
        stats.covered_lessons = len(covered)
        return [rec for i, rec in enumerate(lessons) if i not in covered]

    def held_out(self, trace: Trace) -> HeldOutTask | None:
        """The held-out task ``trace`` is kept as instead of being learned (the replay gate),
        or None."""
        return self.holdout.held_out(trace) if self.holdout is not None else None

    async def commit(
        self,
        proposal: Proposal,
        onto: Playbook,
        *,
        holdout: Holdout | None = None,
        held_out: Sequence[Source] = (),
        measure: Callable[[WindowResult], int] | None = None,
    ) -> WindowResult:
        """Apply a proposal to ``onto`` — its own snapshot, or a newer version of the same key,
        in which case the delta is first rebased — through the commit ladder
        (:mod:`~combee_stream.core.commit`: budget, consolidation, size, gate, blame-prune,
        fallbacks, re-review, final size). ``holdout``: the key's held-out tasks with the
        window's ``held_out`` traces already in them. ``measure``: the bytes of the version a
        result makes (the driver's :meth:`~combee_stream.core.versions.KeyChain.measure`),
        bounded by the learner's ``max_update_bytes``; without it nothing bounds the size."""
        merge_similar = self._embed is not None and self._config.merge_similar
        similar = self.consolidator.merge_similar if merge_similar else None
        ladder = Commit(
            proposal, onto, learning=self._config, gate=self._gate, review=self._apply,
            consolidate=self.consolidator.consolidate, max_update_bytes=self.max_update_bytes,
            holdout=holdout, held_out=held_out, measure=measure, merge_similar=similar,
        )  # fmt: skip
        return await ladder.run()

    def size_rejected(self, result: WindowResult, onto: Playbook, would_be: int) -> WindowResult:
        """``result``'s window as its smallest version, rejected for size
        (:func:`~combee_stream.core.commit.size_rejected`): what a driver publishes when the
        broker refuses ``result``'s record (``would_be``: its size)."""
        return size_rejected(result, onto, would_be, self.max_update_bytes)

    async def _apply(
        self,
        snapshot: Playbook,
        delta: Delta,
        tasks: Sequence[str],
        *,
        budget: int | None = -1,
        own_tasks: Mapping[str, Sequence[str]] | None = None,
        refused: Sequence[SkippedOp] = (),
        quoted: Sequence[str] = (),
    ) -> ApplyResult:
        """The review (:mod:`~combee_stream.core.hygiene`: ADDs, UPDATEs and REMOVEs), then the
        delta applied within ``budget`` (default: the token budget; None: no limit)."""
        limit, policy = self._config.max_bullet_chars, self._policy
        rejected = review_adds(
            snapshot, delta, tasks, max_chars=limit, policy=policy, own_tasks=own_tasks,
            quoted=quoted, examples=self._config.worked_examples,
        )  # fmt: skip
        edits = review_edits(snapshot, delta, max_chars=limit, policy=policy, quoted=quoted)
        refused = [*refused, *edits]
        if refused:
            drop = [r.op for r in refused]
            kept = [op for op in delta.operations if op not in drop]
            delta = msgspec.structs.replace(delta, operations=kept)
        limit_tokens = self._config.token_budget if budget == -1 else budget
        result = await self._apply_reviewed(snapshot, delta, rejected, limit_tokens)
        result.skipped = [*result.skipped, *refused]
        return result

    async def _apply_reviewed(
        self, snapshot: Playbook, delta: Delta, rejected: dict[int, SkipReason], budget: int | None
    ) -> ApplyResult:
        if self._embed is None:
            return apply(snapshot, delta, token_budget=budget, skip_adds=rejected)
        try:
            return await apply_semantic(
                snapshot,
                delta,
                token_budget=budget,
                embed=self._embed,
                threshold=self._threshold,
                skip_adds=rejected,
            )
        except LLMCallError as exc:
            raise WindowError(snapshot.key, f"embedding dedup: {exc}") from exc


def tidied(operations: Sequence[Operation], bound: int) -> list[Operation]:
    """The operations with a last sentence that the grammar's length bound (``bound``
    characters a string, 0: none) cut short dropped from their text
    (:func:`~combee_stream.core.hygiene.without_cut_sentence`): a grammar-bounded small model
    writes to the bound, and what it was saying when cut is no part of a rule. A leading copy
    of the playbook's line format is cut too
    (:func:`~combee_stream.core.hygiene.without_rendered_prefix`), and so are sentences that
    narrate the trace rather than state the rule
    (:func:`~combee_stream.core.hygiene.without_narration`)."""
    out: list[Operation] = []
    for op in operations:
        if isinstance(op, AddOp | UpdateOp):
            content = as_rule(without_rendered_prefix(op.content), bound)
            op = msgspec.structs.replace(op, content=content)
        out.append(op)
    return out


def teaches(reflection: Reflection) -> bool:
    """Whether a reflection has a lesson for the curators (its key insight is not empty or
    "none", as the reflector is told to answer when a success needed nothing)."""
    return normalize(reflection.key_insight) not in NO_LESSON


# How a driver gets its learner: from the config it runs with and the LLM client it made.
LearnerFactory = Callable[[Config, LLMClient], Learner]


__all__ = ["Learner", "LearnerFactory", "required_roles", "teaches"]
