"""Consolidation: near-duplicate bullets merged into one, and bullets that hurt more than they
help dropped, by the consolidator (a call to the curator's endpoint).

Two ways in, both from the commit ladder (:mod:`~combee_stream.core.commit`): near the token
budget or the size bound, each section of more than one bullet is shown to the consolidator
(:meth:`Consolidator.consolidate`); with ``learning.merge_similar`` and an embedding model, each
group of bullets that give the same advice as a new one is shown alone
(:meth:`Consolidator.merge_similar`). A merge is kept only when it states one rule that every
bullet it replaces said (:meth:`Consolidator.keeps_each`), so a small consolidator cannot fold
two rules into one bullet or drop one of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import msgspec

from combee_stream.core.calls import CurationContext
from combee_stream.core.commit import without
from combee_stream.core.hygiene import as_rule, violates
from combee_stream.core.outputs import ConsolidatorOutput
from combee_stream.core.playbook import (
    MAX_BULLET_SOURCES,
    EmbedFn,
    cosine,
    playbook_tokens,
    similar_groups,
)
from combee_stream.core.prompts import consolidator_messages
from combee_stream.core.results import WindowError, WindowStats
from combee_stream.llm import LLMCallError
from combee_stream.logs import get_logger
from combee_stream.schemas import Consolidation, Playbook, Section

log = get_logger(__name__)

# Embedding cosine a merged bullet keeps to each bullet it replaces, whole bullets compared:
# MiniLM scores rewordings of one rule 0.6-0.9, different rules below 0.35.
MERGE_COSINE = 0.5


class Consolidator:
    """Merges and drops bullets of a playbook (see the module's docstring)."""

    def __init__(self, context: CurationContext, *, embed: EmbedFn | None = None) -> None:
        self._context = context
        self._embed = embed

    async def keeps_each(self, key: str, merged: str, texts: Sequence[str]) -> bool:
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

    async def merge_similar(
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
            groups = await similar_groups(
                playbook, new, self._embed, self._context.learning.merge_similar
            )
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
        ((section index, bullet ids), see :meth:`merge_similar`): the consolidator is shown
        each group alone instead of each section, and nothing is dropped."""
        before = playbook_tokens(playbook)
        margin = self._context.learning.drop_harmful_margin
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
        limit = self._context.learning.max_bullet_chars
        proposals: dict[int, ConsolidatorOutput] = {}

        async def ask(n: int, section: Section) -> None:
            messages = consolidator_messages(self._context.prompts, section, limit)
            try:
                proposals[n] = await self._context.calls(
                    "consolidator", messages, ConsolidatorOutput, stats
                )
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
                text = as_rule(group_of.content.strip(), self._context.bound)
                if (
                    len(ids) < 2
                    or any(i not in by_id for i in ids)
                    or not text
                    or len(text) > limit
                    or violates(text, self._context.policy)
                    or not await self.keeps_each(
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


__all__ = ["MERGE_COSINE", "Consolidator"]
