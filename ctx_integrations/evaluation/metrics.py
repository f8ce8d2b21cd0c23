"""Answer and citation metrics, computed per example and averaged per mode.

Answer metrics follow SQuAD's evaluation script (normalise, then token F1), with "substring EM"
(a normalised gold answer occurs in the normalised prediction) because a chat model wraps its
answer in a sentence. Citation precision / recall compare the set of cited documents with the
gold supporting documents of an example; they are undefined (``None``) where the set they divide
by is empty and left out of the averages, so "cited nothing" never counts as perfect precision.
"""

from __future__ import annotations

import re
import statistics
import string
import unicodedata
from collections import Counter
from collections.abc import Collection, Iterable, Sequence

_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation and articles, squeeze whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 between a prediction and one gold answer."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, answers: Sequence[str]) -> float:
    """The best token F1 over the gold answers (0 when there are none)."""
    return max((token_f1(prediction, a) for a in answers), default=0.0)


def substring_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when a (non-empty) normalised gold answer occurs in the normalised prediction."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(a) and normalize_answer(a) in pred for a in answers))


def bounded_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when a gold answer occurs in the prediction as a whole, not inside a longer word, number or option.

    An answer of words is compared SQuAD-normalised, as whole tokens: ``diff`` matches "use diff" but not "the
    difference", ``BLOCK_SIZE`` not ``DU_BLOCK_SIZE``. An answer that normalisation would shrink to a letter or
    two (an option such as ``-i`` -> ``i``, an exit status ``2``, a command ``Q``), and any option, must occur as
    written, case kept (``-a`` is not ``-A``): ``-i`` matches "use ``-i``." but not "ignore" or ``-iv``, ``2`` not
    "12". :func:`substring_match` would find ``-i`` in any answer that has an "i" in it.
    """
    words = f" {normalize_answer(_unquoted(prediction))} "
    for answer in (a.strip() for a in answers):
        if answer and (answer.startswith("-") or len(normalize_answer(answer)) <= 3):
            before = r"(?<![\w-])" if answer.startswith("-") else r"(?<!\w)"
            if re.search(before + re.escape(answer) + r"(?!\w)", prediction):
                return 1.0
        elif normalize_answer(answer) and f" {normalize_answer(answer)} " in words:
            return 1.0
    return 0.0


# What the answer must say to abstain (:func:`abstains`): a statement about the documents, or about the thing asked.
_SOURCE = (r"(?:documents?|context|passages?|excerpts?"
           r"|(?:provided|given|supplied) (?:text|information|sources?|manuals?)"
           r"|(?:text|information|sources?|manuals?) (?:provided|given|above|supplied))")
_SOURCE_AFTER = r"(?:documents?|context|passages?|excerpts?|text|information|sources?|manuals?)"
_THING = r"(?:option|flag|switch|test|variable|command|program|setting|feature|company|person)s?"
_ABSTAINING = tuple(re.compile(pattern) for pattern in (
    # "the documents (provided) do not mention ...", "the given text doesn't say ..."
    rf"\b{_SOURCE}(?: (?:provided|given|above|here|supplied))? (?:do|does|did) ?(?:not|n't) (?:\w+ ){{0,2}}?"
    r"(?:contain|mention|provide|include|say|specify|state|describe|cover|address|discuss|give|answer|have|offer"
    r"|explain|list|hold|tell)",
    # "... is not mentioned in the documents", "not explicitly stated in the provided text"
    r"(?<!if )(?<!when )(?<!unless )\bnot (?:\w+ )?(?:mentioned|specified|stated|provided|described|found|given"
    r"|covered|addressed|included|present|discussed|listed|explained|answered) (?:in|by|within|from) (?:the |these |"
    rf"this |any of the )?(?:\w+ )?{_SOURCE_AFTER}",
    # "... does not have a direct answer in the given documents", "there is no information about X in the context"
    rf"\b(?:not|no|n't)\b(?: [^ .]+){{0,6}} (?:in|from|within) (?:the |these |this )?(?:\w+ )?{_SOURCE}"
    r"(?: (?:provided|given|above|here|supplied))?(?:[.,;:!?)]|$| (?:and|or|but|so|about|regarding|for|to)\b)",
    # "the founder is not mentioned", "no information about X": the fact asked for is missing
    r"(?<!if )(?<!when )(?<!unless )\b(?:is|are|was|were) not (?:\w+ )?(?:mentioned|specified|stated|provided"
    r"|given|known|documented)\b(?! (?:as|by|to|with|when|if|for)\b)",
    r"\bno (?:\w+ )?(?:information|mention|details?|data) (?:about|on|regarding|is|was|of|for)\b",
    r"\b(?:is|are) unknown\b",
    r"\b(?:not enough|insufficient) information\b",
    # "I cannot answer", "cannot be determined", "unable to find"
    r"\b(?:cannot|can ?not|can't|unable to|not able to) (?:be )?(?:answer|determine|find|tell|say|found|determined"
    r"|answered|identified|identify|provide)",
    r"\bi (?:do ?(?:not|n't)) know\b",
    # the thing asked about does not exist: "there is no such option", "ls has no --max-entries option"
    rf"\bthere (?:is|are) no (?:such )?(?:\S+ ){{0,2}}{_THING}\b",
    rf"\b(?:has|have) no (?:such )?(?:\S+ ){{0,2}}{_THING}\b",
    rf"\b(?:do|does) ?(?:not|n't) (?:have|support|provide|offer|accept|recognize|exist)\b(?: (?:an?|any|such|the))*"
    rf"(?: \S+){{0,2}} {_THING}\b",
    rf"\b{_THING} (?:\S+ )?(?:does|do) ?(?:not|n't) exist\b",
    rf"\bis not (?:a )?(?:valid|existing|known|recognized|real|an? (?:valid|existing|known|recognized|real)) "
    rf"(?:\S+ ){{0,2}}{_THING}\b",
))


def abstains(prediction: str) -> float:
    """1.0 when the prediction says the documents do not answer (or that what was asked about does not exist).

    A statement is needed, not a negation: "the documents do not mention it", "X is not specified in the context",
    "there is no information about X", "I cannot answer", "there is no such option" count; "the ``--json`` option
    does not output differences" (an invented answer in the negative) and "if not specified, ..." do not, where a
    list of phrases ("does not", "cannot") would count them. Matched on the lower-cased text with typographic quotes
    and runs of white space made plain. Hand-written: no evaluation library scores abstention in free text.
    """
    text = " ".join(prediction.lower().replace("\u2019", "'").replace("\u2018", "'").split())
    return 1.0 if any(pattern.search(text) for pattern in _ABSTAINING) else 0.0


def _unquoted(text: str) -> str:
    """Non-ASCII punctuation (typographic quotes, dashes) as spaces: SQuAD's normalisation keeps them, so
    "‘BLOCK_SIZE’" would not hold the token ``blocksize``."""
    return "".join(" " if ord(ch) > 127 and unicodedata.category(ch).startswith("P") else ch for ch in text)


def citation_precision(cited: Collection[int], gold: Collection[int]) -> float | None:
    """Share of cited documents that are gold support; ``None`` when nothing was cited."""
    if not cited:
        return None
    return len(set(cited) & set(gold)) / len(set(cited))


def citation_recall(cited: Collection[int], gold: Collection[int]) -> float | None:
    """Share of gold supporting documents that were cited; ``None`` when there is no gold support."""
    if not gold:
        return None
    return len(set(cited) & set(gold)) / len(set(gold))


def mean_defined(values: Iterable[float | None]) -> float | None:
    """Mean of the values that are not ``None`` (``None`` if there are none)."""
    defined = [v for v in values if v is not None]
    return sum(defined) / len(defined) if defined else None


def median_defined(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not ``None`` (``None`` if there are none)."""
    defined = [v for v in values if v is not None]
    return statistics.median(defined) if defined else None


def bracket_citations(text: str, n_documents: int) -> list[int]:
    """Document indices (0-based) named by ``[n]`` markers (1-based) in ``text``, in order, valid ones only.

    ``[1, 3]`` and ``[1][3]`` both count; numbers outside 1..n_documents are ignored (a model's
    invented reference is not a citation of any retrieved document).
    """
    found: list[int] = []
    for group in re.findall(r"\[([\d,\s]+)\]", text):
        for number in re.findall(r"\d+", group):
            index = int(number) - 1
            if 0 <= index < n_documents and index not in found:
                found.append(index)
    return found


def recall_at_k(gold_ranks: Sequence[int | None], depth: int) -> dict[str, float]:
    """``{"recall@k": share}`` for k = 1 .. ``depth``: the share of questions whose gold passage the retriever
    ranked k-th or better (ranks are 1-based; ``None``: not retrieved at all)."""
    if not gold_ranks:
        return {}
    return {f"recall@{k}": sum(1 for rank in gold_ranks if rank is not None and rank <= k) / len(gold_ranks)
            for k in range(1, depth + 1)}
