"""How one answer is decoded: :class:`SamplingParams`, the one object the engine, the framework adapters
and the server pass along instead of five separate arguments (vLLM's name and field names)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ctx_integrations.engine.core.decoding import StopCriteria, TokenSampler, as_stop_strings, sampling_knobs
from ctx_integrations.engine.core.defaults import DEFAULT_MAX_NEW_TOKENS
from ctx_integrations.engine.core.validation import whole_number
from ctx_integrations.errors import InvalidOptionError


@dataclass(frozen=True)
class SamplingParams:
    """``max_tokens`` (the answer's length limit), ``temperature`` (0: greedy), ``top_p`` (nucleus),
    ``seed`` (None: a fresh random seed per answer) and ``stop`` (strings that end the answer, cut off).

    Checked when built, so a bad value fails where it is written, with the same typed errors as the
    engine's keyword arguments (``InvalidOptionError``).
    """

    max_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        temperature, top_p, seed = sampling_knobs(self.temperature, self.top_p, self.seed)
        object.__setattr__(self, "max_tokens", whole_number("max_tokens (max_new_tokens)", self.max_tokens, minimum=1))
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "stop", as_stop_strings(self.stop))

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

    def sampler(self, seed_offset: int = 0) -> TokenSampler:
        """A fresh sampler (its own generator); ``seed_offset`` gives question i of a batch seed + i."""
        return TokenSampler(self.temperature, self.top_p, None if self.seed is None else self.seed + seed_offset)

    def stop_criteria(self, eos_token_ids: frozenset[int]) -> StopCriteria:
        return StopCriteria(eos_token_ids, self.max_tokens, self.stop)


DEFAULT_SAMPLING = SamplingParams()
