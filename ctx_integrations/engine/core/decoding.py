"""The small pieces every decode loop is made of (in the spirit of gpt-fast).

``TokenSampler`` picks a token from scores, ``StopCriteria`` says when to stop, ``IncrementalText`` turns
token ids into streamed text, and ``Emitter`` records one answer as it is decoded (trace, streaming,
stopping, time to first token). The scheduler's pooled jobs use these with the shared row pool
(``rows.py``); the exclusive job of APE on the flex kernel runs its own streams with ``forward_sequences``
and the step generator ``fused_steps``, which yields after every forward pass.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ctx_integrations.engine.core.cache import SequenceBatch
from ctx_integrations.engine.core.defaults import DEFAULT_MAX_NEW_TOKENS
from ctx_integrations.errors import InvalidOptionError, NoAllowedTokenError, NonFiniteScoresError


@dataclass(frozen=True)
class FusedStep:
    """A fusion rule's output for one step: fused scores over the vocabulary, and per-stream evidence.

    ``evidence[k, v]`` is how strongly expert k supports token v; the winner of the chosen token is
    the argmax over k, which gives the per-token citation trace for free.
    """

    scores: torch.Tensor  # [V]
    evidence: torch.Tensor | None = None  # [K, V]
    carry: object = None  # what the rule hands its next call (FusionState.carry), e.g. PCED's dynamic beta


@dataclass(frozen=True)
class FusionState:
    """What a fusion rule may know of the steps before this one; the job keeps it, so rules stay pure.

    ``last_token`` / ``last_winner``: the token chosen at the previous step and the stream that won it
    (``None`` at the first step); ``carry``: the previous call's :attr:`FusedStep.carry`. Like the
    ``input_ids`` a transformers logits processor receives, it is read, never edited.
    """

    last_token: int | None = None
    last_winner: int | None = None
    carry: object = None


FIRST_STEP = FusionState()
FusionRule = Callable[[torch.Tensor, FusionState], FusedStep]
"""A rule with a true ``format_masks_streams`` attribute gets the streams' logits already masked to the tokens a
structured-output format allows (rules that keep only a nucleus of each stream: masking their fused scores
afterwards could leave no allowed token); every other rule's fused scores are masked before the pick.

A rule may also evaluate the steps of several requests at once: its ``batch_key()`` (hashable, ``None``: one by
one) says which rules go together, and its class's ``fuse_batch(rules, rows, states)`` returns a
:class:`FusedBatch` with, per request, exactly what the request's own ``rule(torch.stack(rows), state)`` gives
(PCED's :class:`~ctx_integrations.engine.modes.pced.PCEDFusion`, Soft-NBCE's
:class:`~ctx_integrations.engine.modes.soft_nbce.SoftNBCEFusion`). The scheduler then pays a constant number of
tensor operations per step for those requests instead of a rule evaluation each (:meth:`FusedJob.propose_batch`)."""


@dataclass(frozen=True)
class FusedBatch:
    """A batched rule's output for one step of J requests (``fuse_batch``).

    ``scores[j]`` is request j's fused scores; ``evidence[j, :K_j]`` its streams' evidence, the rows past its own
    K_j (padding up to the widest request) are ``-inf`` so a padded stream never wins (``None``: the rule attributes
    nothing); ``carries[j]`` its carry.
    """

    scores: torch.Tensor  # [J, V]
    evidence: torch.Tensor | None  # [J, K_max, V]; None: no attribution (:class:`SingleStream`)
    carries: list[object]


def padded_streams(rows: Sequence[Sequence[torch.Tensor]]) -> tuple[torch.Tensor, list[int]]:
    """J requests' streams for a ``fuse_batch``: ``[J, 1 + W, V]`` float32, request j's rows (``[V]`` each, its
    context-free row first, then its K_j experts) padded to the widest count W with copies of that first row (finite,
    so no NaN reaches a maximum or a sum; the rule gives the padding ``-inf`` evidence), and the counts K_j."""
    counts = [len(streams) - 1 for streams in rows]
    width = max(counts)
    padded = [row for streams in rows for row in (*streams, *[streams[0]] * (width + 1 - len(streams)))]
    return torch.stack(padded).float().unflatten(0, (len(rows), width + 1)), counts


class SingleStream:
    """The identity rule: one stream, its own logits, no attribution (concat, single, APE, chat). Its requests choose
    together like any batched rule's (:meth:`fuse_batch`): their scores are their logits, stacked."""

    def __call__(self, logits: torch.Tensor, state: FusionState = FIRST_STEP) -> FusedStep:
        return FusedStep(logits[0])

    def batch_key(self) -> tuple[type]:
        return (SingleStream,)

    @classmethod
    def fuse_batch(cls, rules: Sequence[SingleStream], rows: Sequence[Sequence[torch.Tensor]],
                   states: Sequence[FusionState]) -> FusedBatch:
        return FusedBatch(torch.stack([streams[0] for streams in rows]), None, [None] * len(rows))


single_stream = SingleStream()


@dataclass(frozen=True)
class TraceStep:
    """Which document produced a token, and its fused score there (``document=None``: no attribution).

    ``logprob`` / ``top_logprobs``: when the request asked for log-probabilities (``SamplingParams.logprobs``),
    the token's log-probability under the mode's fused scores (softmax of the scores the rule produced,
    before penalties, the format's mask and temperature: vLLM's raw log-probabilities), and the most
    likely ``(token id, log-probability)`` pairs at that step; ``None`` and ``()`` otherwise.
    """

    token_id: int
    document: int | None
    score: float
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@torch.inference_mode()
def forward_sequences(model: torch.nn.Module, sequences: SequenceBatch, input_ids: torch.Tensor) -> torch.Tensor:
    """Append ``input_ids`` ([B, S]) to every sequence and return the last position's logits ([B, V], fp32)."""
    return forward_sequences_keep(model, sequences, input_ids, 1)[:, -1]


@torch.inference_mode()
def forward_sequences_keep(model: torch.nn.Module, sequences: SequenceBatch, input_ids: torch.Tensor,
                           keep: int) -> torch.Tensor:
    """Like :func:`forward_sequences`, returning the logits of the last ``keep`` positions ([B, keep, V], fp32).

    A prefill whose every position's next-token distribution is read (APE's exactness tests) needs them all.
    """
    batch, length = input_ids.shape
    positions = sequences.positions.unsqueeze(1) + torch.arange(length, device=input_ids.device)
    mask = torch.cat([sequences.attention_mask, sequences.attention_mask.new_ones(batch, length)], dim=1)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                past_key_values=sequences.cache, use_cache=True, logits_to_keep=keep, **sequences.forward_kwargs)
    sequences.attention_mask = mask
    sequences.positions = sequences.positions + length
    return out.logits[:, -keep:].float()


def check_finite_scores(best: float) -> None:
    """Refuse to choose a token when the best score is NaN or infinite (``torch.max`` propagates NaN).

    Greedy ``argmax`` over such scores returns token id 0 at every step (an empty answer that looks
    like a success) and sampling fails inside ``torch.multinomial``; both become a typed error here.
    """
    if not math.isfinite(best):
        raise NonFiniteScoresError(
            f"the scores of the next token are not finite (score {best}): a decoding knob is at an extreme "
            "value (gamma, beta, eta, tau, attention_temperature...) or the model produced NaN; use values nearer "
            "the defaults, or a model in float32")


def sampling_knobs(temperature: float, top_p: float, seed: int | None) -> tuple[float, float, int | None]:
    """Check temperature, top_p and seed (typed errors naming the argument); return them normalised."""
    from ctx_integrations.engine.core.validation import optional_whole_number, real_number

    temperature = real_number("temperature", temperature, minimum=0.0, hint=" (0 = greedy)")
    if 0 < temperature < 1e-4:  # scores / temperature would overflow to inf, and softmax give NaN
        raise InvalidOptionError(f"temperature must be 0 (greedy) or >= 1e-4, got {temperature}")
    top_p = real_number("top_p", top_p, minimum=0.0, maximum=1.0, min_inclusive=False)
    seed = optional_whole_number("seed", seed, minimum=0, maximum=2**64 - 1, hint=" (None = a fresh random seed)")
    return temperature, top_p, seed


def filter_knobs(top_k: int, min_p: float, repetition_penalty: float, frequency_penalty: float,
                 presence_penalty: float) -> tuple[int, float, float, float, float]:
    """Check top_k, min_p and the three penalties (typed errors naming the argument); return them normalised.

    ``top_k=-1`` is vLLM's spelling of "off" and is taken as 0. The penalties' ranges are OpenAI's and vLLM's.
    """
    from ctx_integrations.engine.core.validation import real_number, whole_number

    top_k = whole_number("top_k", top_k, minimum=-1, hint=" (0 or -1 = every token)")
    min_p = real_number("min_p", min_p, minimum=0.0, maximum=1.0, hint=" (0 = off)")
    repetition_penalty = real_number("repetition_penalty", repetition_penalty, minimum=0.0, maximum=100.0,
                                     min_inclusive=False, hint=" (1 = off)")
    frequency_penalty = real_number("frequency_penalty", frequency_penalty, minimum=-2.0, maximum=2.0,
                                    hint=" (0 = off)")
    presence_penalty = real_number("presence_penalty", presence_penalty, minimum=-2.0, maximum=2.0, hint=" (0 = off)")
    return max(top_k, 0), min_p, repetition_penalty, frequency_penalty, presence_penalty


@dataclass(frozen=True)
class Penalties:
    """OpenAI's and vLLM's penalties, over the tokens of the answer so far (not the prompt's).

    ``repetition`` (transformers' and vLLM's ``repetition_penalty``, 1 = off): a token already in the answer has
    its score divided by it when positive, multiplied by it when negative (the rule of transformers'
    ``RepetitionPenaltyLogitsProcessor``). ``frequency`` and ``presence`` (OpenAI's, 0 = off): ``score -=
    frequency * count + presence * (count > 0)``, count being how often the token is in the answer. Applied in
    that order, as vLLM does, to the mode's fused scores before the pick (greedy too). Only the answer's tokens
    count: a prompt here is several streams of documents, and penalising the documents' words would push a
    grounded answer away from the very names and figures it should quote.
    """

    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0

    def apply(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``scores`` ([V]) penalised by ``counts`` ([V], how often each token is in the answer); a new tensor."""
        seen = counts > 0
        if self.repetition != 1.0:
            scores = torch.where(seen, torch.where(scores > 0, scores / self.repetition, scores * self.repetition),
                                 scores)
        if self.frequency != 0.0 or self.presence != 0.0:
            scores = scores - self.frequency * counts - self.presence * seen.to(scores.dtype)
        return scores


NO_PENALTIES = Penalties()


def logprob_values(scores: torch.Tensor, token: torch.Tensor, top: int) -> torch.Tensor:
    """``[log p(token), then the ``top`` most likely ids, then their log p]`` (float64, on the scores' device), where
    p = softmax of ``scores``: the values :func:`read_logprobs` turns back into a step's log-probabilities."""
    logprobs = torch.log_softmax(scores.float(), -1)
    best = torch.topk(logprobs, top) if top else None
    parts = [logprobs[token].double().view(1)]
    if best is not None:
        parts += [best.indices.double(), best.values.double()]
    return torch.cat(parts)


def read_logprobs(values: Sequence[float], top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The chosen token's log-probability and the ``top`` alternatives, from :func:`logprob_values` read back."""
    return values[0], tuple((int(i), lp) for i, lp in zip(values[1:1 + top], values[1 + top:1 + 2 * top]))


def as_stop_strings(value: Sequence[str] | str | None) -> tuple[str, ...]:
    """A stop string, a list of them or None, as a tuple of strings (anything else, an empty string included:
    ``InvalidOptionError``)."""
    if value is None:
        return ()
    try:
        strings = (value,) if isinstance(value, str) else tuple(value)
    except TypeError:
        raise InvalidOptionError(f"stop must be a string or a list of strings, got {value!r}") from None
    if not all(isinstance(s, str) for s in strings):
        raise InvalidOptionError(f"stop must be a string or a list of strings, got {strings!r}")
    if not all(strings):  # "" would be accepted and never match: the answer would run on to max_tokens
        raise InvalidOptionError(f"stop strings must not be empty, got {strings!r}: leave the empty one out")
    return strings


def race_noises(samplers: Sequence[TokenSampler], width: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """The exponential noise of one draw over ``width`` tokens per sampler, ``[J, V]`` on ``device``, for
    :func:`race_winner`: ``torch.multinomial``'s own algorithm for one sample (the argmax of p / q, q ~ Exp(1)) with q
    chosen per request. A seeded sampler's q comes from its own CPU generator (as :func:`race_noise`: the same draws on
    every device, alone or batched; on a CPU the draw is bit for bit ``torch.multinomial(probs, 1,
    generator=...)``), copied to the device without a wait. The unseeded samplers' q is one draw on the device from its
    default generator, as vLLM draws the noise of requests without a seed: nothing to reproduce, and no V-wide draw
    per request on the host each step. Each seeded row is drawn in place, so a seeded request adds one host
    operation (its draw) and no V-wide copy."""
    seeded = [j for j, sampler in enumerate(samplers) if sampler.seeded]
    own = None
    if seeded:
        own = torch.empty(len(seeded), width, dtype=dtype)
        for row, j in zip(own.unbind(), seeded):
            row.exponential_(generator=samplers[j].generator)
    if len(seeded) == len(samplers):
        return own.to(device, non_blocking=True)
    race = torch.empty(len(samplers), width, dtype=dtype, device=device).exponential_()
    if own is not None:
        race[seeded] = own.to(device, non_blocking=True)
    return race


def race_noise(generator: torch.Generator, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The exponential noise of one draw over ``width`` tokens from ``generator`` (on the CPU): what
    :func:`race_noises` draws for a seeded request, row by row."""
    return torch.empty(width, dtype=dtype).exponential_(generator=generator)


def race_winner(probs: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """The exponential race's winner per row of ``probs`` (``[..., V]``) against ``race`` (``[..., V]``: noise from
    :func:`race_noises`, or CPU noise from :func:`race_noise`, copied to the probabilities' device without a wait)."""
    return torch.argmax(probs / race.to(probs.device, non_blocking=True), dim=-1)


def sampling_probs(scores: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """The distribution a sampled token is drawn from, per row of ``scores`` (``[..., V]``): temperature, then top_k
    (transformers' ``TopKLogitsWarper``), top_p (nucleus), then min_p (``MinPLogitsWarper``): transformers' order.
    Row by row the operations are the same whatever the leading dimensions, so J requests sampled together get
    each what it gets alone."""
    logits = scores.float() / temperature
    width = logits.shape[-1]
    if top_k:
        from transformers import TopKLogitsWarper

        logits = TopKLogitsWarper(top_k)(None, logits.reshape(-1, width)).view(logits.shape)
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, -1) - sorted_probs < top_p
        keep[..., 0] = True  # the top token always stays (a top_p below float32's smallest number compares as 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)  # no boolean index: no read
    if min_p:
        from transformers import MinPLogitsWarper

        probs = torch.softmax(MinPLogitsWarper(min_p)(None, probs.log().reshape(-1, width)).view(probs.shape), dim=-1)
    return probs


@contextmanager
def generators_kept(samplers: Sequence[TokenSampler]) -> Iterator[None]:
    """Put the seeded samplers' generators back as they were if the block raises: a batch that fails is proposed
    again one by one (``choice.choose``), and must draw the same noise then. Greedy and unseeded samplers draw
    nothing from their own generators (:func:`race_noises`), so theirs are not read: no state copy per request."""
    generators = {id(sampler.generator): sampler.generator for sampler in samplers
                  if sampler.seeded and sampler.temperature > 0}
    states = {key: generator.get_state() for key, generator in generators.items()}
    try:
        yield
    except BaseException:
        for key, generator in generators.items():
            generator.set_state(states[key])
        raise


class TokenSampler:
    """Chooses one answer's tokens: greedy (temperature 0) or temperature + top_k + top_p (nucleus) + min_p
    sampling with its own seeded generator, after the answer's penalties and its structured-output constraint.

    A sampler belongs to one answer: it keeps the answer's token counts (for the penalties) and its
    constraint's place in the format, both updated by :meth:`accept` with each token chosen. ``logprobs``
    (``None``: off) asks every step for the chosen token's log-probability and that many alternatives.
    With every knob at its default, :meth:`pick` is exactly the plain argmax / nucleus draw.
    """

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, *, top_k: int = 0,
                 min_p: float = 0.0, penalties: Penalties = NO_PENALTIES, constraint: object | None = None,
                 logprobs: int | None = None, generator: torch.Generator | None = None):
        temperature, top_p, seed = sampling_knobs(temperature, top_p, seed)
        top_k, min_p, *_ = filter_knobs(top_k, min_p, penalties.repetition, penalties.frequency, penalties.presence)
        self.temperature, self.top_p, self.top_k, self.min_p = temperature, top_p, top_k, min_p
        self.penalties, self.constraint, self.logprobs = penalties, constraint, logprobs
        self.counts: torch.Tensor | None = None  # how often each token is in the answer (penalties only)
        # Only a seeded answer has a generator of its own: an unseeded answer's sampled noise is drawn on the device
        # (race_noises, verdict_noises), so nothing can draw from an unseeded generator by mistake. ``generator``: a
        # side decode of a seeded request (``unconstrained``) continuing its sequence of draws.
        self.generator: torch.Generator | None = generator
        if generator is None and seed is not None:
            self.generator = torch.Generator().manual_seed(seed)
        self.seeded = self.generator is not None

    def unconstrained(self) -> TokenSampler:
        """A sampler for a side decode of this answer's request (MapReduce's summaries): the same knobs and
        generator (so a seeded request's draws stay in one sequence; an unseeded one has none), its own penalty
        counts, no constraint, no logprobs."""
        return TokenSampler(self.temperature, self.top_p, top_k=self.top_k, min_p=self.min_p,
                            penalties=self.penalties, generator=self.generator)

    @property
    def plain(self) -> bool:
        """Whether :meth:`pick` reads nothing from the scores but its knobs (no penalties, no constraint, no
        logprobs): such answers' tokens can be chosen for a batch of requests at once (:func:`batch_proposals`)."""
        return not self.penalties.active and self.constraint is None and self.logprobs is None

    @property
    def batch_knobs(self) -> tuple | None:
        """What answers choosing together must share (``None``: this one chooses alone): greedy answers any greedy
        ones; sampled answers those with the same temperature, top_p, top_k and min_p, each drawing its own noise
        from its own generator (as vLLM's sampler draws a seeded request's noise from its own generator)."""
        if not self.plain:
            return None
        if self.temperature == 0:
            return ("greedy",)
        return ("sampled", self.temperature, self.top_p, self.top_k, self.min_p)

    @property
    def logprob_width(self) -> int:
        """How many values :func:`logprob_values` adds to a proposal (0 without logprobs)."""
        return 0 if self.logprobs is None else 1 + 2 * self.logprobs

    def __call__(self, scores: torch.Tensor) -> int:
        token, checked = self.pick(scores)
        self.check(float(checked))
        return int(token)

    def adjusted(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores the pick reads: ``scores`` penalised and masked to the format (``scores`` itself when neither
        applies, so default decoding is bit-for-bit what it was)."""
        if self.penalties.active:
            if self.counts is None:
                self.counts = torch.zeros(scores.shape[-1], dtype=torch.float32, device=scores.device)
            scores = self.penalties.apply(scores.float(), self.counts)
        if self.constraint is not None:
            scores = self.constraint.mask(scores)
        return scores

    def pick(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The token (a 0-d tensor on ``scores``' device) and the score whose finiteness the caller checks
        (:meth:`check`) once it reads both back.

        Nothing is read back, greedy or sampled, so a batch of jobs reads all their tokens in one transfer.
        Sampling draws from :func:`sampling_probs` with :func:`race_noises`' noise: a seeded answer's from its own
        CPU generator. NaN scores win the max, and a format that allows nothing leaves it at ``-inf``: the
        caller's check refuses both before the token is used.
        """
        scores = self.adjusted(scores)
        if self.temperature == 0:
            token = torch.argmax(scores)  # NaN wins argmax, and all -inf gives 0: the caller's check catches both
            return token, scores[token]
        probs = sampling_probs(scores, self.temperature, self.top_p, self.top_k, self.min_p)
        return race_winner(probs, race_noises([self], probs.shape[-1], probs.dtype, probs.device)[0]), scores.max()

    def check(self, best: float) -> None:
        """Refuse a pick whose best score is not finite (:func:`check_finite_scores`); under a constraint, a best
        of ``-inf`` means the mode's scores allow none of the tokens the format allows (``NoAllowedTokenError``)."""
        if self.constraint is not None and best == -math.inf:
            raise NoAllowedTokenError(
                "every token the structured-output format allows next has a score of -inf under this mode's fused "
                "scores, so no valid token can be chosen: use a mode whose scores cover the vocabulary (pced, "
                "concat, soft_nbce, chat)")
        check_finite_scores(best)

    def accept(self, token_id: int) -> None:
        """Take the token chosen (read back) into the answer's counts and its format's matcher."""
        if self.counts is not None:
            self.counts[token_id] += 1
        if self.constraint is not None:
            self.constraint.accept(token_id)


class IncrementalText:
    """Incremental detokenisation with offsets (vLLM's ``detokenize_incrementally``): O(1) ids decoded per token.

    Decoding all ids at every token costs O(n) per token, O(n^2) per answer. Instead two windows are decoded:
    ``ids[prefix:read]`` (already emitted, kept as context so a word-initial space or a merge across the boundary
    decodes as in the whole text) and ``ids[prefix:]``; the new text is what the second adds to the first. While
    it ends in a partial UTF-8 character (U+FFFD) it is held back and the window grows until the character is
    whole; then both offsets move on. Special tokens decode to nothing (``skip_special_tokens``).
    """

    def __init__(self, tokenizer: object):
        self.tokenizer, self.ids = tokenizer, []
        self.safe_text = ""  # everything emitted so far
        self._prefix = self._read = 0

    def push(self, token_id: int) -> str:
        """Add one id; return the text so far (without a trailing partial character)."""
        self.ids.append(token_id)
        before, after = self._window()
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.safe_text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self.safe_text

    def _window(self) -> tuple[str, str]:
        decode, window = self.tokenizer.decode, self.ids[self._prefix:self._read]
        before = decode(window, skip_special_tokens=True) if window else ""
        return before, decode(self.ids[self._prefix:], skip_special_tokens=True)

    @property
    def text(self) -> str:
        """The whole text, the held-back tail included (a partial character at the end stays U+FFFD)."""
        if self._read == len(self.ids):
            return self.safe_text
        before, after = self._window()
        return self.safe_text + after[len(before):]


@dataclass
class StopCriteria:
    """Stop on an EOS id, after ``max_new_tokens``, or when a stop string appears (it is cut off)."""

    eos_token_ids: frozenset[int]
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_strings: Sequence[str] = ()

    def __post_init__(self) -> None:
        from ctx_integrations.engine.core.validation import whole_number

        self.max_new_tokens = whole_number("max_new_tokens", self.max_new_tokens, minimum=1)
        self.stop_strings = as_stop_strings(self.stop_strings)

    def cut(self, text: str) -> tuple[str, bool]:
        """Return the text up to the first stop string and whether one was found."""
        hit = self.first_stop(text)
        return (text[:hit], True) if hit is not None else (text, False)

    def first_stop(self, text: str, checked: int = 0) -> int | None:
        """Where the first stop string in ``text`` starts, looking only where one could end after ``checked``
        characters (those were looked at before): O(new text + longest stop string), not O(text)."""
        strings = [s for s in self.stop_strings if s]
        if not strings:
            return None
        start = max(0, checked - max(map(len, strings)) + 1)
        hits = [found for s in strings if (found := text.find(s, start)) >= 0]
        return min(hits) if hits else None


@dataclass
class DecodeResult:
    token_ids: list[int]
    text: str
    trace: list[TraceStep]
    ttft_s: float
    finish_reason: str  # "eos" | "length" | "stop"
    steps: int = 0
    extra: dict = field(default_factory=dict)


class Emitter:
    """One answer as it is decoded: its trace, streamed text, stop criteria and time to first token.

    Every decode loop (fused streams, independent streams, speculative rounds, stacked questions)
    pushes the tokens it chooses here, so stopping and streaming behave the same in every mode.
    """

    def __init__(self, tokenizer: object, stop: StopCriteria, on_token: Callable[[str], None] | None = None,
                 started: float | None = None):
        self.stop, self.on_token = stop, on_token
        self.started = time.perf_counter() if started is None else started
        self.pieces, self.trace = IncrementalText(tokenizer), []
        self.ttft: float | None = None
        self.reason, self.done, self._emitted = "length", False, 0
        # the characters a stop string may have begun in without being whole yet: held back from the stream until the
        # next token or the end (as OpenAI's API and vLLM do), so no piece streamed is ever cut from the answer after
        self._held = max((len(s) - 1 for s in stop.stop_strings if s), default=0)

    def push(self, step: TraceStep) -> bool:
        """Record the chosen token (an EOS ends the answer and is not kept); return whether the answer is done."""
        if self.done:
            return True
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.started
        if math.isnan(step.score):  # a rule that turned NaN scores into a token (its fused scores looked finite)
            check_finite_scores(step.score)
        if step.token_id in self.stop.eos_token_ids:
            self.reason, self.done = "eos", True
            return True
        self.trace.append(step)
        checked = len(self.pieces.safe_text)
        text = self.pieces.push(step.token_id)
        hit = self.stop.first_stop(text, checked)
        self._send_text(text[:len(text) - self._held] if hit is None else text[:hit])
        if hit is not None:
            self.reason, self.done = "stop", True
        elif len(self.trace) >= self.stop.max_new_tokens:
            self.done = True
        return self.done

    def _send_text(self, text: str) -> None:
        if self.on_token is not None and len(text) > self._emitted:
            self.on_token(text[self._emitted:])
            self._emitted = len(text)

    def result(self) -> DecodeResult:
        text, _ = self.stop.cut(self.pieces.text)
        self._send_text(text)
        return DecodeResult([s.token_id for s in self.trace], text, self.trace, self.ttft or 0.0, self.reason,
                            steps=len(self.trace))


def propose_token(rule: FusionRule, logits: torch.Tensor, state: FusionState,
                  sampler: TokenSampler) -> tuple[torch.Tensor, object]:
    """The device half of a fused step: fuse the streams' logits ``[K, V]``, pick a token and the stream with
    the most evidence for it, and read nothing back (gpt-fast / nano-vllm keep tokens on the device).

    Returns the proposal (float64 ``[token, winner (-1: none), score, the score to check for finiteness]`` on
    the logits' device, then the log-probabilities when the sampler asks for them, read back later together
    with every other job's) and the rule's carry; :func:`settle_token` turns the values read into the step.
    """
    if sampler.constraint is not None and getattr(rule, "format_masks_streams", False):
        logits = sampler.constraint.mask(logits)  # the rule's nuclei are taken among the tokens the format allows
    fused = rule(logits, state)
    token, checked = sampler.pick(fused.scores)
    if fused.evidence is not None:
        winner = torch.argmax(fused.evidence[:, token])
        score = fused.evidence[winner, token]
    else:
        winner, score = torch.full((), -1, device=token.device), fused.scores[token]
    proposal = torch.stack([token.double(), winner.double(), score.double(), checked.double()])
    if sampler.logprobs is not None:
        proposal = torch.cat([proposal, logprob_values(fused.scores, token, sampler.logprobs)])
    return proposal, fused.carry


def batch_proposals(fused: FusedBatch, samplers: Sequence[TokenSampler]) -> torch.Tensor:
    """:func:`propose_token`'s values ``[J, 4]`` for J answers from one batched rule evaluation, their samplers
    :attr:`~TokenSampler.plain` with one :attr:`~TokenSampler.batch_knobs`: per row the same token, winner, score and
    checked score as alone. Greedy: argmax takes the first maximum in both, and the padded streams' ``-inf`` evidence
    never comes before a real one. Sampled: each answer's noise comes from its own generator, in the jobs' order (the
    order they draw in one by one)."""
    first = samplers[0]
    if first.temperature == 0:
        token = torch.argmax(fused.scores, -1)
        checked = fused.scores.gather(1, token.unsqueeze(1)).squeeze(1)
    else:
        probs = sampling_probs(fused.scores, first.temperature, first.top_p, first.top_k, first.min_p)
        race = race_noises(samplers, probs.shape[-1], probs.dtype, probs.device)
        token, checked = race_winner(probs, race), fused.scores.max(-1).values
    if fused.evidence is None:
        winner = torch.full_like(token, -1)
        score = fused.scores.gather(1, token.unsqueeze(1)).squeeze(1)
    else:
        column = fused.evidence.gather(2, token.view(-1, 1, 1).expand(-1, fused.evidence.shape[1], 1)).squeeze(2)
        winner = torch.argmax(column, -1)
        score = column.gather(1, winner.unsqueeze(1)).squeeze(1)
    return torch.stack([token.double(), winner.double(), score.double(), checked.double()], 1)


def settle_token(values: Sequence[float], carry: object, sampler: TokenSampler) -> tuple[TraceStep, FusionState]:
    """The host half: the step and the state the rule sees next, from a proposal's values read back; the token
    is accepted into the sampler (its penalty counts and its format's matcher)."""
    token, winner, score, checked = values[:4]
    sampler.check(checked)
    token_id, won = int(token), (int(winner) if winner >= 0 else None)
    sampler.accept(token_id)
    if sampler.logprobs is None:
        return TraceStep(token_id, won, score), FusionState(token_id, won, carry)
    logprob, top = read_logprobs(values[4:], sampler.logprobs)
    return TraceStep(token_id, won, score, logprob, top), FusionState(token_id, won, carry)


def choose_token(rule: FusionRule, logits: torch.Tensor, state: FusionState,
                 sampler: TokenSampler) -> tuple[TraceStep, FusionState]:
    """One fused step for a caller on its own (one read back): :func:`propose_token` then :func:`settle_token`."""
    values, carry = propose_token(rule, logits, state, sampler)
    return settle_token(values.tolist(), carry, sampler)


def fused_steps(forward: Callable[[torch.Tensor], torch.Tensor], tokenizer: object, first_logits: torch.Tensor,
                rule: FusionRule, sampler: TokenSampler, stop: StopCriteria,
                on_token: Callable[[str], None] | None = None,
                started: float | None = None) -> Generator[None, None, DecodeResult]:
    """Decode one answer from B streams: fuse, choose one token, append it to every stream, repeat.

    ``first_logits`` are the streams' logits after the prompt; ``forward(ids)`` appends ``ids``
    ([B, 1]) to every stream and returns the next logits ([B, V]). The generator yields after each
    forward pass, so a scheduler can run other work between them; its return value is the result.
    """
    emitter = Emitter(tokenizer, stop, on_token, started)
    batch, device, logits = first_logits.shape[0], first_logits.device, first_logits
    state = FIRST_STEP
    while True:
        step, state = choose_token(rule, logits, state, sampler)
        if emitter.push(step):
            return emitter.result()
        logits = forward(torch.full((batch, 1), step.token_id, device=device))
        yield
