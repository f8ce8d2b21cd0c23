"""Why a PCED answer went where it went: its streams' scores at every step, replayed from the answer itself.

PCED picks each token as the best of its experts' contrasted, prior-weighted scores (docs/methods.md#pced). To
say why an answer copied one passage or missed the one holding the answer, :func:`replay_pced` recomputes what
the rule saw: it runs each stream's whole prompt once with the answer appended (teacher forcing: the amateur's
``prefix + suffix(question) + answer``, expert k's ``prefix + document_k + suffix(question) + answer``, the
layout's own token ids), and feeds the logits of every step to the same :class:`PCEDFusion` rule the engine built,
carrying its state from step to step. Per step it reports the token the rule picks from those logits, the expert
that won the answer's token and by what margin over the runner-up, and each expert's best score; per stream, the
question's log-likelihood given its document (UPR's reranking signal, which ``query_likelihood`` weighs).

Recomputing without the KV caches reproduces the engine's scores up to float rounding (exactly in float32,
``tests/test_diagnosis.py``); the replay says how often its pick agrees with the answer's token, so a reading in
bfloat16 can be discounted where it does not. Written here because no library replays a fusion rule over
teacher-forced streams; it is a measuring aid for docs/evaluation.md, not part of answering.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ctx_integrations.documents import prepare_documents
from ctx_integrations.engine.core.decoding import FIRST_STEP, FusionState
from ctx_integrations.engine.modes.pced import PCEDFusion
from ctx_integrations.errors import InvalidOptionError


@dataclass(frozen=True)
class StepReading:
    """One step of a replayed answer: the answer's token, the expert that won it and by how much.

    ``picked``: the token the rule's fused scores rank first (equal to ``token`` when the replay reproduces the
    engine); ``winner``: the expert (0-based document index) with the best score for ``token``; ``margin``: that
    score minus the best other expert's for the same token (nats; ``inf`` with one expert); ``best``: each expert's
    best score over the vocabulary at this step (what it would have said if it had won).
    """

    token: int
    picked: int
    winner: int
    margin: float
    best: tuple[float, ...]


@dataclass
class Replay:
    """A replayed PCED answer: its steps, each stream's question log-likelihood and the rule's betas."""

    steps: list[StepReading]
    question_loglik: list[float]  # per expert, log p(question | prefix + document_k)
    amateur_question_loglik: float
    beta: list[float]
    prior: list[float]  # per expert, gamma times the log-prior the rule added (after query_likelihood's re-ranking)
    pieces: list[str] = field(default_factory=list)  # each step's token as text

    @property
    def agreement(self) -> float:
        """The share of steps whose replayed pick is the answer's token (1.0: the replay is the engine's run)."""
        return sum(s.picked == s.token for s in self.steps) / len(self.steps) if self.steps else 1.0


def stream_ids(layout: Any, question: str, documents: Sequence[str]) -> list[list[int]]:
    """The prompt ids of PCED's streams, as the engine lays them out: the amateur first, then one per document."""
    suffix = layout.suffix_ids(question)
    return [layout.prefix_ids + suffix] + [layout.prefix_ids + layout.context_ids(d) + suffix for d in documents]


@torch.inference_mode()
def _teacher_forced(model: Any, prompt: list[int], answer: Sequence[int], device: Any) -> torch.Tensor:
    """Float32 logits ``[len(prompt) + len(answer) - 1, V]``: position i scores token i + 1."""
    ids = torch.tensor([prompt + list(answer)], device=device)
    return model(input_ids=ids).logits[0, :-1].float()


def replay_pced(engine: Any, question: str, documents: Sequence[Any], answer_ids: Sequence[int],
                **options: Any) -> Replay:
    """Replay ``answer_ids`` (an answer's token ids, e.g. ``engine.generate(..., mode="pced").token_ids``) through
    PCED's rule built with ``options`` (PCEDFusion's keyword arguments, e.g. ``gamma``, ``prior``) over
    ``documents`` (with scores, as the engine takes them)."""
    if not documents:
        raise InvalidOptionError("replay_pced needs at least one document")
    if not answer_ids:
        raise InvalidOptionError("replay_pced needs an answer of at least one token")
    documents = prepare_documents(documents)  # the engine's texts and scores (r = 1 where none is given)
    rule = PCEDFusion([d.score for d in documents], **options)
    layout, loaded = engine.layout, engine.loaded
    suffix = layout.suffix_ids(question)
    span = layout.question_span(suffix)
    logits, loglik = [], []
    for prompt in stream_ids(layout, question, [d.text for d in documents]):
        full = _teacher_forced(loaded.model, prompt, answer_ids, loaded.device)
        logits.append(full[len(prompt) - 1:])
        start, stop = len(prompt) - len(suffix) + span[0], len(prompt) - len(suffix) + span[1]
        targets = torch.tensor(prompt[start:stop], device=full.device)
        picked = torch.log_softmax(full[start - 1:stop - 1], -1).gather(1, targets.unsqueeze(1))
        loglik.append(float(picked.sum()))
    if rule.wants_likelihood:  # the prior the engine re-ranks by the question's likelihood before the first token
        rule = rule.given_likelihood(torch.tensor(loglik))
    stacked = torch.stack(logits)  # [1 + K, T, V]
    steps, state = [], FIRST_STEP
    for t, token in enumerate(answer_ids):
        fused = rule(stacked[:, t], state)
        scores_for_token = fused.evidence[:, token]
        winner = int(scores_for_token.argmax())
        others = torch.cat([scores_for_token[:winner], scores_for_token[winner + 1:]])
        margin = float(scores_for_token[winner] - others.max()) if others.numel() else float("inf")
        steps.append(StepReading(int(token), int(fused.scores.argmax()), winner, margin,
                                 tuple(float(v) for v in fused.evidence.max(1).values)))
        state = FusionState(last_token=int(token), last_winner=winner, carry=fused.carry)
    beta = state.carry.tolist() if isinstance(state.carry, torch.Tensor) else []
    pieces = [loaded.tokenizer.decode([t]) for t in answer_ids]
    return Replay(steps, loglik[1:], loglik[0], beta, (rule.gamma * rule.log_prior).tolist(), pieces)


@dataclass(frozen=True)
class Grounding:
    """An answer's tokens scored on every stream, teacher-forced: how much more likely each token is given a
    document than given the question alone (issue 61's grounding signal, measured before any rule is built on it).

    ``context_free[t]``: log p(token t | question) on the context-free stream (Soft-NBCE's prior, PCED's amateur);
    ``per_document[t][k]``: log p(token t | document k, question); both the full softmax (no nucleus, no contrast),
    in nats. ``pieces``: each token's text.
    """

    context_free: list[float]
    per_document: list[list[float]]
    pieces: list[str]

    def gains(self) -> list[float]:
        """Per token: the best document's log-probability minus the context-free one."""
        return [max(row) - free for row, free in zip(self.per_document, self.context_free)]


def grounding(engine: Any, question: str, documents: Sequence[Any], answer_ids: Sequence[int]) -> Grounding:
    """Score ``answer_ids`` on the context-free stream and on each document's stream, laid out as the engine lays
    them (:func:`stream_ids`, one stream per document: documents must fit one Soft-NBCE chunk each)."""
    if not documents or not answer_ids:
        raise InvalidOptionError("grounding needs at least one document and an answer of at least one token")
    documents = prepare_documents(documents)
    loaded = engine.loaded
    rows = []
    targets = torch.tensor(list(answer_ids), device=loaded.device).unsqueeze(1)
    for prompt in stream_ids(engine.layout, question, [d.text for d in documents]):
        full = _teacher_forced(loaded.model, prompt, answer_ids, loaded.device)[len(prompt) - 1:]
        rows.append(torch.log_softmax(full, -1).gather(1, targets).squeeze(1))
    stacked = torch.stack(rows)  # [1 + K, T]
    return Grounding(stacked[0].tolist(), stacked[1:].T.tolist(), [loaded.tokenizer.decode([t]) for t in answer_ids])
