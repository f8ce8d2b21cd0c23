"""Evaluation sets: questions with gold answers, retrieved documents with scores, and gold support.

Three sets, all returned as lists of :class:`Example`:

* ``world_set``: a seeded generator of invented-world multi-document QA (written by hand: no published
  generator invents facts a 135M model has never seen and keeps track of which document supports which
  answer). Four kinds of question: single-hop (one document holds the answer), two-hop (the answer needs
  two documents), unanswerable (no document mentions the entity asked about; the answer must say so,
  :func:`~ctx_integrations.evaluation.metrics.abstains`) and conflicting (two documents disagree; either
  value is accepted and an honest answer cites both). The number of documents per question and their
  approximate length are parameters; the rest of the documents are profiles of other invented entities
  written with the same templates, so the model has to read, not pattern-match.
* ``secret_code_set``: the PCED paper's synthetic set (N documents of exactly L tokens, one holds a
  secret code; needs the engine's prompt layout to cut documents to exact token counts).
* ``musique_set``: the shared MuSiQue dev file (no gold support: citation metrics are undefined).

Invented facts make accuracy measurable on a small model: nothing can be answered from the
model's own memory, so a correct answer came from the documents.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctx_integrations.documents import Document
from ctx_integrations.errors import InvalidOptionError

KINDS = ("single_hop", "two_hop", "unanswerable", "conflicting")
# An unanswerable question's answers, for F1 and the report: what a model says when the documents do not hold the
# answer. Correctness is :func:`~ctx_integrations.evaluation.metrics.abstains` (a statement, not any "does not").
ABSTENTIONS = ("unknown", "not mentioned", "no information", "not provided", "does not", "do not", "cannot",
               "can not", "don't know", "not specified", "not stated", "no mention", "not known", "not available")
MUSIQUE_ENV = "CTX_MUSIQUE"  # where the MuSiQue dev file is when no path is given (not shipped with the package)


@dataclass(frozen=True)
class Example:
    """One question with its retrieved documents (scores on them) and what a correct answer is.

    ``gold`` indexes ``documents``: the supporting documents (empty for an unanswerable question).
    ``has_gold`` is False where the set does not know its supporting documents (MuSiQue here).
    """

    id: str
    question: str
    answers: tuple[str, ...]
    documents: tuple[Document, ...]
    gold: tuple[int, ...] = ()
    kind: str = "single_hop"
    has_gold: bool = True
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "question": self.question, "answers": list(self.answers), "kind": self.kind,
                "gold": list(self.gold), "has_gold": self.has_gold,
                "documents": [{"id": d.id, "score": d.score, "text": d.text} for d in self.documents]}


# -- the invented world ---------------------------------------------------------------------------------
_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "th", "v", "w")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ia", "ou")
_CODAS = ("", "n", "r", "l", "s", "th", "nd", "rk", "m", "x")
_PROFESSIONS = ("baker", "clockmaker", "sailor", "painter", "glassblower", "beekeeper", "cartographer", "weaver",
                "brewer", "stonemason", "astronomer", "potter")
_INDUSTRIES = ("shipbuilding", "tea", "lantern", "textile", "salt", "paper", "bicycle", "cheese", "rope", "ink")
_ADJECTIVES = ("quiet", "narrow", "busy", "old", "painted", "windy", "green", "crowded", "tall", "small", "famous")
_NOUNS = ("square", "harbour", "market", "garden", "bridge", "library", "workshop", "courtyard", "tower", "orchard")
_VERBS = ("visits", "admires", "walks past", "photographs", "remembers", "describes", "recommends")


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


class _Names:
    """Unique invented names (two syllables, capitalised), never repeated within one set."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def __call__(self, syllables: int = 2) -> str:
        while True:
            name = _word(self.rng, syllables).capitalize()
            if name not in self.used and len(name) >= 4:
                self.used.add(name)
                return name


@dataclass
class _Person:
    name: str
    profession: str
    town: str
    year: int


@dataclass
class _Company:
    name: str
    industry: str
    founder: str
    year: int
    town: str


def _person_text(p: _Person) -> str:
    return (f"{p.name} is a {p.profession} who lives in the town of {p.town}. "
            f"{p.name} was born in {p.year}.")


def _company_text(c: _Company, founder_sentence: str | None = None) -> str:
    founded = founder_sentence or f"It was founded by {c.founder} in {c.year}."
    return f"{c.name} is a {c.industry} company based in {c.town}. {founded}"


def _pad(rng: random.Random, text: str, subject: str, words: int) -> str:
    """Add neutral sentences about ``subject`` (no names, years or professions) until about ``words`` words."""
    sentences = [text]
    while len(" ".join(sentences).split()) < words:
        template = rng.randrange(3)
        adjective, noun = rng.choice(_ADJECTIVES), rng.choice(_NOUNS)
        if template == 0:
            sentences.append(f"Many travellers know {subject} for its {adjective} {noun}.")
        elif template == 1:
            sentences.append(f"Everyone who {rng.choice(_VERBS)} the {adjective} {noun} talks about {subject}.")
        else:
            article = "an" if adjective[0] in "aeiou" else "a"
            sentences.append(f"Near {subject} there is {article} {adjective} {noun} that is open every day.")
    return " ".join(sentences)


def world_set(n_questions: int = 8, *, documents: int = 4, document_tokens: int = 64, seed: int = 0,
              kinds: tuple[str, ...] = KINDS) -> list[Example]:
    """Invented-world multi-document QA, seeded: the same arguments give the same set.

    n_questions: questions, cycling through ``kinds`` (single_hop, two_hop, unanswerable,
    conflicting). documents: retrieved documents per question (>= 2; gold ones included). document_tokens:
    approximate length of each document (padded with neutral sentences; about 1.3 tokens a word).
    Each document carries a retrieval score in [0.3, 0.95]: gold documents are drawn from a higher
    range than distractors but not always above them, as with a real retriever.
    """
    if n_questions < 1:
        raise InvalidOptionError(f"world_set needs n_questions >= 1, got {n_questions}")
    if documents < 2:
        raise InvalidOptionError(f"world_set needs documents >= 2 per question (two-hop and conflicting questions "
                                 f"use two), got {documents}")
    if document_tokens < 16:
        raise InvalidOptionError(f"world_set needs document_tokens >= 16 (a fact is ~16 tokens), got {document_tokens}")
    unknown = [k for k in kinds if k not in KINDS]
    if not kinds or unknown:
        raise InvalidOptionError(f"world_set kinds must be a non-empty subset of {', '.join(KINDS)}, got {kinds!r}")
    rng = random.Random(seed)
    names = _Names(rng)
    words = max(8, round(document_tokens / 1.3))
    return [_world_example(rng, names, kinds[i % len(kinds)], f"world-{seed}-{i:03d}", documents, words)
            for i in range(n_questions)]


def _new_person(rng: random.Random, names: _Names) -> _Person:
    return _Person(f"{names()} {names()}", rng.choice(_PROFESSIONS), names(), rng.randint(1901, 1999))


def _new_company(rng: random.Random, names: _Names, founder: str) -> _Company:
    return _Company(f"{names()} {rng.choice(('Works', 'Company', 'Guild', 'Trading House'))}",
                    rng.choice(_INDUSTRIES), founder, rng.randint(1820, 1990), names())


def _distractor(rng: random.Random, names: _Names, words: int) -> str:
    if rng.random() < 0.5:
        person = _new_person(rng, names)
        return _pad(rng, _person_text(person), person.name, words)
    company = _new_company(rng, names, _new_person(rng, names).name)
    return _pad(rng, _company_text(company), company.name, words)


def _world_example(rng: random.Random, names: _Names, kind: str, example_id: str, n_docs: int,
                   words: int) -> Example:
    person = _new_person(rng, names)
    company = _new_company(rng, names, person.name)
    if kind == "single_hop":
        if rng.random() < 0.5:
            question, answers = f"Who founded {company.name}?", (person.name,)
            gold_texts = [_pad(rng, _company_text(company), company.name, words)]
        else:
            question, answers = f"What is the profession of {person.name}?", (person.profession,)
            gold_texts = [_pad(rng, _person_text(person), person.name, words)]
    elif kind == "two_hop":
        question, answers = f"In which town does the founder of {company.name} live?", (person.town,)
        gold_texts = [_pad(rng, _company_text(company), company.name, words),
                      _pad(rng, _person_text(person), person.name, words)]
    elif kind == "unanswerable":  # the company is never described in any document
        question, answers, gold_texts = f"Who founded {company.name}?", ABSTENTIONS, []
    else:  # conflicting: two sources name different founders
        other = f"{names()} {names()}"
        question, answers = f"Who founded {company.name}?", (person.name, other)
        gold_texts = [
            _pad(rng, _company_text(company, f"According to the trade register, it was founded by {person.name} "
                                             f"in {company.year}."), company.name, words),
            _pad(rng, _company_text(company, f"A local history book says it was founded by {other} "
                                             f"in {company.year}."), company.name, words)]
    texts = gold_texts + [_distractor(rng, names, words) for _ in range(n_docs - len(gold_texts))]
    scores = [rng.uniform(0.55, 0.95) for _ in gold_texts] + [rng.uniform(0.3, 0.85)
                                                              for _ in range(n_docs - len(gold_texts))]
    order = list(range(n_docs))
    rng.shuffle(order)
    documents = tuple(Document(texts[i], id=f"{example_id}-d{rank}", score=round(scores[i], 3))
                      for rank, i in enumerate(order))
    gold = tuple(sorted(rank for rank, i in enumerate(order) if i < len(gold_texts)))
    meta = {"answer_match": "abstention"} if kind == "unanswerable" else {}
    return Example(example_id, question, answers, documents, gold, kind, meta=meta)


# -- the secret-code set ----------------------------------------------------------------------------------
_FILLER = ("the river town market people water city day year time house school road field work light house "
           "tree hill stone wind rain bridge north south east west small large old new green blue red morning "
           "evening night week summer winter garden table window door street wall farm village").split()
SECRET_CODE_QUESTION = "What is the secret code? Answer with the code only."


def _single_token_words(layout: Any) -> list[str]:
    encode = layout.tokenizer
    words = [w for w in dict.fromkeys(_FILLER) if len(encode(" " + w, add_special_tokens=False)["input_ids"]) == 1]
    if len(words) < 10:
        raise InvalidOptionError("the tokenizer has too few single-token filler words for the secret-code set")
    return words


def _fit(layout: Any, head: str, words: list[str], length: int) -> str:
    """``head`` followed by filler words, cut so the document is exactly ``length`` tokens in ``layout``."""
    text = head
    for word in words:
        if len(layout.context_ids(text)) >= length:
            break
        text += " " + word
    n = len(layout.context_ids(text))
    if n != length:
        raise InvalidOptionError(f"could not fit a secret-code document to {length} tokens (got {n}); "
                                 "use a longer document length")
    return text


def secret_code_documents(layout: Any, n_documents: int, length: int, seed: int = 0) -> tuple[list[str], int, str]:
    """The PCED paper's synthetic example: ``(documents, needle_index, code)``, each document exactly ``length``
    tokens as ``layout`` (an engine's :class:`~ctx_integrations.engine.core.layout.PromptLayout`) tokenises it."""
    rng = random.Random(seed)
    vocab = _single_token_words(layout)
    code = str(rng.randint(10000, 99999))
    needle = rng.randrange(n_documents)
    documents = []
    for i in range(n_documents):
        words = [rng.choice(vocab) for _ in range(length + 8)]
        if i == needle:
            cut = rng.randrange(1, max(2, length // 2))
            head = "Note:" + "".join(" " + w for w in words[:cut]) + f". The secret code is {code}."
            documents.append(_fit(layout, head, words[cut:], length))
        else:
            documents.append(_fit(layout, "Note:", words, length))
    return documents, needle, code


def secret_code_set(layout: Any, n_questions: int = 6, *, documents: int = 4, document_tokens: int = 64,
                    seed: int = 0) -> list[Example]:
    """Secret-code examples (gold support: the needle document); every document has score 1 (no prior)."""
    if n_questions < 1 or documents < 1:
        raise InvalidOptionError(f"secret_code_set needs n_questions >= 1 and documents >= 1, got {n_questions}, "
                                 f"{documents}")
    examples = []
    for i in range(n_questions):
        texts, needle, code = secret_code_documents(layout, documents, document_tokens, seed=seed * 1000 + i)
        docs = tuple(Document(t, id=f"code-{seed}-{i:03d}-d{j}", score=1.0) for j, t in enumerate(texts))
        examples.append(Example(f"code-{seed}-{i:03d}", SECRET_CODE_QUESTION, (code,), docs, (needle,),
                                "secret_code"))
    return examples


# -- MuSiQue -------------------------------------------------------------------------------------------
def musique_set(path: str | Path | None = None, n_questions: int | None = 12) -> list[Example]:
    """MuSiQue dev questions from ``path`` (default ``$CTX_MUSIQUE``), a jsonl of ``{"id", "question",
    "answers", "documents"}`` rows. Scores fall with document order (r = 1 - i / 20), as in ``benchmarks/``."""
    if path is None and not os.environ.get(MUSIQUE_ENV):
        raise InvalidOptionError(f"the MuSiQue set is not shipped: pass its jsonl file (--data PATH, or "
                                 f"musique_set(path=...)) or set {MUSIQUE_ENV}")
    location = Path(path) if path is not None else Path(os.environ[MUSIQUE_ENV])
    if not location.is_file():
        raise InvalidOptionError(f"MuSiQue file {location} not found: pass its path (--data PATH, or "
                                 f"musique_set(path=...), or {MUSIQUE_ENV})")
    rows = [json.loads(line) for line in location.read_text(encoding="utf-8").splitlines() if line.strip()]
    examples = []
    for row in rows[:n_questions] if n_questions else rows:
        docs = tuple(Document(t, id=f"{row['id']}-d{j}", score=max(0.05, 1 - j / 20))
                     for j, t in enumerate(row["documents"]))
        examples.append(Example(row["id"], row["question"], tuple(row["answers"]), docs, (), "musique",
                                has_gold=False))
    return examples
