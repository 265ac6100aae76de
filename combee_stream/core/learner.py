"""The learning core: one window of traces -> one new playbook version (Map, Shuffle, Reduce).

Used by offline learning (``combee-stream learn``), the Kafka engine and the benchmarks, so it
does no I/O besides LLM (and optional embedding) calls.

One window:

1. **Map** — reflect every trace in parallel against the frozen snapshot. A trace whose
   reflector call fails after the client's retries lands in ``WindowResult.failed`` with the
   reason (the caller decides whether to retry it in a later window); it is never dropped.
2. **Tags** — all bullet tags of the window are collected once; the curators see the snapshot
   with them applied (as the reference ACE-batch code does), the final delta carries them.
3. **Shuffle + tree** (:mod:`combee_stream.core.scan`) on the frozen snapshot.
4. **Apply** the merged delta (tags, operations, provenance) with the token budget and the
   optional semantic dedup: the commit ladder (:mod:`combee_stream.core.commit`).

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
from typing import Final, Protocol, TypeVar

import anyio
import msgspec

from combee_stream.config import Config, LearningConfig
from combee_stream.core.commit import Commit, size_rejected, without
from combee_stream.core.delta import canonical, empty, merge
from combee_stream.core.gate import AcceptAll, PublishGate
from combee_stream.core.holdout import HoldoutPolicy
from combee_stream.core.hygiene import (
    DEFAULT_POLICY,
    EXAMPLE_MARK,
    as_rule,
    compile_policy,
    content_words,
    review_adds,
    review_edits,
    text_problem,
    violates,
    without_rendered_prefix,
)
from combee_stream.core.outputs import (
    ConsolidatorOutput,
    CuratorOutput,
    ExampleCheck,
    ReflectorOutput,
    ReflectorOutputNoTags,
    WorkedExample,
    is_calculation,
)
from combee_stream.core.playbook import (
    MAX_BULLET_SOURCES,
    ApplyResult,
    EmbedFn,
    SkippedOp,
    SkipReason,
    apply,
    apply_semantic,
    cosine,
    covered_lessons,
    has_formula,
    normalize,
    playbook_tokens,
    similar_groups,
)
from combee_stream.core.prompts import (
    PromptRole,
    Prompts,
    ReflectionRecord,
    combiner_messages,
    consolidator_messages,
    curator_messages,
    exemplifier_messages,
    exemplifier_retry,
    reflector_messages,
)
from combee_stream.core.results import (
    FailedTrace,
    Proposal,
    UpdateSize,
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
from combee_stream.errors import CombeeError
from combee_stream.llm import ChatMessage, Completion, LLMCallError, LLMClient, Role
from combee_stream.logs import get_logger
from combee_stream.schemas import (
    AddOp,
    BulletTag,
    Consolidation,
    Delta,
    HeldOutTask,
    Holdout,
    Operation,
    Playbook,
    Reflection,
    RemoveOp,
    Section,
    Source,
    Trace,
    UpdateOp,
)

T = TypeVar("T")
log = get_logger(__name__)


class LLM(Protocol):
    """What the learner needs from :class:`combee_stream.llm.LLMClient`."""

    async def complete(
        self, role: Role, messages: list[ChatMessage], output_type: type[T]
    ) -> Completion[T]: ...


class WindowError(CombeeError):
    """The window could not be reduced (a curator / combiner / embedding call failed for good).
    Nothing was applied; retrying replays the finished calls from the completion memo."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"window of key {key!r} failed: {reason}")
        self.key = key
        self.reason = reason


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
        self._llm = llm
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
        self._check_example = check_example
        self._prompts = prompts
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
                out = await self._call("reflector", messages, ReflectorOutput, stats)
            else:
                bare = await self._call("reflector", messages, ReflectorOutputNoTags, stats)
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
                out = await self._call("curator", messages, CuratorOutput, stats)
            finally:
                warmed.set()
            operations = tidied(out.operations, self._bounds.get("curator", 0))
            if self._config.worked_examples:
                operations, shown = await self._exemplified(operations, group, stats)
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
            out = await self._call("combiner", messages, CuratorOutput, stats)
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
        similar = (
            self._merge_similar if self._embed is not None and self._config.merge_similar else None
        )
        ladder = Commit(
            proposal, onto, learning=self._config, gate=self._gate, review=self._apply,
            consolidate=self.consolidate, max_update_bytes=self.max_update_bytes,
            holdout=holdout, held_out=held_out, measure=measure, merge_similar=similar,
        )  # fmt: skip
        return await ladder.run()

    def size_rejected(self, result: WindowResult, onto: Playbook, would_be: int) -> WindowResult:
        """``result``'s window as its smallest version, rejected for size
        (:func:`~combee_stream.core.commit.size_rejected`): what a driver publishes when the
        broker refuses ``result``'s record (``would_be``: its size)."""
        return size_rejected(result, onto, would_be, self.max_update_bytes)

    async def _keeps_each(self, key: str, merged: str, texts: Sequence[str]) -> bool:
        """Whether a merge states one rule that each bullet it replaces said: embedding cosine
        at least ``MERGE_COSINE`` from the merged text to every one of them, and between every
        two of them. A 1.5B consolidator merged an NPV rule and two rounding rules into the NPV
        rule alone (the first check), and in another run joined an NPV units rule and a Sharpe
        rounding rule into one bullet of two sentences, 0.86 and 0.56 to them but 0.20 between
        them (the second: a merge is for rewordings of one rule, not for two rules in one
        bullet). True without an embedding model (nothing to judge with)."""
        if self._embed is None:
            return True
        try:
            vectors = await self._embed([merged, *texts])
        except LLMCallError as exc:
            raise WindowError(key, f"embedding a merged bullet: {exc}") from exc
        merged_vector, sources = vectors[0], vectors[1:]
        return all(cosine(merged_vector, v) >= MERGE_COSINE for v in sources) and all(
            cosine(a, b) >= MERGE_COSINE for i, a in enumerate(sources) for b in sources[i + 1 :]
        )

    async def _merge_similar(
        self, playbook: Playbook, new: set[str], stats: WindowStats
    ) -> tuple[Playbook, Consolidation | None]:
        """``playbook`` with each group of bullets that give the same advice as a bullet of
        ``new`` (:func:`~combee_stream.core.playbook.similar_groups` at
        ``learning.merge_similar``) merged by the consolidator, which is shown that group
        alone: asked to find the groups in a whole section, a 1.5B consolidator named six
        bullets of five different rules as one group (and the merge was refused), while shown
        the three rounding rules it wrote one rule for beta, DSCR and WACC."""
        assert self._embed is not None
        try:
            groups = await similar_groups(playbook, new, self._embed, self._config.merge_similar)
        except LLMCallError as exc:
            raise WindowError(playbook.key, f"embedding similar bullets: {exc}") from exc
        if not groups:
            return playbook, None
        return await self.consolidate(playbook, stats, groups=groups)

    async def consolidate(
        self,
        playbook: Playbook,
        stats: WindowStats,
        *,
        groups: Sequence[tuple[int, list[str]]] | None = None,
    ) -> tuple[Playbook, Consolidation | None]:
        """``playbook`` with, per section, the near-duplicates the consolidator names merged
        into the first of each group (its id, the group's summed counts and provenance), and
        the bullets whose harmful count exceeds their helpful count by
        ``learning.drop_harmful_margin`` dropped; None when that changes nothing. A merge that
        names unknown or already merged bullets, or whose text is too long or breaks the
        content policy, is refused; a section whose call fails is left as it is. ``groups``
        ((section index, bullet ids), see :meth:`_merge_similar`): the consolidator is shown
        each group alone instead of each section, and nothing is dropped."""
        before = playbook_tokens(playbook)
        margin = self._config.drop_harmful_margin
        bullets = [b for s in playbook.sections for b in s.bullets]
        harmful = [b.id for b in bullets if b.harmful >= b.helpful + margin]
        dropped = harmful if groups is None else []
        out = without(playbook, set(dropped))
        if groups is None:
            shown = [(i, s) for i, s in enumerate(out.sections) if len(s.bullets) > 1]
        else:
            shown = [
                (i, msgspec.structs.replace(
                    out.sections[i], bullets=[b for b in out.sections[i].bullets if b.id in ids]
                ))
                for i, ids in groups
            ]  # fmt: skip
        limit = self._config.max_bullet_chars
        proposals: dict[int, ConsolidatorOutput] = {}

        async def ask(n: int, section: Section) -> None:
            messages = consolidator_messages(self._prompts, section, limit)
            try:
                proposals[n] = await self._call("consolidator", messages, ConsolidatorOutput, stats)
            except LLMCallError as exc:
                log.warning(
                    "consolidation of a section failed", section=section.name, error=str(exc)
                )

        async with anyio.create_task_group() as tg:
            for n, (_, section) in enumerate(shown):
                tg.start_soon(ask, n, section)
        merged: list[list[str]] = []
        refused = 0
        for n, proposal in sorted(proposals.items()):
            index, view = shown[n]
            section = out.sections[index]
            allowed = {b.id for b in view.bullets}
            for group_of in proposal.merges:
                by_id = {b.id: b for b in section.bullets if b.id in allowed}
                ids = list(dict.fromkeys(group_of.bullet_ids))
                text = as_rule(group_of.content.strip(), self._bounds.get("curator", 0))
                if (
                    len(ids) < 2
                    or any(i not in by_id for i in ids)
                    or not text
                    or len(text) > limit
                    or violates(text, self._policy)
                    or not await self._keeps_each(
                        playbook.key, text, [by_id[i].content for i in ids]
                    )
                ):
                    refused += 1
                    continue
                group = [by_id[i] for i in ids]
                survivor = group[0]
                survivor.content = text
                survivor.helpful = sum(b.helpful for b in group)
                survivor.harmful = sum(b.harmful for b in group)
                sources = [src for b in group for src in b.sources]
                survivor.sources = list(dict.fromkeys(sources))[:MAX_BULLET_SOURCES]
                section.bullets = [b for b in section.bullets if b.id not in ids[1:]]
                merged.append(ids)
        if not merged and not dropped:
            return playbook, None
        report = Consolidation(
            tokens_before=before,
            tokens_after=playbook_tokens(out),
            merged=merged,
            dropped=dropped,
            refused=refused,
        )
        return out, report

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

    async def _exemplified(
        self, operations: list[Operation], group: Sequence[ReflectionRecord], stats: WindowStats
    ) -> tuple[list[Operation], dict[str, str]]:
        """The curator's ADDs, each with a worked example from the failed trace of its group
        that shares most words with it (``learning.worked_examples``), and, per normalised new
        content, the trace id its example came from. An ADD keeps its rule alone when the group
        has no failed trace with a reference answer, when the call fails, or when the example
        is empty, cut by the reply's length bound, longer than ``max_bullet_chars`` allows, or
        breaks the content policy, carries playbook markup or forwards what a trace only quoted
        (its task is untrusted text): the review would refuse the bullet whole. With
        ``check_example``, also when its calculation is still wrong for its task after one
        re-ask that says what it gives (``stats.wrong_examples``); a calculation the check
        rounds as its task asks is shown rounded, and a reply of results alone gives way to the
        agent's own calculation when that is right once rounded."""
        failures = [rec for rec in group if rec.trace]
        out = list(operations)
        shown: dict[str, str] = {}
        if not failures:
            return out, shown
        bound = self._bounds.get("curator", 0)
        quoted = [span for rec in group for span in rec.quoted]

        async def one(i: int, op: AddOp) -> None:
            words = set(content_words(op.content))
            record = max(failures, key=lambda rec: len(words & set(content_words(rec.task))))
            messages = exemplifier_messages(self._prompts, op.content, record)
            task = record.retry
            # Checked before the text checks: "write X, not X" is most often the agent's own
            # calculation, right but unrounded, and told what it gives the exemplifier rounds.
            for asked in range(2):
                try:
                    reply = await self._call("exemplifier", messages, WorkedExample, stats)
                except LLMCallError as exc:
                    log.warning("worked example failed", error=str(exc))
                    return
                if self._check_example is None or task is None:
                    break
                own = self._own_example(reply, record, task)
                if own is not None:
                    reply = own
                    break
                checked = self._check_example(reply.calculations()[0], task)
                if checked.problem is None:
                    reply = msgspec.structs.replace(reply, right=checked.calculation)
                    break
                if asked:
                    stats.wrong_examples += 1
                    return
                messages = exemplifier_retry(messages, reply, checked.problem)
            content = example(op.content, reply)
            if content is None:
                return
            out[i] = msgspec.structs.replace(op, content=content)
            shown[normalize(content)] = record.reflection.source.trace_id
            stats.examples += 1

        def example(rule: str, reply: WorkedExample) -> str | None:
            """The bullet with ``reply``'s example, or None when a text check refuses it."""
            right, wrong = reply.calculations()
            content = f"{rule.rstrip()}{EXAMPLE_MARK}{reply.text()}"
            # A field the grammar's bound stopped was cut mid-calculation.
            cut = bound and max(len(reply.right), len(reply.wrong)) >= bound - 2
            if (
                cut
                or normalize(right) in _NO_LESSON
                or not wrong
                # "write X, not X": on ACE's Formula rows the agent's calculation was often
                # right and its answer wrong for another reason (unrounded, a unit), and a
                # 1.5B exemplifier then gives the same calculation twice.
                or right.replace(" ", "") == wrong.replace(" ", "")
                # The agent's mistake was a calculation: a bare result shows nothing of it.
                or (has_formula(wrong) and not has_formula(right))
                # The review's own text checks (length, policy, markup, quoted spans): they
                # would refuse the whole bullet, and the rule alone may still pass.
                or text_problem(content, self._config.max_bullet_chars, self._policy, quoted)
            ):
                return None
            return content

        async with anyio.create_task_group() as tg:
            for i, op in enumerate(operations):
                if isinstance(op, AddOp):
                    tg.start_soon(one, i, op)
        return out, shown

    def _own_example(
        self, reply: WorkedExample, record: ReflectionRecord, task: HeldOutTask
    ) -> WorkedExample | None:
        """The agent's own calculation, rounded as its task asks, as the example, when the
        exemplifier answered with a result and the agent's calculation was right but unrounded.
        Shown "(300000/500000) * 0.04 + (200000/500000) * 0.035 * (1 - 0.26)" (a WACC row of
        ACE, right to 0.03436 where 0.03 was asked), a real 1.5B exemplifier wrote "write 0.03,
        not 0.03436" (the twenty-fourth run, docs/benchmarks/quality_24.md): served, that
        example had the agent round 56 of 100 held-out answers, where the runs whose example
        showed ``round(<calculation>, 2)`` had it round 94 to 99. What it should have shown is
        what the check builds from the agent's calculation; an agent right without rounding
        failed for some other reason, and then nothing is built."""
        if self._check_example is None or is_calculation(reply.calculations()[0]):
            return None
        if not is_calculation(record.calculation):
            return None
        checked = self._check_example(record.calculation, task)
        if checked.problem is not None or checked.calculation == record.calculation:
            return None
        return WorkedExample(wrong=record.calculation, right=checked.calculation)

    async def _call(
        self,
        kind: PromptRole,
        messages: list[ChatMessage],
        output_type: type[T],
        stats: WindowStats,
    ) -> T:
        """One call of the learner, counted by ``kind``; the consolidator and the exemplifier
        are calls to the curator's endpoint."""
        stats.llm_calls += 1
        setattr(stats, _CALLS[kind], getattr(stats, _CALLS[kind]) + 1)
        role: Role = kind if kind in ("reflector", "curator", "combiner") else "curator"
        completion = await self._llm.complete(role, messages, output_type)
        stats.cached_calls += int(completion.cached)
        stats.tokens_in += completion.tokens_in
        stats.tokens_out += completion.tokens_out
        return completion.value


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


# Embedding cosine a merged bullet keeps to each bullet it replaces, whole bullets compared:
# MiniLM scores rewordings of one rule 0.6-0.9, different rules below 0.35.
MERGE_COSINE = 0.5
_NO_LESSON = frozenset({"", "none", "n a", "no lesson", "nothing"})
# The WindowStats counter of each kind of learner call.
_CALLS: Final[dict[PromptRole, str]] = {
    "reflector": "reflector_calls",
    "curator": "curator_calls",
    "combiner": "combiner_calls",
    "consolidator": "consolidator_calls",
    "exemplifier": "example_calls",
}


def teaches(reflection: Reflection) -> bool:
    """Whether a reflection has a lesson for the curators (its key insight is not empty or
    "none", as the reflector is told to answer when a success needed nothing)."""
    return normalize(reflection.key_insight) not in _NO_LESSON


# How a driver gets its learner: from the config it runs with and the LLM client it made.
LearnerFactory = Callable[[Config, LLMClient], Learner]


__all__ = [
    "LLM",
    "Learner",
    "LearnerFactory",
    "WindowError",
    "required_roles",
    "teaches",
]
