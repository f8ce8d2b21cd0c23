"""IPPD mode: many questions over shared contexts, answered in one stacked prompt (docs/methods.md#ippd).

A stack is one sequence ``[prefix | c_1 | c_2 | ... | x_11 | x_12 | ... | x_21 | ... | answers]``:
the shared prefix, each context once (the concatenation of a question group's documents, its KV
from the store), then every question's suffix, then the answers' tokens appended as they grow. Each
token has a *virtual position*, the position it would have if its own (prefix, context, question)
were decoded alone, a context id and a question id (0 = shared), and may see a key iff

    vpos(q) >= vpos(k)  and  (ctx(q) = ctx(k) or ctx(k) = 0)  and  (qid(q) = qid(k) or qid(k) = 0)

so every answer sees exactly what independent decoding would, while the context's keys are read
once per step for all of its questions. That rule is the scheduler's row pool's own
(``engine/core/rows.py::visibility``): a stack is a row of the pool like any other stream, so IPPD
stacks share the batched forward with every other request.

Questions are packed into stacks of at most ``max_stack_tokens`` tokens (prompt plus answer
budget; default the model's window), one pool row per stack. Each step appends the next token of
every unfinished answer (rows padded to the longest step); padding has an infinite virtual
position, so no real token ever attends to it.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from ctx_integrations.engine.core.cache import CachedKV
from ctx_integrations.engine.core.decoding import (
    DecodeResult,
    Emitter,
    TokenSampler,
    TraceStep,
    generators_kept,
    logprob_values,
    race_noises,
    race_winner,
    read_logprobs,
    sampling_probs,
)
from ctx_integrations.engine.core.jobs import PooledJob
from ctx_integrations.engine.core.registry import DecodeContext, register_mode
from ctx_integrations.engine.core.rows import PAD_ID, PAD_POSITION, Piece, Run, visibility
from ctx_integrations.engine.core.transfer import same_device
from ctx_integrations.engine.modes.specs import IPPD
from ctx_integrations.errors import DocumentTooLongError, InvalidOptionError

__all__ = ["PAD_ID", "PAD_POSITION", "StackedJob", "run_ippd", "visibility"]


@dataclass
class _Question:
    """One question of a stack: where its answer stands."""

    index: int  # position in the caller's list
    ctx: DecodeContext
    stack: int  # which stack (batch row) holds it
    context: int  # context id in its stack (>= 1)
    qid: int  # question id in its stack (>= 1)
    suffix: list[int]
    emitter: Emitter
    next_position: int  # virtual position of the answer's next token


@dataclass
class _Stack:
    """One stacked prompt: its contexts (store entries) and its questions."""

    contexts: list[CachedKV] = field(default_factory=list)
    context_keys: list[str] = field(default_factory=list)
    questions: list[_Question] = field(default_factory=list)
    tokens: int = 0  # prompt tokens + answer budget


def _pack(ctx_groups: list[tuple[CachedKV, list[_Question]]], prefix_len: int, budget: int,
          max_new_tokens: int) -> list[_Stack]:
    """Fill stacks in order: a context joins a stack with its first question; more follow while they fit."""
    stacks: list[_Stack] = []
    for entry, questions in ctx_groups:
        for question in questions:
            need = len(question.suffix) + max_new_tokens
            stack = stacks[-1] if stacks else None
            joins_context = stack is not None and stack.context_keys and stack.context_keys[-1] == entry.key
            extra = need + (0 if joins_context else entry.length)
            if stack is None or stack.tokens + extra > budget:
                stack, joins_context = _Stack(tokens=prefix_len), False
                stacks.append(stack)
                extra = need + entry.length
            if not joins_context:
                stack.contexts.append(entry)
                stack.context_keys.append(entry.key)
            question.stack, question.context = len(stacks) - 1, len(stack.contexts)
            question.qid = len(stack.questions) + 1
            stack.questions.append(question)
            stack.tokens += extra
    return stacks


def _check_devices(model_device: torch.device, entries: list[CachedKV]) -> None:
    devices = {str(e.kv.device) for e in entries}
    if len(devices) > 1 or not same_device(devices.pop(), model_device):  # "cuda" is "cuda:0"; == says otherwise
        raise InvalidOptionError(f"IPPD got cached contexts on {sorted({str(e.kv.device) for e in entries})} for a "
                                 f"model on {model_device}: compute the caches with this engine (its store moves "
                                 "them to the model's device) instead of mixing engines or devices")


class StackedJob(PooledJob):
    """IPPD's job: one row per stack; each step appends the next token of every unfinished answer of a stack.

    Each question has its own sampler and emitter; its tokens carry its virtual positions, its
    context id and its question id, so the pool's visibility rule gives it exactly its own view.
    """

    def __init__(self, contexts: list[DecodeContext], stacks: list[_Stack], prefix: CachedKV, prefix_len: int):
        super().__init__(contexts)
        self.stacks, self.prefix, self.prefix_len = stacks, prefix, prefix_len
        self._next = [[Run(tuple(q.suffix), q.next_position - len(q.suffix), q.context, q.qid) for q in s.questions]
                      for s in stacks]
        self._waiting: list[list[_Question]] = [list(s.questions) for s in stacks]
        self._live = list(range(len(stacks)))  # the stacks whose rows are still in the pool, in row order

    @property
    def done(self) -> bool:
        return not any(self._waiting)

    def take_finished_rows(self) -> list[int]:
        """A stack whose questions are all answered leaves the pool while the other stacks decode."""
        finished = [row for row, stack in enumerate(self._live) if not self._waiting[stack]]
        if finished and not self.done:
            self._live = [stack for stack in self._live if self._waiting[stack]]
            return finished
        return []

    def rows(self) -> list[list[Piece]]:
        return [[Piece(self.prefix.kv, 0)] + [Piece(entry.kv, self.prefix_len, context)
                                              for context, entry in enumerate(stack.contexts, start=1)]
                for stack in self.stacks]

    def runs(self) -> list[list[Run]]:
        return [self._next[stack] for stack in self._live]

    def kv_tokens(self) -> int:
        return sum(self.prefix_len + sum(entry.kv.shape[3] for entry in stack.contexts)
                   + sum(len(q.suffix) + q.ctx.stop.max_new_tokens for q in stack.questions) for stack in self.stacks)

    def propose(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """Per waiting question, in stack order: its token, the token's log-probability, the score to check, then
        its log-probabilities when its sampler asks for them (every question's sampler asks the same). Questions whose
        samplers share their knobs (:attr:`~TokenSampler.batch_knobs`: all greedy, or all sampled alike) are chosen all
        at once per stack (:func:`greedy_question_values`, :func:`sampled_question_values`), the others one by one."""
        self._prefilled()
        knobs = self._knobs()
        if knobs is not None:  # per stack, not one [Q, V] copy of every stack's logits (the CPU reads each from cache)
            return torch.cat([question_values(rows, self._samplers(stack))
                              for stack, rows in zip(self._live, self._question_scores(logits), strict=True)])
        values = []
        for stack, row in zip(self._live, logits):
            for question, scores in zip(self._waiting[stack], row):
                sampler = question.ctx.sampler
                token, checked = sampler.pick(scores)
                logprob = scores[token] - torch.logsumexp(scores, -1)  # log_softmax's value, without its [V] output
                values.append(torch.stack([token.double(), logprob.double(), checked.double()]))
                if sampler.logprobs is not None:
                    values.append(logprob_values(scores, token, sampler.logprobs))
        return torch.cat(values)

    def batch_key(self) -> Hashable | None:
        """IPPD requests whose questions' samplers share their knobs choose together on an accelerator
        (:meth:`propose_batch`; on the CPU with :attr:`~PooledJob.batch_on_cpu`): their rule is one pick per
        question, whatever the request."""
        knobs = self._knobs()
        return knobs if knobs is not None and self.batches_here() else None

    @classmethod
    def propose_batch(cls, jobs: list[StackedJob], logits: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Every job's questions in one evaluation: the values each job's :meth:`propose` returns."""
        scores = [torch.cat(job._question_scores(rows)) for job, rows in zip(jobs, logits, strict=True)]
        samplers = [sampler for job in jobs for stack in job._live for sampler in job._samplers(stack)]
        values = question_values(torch.cat(scores), samplers).split([3 * len(s) for s in scores])
        for job in jobs:
            job._prefilled()
        return list(values)

    def _knobs(self) -> tuple | None:
        """The knobs every waiting question's sampler shares (``None``: they differ, or one reads more than its knobs
        from the scores: penalties, a format, logprobs)."""
        knobs = {q.ctx.sampler.batch_knobs for stack in self._live for q in self._waiting[stack]}
        return knobs.pop() if len(knobs) == 1 else None

    def _samplers(self, stack: int) -> list[TokenSampler]:
        return [question.ctx.sampler for question in self._waiting[stack]]

    def _question_scores(self, logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per live stack, its waiting questions' logits ``[questions, V]`` (views), in the order :meth:`accept` reads
        their values."""
        return [row[:len(self._waiting[stack])] for stack, row in zip(self._live, logits)]

    def accept(self, values: list[float]) -> None:
        offset = 0
        for stack in self._live:
            still = []
            for question in self._waiting[stack]:
                sampler = question.ctx.sampler
                token, logprob, checked = values[offset:offset + 3]
                sampler.check(checked)
                sampler.accept(int(token))
                step = TraceStep(int(token), None, logprob)
                if sampler.logprobs is not None:
                    own, top = read_logprobs(values[offset + 3:offset + 3 + sampler.logprob_width], sampler.logprobs)
                    step = TraceStep(int(token), None, logprob, own, top)
                offset += 3 + sampler.logprob_width
                if not question.emitter.push(step):
                    still.append(question)
            self._waiting[stack] = still
            self._next[stack] = [Run((q.emitter.trace[-1].token_id,), q.next_position, q.context, q.qid)
                                 for q in still]
            for question in still:
                question.next_position += 1

    def results(self) -> list[DecodeResult]:
        results: list[DecodeResult | None] = [None] * len(self.contexts)
        for stack in self.stacks:
            for question in stack.questions:
                result = question.emitter.result()
                # Each answer sees only its own question's context: that is its per-token attribution (citations.py).
                result.extra.update(stack=question.stack, stacked_questions=len(stack.questions), attribution="context")
                results[question.index] = result
        return results  # type: ignore[return-value]


def question_values(scores: torch.Tensor, samplers: list[TokenSampler]) -> torch.Tensor:
    """:meth:`StackedJob.propose`'s values for Q questions at once (``scores`` ``[Q, V]``) whose samplers share their
    knobs: :func:`greedy_question_values` or :func:`sampled_question_values`."""
    if samplers[0].temperature == 0:
        return greedy_question_values(scores)
    return sampled_question_values(scores, samplers)


def sampled_question_values(scores: torch.Tensor, samplers: list[TokenSampler]) -> torch.Tensor:
    """:func:`greedy_question_values` for Q sampled questions with one sampler's knobs: one nucleus and one
    exponential race for all (:func:`~ctx_integrations.engine.core.decoding.sampling_probs`, ``race_noises``), a seeded
    question's noise from its own generator in question order, so each draws what its :meth:`TokenSampler.pick` draws
    alone; a batch that raises leaves the generators as they were."""
    first = samplers[0]
    with generators_kept(samplers):
        probs = sampling_probs(scores, first.temperature, first.top_p, first.top_k, first.min_p)
        race = race_noises(samplers, scores.shape[-1], probs.dtype, probs.device)
        token = race_winner(probs, race).unsqueeze(1)
        logprob = scores.gather(1, token) - torch.logsumexp(scores, -1, keepdim=True)
        checked = scores.amax(-1, keepdim=True)
        return torch.cat([token.double(), logprob.double(), checked.double()], 1).flatten()


def greedy_question_values(scores: torch.Tensor) -> torch.Tensor:
    """:meth:`StackedJob.propose`'s values for Q greedy questions at once (``scores`` ``[Q, V]``): per question its
    argmax, that token's log-probability and its score (to check), flattened in question order; the launches of one
    question's choice, not Q times as many. Only reductions read the scores (no ``[Q, V]`` log-softmax is written),
    and :meth:`StackedJob.propose` calls it per stack, on views: on this project's CPU (one thread, 49,152-token
    vocabulary) a step of 64 questions in two stacks chose in 4.9 ms against 5.5 ms one question at a time, where one
    ``[64, V]`` copy and log-softmax took 13.9 ms."""
    token = torch.argmax(scores, -1, keepdim=True)
    checked = scores.gather(1, token)
    logprob = checked - torch.logsumexp(scores, -1, keepdim=True)
    return torch.cat([token.double(), logprob.double(), checked.double()], 1).flatten()


@register_mode(IPPD)
def run_ippd(contexts: list[DecodeContext], *, max_stack_tokens: int | None = None) -> StackedJob:
    """Intra-prompt parallel decoding: every question answered in one stacked decode.

    Questions with the same documents (same texts, same order) share one context: the
    concatenation of their documents, as ``concat`` would prompt it, so each answer equals
    ``concat``'s greedy answer token for token. max_stack_tokens: the most tokens (prompt plus
    ``max_new_tokens`` per question) one stacked prompt may hold; default the model's window. More
    questions go into further stacks of the same batch.
    """
    first = contexts[0]
    engine, layout, loaded = first.engine, first.engine.layout, first.engine.loaded
    window = loaded.max_positions
    budget = window if max_stack_tokens is None else max_stack_tokens
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InvalidOptionError(f"max_stack_tokens must be a positive int or None, got {max_stack_tokens!r}")
    prefix_len, max_new = len(layout.prefix_ids), first.stop.max_new_tokens

    groups: dict[tuple[str, ...], list[_Question]] = {}
    group_ids: dict[tuple[str, ...], list[int]] = {}
    for index, ctx in enumerate(contexts):
        texts = tuple(d.text for d in ctx.documents)
        if texts not in group_ids:
            group_ids[texts] = [t for prepared in ctx.prepared for t in prepared.ids]
        suffix = list(ctx.suffix_ids)
        ctx.check_window(prefix_len + len(group_ids[texts]) + len(suffix), f"question {index} with its documents")
        position = prefix_len + len(group_ids[texts]) + len(suffix)
        emitter = Emitter(loaded.tokenizer, ctx.stop, ctx.on_token, ctx.started)
        groups.setdefault(texts, []).append(_Question(index, ctx, 0, 0, 0, suffix, emitter, position))
    first.check_streams(1, prefix_len + sum(map(len, group_ids.values())) + sum(
        len(q.suffix) + max_new for qs in groups.values() for q in qs), "IPPD's stacked prompts (all questions)")
    # a concatenation of several documents serves this question group only: memory tier, not the disk
    entries = engine.store.documents_tokens(layout, list(group_ids.values()), stats=first.cache,
                                            persist=all(len(group) == 1 for group in groups))
    for ctx in contexts[1:]:
        ctx.cache = first.cache  # one lookup serves every question of the call
    _check_devices(loaded.device, entries)
    for questions, entry in zip(groups.values(), entries):
        need = prefix_len + entry.length + max(len(q.suffix) for q in questions) + max_new
        if need > budget:
            raise DocumentTooLongError(
                f"one stacked prompt may hold {budget} tokens (max_stack_tokens), but the prefix, a context of "
                f"{entry.length} tokens and its longest question with max_new_tokens={max_new} need {need}, so not "
                f"even one of its {len(questions)} questions fits. Raise max_stack_tokens, retrieve fewer or shorter "
                "documents, or lower max_new_tokens.")
    stacks = _pack(list(zip(entries, groups.values())), prefix_len, budget, max_new)
    cache_s = time.perf_counter() - first.started
    for ctx in contexts:
        ctx.timings.update(cache_s=cache_s, stacks=float(len(stacks)), questions_per_stack=len(contexts) / len(stacks))
    return StackedJob(contexts, stacks, engine.store.prefix(layout), prefix_len)
