"""Which proposed bullets do not earn a place in the playbook, before they are applied.

A real model's curator (Qwen2.5-Coder at 0.5B and 1.5B, on ACE's Formula tasks) writes bullets that
restate the task they came from ("To calculate the WACC, the agent should have applied the
formula ...", with the task's own numbers), repeat one sentence across sections with a word
changed, or say nothing reusable ("Be careful."). Exact dedup catches none of them; these
checks run on every ADD of every window, in both drivers, with no LLM call, and each rejection
is counted by reason in the version's stats (``UpdateStats.skipped``):

- ``near_duplicate``: its content words and those of an existing bullet (or of an earlier ADD
  of the same delta) differ by at most ``NEAR_DUPLICATE_WORDS`` (one word substituted, or two
  added or dropped), whatever their order. Two lessons that differ in a clause, or in a number
  ("monthly ... 12" against "quarterly ... 4"), stay apart; the optional embedding dedup
  catches rewordings beyond that.
- ``restates_task``: most of the bullet's words come from its own task (``RESTATED`` of its
  content words) or it repeats a number of four digits or more, or with a fractional part,
  that the task or its reference answer gave (:func:`instance`; "0.1040" is "0.104"): an
  instance, not a lesson. The real-model demo of 2026-12-05 published a CAPM rule ending
  "0.1040, not 10.4", one training task's answer. A bullet whose formula the task itself
  states (every operator and the words beside it are in the task: ACE's Formula tasks quote
  their formula) is no lesson either.
- ``contradicts_itself``: "the formula should be A, not A" or "use A instead of A": the fix
  and the error are the same words (a 1.5B reflector wrote this on about one trace in five,
  mostly on successes).
- ``too_long``: longer than ``learning.max_bullet_chars`` (a lesson is a rule, not a document:
  one trace must not fill the prompt of every agent of its key).
- ``policy``: it matches a pattern of the content policy: ``DEFAULT_POLICY`` (on unless
  ``learning.default_content_policy`` is false: links, e-mail addresses, instructions aimed
  at the model, system or role markers, card numbers, secret-like strings) and the patterns of
  ``learning.content_policy``. A trace is untrusted (its task text comes from users) and a
  bullet reaches every agent of its key.
- ``quotes_trace``: it reproduces a span a trace of the window only quoted (in quotation
  marks or backticks: a customer record, an instruction pasted into the feedback) of
  ``QUOTED_WORDS`` words or more, or one carrying digits: a lesson states a rule in its own
  words, it does not forward what a trace carried.
- ``no_lesson``: fewer than ``MIN_WORDS`` content words, or only words of generic advice
  (``GENERIC``: "always double-check the formula and the conventions" teaches nothing a model
  did not already try to do) in what it says to do (:func:`teaches_nothing`: after its "When
  <situation>," clause, whose formula name would otherwise let any padding through).

- ``bullet_markup``: it carries a rendered bullet's id or counters (``strat-00008]
  helpful=0 harmful=0 :: ...``): a small model copying the playbook's own lines into a bullet.
  A curator that writes its whole new bullet in the playbook's line format (``[calc-00004]
  helpful=0 harmful=0 :: When ...``, every window of a 1.5B curator in the real-model demo of
  2026-12-03) copied the format, not the markup, so :func:`without_rendered_prefix` cuts that
  leading prefix first and the rule behind it is reviewed as any other; markup anywhere else
  still refuses the bullet.

``tidied`` (in the learner) first cuts what a reply's text carries that is no part of a rule: a
leading copy of the playbook's line format, a last sentence the length bound cut, and
sentences that narrate the one trace the lesson came from (:func:`without_narration`: "In this
case, the cash flows are given in thousands of dollars, so we need to ... multiply by 1000",
"The agent should have used ..., which is incorrect"). A 1.5B curator appended such a sentence
to 13 of the 29 distinct bullets it proposed in three real runs, and the agent reads it as a rule
for every task: a playbook that said "multiply by 1000" in an NPV bullet was followed by
answers that scaled an input by 100 or 1000 on 9 held-out tasks the base prompt got right
(market capitalisation, turnover, payout, price-to-book), 8 of which the agent answered right
again once it was cut. The reflector's key insight is cut the same way before a curator reads
it (the curator copies it).

``restates_task`` compares a bullet with the tasks of the curator groups that proposed it (its
own sources; the window's tasks for a bullet only a combiner wrote), and a bullet that carries a
formula or a rule with operators (``ceil(debt / payment)``) is not refused for sharing its
task's nouns: naming the quantities is what a formula does. It still may not carry the task's
own large numbers.

UPDATEs and REMOVEs are reviewed too (:func:`review_edits`): curation keeps what it learned
unless evidence says otherwise. A REMOVE needs evidence against its bullet (harmful above
helpful, counting this window's tags, or a trace of the window tagging it harmful):
``unsupported_remove``. An UPDATE that changes a bullet's meaning (drops most of its words or
any of its numbers) needs the same evidence: ``unsupported_update``; one that refines it (keeps
its words and numbers, adds detail) does not. Both are checked for length, policy and markup
like an ADD. Without this, with k curator groups a new bullet had k chances per window to be
deleted by one curator's whim (a real run removed the one bullet it had added, a window later).

The thresholds are the module's constants; a rejected operation is reported, never silently
lost.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Final

from combee_stream.core.playbook import (
    SkippedOp,
    SkipReason,
    advice,
    formula_terms,
    has_formula,
    normalize,
)
from combee_stream.schemas import AddOp, Delta, Playbook, RemoveOp, UpdateOp

NEAR_DUPLICATE_WORDS: Final = 2
RESTATED: Final = 0.75
MIN_WORDS: Final = 4
# What a reflector writes for "nothing to learn", and an exemplifier for "no example", once
# normalised (the reflector is told to answer "none" when a success needed nothing).
NO_LESSON: Final = frozenset({"", "none", "n a", "no lesson", "nothing"})

_STOP: Final = frozenset(
    "a an and are as at be by for from has have if in is it its of on or so that the this to "
    "was were when which with you your should must agent".split()
)
GENERIC: Final = frozenset(
    "always double check checking careful carefully make sure ensure correct correctly right "
    "properly proper formula formulas approach verify reusable lesson accurate accuracy attention "
    "pay read reread task question again work steps step calculation calculations calculate "
    "result results answer appropriate important use using used follow instructions mistake "
    "mistakes avoid error errors convention conventions units data information given problem "
    "solution method methods values value all any each every before after carefully".split()
    # What a 1.5B curator pads a rule with ("it's important to follow the playbook's
    # instructions", "check the syntax and order of operations", "substitute the given values
    # into the formula"); "s" is what is left of "it's" and "playbook's".
    + "s playbook playbooks consistent consistency substitute substituted substituting syntax "
    "order operations check checked checking apply applied applying implement implemented "
    "implementing done these those into precise precision accurately understandable user "
    "financial metric metrics tool tools programming language languages can lead incorrect "
    "incorrectly wrong wrongly".split()
    # Naming a kind of convention without saying which one: "use the appropriate conventions
    # for units, percentages, or other relevant information" (a real run's DSO bullet,
    # 2026-12-06, from a lesson whose rule was in the sentence the length bound cut).
    + "percent percentage percentages relevant other we our".split()
    # "correctly format the formula and plug in the correct values" (a DDM bullet of a real
    # run's combee playbook, 2026-12-06): the format of a formula and plugging values in are
    # what any agent does, not a rule.
    + "format formatted formatting plug plugged plugging".split()
    # "follow the steps outlined in the formula" (an NPV bullet of the fifteenth run's combee
    # playbook, 2026-12-06): the steps a formula describes are the formula.
    + "outlined outline outlines described describes specified".split()
)
# The default content policy: what no bullet may carry, whatever the deployment adds. Each is
# something an attacker with write access to the traces topic would put in a bullet, and none
# is part of a lesson an agent needs.
DEFAULT_POLICY: Final = (
    r"\bhttps?://|\bwww\.\w|\b[\w-]+\.(?:com|net|org|io|example|ru|cn|xyz)/",  # links
    r"\b[\w.+-]+@[\w-]+\.[\w.-]+\b",  # e-mail addresses
    # Instructions aimed at the model rather than the task.
    r"\b(?:ignore|disregard|forget|override)\b.{0,30}\b(?:previous|prior|above|earlier|all|"
    r"other|system)\b.{0,20}\b(?:instructions?|rules?|prompts?|guidelines?|messages?)\b",
    r"\byou are now\b|\bnew instructions?\s*:|\bjailbreak\b|\bdeveloper mode\b",
    # System or role markers of chat templates and transcripts.
    r"<\|?(?:im_start|im_end|system|endoftext|eot_id|start_header_id)\|?>|\[/?INST\]|<</?SYS>>",
    r"(?:^|\n|\.\s)\s*(?:system|assistant|developer)\s*:",
    r"\b(?:\d[ -]?){13,19}\b",  # card numbers (13-19 digits, spaces or dashes between)
    # Secret-like strings: API keys, tokens, private keys, passwords.
    r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}|\bAKIA[0-9A-Z]{16}\b|\bgh[pousr]_[A-Za-z0-9]{20,}",
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----|\b(?:api[_-]?key|password|passwd|secret|token)\s*[:=]",
)
QUOTED_WORDS: Final = 6
_QUOTED = re.compile(r'"([^"\n]{6,400})"|“([^”\n]{6,400})”|`([^`\n]{6,400})`')
# A number of four digits or more, or one with a fractional part ("0.032"): the instance's
# own data, where a rule's numbers are small counts ("2 decimal places", "12 months").
_BIG_NUMBER = re.compile(r"\d[\d,]{3,}(?:\.\d+)?|\d+\.\d+")
_ANY_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
# A rendered bullet's id ("strat-00008]") or counters ("helpful=0"): playbook markup.
_BULLET_ID = r"[a-z]{2,6}-\d{5}"
_MARKUP = re.compile(rf"\b{_BULLET_ID}\]|\b(?:helpful|harmful)\s*=\s*\d")
# The same line format at the start of a text, as the curator sees the playbook's lines.
_RENDERED_PREFIX = re.compile(
    rf"^\s*\[{_BULLET_ID}\]\s*(?:helpful\s*=\s*\d+\s+harmful\s*=\s*\d+\s*::\s*)?"
)
# "... should be A, not B" / "... is A, not B", within one clause (no sentence break in A).
_NOT_X = re.compile(
    r"(?:should be|must be|is|are|use|uses)\s+([^.;:]{3,200}?),\s*"
    r"(?:not|but (?:the agent |it )?(?:used|wrote|applied))\s+([^.;,]{3,200})"
)
# A sentence that tells one trace's story rather than a rule: "in this case", what the agent did
# or should have done, "which is incorrect". A rule is addressed to the agent ("When X, do Y").
_NARRATION = re.compile(
    r"\bin (?:this|that|the given) (?:case|task|example|problem|question|scenario|instance|trace)\b"
    r"|\bthe agent (?:should have|should've|did not|didn't|failed|forgot|instead|incorrectly|"
    r"mistakenly|used|wrote|applied|gave|got|made|was|had)\b"
    r"|\bwhich (?:is|was) (?:incorrect|wrong)\b"
    r"|\b(?:this|the) (?:mistake|error|oversight) (?:led|leads|caused|causes|resulted|results)\b"
    r"|\binstead of the expected\b"
    # First person: "The Market Cap is given in dollars, so we convert it to millions" (a real
    # run's EV bullet, 2026-12-04: its agent then scaled inputs by a million on 4 tasks).
    r"|\bwe\b|\blet(?:'s| us)\b"
    # The reflector's own instructions echoed into a lesson: "When the agent succeeded and
    # needed nothing beyond what the task says, the key insight is 'none'." (a real 1.5B
    # curator's DDM bullet, served by naive in the twenty-sixth run, 2026-12-07). A rule for
    # the agent never speaks of the reflection's fields.
    r"|\bkey insight\b",
    re.IGNORECASE,
)
# "use A instead of B" / "A rather than B": the same correction with the fix first.
_INSTEAD = re.compile(r"([^.;:]{1,200}?)\s+(?:instead of|rather than)\s+([^.;,]{1,200})")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'`])")
# An UPDATE keeps a bullet's meaning when it keeps this share of its content words.
KEPT_MEANING: Final = 0.7
# What the learner appends a worked example after (``learning.worked_examples``).
EXAMPLE_MARK: Final = " Example: "


def rule_of(text: str) -> str:
    """A bullet's rule: its text before a worked example (all of it when it has none)."""
    head, mark, _ = text.partition(EXAMPLE_MARK)
    return head if mark else text


def content_words(text: str) -> list[str]:
    return [w for w in normalize(text).split() if w not in _STOP]


def teaches_nothing(text: str) -> bool:
    """Whether a bullet is generic advice: in each of its sentences, every content word of
    what it says to do (the sentence after a leading "When <situation>," clause) is in
    ``GENERIC``."""

    # The situation says where a rule applies, and a formula's name there ("Days Sales
    # Outstanding") is enough to pass the content-word check on its own, so the advice after it
    # is judged alone: "When calculating the DSO, it is important to follow the playbook's
    # instructions and ensure that all calculations are done correctly" teaches nothing.
    # A formula stated in the situation ("When using P_1 = (S_1 / S_0) * P_0, ...") is content
    # wherever it stands (whether the task already gave it is copies_formula's question).
    def generic(sentence: str) -> bool:
        rest = advice(sentence)
        situation = sentence[: len(sentence) - len(rest)]
        return not formula_terms(situation) and all(w in GENERIC for w in content_words(rest))

    return all(generic(sentence) for sentence in _SENTENCE_END.split(text.strip()))


def near_duplicates(a: frozenset[str], b: frozenset[str]) -> bool:
    """Whether two bullets' content-word sets differ by at most NEAR_DUPLICATE_WORDS."""
    return len(a ^ b) <= NEAR_DUPLICATE_WORDS


def _numbers(text: str) -> set[str]:
    """The large numbers of ``text``, written one way ("1,000.50" and "1000.5" are one): no
    commas, no trailing zeros after the point. Leading zeros stay ("00003" is no 3)."""
    found = set()
    for match in _BIG_NUMBER.findall(text):
        plain = match.replace(",", "")
        found.add(plain.rstrip("0").rstrip(".") if "." in plain else plain)
    return found


def instance(task: str, answer: str | None) -> str:
    """What :func:`restates` compares a bullet with: the task, and the large numbers of its
    reference answer (the numbers only: a worded reference answer's words are no task's)."""
    numbers = sorted(_numbers(answer or ""))
    return f"{task}\n{' '.join(numbers)}" if numbers else task


def carries_markup(text: str) -> bool:
    return _MARKUP.search(text) is not None


def without_rendered_prefix(text: str) -> str:
    """``text`` without a leading ``[id] helpful=h harmful=r ::`` (or ``[id]``): the playbook's
    own line format, which a small curator copies in front of the rule it writes."""
    return _RENDERED_PREFIX.sub("", text, count=1)


def keeps_meaning(old: str, new: str) -> bool:
    """Whether ``new`` refines ``old`` rather than replacing it: it keeps KEPT_MEANING of its
    content words and every number it states."""
    old_words = set(content_words(old))
    kept = len(old_words & set(content_words(new))) / len(old_words) if old_words else 1.0
    return kept >= KEPT_MEANING and set(_ANY_NUMBER.findall(old)) <= set(_ANY_NUMBER.findall(new))


def contested(playbook: Playbook, delta: Delta) -> set[str]:
    """Bullets with evidence against them: harmful above helpful once the delta's tags count,
    or tagged harmful by a trace of the delta."""
    helpful = Counter(t.bullet_id for t in delta.tags if t.tag == "helpful")
    harmful = Counter(t.bullet_id for t in delta.tags if t.tag == "harmful")
    return {
        b.id
        for s in playbook.sections
        for b in s.bullets
        if harmful[b.id] or b.harmful + harmful[b.id] > b.helpful + helpful[b.id]
    }


def quoted_spans(*texts: str) -> list[str]:
    """The normalised spans ``texts`` quote that a bullet may not reproduce (see the module):
    of ``QUOTED_WORDS`` words or more, or carrying a digit."""
    spans: list[str] = []
    for text in texts:
        for match in _QUOTED.finditer(text):
            span = next(group for group in match.groups() if group)
            norm = normalize(span)
            if len(norm.split()) >= QUOTED_WORDS or (
                any(c.isdigit() for c in span) and len(norm) >= 6
            ):
                spans.append(norm)
    return list(dict.fromkeys(spans))


def quotes(text: str, spans: Sequence[str]) -> bool:
    norm = normalize(text)
    return any(span in norm for span in spans)


def compile_policy(patterns: Sequence[str]) -> list[re.Pattern[str]]:
    return [re.compile(p, re.IGNORECASE) for p in patterns]


def violates(text: str, policy: Sequence[re.Pattern[str]]) -> bool:
    return any(pattern.search(text) for pattern in policy)


def text_problem(
    text: str, max_chars: int, policy: Sequence[re.Pattern[str]], quoted: Sequence[str]
) -> SkipReason | None:
    if len(text) > max_chars:
        return "too_long"
    if violates(text, policy):
        return "policy"
    if carries_markup(text):
        return "bullet_markup"
    if quotes(text, quoted):
        return "quotes_trace"
    return None


def without_cut_sentence(text: str, bound: int) -> str:
    """``text`` without a last sentence that stops short (no closing punctuation) when a whole
    sentence precedes it and ``text`` is as long as the grammar's string bound (``bound``
    characters; 0: no bound): what the bound leaves of a small model's reply ("... round the
    result to two decimals. When the agent did not round the result, "), or when it ends on
    a comma, semicolon or colon, at any length and with any bound. A shorter text that ends
    without a full stop otherwise was written that way, not cut. A single sentence cut short
    ends at its last whole clause instead (``..., and then subtracting g from r, and then``
    -> ``..., and then subtracting g from r.``): a 1.5B curator's long one-sentence rule is
    mostly whole, and a rule that trails off mid-clause reads as broken."""
    stripped = text.rstrip()
    if not stripped or stripped[-1] in ".!?)]\"'`":
        return text
    # A text ending on a comma, a semicolon or a colon was cut whatever its length: the
    # curator copies a reflection's insight that the reflector's own bound cut (a real run
    # served "... When the agent did not round the result, " at 237 of 300 characters).
    if stripped[-1] not in ",;:" and (not bound or len(text) < bound - 2):
        return text
    end = max(stripped.rfind(". "), stripped.rfind("! "), stripped.rfind("? "))
    if end >= 0:
        head = stripped[: end + 1]
    else:
        clause = max(stripped.rfind(", "), stripped.rfind("; "))
        head = stripped[:clause].rstrip(",;: ") + "." if clause > 0 else ""
    return head if len(content_words(head)) >= MIN_WORDS else text


def without_narration(text: str) -> str:
    """``text`` without its sentences that narrate one trace (see the module): what stays is
    the rule. A text whose every sentence narrates is returned as it is, for the review to
    judge (it is usually refused as restating its task)."""
    sentences = _SENTENCE_END.split(text.strip())
    kept = [s for s in sentences if not _NARRATION.search(s)]
    if not kept or len(kept) == len(sentences):
        return text
    return " ".join(kept)


def as_rule(text: str, bound: int) -> str:
    """``text`` without what a small model's reply carries that is no part of a rule: a last
    sentence the length bound (``bound``) cut and sentences that narrate one trace."""
    return without_narration(without_cut_sentence(text, bound))


def copies_formula(text: str, task: str) -> bool:
    """Whether every piece of the bullet's formula is already in ``task``: a lesson that only
    repeats the formula its task states (ACE's Formula tasks give it: "Formula: Current Ratio
    = Current Assets / Current Liabilities") teaches the agent nothing it was not told."""
    terms = formula_terms(text)
    if not terms:
        return False
    known = (
        " ".join(formula_terms(task))
        + " "
        + " ".join(
            re.sub(
                r"[^\w*/=^+-]", " ", unicodedata.normalize("NFKC", task).lower().replace("×", "*")
            ).split()
        )
    )
    return all(term in known for term in terms)


def contradicts_itself(text: str) -> bool:
    """ "The formula should be A, not A": a small model's reflection that calls something wrong
    and gives it again as the fix (both sides the same words)."""
    for match in _NOT_X.finditer(text):
        right, wrong = _symbols(match.group(1)), _symbols(match.group(2))
        if right and wrong and (right == wrong or wrong in right):
            return True
    # "Always use the correct operator '×' instead of '×'" (a 1.5B curator's bullet of the
    # twenty-first run, 2026-12-07). Only equal sides count here, once the generic words are
    # gone: the left side runs back to the clause's start, so "is expressed as a decimal
    # (0.10 instead of 10%)" holds the right side's digits and is a real rule.
    for match in _INSTEAD.finditer(text):
        right, wrong = (
            " ".join(w for w in _symbols(side).split() if w not in GENERIC and w != "operator")
            for side in (match.group(1).rsplit(",", 1)[-1], match.group(2))
        )
        if wrong and right == wrong:
            return True
    return False


def _symbols(text: str) -> str:
    """Content words, operators and brackets (so ``r - g`` and ``r + g`` stay apart)."""
    flat = unicodedata.normalize("NFKC", text).lower()
    marks = r"([*/=^+\-×÷()])"
    tokens = re.sub(r"[^\w*/=^+\-×÷()]", " ", re.sub(marks, r" \1 ", flat)).split()
    return " ".join(t for t in tokens if t not in _STOP)


def restates(text: str, task: str) -> bool:
    """Whether a bullet is an instance of ``task`` rather than a lesson (see the module)."""
    if _numbers(text) & _numbers(task):
        return True
    words = content_words(text)
    if not words:
        return False
    if has_formula(text) and not copies_formula(text, task):
        return False
    known = set(content_words(task))
    return sum(1 for w in words if w in known) / len(words) >= RESTATED


def review_adds(
    playbook: Playbook,
    delta: Delta,
    tasks: Sequence[str],
    *,
    max_chars: int = 2000,
    policy: Sequence[re.Pattern[str]] = (),
    own_tasks: Mapping[str, Sequence[str]] | None = None,
    quoted: Sequence[str] = (),
    examples: bool = False,
) -> dict[int, SkipReason]:
    """Index (among the delta's ADDs) -> why it is rejected, for the ADDs that are.
    ``own_tasks``: normalised content -> the tasks of the curator groups that proposed it;
    an ADD not in it is compared with all of ``tasks``. ``examples`` (the learner writes worked
    examples): the checks of what a rule says read the text before ``EXAMPLE_MARK`` (an
    example restates its task by design); the whole text meets the length bound, the policy,
    the markup and quoting checks, and the exact-duplicate one."""
    adds = [op for op in delta.operations if isinstance(op, AddOp)]
    existing = [b.content for s in playbook.sections for b in s.bullets]
    exact = {normalize(text) for text in existing}
    kept = [frozenset(content_words(rule_of(t) if examples else t)) for t in existing]
    rejected: dict[int, SkipReason] = {}
    for i, add in enumerate(adds):
        problem = text_problem(add.content, max_chars, policy, quoted)
        if problem is not None:
            rejected[i] = problem
            continue
        norm = normalize(add.content)
        rule = rule_of(add.content) if examples else add.content
        words = content_words(rule)
        if len(words) < MIN_WORDS or teaches_nothing(rule):
            rejected[i] = "no_lesson"
            continue
        if contradicts_itself(rule):
            rejected[i] = "contradicts_itself"
            continue
        sources = (own_tasks or {}).get(norm, tasks)
        if any(restates(rule, task) for task in sources):
            rejected[i] = "restates_task"
            continue
        if norm in exact:
            continue  # an exact duplicate: apply skips it as such
        bag = frozenset(words)
        if any(near_duplicates(bag, other) for other in kept):
            rejected[i] = "near_duplicate"
            continue
        exact.add(norm)
        kept.append(bag)
    return rejected


def review_edits(
    playbook: Playbook,
    delta: Delta,
    *,
    max_chars: int = 2000,
    policy: Sequence[re.Pattern[str]] = (),
    quoted: Sequence[str] = (),
) -> list[SkippedOp]:
    """The delta's UPDATEs and REMOVEs that are refused, with why (see the module)."""
    against = contested(playbook, delta)
    by_id = {b.id: b for s in playbook.sections for b in s.bullets}
    refused: list[SkippedOp] = []
    for op in delta.operations:
        if isinstance(op, UpdateOp):
            problem = text_problem(op.content, max_chars, policy, quoted)
            target = by_id.get(op.bullet_id)
            if problem is not None:
                refused.append(SkippedOp(op=op, reason=problem))
            elif (
                target is not None
                and op.bullet_id not in against
                and not keeps_meaning(target.content, op.content)
            ):
                refused.append(SkippedOp(op=op, reason="unsupported_update"))
        elif isinstance(op, RemoveOp) and op.bullet_id in by_id and op.bullet_id not in against:
            refused.append(SkippedOp(op=op, reason="unsupported_remove"))
    return refused


__all__ = [
    "DEFAULT_POLICY",
    "EXAMPLE_MARK",
    "GENERIC",
    "KEPT_MEANING",
    "MIN_WORDS",
    "NEAR_DUPLICATE_WORDS",
    "NO_LESSON",
    "QUOTED_WORDS",
    "RESTATED",
    "as_rule",
    "carries_markup",
    "compile_policy",
    "content_words",
    "contested",
    "contradicts_itself",
    "copies_formula",
    "instance",
    "keeps_meaning",
    "near_duplicates",
    "quoted_spans",
    "quotes",
    "restates",
    "review_adds",
    "review_edits",
    "rule_of",
    "text_problem",
    "violates",
    "without_cut_sentence",
    "without_narration",
    "without_rendered_prefix",
]
