"""RAPID's draft / verify rounds as rows of the shared batch (the RAPID paper, Algorithm 1).

The target row holds the long context (prefix + every document: cached pieces) and the question; the
drafter row holds the retrieved short context. Each round the drafter row takes one token per step
until it has ``g`` drafts (or drafted an EOS); the target row then takes the last accepted token and
the drafts in one step, each as a run of its own, so the runner returns the logits after every one of
them (the ``g + 1`` rows of Algorithm 1's single verification pass); the verdict accepts a prefix,
and each row drops its rejected columns before its next tokens (``ScheduledStep.rewind``).

When the drafter is the target's model (the default: self-speculation) both rows belong to one
:class:`RapidJob` on one scheduler. A drafter model of its own runs its row on that model's
scheduler, batched with that model's other requests (:class:`DraftJob`); the two jobs hand sequences
and drafts over through a :class:`DraftChannel` and wake each other's scheduler.

Written by hand: transformers' assisted generation runs one request on one model, not rows of a batch
that other requests share.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence

import torch

from ctx_integrations.engine.core.decoding import (
    DecodeResult,
    Emitter,
    TokenSampler,
    TraceStep,
    check_finite_scores,
    generators_kept,
    race_noises,
    race_winner,
)
from ctx_integrations.engine.core.jobs import PooledJob
from ctx_integrations.engine.core.registry import DecodeContext
from ctx_integrations.engine.core.rows import Piece, Run
from ctx_integrations.engine.modes import speculative
from ctx_integrations.engine.modes.speculative import greedy_verdict, nucleus

NOTHING = torch.empty(0, dtype=torch.float64)  # a step's proposal when the job chose no token


class SequenceRow:
    """One row's tokens after its cached pieces, and the runs (and rewind) that make it hold a new sequence.

    ``held`` is what the row's cache holds; the runs set by :meth:`feed` or :meth:`append` are pending until
    the job says they :meth:`ran` (a sequence fed again before its runs ran is compared with ``held`` only).
    """

    def __init__(self, first_position: int):
        self.first_position = first_position  # virtual position of the first token after the cached pieces
        self.held: list[int] = []
        self.runs: list[Run] = []
        self.rewind: int | None = None
        self._pending: list[int] | None = None

    def feed(self, sequence: Sequence[int], keep: int) -> None:
        """At the next step, make the row hold ``sequence`` and return the logits after each of its last ``keep``.

        What the row holds is kept up to the longest common prefix with ``sequence`` (never into the last
        ``keep`` tokens, which must go through the forward); the rest is rewound.
        """
        limit = len(sequence) - keep
        common = 0
        for held, wanted in zip(self.held, sequence[:limit]):
            if held != wanted:
                break
            common += 1
        self.rewind = self.first_position + common if common < len(self.held) else None
        new, at = list(sequence[common:]), self.first_position + common
        head = len(new) - keep
        self.runs = ([Run(tuple(new[:head]), at)] if head > 0 else []) + [
            Run((token,), at + head + i) for i, token in enumerate(new[head:])]
        self._pending = list(sequence)

    def append(self, token: int) -> None:
        """At the next step, take one more token (the logits after it are returned)."""
        self.runs, self.rewind = [Run((token,), self.first_position + len(self.held))], None
        self._pending = self.held + [token]

    def ran(self) -> None:
        """The step ran this row's runs: it holds what they fed, and takes nothing more until fed again."""
        if self._pending is not None:
            self.held = self._pending
        self.runs, self.rewind, self._pending = [], None, None


class DraftRow:
    """The drafter's row: up to ``goal`` tokens after a sequence, one per step, and the distributions they came
    from (greedy: the drafter's softmax; sampling: the tempered nucleus the draft was drawn from)."""

    def __init__(self, row: SequenceRow, prompt: Sequence[int], sampler: TokenSampler, eos: frozenset[int],
                 width: int):
        self.row, self.prompt, self.sampler, self.eos, self.width = row, list(prompt), sampler, eos, width
        self.drafts: list[int] = []
        self.dists: list[torch.Tensor] = []
        self.goal = 0
        self.passes = 0
        self.first_draft_at: float | None = None
        self._q: torch.Tensor | None = None

    @property
    def drafting(self) -> bool:
        return len(self.drafts) < self.goal and not (self.drafts and self.drafts[-1] in self.eos)

    def start(self, generated: Sequence[int], goal: int) -> None:
        """Draft up to ``goal`` tokens after ``prompt + generated`` (the row rewinds what it holds beyond that)."""
        self.drafts, self.dists, self.goal = [], [], goal
        self.row.feed(self.prompt + list(generated), 1)

    def propose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next draft from the logits after the row's last token: ``[token, the score to check]``."""
        return DraftRow.propose_batch([self], [logits])[0]

    def batch_key(self) -> Hashable:
        """Drafters of one vocabulary width and one sampler's knobs draft together (:meth:`propose_batch`). A RAPID
        request's sampler reads nothing but its knobs: RAPID refuses the rest (``beyond_plain_sampling``)."""
        return "draft", self.width, self.sampler.batch_knobs

    @staticmethod
    def propose_batch(drafters: list[DraftRow], logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each drafter's :meth:`propose` (the logits after its row's runs each), in one evaluation: greedy, the
        argmax of the drafter's softmax; sampled, a draw from its tempered nucleus with each drafter's own noise
        (NaN scores win the max: ``accept`` refuses them before the draft is used). Every drafter keeps its row of
        the distributions as the one its draft came from; a batch that raises changes no drafter."""
        first = drafters[0]
        scores = torch.stack([rows[-1, : first.width] for rows in logits]).float()
        best = scores.amax(dim=-1)
        with generators_kept([drafter.sampler for drafter in drafters]):
            if first.sampler.temperature == 0:
                q = torch.softmax(scores, dim=-1)
                token = q.argmax(dim=-1)
            else:
                q = torch.softmax(nucleus(scores / first.sampler.temperature, first.sampler.top_p), dim=-1)
                race = race_noises([drafter.sampler for drafter in drafters], first.width, q.dtype, q.device)
                token = race_winner(q, race)
            values = torch.stack([token.double(), best.double()], dim=-1).unbind(0)
        for drafter, row in zip(drafters, q.unbind(0), strict=True):
            drafter._q = row
        return list(values)

    def accept(self, values: Sequence[float]) -> None:
        self.row.ran()
        token, checked = values
        check_finite_scores(checked)
        self.drafts.append(int(token))
        self.dists.append(self._q)
        self.passes += 1
        if self.first_draft_at is None:
            self.first_draft_at = time.perf_counter()
        if self.drafting:
            self.row.append(int(token))


class DraftChannel:
    """Where a RAPID request and its drafter row on another model's scheduler meet (thread-safe).

    The target asks for ``goal`` drafts after a sequence and sleeps; the drafter's job takes the ask at
    its next step, drafts, and answers (or fails); each side wakes the other's scheduler.
    """

    def __init__(self, wake_target: Callable[[], None], wake_drafter: Callable[[], None]):
        self._lock = threading.Lock()
        self._wake_target, self._wake_drafter = wake_target, wake_drafter
        self._ask: tuple[list[int], int] | None = None
        self._answer: tuple[list[int], list[torch.Tensor], int, float | None] | None = None
        self.error: BaseException | None = None
        self.closed = False

    def ask(self, generated: Sequence[int], goal: int) -> None:
        with self._lock:
            self._ask, self._answer = (list(generated), goal), None
        self._wake_drafter()

    @property
    def asked(self) -> bool:
        with self._lock:
            return self._ask is not None

    def take_ask(self) -> tuple[list[int], int] | None:
        with self._lock:
            ask, self._ask = self._ask, None
            return ask

    def answer(self, draft: DraftRow) -> None:
        with self._lock:
            self._answer = (list(draft.drafts), list(draft.dists), draft.passes, draft.first_draft_at)
        self._wake_target()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self.error = error
        self._wake_target()

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._answer is not None or self.error is not None

    def take_answer(self) -> tuple[list[int], list[torch.Tensor], int, float | None] | None:
        with self._lock:
            answer, self._answer = self._answer, None
            return answer

    def close(self) -> None:
        """The RAPID request left: its drafter job ends at its scheduler's next step."""
        with self._lock:
            self.closed = True
        self._wake_drafter()


class DraftJob(PooledJob):
    """A drafter row on the drafter model's own scheduler, drafting whenever its RAPID request asks."""

    def __init__(self, pieces: list[Piece], draft: DraftRow, channel: DraftChannel, kv_tokens: int):
        super().__init__([])
        self.pieces, self.draft, self.channel, self._kv_tokens = pieces, draft, channel, kv_tokens

    @property
    def done(self) -> bool:
        return self.channel.closed

    @property
    def waiting(self) -> bool:
        return not self.draft.drafting and not self.channel.closed and not self.channel.asked

    @property
    def device(self) -> torch.device:
        """The drafter model's device (the job answers no context of its own): where its prefix cache is."""
        return self.pieces[0].kv.device

    def kv_tokens(self) -> int:
        return self._kv_tokens

    def rows(self) -> list[list[Piece]]:
        return [self.pieces]

    def prepare(self) -> None:
        ask = self.channel.take_ask()
        if ask is not None:
            self.draft.start(*ask)

    def runs(self) -> list[list[Run]]:
        return [self.draft.row.runs]

    def rewinds(self) -> dict[int, int]:
        return {} if self.draft.row.rewind is None else {0: self.draft.row.rewind}

    def propose(self, logits: list[torch.Tensor]) -> torch.Tensor:
        return self.draft.propose(logits[0]) if self.draft.drafting and len(logits[0]) else NOTHING

    def batch_key(self) -> Hashable | None:
        """The drafter's key (:meth:`DraftRow.batch_key`) while it drafts, on an accelerator (or on the CPU with
        :attr:`~PooledJob.batch_on_cpu`)."""
        if not (self.draft.drafting and self.draft.row.runs) or not self.batches_here():
            return None
        return self.draft.batch_key()

    @classmethod
    def propose_batch(cls, jobs: list[DraftJob], logits: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return DraftRow.propose_batch([job.draft for job in jobs], [rows[0] for rows in logits])

    def accept(self, values: list[float]) -> None:
        if not values:
            return
        self.draft.accept(values)
        if not self.draft.drafting:
            self.channel.answer(self.draft)

    def results(self) -> list[DecodeResult]:
        return []


def verdict_values(logits: torch.Tensor, drafts: torch.Tensor, accepted: torch.Tensor, token: torch.Tensor,
                   checked: torch.Tensor, temperature: float) -> torch.Tensor:
    """A verification's proposal, ``[accepted, token, the score to check, log p of each of the g + 1 positions'
    emitted token]`` (the accepted drafts, then ``token`` at position ``accepted``), for one request (``logits``
    ``[g + 1, V]``) or J together (``[J, g + 1, V]``: one row of values each)."""
    log_p = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
    emitted = torch.cat([drafts, token.unsqueeze(-1)], dim=-1).scatter(-1, accepted.unsqueeze(-1),
                                                                        token.unsqueeze(-1))
    log_probs = log_p.gather(-1, emitted.unsqueeze(-1)).squeeze(-1)
    head = torch.stack([accepted.double(), token.double(), checked.double()], dim=-1)
    return torch.cat([head, log_probs.double()], dim=-1)


DRAFT, VERIFY = "draft", "verify"


class RapidJob(PooledJob):
    """One RAPID request: its target row (and its drafter row, when the drafter is the target's model).

    ``draft``: the drafter row when it is in this job; ``channel``: the way to a :class:`DraftJob` on the
    drafter model's scheduler otherwise. ``finish`` adds the mode's extras to the result; ``then`` builds the
    request's follow-up job once the answer is done (``compare_target``'s run of the target alone).
    """

    def __init__(self, ctx: DecodeContext, target_pieces: list[Piece], target_row: SequenceRow, suffix: list[int],
                 *, gamma: int, eta: float, tail_rule: str, width: int, kv_tokens: int,
                 draft: tuple[list[Piece], DraftRow] | None = None, channel: DraftChannel | None = None,
                 finish: Callable[[DecodeResult], DecodeResult] | None = None,
                 then: Callable[[RapidJob], PooledJob | None] | None = None):
        super().__init__([ctx])
        if (draft is None) == (channel is None):
            raise AssertionError("a RAPID job drafts either in its own row or through a channel")
        self.ctx, self.pieces, self.target, self.suffix = ctx, target_pieces, target_row, list(suffix)
        self.gamma, self.eta, self.tail_rule, self.width, self._kv_tokens = gamma, eta, tail_rule, width, kv_tokens
        self.draft_pieces, self.draft = draft if draft is not None else (None, None)
        self.channel, self.finish, self.then = channel, finish, then
        self.emitter = Emitter(ctx.engine.loaded.tokenizer, ctx.stop, ctx.on_token, ctx.started)
        self.generated: list[int] = []
        self.drafted_flags: list[bool] = []
        self.drafts: list[int] = []
        self.dists: torch.Tensor | None = None
        self.stats = {"drafted": 0, "accepted": 0, "target_passes": 0, "draft_passes": 0}
        self.prefilled_at: float | None = None
        self.first_draft_at: float | None = None
        self.phase = DRAFT
        self._next_round()
        if self.phase == DRAFT:  # the question's prefill goes with the first draft's step
            self.target.feed(self.suffix[:-1], 0)

    # -- the scheduler's side ------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.emitter.done

    @property
    def waiting(self) -> bool:
        return self.channel is not None and self.phase == DRAFT and not self.target.runs and not self.channel.ready

    def kv_tokens(self) -> int:
        return self._kv_tokens

    def rows(self) -> list[list[Piece]]:
        return [self.pieces] + ([self.draft_pieces] if self.draft is not None else [])

    def _rows(self) -> list[SequenceRow]:
        return [self.target] + ([self.draft.row] if self.draft is not None else [])

    def prepare(self) -> None:
        if self.channel is not None and self.phase == DRAFT:
            if self.channel.error is not None:
                raise self.channel.error
            answer = self.channel.take_answer()
            if answer is not None:
                drafts, dists, self.stats["draft_passes"], first = answer
                self.first_draft_at = self.first_draft_at or first
                self._verify(drafts, dists)

    def runs(self) -> list[list[Run]]:
        return [row.runs for row in self._rows()]

    def rewinds(self) -> dict[int, int]:
        return {i: row.rewind for i, row in enumerate(self._rows()) if row.rewind is not None}

    def propose(self, logits: list[torch.Tensor]) -> torch.Tensor:
        self._prefilled()
        if self.phase == VERIFY and self.target.runs:
            return self._propose_verdict(logits[0])
        if self.draft is not None and self.draft.drafting:
            return self.draft.propose(logits[1])
        return NOTHING  # the target's prefill step with a drafter elsewhere, or a step spent waiting for it

    def batch_key(self) -> Hashable | None:
        """On an accelerator (or on the CPU with :attr:`~PooledJob.batch_on_cpu`), verifications of as many drafts
        over one vocabulary width, with one ``eta``, tail rule and sampler's knobs, choose their verdicts together
        (:meth:`propose_batch`), and so do the drafting steps of drafters with one key (:meth:`DraftRow.batch_key`);
        the last token's verification (no drafts) chooses alone."""
        if not self.batches_here():
            return None
        if self.phase == VERIFY and self.target.runs:
            if self.dists is None:
                return None
            return "verdict", len(self.drafts), self.width, self.eta, self.tail_rule, self.ctx.sampler.batch_knobs
        return self.draft.batch_key() if self.draft is not None and self.draft.drafting else None

    @classmethod
    def propose_batch(cls, jobs: list[RapidJob], logits: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """The values each job's :meth:`propose` returns, in one evaluation: every verdict together (one
        :func:`greedy_verdict` or :func:`~.speculative.sampled_verdict` over ``[J, g + 1, V]``, each request's
        noise from its own generator), or every drafter's next draft (:meth:`DraftRow.propose_batch`)."""
        if jobs[0].phase != VERIFY:
            values = DraftRow.propose_batch([job.draft for job in jobs], [rows[1] for rows in logits])
        else:
            values = cls._verdicts(jobs, logits)
        for job in jobs:
            job._prefilled()
        return values

    @staticmethod
    def _verdicts(jobs: list[RapidJob], logits: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        first = jobs[0]
        g, width, sampler = len(first.drafts), first.width, first.ctx.sampler
        target = torch.stack([rows[0][-(g + 1):, :width] for rows in logits])
        drafts = torch.tensor([job.drafts for job in jobs], dtype=torch.long, device=target.device)
        dists = torch.stack([job.dists for job in jobs])
        if sampler.temperature == 0:
            accepted, token = greedy_verdict(target, dists, drafts, eta=first.eta, tail_rule=first.tail_rule)
        else:
            samplers = [job.ctx.sampler for job in jobs]
            with generators_kept(samplers):
                accepted, token = speculative.sampled_verdict(
                    target, dists, drafts, eta=first.eta, temperature=sampler.temperature, top_p=sampler.top_p,
                    noise=speculative.verdict_noises(samplers, g, width, target.device), tail_rule=first.tail_rule)
        values = verdict_values(target, drafts, accepted, token, target.amax(dim=(-2, -1)), sampler.temperature)
        return list(values.unbind(0))

    def _prefilled(self) -> None:
        """The base's ``prefill_s``, and when it was: RAPID's decode starts there (:meth:`results`)."""
        if self.prefilled_at is None:
            self.prefilled_at = time.perf_counter()
            self.ctx.timings["prefill_s"] = self.prefilled_at - self.ctx.started

    def accept(self, values: list[float]) -> None:
        verified = self.phase == VERIFY and bool(self.target.runs)
        for row in self._rows():
            row.ran()
        if verified:
            self._emit(values)
        elif self.draft is not None and self.draft.drafting:
            self.draft.accept(values)
            self.first_draft_at = self.first_draft_at or self.draft.first_draft_at
            if not self.draft.drafting:
                self.stats["draft_passes"] = self.draft.passes
                self._verify(self.draft.drafts, self.draft.dists)

    def follow_up(self) -> PooledJob | None:
        return self.then(self) if self.then is not None else None

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()

    # -- the round -----------------------------------------------------------------------------------
    def _next_round(self) -> None:
        """Draft ``g`` tokens (bounded by the answer budget; none for the last token), or verify at once."""
        goal = min(self.gamma, self.ctx.stop.max_new_tokens - len(self.emitter.trace) - 1)
        if goal <= 0:
            self._verify([], [])
            return
        self.phase = DRAFT
        if self.draft is not None:
            self.draft.start(self.generated, goal)
        else:
            self.channel.ask(self.generated, goal)

    def _verify(self, drafts: list[int], dists: list[torch.Tensor]) -> None:
        """At the next step, the target takes the last emitted token and the drafts (one run each)."""
        device = self.pieces[0].kv.device
        self.drafts, self.dists = drafts, torch.stack(dists).to(device) if dists else None
        self.target.feed(self.suffix + self.generated + drafts, len(drafts) + 1)
        self.phase = VERIFY

    def _propose_verdict(self, logits: torch.Tensor) -> torch.Tensor:
        """``[accepted, token, the score to check, log p of each emitted token]``, chosen on the device, greedy or
        sampled (nothing read back: the step's one read takes it with every other request's values)."""
        g, sampler = len(self.drafts), self.ctx.sampler
        logits = logits[-(g + 1):, : self.width]  # a verification that carries the question's prefill has one more
        checked = logits.max()
        drafts = torch.tensor(self.drafts, dtype=torch.long, device=logits.device)
        if self.dists is None:
            token, checked = sampler.pick(logits[0])
            accepted = torch.zeros((), dtype=torch.long, device=logits.device)
        elif sampler.temperature == 0:
            accepted, token = greedy_verdict(logits, self.dists, drafts, eta=self.eta, tail_rule=self.tail_rule)
        else:
            uniforms, race = speculative.verdict_noises([sampler], g, self.width, logits.device)
            accepted, token = speculative.sampled_verdict(
                logits, self.dists, drafts, eta=self.eta, temperature=sampler.temperature, top_p=sampler.top_p,
                noise=(uniforms[0], race[0]), tail_rule=self.tail_rule)
        return verdict_values(logits, drafts, accepted, token, checked, sampler.temperature)

    def _emit(self, values: list[float]) -> None:
        accepted, token = int(values[0]), int(values[1])
        check_finite_scores(values[2])
        if self.dists is not None:
            self.stats["drafted"] += len(self.drafts)
            self.stats["accepted"] += accepted
        self.stats["target_passes"] += 1
        for i, chosen in enumerate(self.drafts[:accepted] + [token]):
            if not self.emitter.done:
                self.emitter.push(TraceStep(chosen, None, values[3 + i]))
                self.generated.append(chosen)
                self.drafted_flags.append(i < accepted)
        if not self.emitter.done:
            self._next_round()

    def results(self) -> list[DecodeResult]:
        result = self.emitter.result()
        drafted, accepted = self.stats["drafted"], self.stats["accepted"]
        result.extra.update(drafted_tokens=self.drafted_flags[: len(result.token_ids)], drafted=drafted,
                            accepted=accepted, target_passes=self.stats["target_passes"],
                            draft_passes=self.stats["draft_passes"],
                            acceptance_rate=accepted / drafted if drafted else 0.0)
        decode_start = self.prefilled_at or self.ctx.started
        rapid_s = time.perf_counter() - decode_start
        n = len(result.token_ids)
        self.ctx.timings.update(
            draft_prefill_s=max(0.0, (self.first_draft_at or decode_start) - decode_start),
            rapid_decode_s=rapid_s, rapid_tokens_per_s=n / rapid_s, acceptance_rate=result.extra["acceptance_rate"],
            drafted=float(drafted), accepted=float(accepted), target_passes=float(self.stats["target_passes"]),
            tokens_per_target_pass=n / max(self.stats["target_passes"], 1))
        return [self.finish(result) if self.finish is not None else result]
