"""Split the model's own chat template into a shared prefix, per-document contexts and a question suffix.

The rendered prompt is ``prefix + doc_1 + ... + doc_N + suffix(question)``. Each piece is tokenised
on its own with ``add_special_tokens=False``; piece boundaries sit right after a newline and right
before a non-space character, where byte-level BPE pre-tokenisers always split, so a cached
document holds exactly the tokens the concatenated prompt would contain (``check`` verifies it).

Documents and questions are user data: a chat control token written in them (``<|im_start|>``,
``<|im_end|>``, any added special token) must stay text, or a document could close the user turn and
open a forged one. User text is therefore tokenised with ``split_special_tokens=True``; only the
template's own control tokens become control ids. Fast tokenizers cut the input at special tokens
before pre-tokenising, so tokenising each stretch between the template's control tokens on its own
gives the same ids as tokenising the whole prompt whenever the user text holds no control token.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from ctx_integrations.documents import user_text
from ctx_integrations.engine.core.validation import context_template_text
from ctx_integrations.errors import ChatTemplateError, InvalidOptionError

if TYPE_CHECKING:
    from ctx_integrations.engine.core.tools import ToolCallFormat

# PCED paper, appendix A.
PCED_SYSTEM_PROMPT = (
    "You will be given a list of documents. You need to read carefully and understand all of them. "
    "Then you will be given a query, and your goal is to answer the query based on the documents you have read."
)
PCED_QUESTION_TEMPLATE = (
    "Based on the documents above, can you answer the following query? Write a concise answer. query: {question}"
)
# PCED paper, appendix A.1.2, Fig. 5 (LOFT-ICL): exemplars as documents, a strict output format.
ICL_SYSTEM_PROMPT = (
    "Please answer the following questions and ensure you follow a consistent format. In particular, ensure your "
    "final answer always looks like 'Output: ['your_answer_here']' After Output write ONLY the best option "
    "following the example(s). Do NOT write anything else."
)
ICL_CONTEXT_TEMPLATE = "Example(s): {context}"
ICL_QUESTION_TEMPLATE = "Now begin! {question}"
DEFAULT_CONTEXT_TEMPLATE = "{context}"
# Named prompt templates, as keyword arguments of ``Engine`` / ``PromptLayout``: "rag" is Fig. 4 (the default),
# "icl" is Fig. 5: ``Engine.from_pretrained(**prompt_template("icl"))``.
PROMPT_TEMPLATES = {
    "rag": {"system_prompt": PCED_SYSTEM_PROMPT, "question_template": PCED_QUESTION_TEMPLATE,
            "context_template": DEFAULT_CONTEXT_TEMPLATE},
    "icl": {"system_prompt": ICL_SYSTEM_PROMPT, "question_template": ICL_QUESTION_TEMPLATE,
            "context_template": ICL_CONTEXT_TEMPLATE},
}
SUMMARY_SYSTEM_PROMPT = "Summarize the given documents concisely, focusing on the key points and main ideas."
SUMMARY_QUESTION_TEMPLATE = "Summarize the document above."

_CONTEXT_MARK = "\x00CTX\x00"
_QUESTION_MARK = "\x00QUESTION\x00"
# Joins the layout fingerprint (so the cache key): caches written before user text was tokenised with
# special-token splitting hold control ids where the text had control-token strings, and must not be reused.
USER_TEXT_TOKENISATION = "user-text:split-special-tokens"


def prompt_template(name: str) -> dict[str, str]:
    """The keyword arguments of a named template (``"rag"``: PCED Fig. 4, ``"icl"``: PCED Fig. 5)."""
    if name not in PROMPT_TEMPLATES:
        raise InvalidOptionError(f"unknown prompt template {name!r}: choose one of {', '.join(PROMPT_TEMPLATES)}")
    return dict(PROMPT_TEMPLATES[name])


@dataclass(frozen=True)
class PromptLayout:
    """Prefix / context / suffix pieces of one chat template, with their token ids."""

    tokenizer: object
    system_prompt: str = PCED_SYSTEM_PROMPT
    question_template: str = PCED_QUESTION_TEMPLATE
    context_template: str = DEFAULT_CONTEXT_TEMPLATE  # wraps each document, e.g. "Example(s): {context}" (ICL)

    def __post_init__(self) -> None:
        context_template_text(self.context_template)

    @cached_property
    def _pieces(self) -> tuple[str, str]:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ChatTemplateError(
                "the tokenizer has no chat template: use an instruction-tuned model, or set "
                "tokenizer.chat_template to a Jinja template before building the engine")
        user = _CONTEXT_MARK + "\n" + self.question_template.format(question=_QUESTION_MARK)
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]
        try:
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # templates raise jinja errors of many kinds (e.g. no system role)
            raise ChatTemplateError(f"the chat template could not render a system + user turn: {error}") from error
        if rendered.count(_CONTEXT_MARK) != 1 or rendered.count(_QUESTION_MARK) > 1:
            raise ChatTemplateError("the chat template altered the message text; it cannot be split into pieces")
        prefix, rest = rendered.split(_CONTEXT_MARK)
        if not prefix.endswith("\n"):
            raise ChatTemplateError("the chat template puts no newline before the user message; cannot split it safely")
        return prefix, rest

    @property
    def prefix_text(self) -> str:
        return self._pieces[0]

    def suffix_text(self, question: str) -> str:
        return self._pieces[1].replace(_QUESTION_MARK, question.strip())

    def _suffix_parts(self, question: str) -> list[tuple[str, bool]]:
        """The suffix as (text, is_user_text) parts: template text around the question."""
        before, mark, after = self._pieces[1].partition(_QUESTION_MARK)
        parts = [(before, False)]
        if mark:
            parts.append((user_text(question, "the query").strip(), True))
        return parts + [(after, False)]

    def context_text(self, document: str) -> str:
        """A document as it appears in the prompt: stripped, in the context template, ending in one newline."""
        return self.context_template.replace("{context}", document.strip()) + "\n"

    def render(self, documents: list[str], question: str) -> str:
        return self.prefix_text + "".join(self.context_text(d) for d in documents) + self.suffix_text(question)

    def _encode(self, text: str, *, user_text: bool = False) -> list[int]:
        """Token ids of ``text``; ``user_text``: special-token strings in it stay plain text."""
        if user_text and self._user_text_backend is not None:
            return list(self._user_text_backend.encode(text, add_special_tokens=False).ids)
        extra = {"split_special_tokens": True} if user_text else {}
        return list(self.tokenizer(text, add_special_tokens=False, **extra)["input_ids"])

    @cached_property
    def _user_text_backend(self) -> object | None:
        """A private copy of a fast tokenizer's backend that never matches special tokens.

        transformers implements ``split_special_tokens=True`` by flipping a flag on the shared backend for
        each call, so a concurrent call from another thread could flip it back mid-encode; this copy
        keeps the flag set for good. ``None`` for slow tokenizers (they take the flag per call).
        """
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "encode_special_tokens"):
            return None
        from tokenizers import Tokenizer

        private = Tokenizer.from_str(backend.to_str())
        private.encode_special_tokens = True
        private.no_truncation()  # as the tokenizer's own call does without truncation=...
        private.no_padding()
        return private

    @cached_property
    def _special_tokens(self) -> tuple[dict[str, int], re.Pattern[str] | None]:
        """The tokenizer's added special tokens (text -> id) and a pattern finding them, longest first."""
        decoder = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        tokens = {t.content: i for i, t in decoder.items() if getattr(t, "special", False)}
        for text in getattr(self.tokenizer, "all_special_tokens", ()):
            tokens.setdefault(text, self.tokenizer.convert_tokens_to_ids(text))
        longest_first = sorted(tokens, key=len, reverse=True)
        return tokens, re.compile("|".join(map(re.escape, longest_first))) if tokens else None

    @cached_property
    def tool_format(self) -> ToolCallFormat:
        """How this model writes a tool call, read from its chat template (``tools.probe_format``)."""
        from ctx_integrations.engine.core.tools import probe_format

        return probe_format(self.tokenizer)

    def encode_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Token ids of template text and user text joined, with control ids only from the template's own tokens.

        The joined text is cut at the template's control tokens; each stretch between them (which may mix
        template text and user text, e.g. ``"query: " + question``) is tokenised with special-token splitting.
        """
        tokens, pattern = self._special_tokens
        ids: list[int] = []
        stretch = ""
        for text, is_user in parts:
            if is_user or pattern is None:
                stretch += text
                continue
            position = 0
            for match in pattern.finditer(text):
                stretch += text[position:match.start()]
                ids += self._encode(stretch, user_text=True) if stretch else []
                ids.append(tokens[match.group()])
                stretch, position = "", match.end()
            stretch += text[position:]
        return ids + (self._encode(stretch, user_text=True) if stretch else [])

    @cached_property
    def prefix_ids(self) -> list[int]:
        return self._encode(self.prefix_text)

    def context_ids(self, document: str) -> list[int]:
        """A document's tokens; control-token strings written in it are tokenised as plain text."""
        return self._encode(self.context_text(user_text(document, "a document's text")), user_text=True)

    def suffix_ids(self, question: str) -> list[int]:
        """The question suffix's tokens; only the template's own control tokens become control ids."""
        return self.encode_parts(self._suffix_parts(question))

    @cached_property
    def _bare_suffix_ids(self) -> list[int]:
        before, _, after = self._pieces[1].partition(_QUESTION_MARK)
        return self.encode_parts([(before, False), (after, False)])

    def question_span(self, suffix: Sequence[int]) -> tuple[int, int]:
        """Where the question's tokens lie in ``suffix`` (a :meth:`suffix_ids`): ``suffix[start:stop]``, the tokens
        between the longest start and end it shares with the suffix of no question (tokenised once per layout).

        A question's first token may hold the template's space before it (``" Who"`` after ``"query:"``), which is
        then part of the span; ``start == stop`` where the template writes no question.
        """
        bare = self._bare_suffix_ids
        start = 0
        while start < min(len(suffix), len(bare)) and suffix[start] == bare[start]:
            start += 1
        end = 0
        while end < min(len(suffix), len(bare)) - start and suffix[-1 - end] == bare[-1 - end]:
            end += 1
        return start, len(suffix) - end

    @cached_property
    def fingerprint(self) -> str:
        """Identifies the layout in cache keys: a new system prompt or template is a cache miss."""
        parts = [self.prefix_text, self._pieces[1], repr(self.prefix_ids), USER_TEXT_TOKENISATION]
        if self.context_template != DEFAULT_CONTEXT_TEMPLATE:  # default keys stay as they were
            parts.append(self.context_template)
        text = "\x1f".join(parts)
        return hashlib.sha256(text.encode()).hexdigest()

    def check(self, documents: list[str], question: str) -> None:
        """Raise if the separately tokenised pieces differ from tokenising the whole rendered prompt."""
        pieces = self.prefix_ids + [t for d in documents for t in self.context_ids(d)] + self.suffix_ids(question)
        if pieces != self._encode(self.render(documents, question)):
            raise ChatTemplateError(
                "this tokenizer merges tokens across the prompt's piece boundaries, so cached documents would "
                "not match a concatenated prompt")
