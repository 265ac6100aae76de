"""ACE playbooks: sections of bullets, a deterministic ``apply(delta)``, dedup and a token budget.

Decisions (ACE paper §3 and Combee notes §5 / §8 leave these open):

- **Ids.** ``{slug}-{NNNNN}`` from the playbook's global ``next_id`` counter, as in ACE. The slug
  map is ACE's plus ``strat`` for STRATEGIES & INSIGHTS (ACE falls back to word initials).
- **Section names** match after normalisation (case, ``&`` -> ``and``, spaces, punctuation);
  an ADD to a section the playbook does not have goes to OTHERS (created if missing).
- **Apply order.** Counter tags first, then ADDs, UPDATEs, REMOVEs, each group in delta order
  (``delta.merge`` makes that order canonical). An UPDATE/REMOVE/tag of a missing id is skipped
  and reported, never an error: deltas computed on older snapshots are routine in streaming.
- **Exact dedup always.** Contents are compared after :func:`normalize` (lowercase, punctuation
  dropped, whitespace collapsed). An ADD equal to an existing bullet (any section) or to an
  earlier ADD is skipped as ``duplicate``; an UPDATE that would make two bullets equal is
  skipped too. So apply never touches a bullet of another section and keeps the playbook free
  of exact duplicates. :func:`dedup` cleans a playbook that came from elsewhere (first
  occurrence wins, counters summed).
- **Semantic dedup is optional** (:func:`apply_semantic`, needs an async ``embed``): an ADD whose
  cosine similarity to an existing bullet or an earlier kept ADD reaches the threshold is
  skipped as ``near_duplicate``. It filters the delta instead of LLM-merging bullets (ACE's
  BulletpointAnalyzer) so apply stays deterministic and costs no generation call.
- **Token budget.** Tokens are approximated as ``ceil(chars / 4)`` of the rendered prompt (no
  tokenizer dependency; close to BPE for English). A delta whose result exceeds the budget is
  rejected whole with a :class:`BudgetRejection` and the playbook is returned unchanged — never
  truncated. A delta that does not grow an already over-budget playbook is still accepted, so
  REMOVEs can bring it back under.
- **Version** + 1 on every accepted apply (even an empty one: it records that a window was
  learned); a rejected apply leaves the version alone.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Final, Literal

from msgspec import Struct

from combee_stream.core.fencing import fence
from combee_stream.schemas import (
    AddOp,
    BudgetRejection,
    Bullet,
    BulletTag,
    Delta,
    Operation,
    Playbook,
    RemoveOp,
    Section,
    UpdateOp,
)
from combee_stream.tokens import estimate_tokens

DEFAULT_SECTIONS: Final = (
    "STRATEGIES & INSIGHTS",
    "FORMULAS & CALCULATIONS",
    "CODE SNIPPETS & TEMPLATES",
    "COMMON MISTAKES TO AVOID",
    "PROBLEM-SOLVING HEURISTICS",
    "CONTEXT CLUES & INDICATORS",
    "OTHERS",
)
OTHERS: Final = "OTHERS"

_SLUGS: Final = {
    "strategies_and_insights": "strat",
    "formulas_and_calculations": "calc",
    "code_snippets_and_templates": "code",
    "common_mistakes_to_avoid": "err",
    "problem_solving_heuristics": "prob",
    "context_clues_and_indicators": "ctx",
    "others": "misc",
    "financial_strategies_and_insights": "fin",
    "meta_strategies": "meta",
}

EmbedFn = Callable[[list[str]], Awaitable[list[list[float]]]]
SkipReason = Literal[
    "missing_bullet",
    "duplicate",
    "near_duplicate",
    "superseded",
    "restates_task",
    "no_lesson",
    "too_long",
    "policy",
    "bullet_markup",  # content carrying a rendered bullet's id or counters
    "unsupported_remove",  # a REMOVE of a bullet no evidence speaks against
    "unsupported_update",  # an UPDATE changing a bullet's meaning without evidence
    "minority_remove",  # a REMOVE proposed by fewer than half of the window's curator groups
    "contradicts_itself",  # "should be A, not A": the fix and the error are the same words
    "quotes_trace",  # content reproducing data a trace of the window only quoted
    "covered_lesson",  # a reflection's lesson a bullet already states (not shown to curators)
]

# Provenance kept per bullet: the newest this many trace ids (bounded, like the update's size).
MAX_BULLET_SOURCES: Final = 5


class SkippedOp(Struct, frozen=True, forbid_unknown_fields=True):
    """One operation or tag of a delta that apply did not carry out, and why."""

    op: Operation | BulletTag
    reason: SkipReason


class ApplyResult(Struct, forbid_unknown_fields=True):
    """The outcome of one apply. ``playbook`` is the input itself when rejected."""

    playbook: Playbook
    applied: bool
    tokens: int  # of the returned playbook
    added: list[str] = []  # new bullet ids, in order
    updated: list[str] = []
    removed: list[str] = []
    tagged: int = 0
    skipped: list[SkippedOp] = []
    rejected: BudgetRejection | None = None


class SectionStats(Struct, frozen=True):
    name: str
    bullets: int
    helpful: int
    harmful: int


class PlaybookStats(Struct, frozen=True):
    """ACE's curator statistics."""

    bullets: int
    high_performing: int  # helpful > 5 and harmful < 2
    problematic: int  # harmful >= helpful and harmful > 0
    unused: int  # helpful == harmful == 0
    tokens: int
    sections: list[SectionStats]


# --------------------------------------------------------------------------- basics


def new_playbook(key: str, base_prompt: str = "") -> Playbook:
    """An empty playbook with ACE's default sections."""
    return Playbook(
        key=key, base_prompt=base_prompt, sections=[Section(name=n) for n in DEFAULT_SECTIONS]
    )


def normalize(text: str) -> str:
    """Canonical form for exact dedup: NFKC, lowercase, punctuation dropped, spaces collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = re.sub(r"[^\w\s]", " ", text)
    return " ".join(text.split())


def section_key(name: str) -> str:
    """Canonical form of a section name (``Common mistakes to avoid`` == ``COMMON MISTAKES...``)."""
    return "_".join(normalize(name.replace("&", " and ")).split())


def section_slug(name: str) -> str:
    key = section_key(name)
    return _SLUGS.get(key) or "".join(w[0] for w in key.split("_") if w)[:4] or "misc"


def render_bullet(bullet: Bullet, *, counters: bool = False) -> str:
    """``[id] text``, or with ``counters`` ``[id] helpful=h harmful=r :: text`` (the curator's
    view: it decides on the counts; an agent would only read noise in them)."""
    # Bullets come from traces through the LLM: fenced like any untrusted text.
    content = fence(bullet.content)
    if counters:
        return f"[{bullet.id}] helpful={bullet.helpful} harmful={bullet.harmful} :: {content}"
    return f"[{bullet.id}] {content}"


def render(playbook: Playbook, *, empty_sections: bool = False, counters: bool = False) -> str:
    """The system prompt: ``base_prompt``, then each section as ``## NAME`` and its bullets.

    Agents get no empty headers and no counters; the LLM roles ask for both
    (``empty_sections=True, counters=True``) so the curator sees every section it may add to
    and the evidence for and against each bullet."""
    parts: list[str] = []
    if playbook.base_prompt.strip():
        parts.append(playbook.base_prompt.rstrip())
    for section in playbook.sections:
        if not section.bullets and not empty_sections:
            continue
        lines = [
            f"## {section.name}",
            *(render_bullet(b, counters=counters) for b in section.bullets),
        ]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def playbook_tokens(playbook: Playbook) -> int:
    return estimate_tokens(render(playbook))


def find_bullet(playbook: Playbook, bullet_id: str) -> Bullet | None:
    for section in playbook.sections:
        for bullet in section.bullets:
            if bullet.id == bullet_id:
                return bullet
    return None


def bullet_ids(playbook: Playbook) -> set[str]:
    return {b.id for s in playbook.sections for b in s.bullets}


def stats(playbook: Playbook) -> PlaybookStats:
    bullets = [b for s in playbook.sections for b in s.bullets]
    return PlaybookStats(
        bullets=len(bullets),
        high_performing=sum(1 for b in bullets if b.helpful > 5 and b.harmful < 2),
        problematic=sum(1 for b in bullets if b.harmful >= b.helpful and b.harmful > 0),
        unused=sum(1 for b in bullets if b.helpful == 0 and b.harmful == 0),
        tokens=playbook_tokens(playbook),
        sections=[
            SectionStats(
                name=s.name,
                bullets=len(s.bullets),
                helpful=sum(b.helpful for b in s.bullets),
                harmful=sum(b.harmful for b in s.bullets),
            )
            for s in playbook.sections
        ],
    )


def copy_playbook(playbook: Playbook) -> Playbook:
    """A deep copy (Structs are mutable; apply never mutates its input)."""
    return Playbook(
        key=playbook.key,
        version=playbook.version,
        base_prompt=playbook.base_prompt,
        sections=[
            Section(
                name=s.name,
                bullets=[
                    Bullet(
                        id=b.id,
                        content=b.content,
                        helpful=b.helpful,
                        harmful=b.harmful,
                        sources=list(b.sources),
                    )
                    for b in s.bullets
                ],
            )
            for s in playbook.sections
        ],
        next_id=playbook.next_id,
        schema=playbook.schema,
    )


# --------------------------------------------------------------------------- dedup


def dedup(playbook: Playbook) -> Playbook:
    """Merge exact duplicates (after :func:`normalize`): the first occurrence in section order
    keeps its id and gets the summed counters; later copies are dropped. Idempotent."""
    out = copy_playbook(playbook)
    first: dict[str, Bullet] = {}
    for section in out.sections:
        kept: list[Bullet] = []
        for bullet in section.bullets:
            norm = normalize(bullet.content)
            if norm in first:
                first[norm].helpful += bullet.helpful
                first[norm].harmful += bullet.harmful
            else:
                first[norm] = bullet
                kept.append(bullet)
        section.bullets = kept
    return out


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


# A formula's pieces: an operator with the word on each side (``-`` and ``+`` with spaces
# around them, so "debt-to-equity" and "+5" are words; within a line, so a list's "- " mark
# is none), and function calls. The word before an operator is bounded: unbounded, a long run
# of word characters costs quadratic time (each of its positions tries the whole run), and a
# version's texts may be megabytes.
_OPERATOR_TERM = re.compile(r"[\w)\]%]{1,64} ?[*/=^] ?[\w(]+|[\w)\]%]{1,64} [-+] [\w(]+")
_CALL = re.compile(r"\b[a-z_]\w*\(")
# Any operator or call at all: most texts have none and skip the scan for terms.
_ANY_OPERATOR = re.compile(r"[*/=^×÷(]| [-+] ")


def formula_terms(text: str) -> list[str]:
    """The formula a text states, as the operator and a word on each side of it (``ratio =
    current``, ``assets / current``) and the names of its function calls (``ceil``): lower
    case, ``×`` as ``*`` and ``÷`` as ``/``, other marks dropped; empty when it states none.
    The one formula detector: the duplicate check (``says_more``) and the review (``hygiene``)
    both read it."""
    flat = re.sub(r"[^\S\n]+", " ", unicodedata.normalize("NFKC", text).lower())
    if not _ANY_OPERATOR.search(flat):
        return []
    flat = flat.replace("×", "*").replace("÷", "/")
    terms = [m.group(0) for m in _OPERATOR_TERM.finditer(flat)]
    terms += [m.group(0) for m in _CALL.finditer(flat)]
    return [" ".join(re.sub(r"[^\w*/=^+-]", " ", t).split()) for t in terms]


def has_formula(text: str) -> bool:
    return bool(formula_terms(text))


def says_more(text: str, than: str) -> bool:
    """Whether ``text`` states a formula that ``than`` does not: then it is no duplicate of
    ``than`` however close their embeddings. MiniLM puts "use the formula E(Ri) = Rf + βi *
    (ERm - Rf) with the rates as decimal fractions" at 0.82-0.90 from "use the correct formula
    and ensure that all rates are in decimal form" (the real-model demo, seed 719043): at the
    dedup threshold the vague rule kept every lesson that carried the formula from the curators,
    and would have refused the ADD that carried it."""
    return has_formula(text) and not has_formula(than)


def restates(
    text: str, vector: Sequence[float], other: str, other_vector: Sequence[float], threshold: float
) -> bool:
    """Whether ``text`` says nothing ``other`` does not: cosine at least ``threshold`` and no
    formula of its own (:func:`says_more`). The one test of the dedup and the covered check."""
    return cosine(vector, other_vector) >= threshold and not says_more(text, other)


async def near_duplicate_adds(
    playbook: Playbook, adds: Sequence[AddOp], embed: EmbedFn, threshold: float
) -> list[int]:
    """Indexes of ``adds`` whose cosine similarity to an existing bullet or to an earlier kept
    ADD is >= ``threshold``, unless the ADD :func:`says_more` than that text. One embed call
    for everything; deterministic given the vectors."""
    if not adds:
        return []
    existing = [b.content for s in playbook.sections for b in s.bullets]
    vectors = await embed_each(embed, [*existing, *(a.content for a in adds)])
    kept = list(zip(existing, vectors[: len(existing)], strict=True))
    dropped: list[int] = []
    for i, vector in enumerate(vectors[len(existing) :]):
        text = adds[i].content
        if any(restates(text, vector, other, v, threshold) for other, v in kept):
            dropped.append(i)
        else:
            kept.append((text, vector))
    return dropped


async def covered_lessons(
    playbook: Playbook,
    insights: Sequence[str],
    embed: EmbedFn,
    threshold: float,
    blamed: Sequence[Collection[str]],
) -> list[int]:
    """Indexes of ``insights`` at cosine >= ``threshold`` to a bullet of ``playbook`` (whole
    texts, as :func:`near_duplicate_adds` compares an ADD) that the insight does not
    :func:`says_more` than, not counting the bullets in ``blamed[i]`` (those insight ``i``'s
    reflection tagged harmful: it may correct them). One embed call; [] when the playbook has
    no bullet."""
    bullets = [b for s in playbook.sections for b in s.bullets]
    if not bullets or not insights:
        return []
    vectors = await embed_each(embed, [*(b.content for b in bullets), *insights])
    at = list(zip(bullets, vectors[: len(bullets)], strict=True))
    return [
        i
        for i, vector in enumerate(vectors[len(bullets) :])
        if any(
            b.id not in blamed[i] and restates(insights[i], vector, b.content, v, threshold)
            for b, v in at
        )
    ]


# "When <situation>, <advice>": the clause that says where a rule applies, up to its first comma.
_SITUATION = re.compile(r"^\s*(?:when|whenever|if|for|before|after)\b[^,.;]{0,200},\s*", re.I)


def advice(text: str) -> str:
    """What a bullet says to do: its text after a leading "When <situation>," clause."""
    match = _SITUATION.match(text)
    return text[match.end() :] if match else text


async def similar_groups(
    playbook: Playbook, new: Collection[str], embed: EmbedFn, threshold: float
) -> list[tuple[int, list[str]]]:
    """Groups of bullets of one section that give the same advice, each holding a bullet of
    ``new``: (section index, bullet ids in playbook order), the connected bullets whose
    :func:`advice` texts are at cosine >= ``threshold`` (one embed call). The advice, not the
    whole bullet: a small curator states one rule once per formula ("When calculating the
    beta, ... round the result to 2 decimal places", the same for DSCR and WACC: MiniLM 0.90-0.96
    between the advice, 0.59-0.69 between the bullets), while two rules for one formula (WACC
    weights, WACC rounding) share the situation and score 0.58 as bullets, 0.28 as advice."""
    sections = [
        (i, s) for i, s in enumerate(playbook.sections)
        if len(s.bullets) > 1 and any(b.id in new for b in s.bullets)
    ]  # fmt: skip
    bullets = [b for _, s in sections for b in s.bullets]
    if not bullets:
        return []
    vectors = await embed_each(embed, [advice(b.content) for b in bullets])
    at = {b.id: v for b, v in zip(bullets, vectors, strict=True)}
    groups: list[tuple[int, list[str]]] = []
    for index, section in sections:
        ids = [b.id for b in section.bullets]
        group = {i: n for n, i in enumerate(ids)}  # each bullet's group: the first one's index
        for n, a in enumerate(ids):
            for b in ids[n + 1 :]:
                if group[a] != group[b] and cosine(at[a], at[b]) >= threshold:
                    joined, into = group[b], group[a]
                    group = {i: into if g == joined else g for i, g in group.items()}
        members: dict[int, list[str]] = {}
        for i in ids:
            members.setdefault(group[i], []).append(i)
        groups += [(index, g) for g in members.values() if len(g) > 1 and any(i in new for i in g)]
    return groups


async def embed_each(embed: EmbedFn, texts: Sequence[str]) -> list[list[float]]:
    """One vector per text, in one call; an endpoint that returns another count is an error
    (zipping its vectors with the texts would judge some texts by others' vectors)."""
    vectors = list(await embed(list(texts)))
    if len(vectors) != len(texts):
        raise ValueError(f"embed returned {len(vectors)} vectors for {len(texts)}")
    return vectors


# --------------------------------------------------------------------------- apply


def _target_section(playbook: Playbook, name: str) -> Section:
    wanted = section_key(name)
    for section in playbook.sections:
        if section_key(section.name) == wanted:
            return section
    for section in playbook.sections:
        if section_key(section.name) == section_key(OTHERS):
            return section
    others = Section(name=OTHERS)
    playbook.sections.append(others)
    return others


def apply(
    playbook: Playbook,
    delta: Delta,
    *,
    token_budget: int | None,
    skip_adds: Mapping[int, SkipReason] | Sequence[int] = (),
) -> ApplyResult:
    """Apply ``delta`` to a copy of ``playbook`` (see the module docstring for the rules).

    ``skip_adds`` are indexes (among the delta's ADDs) to skip, with their reason (a bare
    sequence means ``near_duplicate``); it is how the bullet review
    (:mod:`combee_stream.core.hygiene`) and :func:`apply_semantic` feed their verdicts into
    this deterministic function.
    """
    if delta.key != playbook.key:
        raise ValueError(f"delta for key {delta.key!r} applied to playbook {playbook.key!r}")
    out = copy_playbook(playbook)
    by_id = {b.id: b for s in out.sections for b in s.bullets}
    section_of = {b.id: s for s in out.sections for b in s.bullets}
    contents = {normalize(b.content) for b in by_id.values()}
    skipped: list[SkippedOp] = []
    added: list[str] = []
    updated: list[str] = []
    removed: list[str] = []
    tagged = 0

    for tag in delta.tags:
        target = by_id.get(tag.bullet_id)
        if target is None:
            skipped.append(SkippedOp(op=tag, reason="missing_bullet"))
            continue
        if tag.tag == "helpful":
            target.helpful += 1
        elif tag.tag == "harmful":
            target.harmful += 1
        tagged += 1

    provenance = list(dict.fromkeys(src.trace_id for src in delta.sources))[-MAX_BULLET_SOURCES:]
    adds = [op for op in delta.operations if isinstance(op, AddOp)]
    near: Mapping[int, SkipReason] = (
        skip_adds if isinstance(skip_adds, Mapping) else dict.fromkeys(skip_adds, "near_duplicate")
    )
    for i, add in enumerate(adds):
        norm = normalize(add.content)
        if i in near:
            skipped.append(SkippedOp(op=add, reason=near[i]))
            continue
        if norm in contents or not norm:
            skipped.append(SkippedOp(op=add, reason="duplicate"))
            continue
        section = _target_section(out, add.section)
        bullet = Bullet(
            id=f"{section_slug(section.name)}-{out.next_id:05d}",
            content=add.content,
            sources=provenance,
        )
        out.next_id += 1
        section.bullets.append(bullet)
        by_id[bullet.id] = bullet
        section_of[bullet.id] = section
        contents.add(norm)
        added.append(bullet.id)

    updates = [op for op in delta.operations if isinstance(op, UpdateOp)]
    last_update = {op.bullet_id: i for i, op in enumerate(updates)}
    for i, update in enumerate(updates):
        target = by_id.get(update.bullet_id)
        if target is None:
            skipped.append(SkippedOp(op=update, reason="missing_bullet"))
            continue
        if last_update[update.bullet_id] != i:
            skipped.append(SkippedOp(op=update, reason="superseded"))
            continue
        old, new = normalize(target.content), normalize(update.content)
        if new != old and (new in contents or not new):
            skipped.append(SkippedOp(op=update, reason="duplicate"))
            continue
        contents.discard(old)
        contents.add(new)
        target.content = update.content
        if new != old:
            target.sources = list(dict.fromkeys([*provenance, *target.sources]))[
                :MAX_BULLET_SOURCES
            ]
        updated.append(target.id)

    for remove in (op for op in delta.operations if isinstance(op, RemoveOp)):
        target = by_id.pop(remove.bullet_id, None)
        if target is None:
            skipped.append(SkippedOp(op=remove, reason="missing_bullet"))
            continue
        section_of[remove.bullet_id].bullets.remove(target)
        contents.discard(normalize(target.content))
        removed.append(remove.bullet_id)

    current = playbook_tokens(playbook)
    would_be = playbook_tokens(out)
    if token_budget is not None and would_be > token_budget and would_be > current:
        return ApplyResult(
            playbook=playbook,
            applied=False,
            tokens=current,
            skipped=skipped,
            rejected=BudgetRejection(budget=token_budget, would_be=would_be, current=current),
        )
    out.version = playbook.version + 1
    return ApplyResult(
        playbook=out,
        applied=True,
        tokens=would_be,
        added=added,
        updated=updated,
        removed=removed,
        tagged=tagged,
        skipped=skipped,
    )


async def apply_semantic(
    playbook: Playbook,
    delta: Delta,
    *,
    token_budget: int | None,
    embed: EmbedFn,
    threshold: float,
    skip_adds: Mapping[int, SkipReason] | None = None,
) -> ApplyResult:
    """:func:`apply` with ADDs that are near duplicates (cosine >= threshold) skipped, on top of
    ``skip_adds`` already decided."""
    adds = [op for op in delta.operations if isinstance(op, AddOp)]
    decided = dict(skip_adds or {})
    # Exact duplicates are apply's business; only ask about the rest.
    contents = {normalize(b.content) for s in playbook.sections for b in s.bullets}
    fresh = [
        i for i, a in enumerate(adds) if i not in decided and normalize(a.content) not in contents
    ]
    near = await near_duplicate_adds(playbook, [adds[i] for i in fresh], embed, threshold)
    decided.update(dict.fromkeys((fresh[i] for i in near), "near_duplicate"))
    return apply(playbook, delta, token_budget=token_budget, skip_adds=decided)


__all__ = [
    "DEFAULT_SECTIONS",
    "OTHERS",
    "ApplyResult",
    "EmbedFn",
    "PlaybookStats",
    "SectionStats",
    "SkippedOp",
    "advice",
    "apply",
    "apply_semantic",
    "bullet_ids",
    "copy_playbook",
    "cosine",
    "dedup",
    "embed_each",
    "find_bullet",
    "formula_terms",
    "has_formula",
    "near_duplicate_adds",
    "new_playbook",
    "normalize",
    "playbook_tokens",
    "render",
    "render_bullet",
    "restates",
    "says_more",
    "section_key",
    "section_slug",
    "similar_groups",
    "stats",
]
