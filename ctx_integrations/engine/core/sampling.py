"""How one answer is decoded: :class:`SamplingParams`, the one object the engine, the framework adapters
and the server pass along instead of five separate arguments (vLLM's name and field names)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ctx_integrations.engine.core.decoding import (
    Penalties,
    StopCriteria,
    TokenSampler,
    as_stop_strings,
    filter_knobs,
    sampling_knobs,
)
from ctx_integrations.engine.core.defaults import DEFAULT_MAX_NEW_TOKENS
from ctx_integrations.engine.core.structured import StructuredOutput, TokenConstraint
from ctx_integrations.engine.core.validation import optional_whole_number, whole_number
from ctx_integrations.errors import InvalidOptionError

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs

@dataclass(frozen=True)
class SamplingParams:
    """How one answer is decoded (vLLM's names; each knob's default leaves decoding exactly as without it):

    - ``max_tokens``: the answer's length limit; ``stop``: strings that end the answer (cut off);
    - ``temperature`` (0: greedy), ``top_p`` (nucleus), ``top_k`` (0 or -1: every token), ``min_p`` (drop tokens
      below ``min_p`` times the top token's probability): transformers' order, temperature -> top_k -> top_p ->
      min_p; the filters change nothing under greedy decoding;
    - ``repetition_penalty`` (1: off), ``frequency_penalty`` and ``presence_penalty`` (0: off; -2..2, OpenAI's):
      over the answer's own tokens, greedy included (:class:`~ctx_integrations.engine.core.decoding.Penalties`);
    - ``seed`` (None: a fresh random seed per answer);
    - ``structured``: a :class:`~ctx_integrations.engine.core.structured.StructuredOutput` (JSON schema, JSON
      mode, regex, choice, grammar) every token keeps to (needs the ``structured`` extra, xgrammar);
    - ``logprobs``: ``None`` (off), or how many most likely alternatives (0-20) to record with each token's
      log-probability (``TraceStep.logprob`` / ``top_logprobs``).

    Checked when built, so a bad value fails where it is written, with the same typed errors as the
    engine's keyword arguments (``InvalidOptionError``). A mode that cannot honour a setting (RAPID: its
    speculative acceptance draws from the target's plain distribution) refuses it with
    :class:`~ctx_integrations.errors.UnsupportedSamplingError`.
    """

    max_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    structured: StructuredOutput | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        temperature, top_p, seed = sampling_knobs(self.temperature, self.top_p, self.seed)
        object.__setattr__(self, "max_tokens", whole_number("max_tokens (max_new_tokens)", self.max_tokens, minimum=1))
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "stop", as_stop_strings(self.stop))
        knobs = filter_knobs(self.top_k, self.min_p, self.repetition_penalty, self.frequency_penalty,
                             self.presence_penalty)
        for name, value in zip(("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"),
                               knobs):
            object.__setattr__(self, name, value)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidOptionError(f"structured must be a StructuredOutput (or None), got "
                                     f"{type(self.structured).__name__}")
        object.__setattr__(self, "logprobs", optional_whole_number(
            "logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS,
            hint=" (None = off; 0 = only the chosen token's log-probability)"))

    @classmethod
    def resolve(cls, sampling: SamplingParams | None, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                stop: Sequence[str] | str = ()) -> SamplingParams:
        """``sampling`` if given (then the separate arguments must be left at their defaults), else the
        separate arguments as one object: what every public method with both spellings calls."""
        separate = cls(max_new_tokens, temperature, top_p, seed, stop)  # type: ignore[arg-type]
        if sampling is None:
            return separate
        if not isinstance(sampling, cls):
            raise InvalidOptionError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if separate != DEFAULT_SAMPLING:
            raise InvalidOptionError("give the decoding settings either as sampling=SamplingParams(...) or as "
                                     "separate arguments (max_new_tokens, temperature, top_p, seed, stop), not both")
        return sampling

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repetition_penalty, self.frequency_penalty, self.presence_penalty)

    def beyond_plain_sampling(self) -> list[str]:
        """The settings set away from their defaults that need every token picked by the answer's own sampler
        (what RAPID's speculative acceptance cannot do): top_k, min_p, the penalties, structured, logprobs."""
        defaults = DEFAULT_SAMPLING
        names = ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "structured",
                 "logprobs")
        return [name for name in names if getattr(self, name) != getattr(defaults, name)]

    def sampler(self, seed_offset: int = 0, grammar: object | None = None) -> TokenSampler:
        """A fresh sampler (its own generator); ``seed_offset`` gives question i of a batch seed + i.

        ``grammar``: ``structured`` compiled for the model (``LoadedModel.grammars.compile``), which the
        sampler's constraint follows; required when ``structured`` is set.
        """
        constraint = None
        if self.structured is not None:
            if grammar is None:
                raise InvalidOptionError("structured output needs its format compiled for the model: decode through "
                                         "an Engine, which compiles it")
            constraint = TokenConstraint(grammar)
        return TokenSampler(self.temperature, self.top_p, None if self.seed is None else self.seed + seed_offset,
                            top_k=self.top_k, min_p=self.min_p, penalties=self.penalties, constraint=constraint,
                            logprobs=self.logprobs)

    def stop_criteria(self, eos_token_ids: frozenset[int]) -> StopCriteria:
        return StopCriteria(eos_token_ids, self.max_tokens, self.stop)


DEFAULT_SAMPLING = SamplingParams()
