"""Split the model's own chat template into a shared prefix, per-document contexts and a question suffix.

The rendered prompt is ``prefix + doc_1 + ... + doc_N + suffix(question)``. Each piece is tokenised
on its own with ``add_special_tokens=False``; piece boundaries sit right after a newline and right
before a non-space character, where byte-level BPE pre-tokenisers always split, so a cached
document holds exactly the tokens the concatenated prompt would contain (``check`` verifies it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

from ctx_integrations.errors import ChatTemplateError, InvalidOptionError

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
        if self.context_template.count("{context}") != 1:
            raise InvalidOptionError(f"context_template must contain '{{context}}' exactly once, "
                                     f"got {self.context_template!r}")

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

    def context_text(self, document: str) -> str:
        """A document as it appears in the prompt: stripped, in the context template, ending in one newline."""
        return self.context_template.replace("{context}", document.strip()) + "\n"

    def render(self, documents: list[str], question: str) -> str:
        return self.prefix_text + "".join(self.context_text(d) for d in documents) + self.suffix_text(question)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @cached_property
    def prefix_ids(self) -> list[int]:
        return self._encode(self.prefix_text)

    def context_ids(self, document: str) -> list[int]:
        return self._encode(self.context_text(document))

    def suffix_ids(self, question: str) -> list[int]:
        return self._encode(self.suffix_text(question))

    @cached_property
    def fingerprint(self) -> str:
        """Identifies the layout in cache keys: a new system prompt or template is a cache miss."""
        parts = [self.prefix_text, self._pieces[1], repr(self.prefix_ids)]
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
