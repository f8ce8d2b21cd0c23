"""The one result type every mode returns, so adapters and users never special-case a mode."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ctx_integrations.documents import Document
from ctx_integrations.engine.core.citations import DEFAULT_THRESHOLD, SentenceCitation, answer_citations
from ctx_integrations.engine.core.decoding import TraceStep
from ctx_integrations.engine.core.tools import CutToolCall, ToolCall
from ctx_integrations.errors import IncompleteStructuredOutputError


@dataclass
class Answer:
    """Text plus everything needed to cite and time it.

    ``trace`` has one entry per generated token: the index (into ``documents``) of the document
    that won that token and its fused score (``None`` for modes without per-token attribution), and, when
    ``SamplingParams.logprobs`` asked for them, its log-probability and the most likely alternatives.
    ``timings`` has at least ``ttft_s``, ``total_s`` and ``tokens_per_s`` (floats), and what they were
    measured under: ``threads`` (torch CPU threads) and ``dtype`` (the compute dtype's name, a string,
    e.g. ``"float32"``). ``prompt_tokens`` is the prompt's length as one concatenation (prefix, documents,
    question; a chat's conversation), what frameworks report as input tokens, counted once when the request
    was prepared. ``cache_hits_by_tier``
    splits ``cache_hits`` into the tier that served them (``memory``: the model's device, ``host``:
    pinned host memory in front of a GPU, ``disk``). ``extra`` holds mode-specific details; where a
    mode that can attribute tokens could not for this answer, ``extra["attribution"] == "unavailable"``
    and ``extra["attribution_note"]`` says why and what to pass instead (APE on the flex kernel).
    ``tool_calls``: the tools a chat answer called (``Engine.chat(tools=...)``), each valid against its schema;
    ``text`` is then the answer without them. ``cut_tool_call``: the call ``max_tokens`` or a stop string cut
    before it was complete (``finish_reason`` is then not ``"eos"``), kept out of ``tool_calls`` and ``text``.
    """

    text: str
    token_ids: list[int]
    trace: list[TraceStep]
    timings: dict[str, float | str]
    documents: list[Document]
    mode: str
    cache_hits: int = 0
    cache_misses: int = 0
    finish_reason: str = "length"
    cache_hits_by_tier: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_tokens: int = 0  # the prompt as one concatenation (prefix + documents + question), or the conversation
    cut_tool_call: CutToolCall | None = None

    def __str__(self) -> str:
        return self.text

    def refuse_cut_tool_call(self) -> None:
        """Raise :class:`~ctx_integrations.errors.IncompleteStructuredOutputError` when the answer ends in a call
        ``max_tokens`` or a stop string cut (:attr:`cut_tool_call`); its ``text`` is the cut arguments. How the
        in-process front ends (LangChain, LlamaIndex) report it, so an agent never takes a cut call for the model's
        final answer nor runs it."""
        cut = self.cut_tool_call
        if cut is None:
            return
        raise IncompleteStructuredOutputError(
            f"the call of tool {cut.name or '(name not written yet)'!r} was cut before it was complete "
            f"(finish_reason {self.finish_reason!r}): raise max_new_tokens (LangChain's max_tokens), or bound the "
            f"tool's strings and arrays (maxLength, maxItems; $CTX_SCHEMA_MAX_LENGTH, $CTX_SCHEMA_MAX_ITEMS); its "
            f"arguments read {cut.arguments[:200]!r}", cut.arguments)

    def citation_counts(self) -> Counter[int]:
        """How many generated tokens each document won."""
        return Counter(step.document for step in self.trace if step.document is not None)

    def cited_documents(self) -> list[Document]:
        """Documents that won at least one token, most tokens first."""
        return [self.documents[i] for i, _ in self.citation_counts().most_common()]

    def to_dict(self) -> dict[str, Any]:
        counts = self.citation_counts()
        return {
            "text": self.text, "mode": self.mode, "token_ids": list(self.token_ids),
            "trace": [_trace_entry(s) for s in self.trace],
            "timings": dict(self.timings), "cache": {"hits": self.cache_hits, "misses": self.cache_misses,
                                                       "hits_by_tier": dict(self.cache_hits_by_tier)},
            "finish_reason": self.finish_reason, "options": dict(self.options), "extra": dict(self.extra),
            "tool_calls": [call.to_dict() for call in self.tool_calls],
            "cut_tool_call": self.cut_tool_call.to_dict() if self.cut_tool_call is not None else None,
            "prompt_tokens": self.prompt_tokens,
            "documents": [{**d.to_dict(), "tokens_won": counts.get(i, 0)} for i, d in enumerate(self.documents)],
        }

    def token_logprobs(self, tokenizer: Any) -> list[dict[str, Any]]:
        """OpenAI's ``logprobs.content``: per token (that has one; ``SamplingParams.logprobs``) its text, its
        log-probability, the UTF-8 bytes of its text and the most likely alternatives in the same shape.

        ``tokenizer`` decodes each token on its own (``engine.loaded.tokenizer``); a token that holds part of
        a character decodes to U+FFFD.
        """
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = tokenizer.decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return [{**entry(step.token_id, step.logprob), "top_logprobs": [entry(t, lp) for t, lp in step.top_logprobs]}
                for step in self.trace if step.logprob is not None]

    def citations(self, tokenizer: Any, threshold: float = DEFAULT_THRESHOLD) -> list[SentenceCitation]:
        """Sentence-level citations: per sentence, the documents that won >= ``threshold`` of its content tokens.

        ``tokenizer`` decodes the tokens (``engine.loaded.tokenizer``). Tokens won by the context-free
        stream cite nothing; RAPID's drafted tokens cite the drafter's chunks; IPPD cites the question's
        context. See :mod:`ctx_integrations.engine.core.citations`.
        """
        return answer_citations(self, tokenizer, threshold)


def _trace_entry(step: TraceStep) -> dict[str, Any]:
    """One trace step as JSON; ``logprob`` and ``top_logprobs`` (``[[token_id, logprob], ...]``) only when asked for."""
    entry: dict[str, Any] = {"token_id": step.token_id, "document": step.document, "score": step.score}
    if step.logprob is not None:
        entry["logprob"] = step.logprob
        entry["top_logprobs"] = [[token, logprob] for token, logprob in step.top_logprobs]
    return entry
