"""What the scheduler runs: one job per request, pooled (its streams share the batched forward) or exclusive.

A *pooled* job declares its streams as rows of cached pieces (:class:`~ctx_integrations.engine.core.rows.Piece`)
and, at every step, the tokens each row takes (:class:`~ctx_integrations.engine.core.rows.Run`); the
scheduler runs ONE forward over the rows of all pooled jobs and hands each job the logits of its own
rows, which it turns into tokens with its own per-step rule. :class:`FusedJob` is the shape most modes
take (PCED, Soft-NBCE and its limits, ``single``, ``concat``, chat, APE with its own row attention):
K streams, one rule over their K logit rows, one chosen token appended to all K. IPPD's stacked
questions and MapReduce's map step are pooled jobs of their own; a job may hand its request on to a
follow-up job (MapReduce's reduce step).

An *exclusive* job (APE on FlexAttention's merge, ``attention_kernel="flex"``; ``warm()``) runs its
own forward passes on the model between the pooled steps: it is a generator
that yields after each forward, so a long answer never holds the other requests for more than a step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass

import torch

from ctx_integrations.engine.core.decoding import (
    FIRST_STEP,
    DecodeResult,
    Emitter,
    FusionRule,
    batch_proposals,
    generators_kept,
    propose_token,
    settle_token,
)
from ctx_integrations.engine.core.registry import DecodeContext
from ctx_integrations.engine.core.rows import Piece, Run


class Job:
    """One request's work: the contexts it answers (several only for IPPD) and their results when done."""

    exclusive = False

    def __init__(self, contexts: list[DecodeContext]):
        self.contexts = contexts

    @property
    def done(self) -> bool:
        raise NotImplementedError

    def results(self) -> list[DecodeResult]:
        raise NotImplementedError

    def follow_up(self) -> Job | None:
        """The job that carries the request on once this one is done, or ``None``: the request is answered.

        A request whose work goes on in new rows (MapReduce's reduce step after its map step) returns its
        next job here; the scheduler drops this job's rows and admits the next one like a new request at
        the head of the queue (its KV bytes reserved anew). ``finish`` receives the last job.
        """
        return None

    def close(self) -> None:
        """The request left (answered, failed, cancelled or timed out): release what the job holds outside the
        batch (an exclusive job's generator, RAPID's drafter rows on another model's scheduler)."""

    def kv_tokens(self) -> int:
        """The KV tokens this request may hold at once, all its rows, prompt + answer budget: what the
        scheduler reserves before admitting it. By default what the mode declared when it checked its
        per-request budget (:meth:`DecodeContext.check_streams`); jobs that know their rows count them."""
        return sum(ctx.kv_tokens for ctx in self.contexts)


class PooledJob(Job):
    """A job whose streams are rows of the scheduler's shared batched cache."""

    def rows(self) -> list[list[Piece]]:
        """The cached pieces of each of the job's rows, laid out once when the job joins."""
        raise NotImplementedError

    def row_attention(self) -> list[Callable[..., torch.Tensor] | None]:
        """Per row, its own attention rule (``row_attention.py``: APE's merge), or ``None``: the model's own."""
        return [None] * len(self.rows())

    @property
    def waiting(self) -> bool:
        """Whether the job takes no tokens until something outside this batch wakes the scheduler (RAPID's
        target row while a drafter on another model's scheduler drafts); a batch of waiting jobs lets the
        scheduler's thread sleep instead of stepping empty forwards."""
        return False

    def prepare(self) -> None:
        """Take up, before the step is planned, what arrived from outside the batch (RAPID's drafts from another
        model's scheduler). Called once per step, joining jobs included; raising fails this request alone."""

    def runs(self) -> list[list[Run]]:
        """The tokens each row takes this step (the first step: the prompt's uncached suffix)."""
        raise NotImplementedError

    def rewinds(self) -> dict[int, int]:
        """Rows (indices among the job's rows) whose cached columns at virtual positions ``>=`` the given one
        leave before this step's runs (RAPID's rejected drafts); most jobs never rewind."""
        return {}

    def propose(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """Per row, the logits after each of its runs (``[runs, V]``): choose this step's tokens on the device.

        Returns a 1-D tensor of values the scheduler reads back together with every other job's (one
        transfer per step for the whole batch) and hands to :meth:`accept`.
        """
        raise NotImplementedError

    batch_on_cpu = False
    """Whether jobs on the CPU choose together too (tests switch it on). Off: a CPU pays no kernel launch to save,
    and the batch's tensors leave the core's cache where one request's stay in it: PCED's rule over 8 requests x 4
    streams x 49,152 logits took 15 ms batched and 2.8 ms one by one, Soft-NBCE's 112 and 97 ms (one thread,
    docs/scheduler.md)."""

    def batches_here(self) -> bool:
        """Whether this job may choose in a batch on its device: on an accelerator, or on the CPU with
        :attr:`batch_on_cpu` (what every :meth:`batch_key` asks before it returns a key)."""
        return self.batch_on_cpu or self.device.type != "cpu"

    @property
    def device(self) -> torch.device:
        """Where this job's rows run: its model's device."""
        return self.contexts[0].engine.loaded.device

    def _prefilled(self) -> None:
        """The first proposal comes right after the prompt's prefill: its time is each request's ``prefill_s``, on
        its own clock (an IPPD job's questions were prepared, and their clocks started, a moment apart)."""
        now = time.perf_counter()
        for ctx in self.contexts:
            ctx.timings.setdefault("prefill_s", now - ctx.started)

    def batch_key(self) -> Hashable | None:
        """Jobs of one class with equal keys may choose a step's tokens together, in one call of the class's
        :meth:`propose_batch` (``None``, the default: this step's tokens are chosen by :meth:`propose` alone).

        A rule evaluated per request costs a launch per tensor operation per request; a batch of requests
        sharing the rule pays them once (docs/scheduler.md#the-rule-batched-across-requests).
        """
        return None

    @classmethod
    def propose_batch(cls, jobs: list[PooledJob], logits: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """:meth:`propose` for several jobs of this class with one :meth:`batch_key`: per job (``logits[j]`` its
        rows' logits) the very values its own :meth:`propose` returns, chosen together.

        If it raises, the scheduler proposes each job alone instead, so an error reaches only the requests it
        belongs to: it must change no job's state unless it returns.
        """
        raise NotImplementedError

    def accept(self, values: list[float]) -> None:
        """This job's proposal, read back: emit its tokens and decide the next runs."""
        raise NotImplementedError

    def take_finished_rows(self) -> list[int]:
        """Rows (indices among the job's rows still in the pool) that take no more tokens while the job goes on.

        The scheduler drops them from the pool after the step, so a finished part of a request (an
        IPPD stack whose questions are all answered) stops costing a row of every forward. From then
        on ``runs`` and ``consume`` speak of the remaining rows only. Most jobs finish all rows at once.
        """
        return []


@dataclass(frozen=True)
class Stream:
    """One stream of a :class:`FusedJob`: its cached pieces and the prompt tokens after them."""

    pieces: tuple[Piece, ...]
    prompt: tuple[int, ...]
    first_position: int  # virtual position of ``prompt[0]``


def prompt_runs(stream: Stream, span: tuple[int, int] | None) -> list[Run]:
    """A stream's first runs: its prompt in one run, or, with a likelihood ``span``, cut so that a run ends right
    before each of ``prompt[start:stop]`` (the logits after run i predict ``prompt[start + i]``); the tokens go
    through the same single forward either way, only more of their logits come back."""
    prompt, first = stream.prompt, stream.first_position
    if span is None or span[0] >= span[1]:
        return [Run(prompt, first)]
    start, stop = span
    if not 0 < start < stop <= len(prompt):
        raise ValueError(f"a likelihood span must lie in the prompt after its first token, got {span} for "
                         f"{len(prompt)} tokens")
    cuts = [0, *range(start, stop), len(prompt)]
    return [Run(prompt[a:b], first + a) for a, b in zip(cuts, cuts[1:]) if b > a]


def sequence_loglik(logits: torch.Tensor, targets: Sequence[int]) -> torch.Tensor:
    """``sum_i log softmax(logits[:, i])[targets[i]]`` in float32: ``logits`` ``[K, n, V]``, one row per stream."""
    if not targets:
        return torch.zeros(logits.shape[0], device=logits.device)
    index = torch.tensor(list(targets), dtype=torch.long, device=logits.device)
    log_p = torch.log_softmax(logits.float(), -1)
    return log_p.gather(2, index.view(1, -1, 1).expand(logits.shape[0], -1, 1)).sum((1, 2))


class FusedJob(PooledJob):
    """K streams decoded in lockstep: ``rule`` fuses their logits, one token is chosen and appended to all.

    ``finish`` may decorate the result (e.g. map a chunk's trace back to its document); ``attention``
    is every stream's own attention rule (``row_attention.py``; APE's merge), ``None`` for the model's.
    ``likelihood_span`` (``start, stop`` in every stream's prompt; the prompts must be equal): the first step's
    runs end at each of those tokens, so the one forward also returns the logits that predict them, and the
    rule receives the log-likelihood of ``prompt[start:stop]`` on each stream (``[K]``, float32, on the device)
    through its ``given_likelihood`` before it chooses the first token (PCED's ``query_likelihood``).
    """

    def __init__(self, ctx: DecodeContext, streams: list[Stream], rule: FusionRule,
                 finish: Callable[[DecodeResult], DecodeResult] | None = None,
                 attention: Callable[..., torch.Tensor] | None = None,
                 likelihood_span: tuple[int, int] | None = None):
        super().__init__([ctx])
        if not streams:
            raise ValueError("a fused job needs at least one stream")
        self.ctx, self.streams, self.rule, self.finish = ctx, streams, rule, finish
        self.attention = attention
        self.emitter = Emitter(ctx.engine.loaded.tokenizer, ctx.stop, ctx.on_token, ctx.started)
        # the prompt's first token is predicted by the cached piece before it, whose logits are gone: scored from
        # the second on (a template that writes nothing before the question)
        span = None if likelihood_span is None else (max(1, likelihood_span[0]), likelihood_span[1])
        self._next: list[list[Run]] = [prompt_runs(s, span) for s in streams]
        self._scored = None if span is None else streams[0].prompt[span[0]:span[1]]
        if self._scored is not None and any(s.prompt != streams[0].prompt for s in streams):
            raise ValueError("a likelihood span needs every stream to take the same prompt")
        self.likelihood: torch.Tensor | None = None  # [K] once measured (the first step)
        self._positions = [s.first_position + len(s.prompt) for s in streams]
        self.state = FIRST_STEP  # what the rule knows of the steps before (its carry, the last token and winner)
        self._carry: object = None  # the rule's carry of the step proposed, until it is accepted

    @property
    def done(self) -> bool:
        return self.emitter.done

    def rows(self) -> list[list[Piece]]:
        return [list(s.pieces) for s in self.streams]

    def row_attention(self) -> list[Callable[..., torch.Tensor] | None]:
        return [self.attention] * len(self.streams)

    def kv_tokens(self) -> int:
        answer = self.ctx.stop.max_new_tokens
        return sum(sum(p.kv.shape[3] for p in s.pieces) + len(s.prompt) + answer for s in self.streams)

    def runs(self) -> list[list[Run]]:
        return self._next

    def propose(self, logits: list[torch.Tensor]) -> torch.Tensor:
        self._prefilled()
        rule, likelihood = self._rule_for(logits)
        values, self._carry = propose_token(rule, torch.stack([row[-1] for row in logits]), self.state,
                                            self.ctx.sampler)
        self.rule, self.likelihood = rule, likelihood
        return values

    def _rule_for(self, logits: list[torch.Tensor]) -> tuple[FusionRule, torch.Tensor | None]:
        """The rule this step fuses with, and the likelihood it was given (the first step of a scored prompt: the
        question's log-likelihood on each stream, from the logits its runs returned before the last)."""
        if self._scored is None or self.likelihood is not None:
            return self.rule, self.likelihood
        likelihood = sequence_loglik(torch.stack([row[:-1] for row in logits]), self._scored)
        return self.rule.given_likelihood(likelihood), likelihood

    def batch_key(self) -> Hashable | None:
        """The rule's batch key (see :data:`~ctx_integrations.engine.core.decoding.FusionRule`) with the sampler's
        knobs, when the sampler reads nothing else from the fused scores (:attr:`TokenSampler.batch_knobs`: greedy,
        or sampled with the same temperature, top_p, top_k and min_p), on an accelerator (or on the CPU with
        :attr:`batch_on_cpu`)."""
        key, knobs = getattr(self.rule, "batch_key", None), self.ctx.sampler.batch_knobs
        if key is None or knobs is None or not self.batches_here():
            return None
        rule_key = key()
        return None if rule_key is None else (rule_key, knobs)

    @classmethod
    def propose_batch(cls, jobs: list[FusedJob], logits: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """One batched rule evaluation and one pick for all the jobs (their rules and samplers share a batch key);
        a sampled batch that raises leaves every generator as it was."""
        given = [job._rule_for(rows) for job, rows in zip(jobs, logits, strict=True)]
        rules, samplers = [rule for rule, _ in given], [job.ctx.sampler for job in jobs]
        with generators_kept(samplers):
            fused = type(rules[0]).fuse_batch(rules, [[row[-1] for row in rows] for rows in logits],
                                              [job.state for job in jobs])
            values = batch_proposals(fused, samplers).unbind(0)
        for job, carry, (rule, likelihood) in zip(jobs, fused.carries, given, strict=True):
            job._prefilled()
            job._carry, job.rule, job.likelihood = carry, rule, likelihood
        return list(values)

    def accept(self, values: list[float]) -> None:
        step, self.state = settle_token(values, self._carry, self.ctx.sampler)
        if self.emitter.push(step):
            self._next = [[] for _ in self.streams]
            return
        self._next = [[Run((step.token_id,), position)] for position in self._positions]
        self._positions = [p + 1 for p in self._positions]

    def results(self) -> list[DecodeResult]:
        result = self.emitter.result()
        return [self.finish(result) if self.finish is not None else result]


class ExclusiveJob(Job):
    """A job that runs its own forward passes between pooled steps: ``steps`` yields after each one.

    The generator returns one :class:`DecodeResult` per context when it is finished.
    """

    exclusive = True

    def __init__(self, contexts: list[DecodeContext], steps: Generator[None, None, list[DecodeResult]]):
        super().__init__(contexts)
        self._steps, self._results = steps, None

    @property
    def done(self) -> bool:
        return self._results is not None

    def step(self) -> None:
        """Run the job until its next forward pass is done (or it finishes)."""
        try:
            next(self._steps)
        except StopIteration as finished:
            self._results = list(finished.value)

    def close(self) -> None:
        """Stop a cancelled job (runs its ``finally`` blocks, e.g. restoring the model's attention)."""
        self._steps.close()

    def results(self) -> list[DecodeResult]:
        assert self._results is not None
        return self._results


def single_result(steps: Generator[None, None, DecodeResult]) -> Generator[None, None, list[DecodeResult]]:
    """Adapt a generator that decodes one answer to the list an :class:`ExclusiveJob` returns."""
    return [(yield from steps)]
