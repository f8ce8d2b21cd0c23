"""Prompt layout: separately tokenised pieces must equal the tokens of the whole rendered prompt."""

from __future__ import annotations

import pytest

from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.errors import ChatTemplateError
from tests.helpers import embedded_tokenizer

DOCUMENTS = [
    "The capital of Veloria is Marrowgate.",
    "  leading and trailing whitespace \n\n",
    "Paragraph one.\n\nParagraph two, with digits 12345 and unicode: café, 東京, emoji 🙂.",
    "ends with a newline already\n",
    "- a list\n- of items\n\t- nested with a tab",
    "Numbers: 3.14159, 2,718; code `x = y + 1`; quotes \"like this\".",
]


@pytest.fixture(scope="module")
def layout() -> PromptLayout:
    return PromptLayout(embedded_tokenizer())


@pytest.mark.parametrize("question", ["Who is the mayor?", "  What is 2 + 2?  ", "Où est la gare ?"])
def test_pieces_equal_whole_prompt(layout, question):
    layout.check(DOCUMENTS, question)
    whole = layout.tokenizer(layout.render(DOCUMENTS, question), add_special_tokens=False)["input_ids"]
    pieces = layout.prefix_ids + [t for d in DOCUMENTS for t in layout.context_ids(d)] + layout.suffix_ids(question)
    assert pieces == list(whole)


def test_every_single_document_prompt_splits_exactly(layout):
    for document in DOCUMENTS:
        layout.check([document], "Which document is this?")


def test_prompt_uses_paper_templates_and_chat_template(layout):
    text = layout.render(["doc"], "q?")
    assert text.startswith("<|im_start|>system\nYou will be given a list of documents.")
    assert "query: q?<|im_end|>\n<|im_start|>assistant\n" in text


def test_fingerprint_changes_with_system_prompt(layout):
    other = PromptLayout(layout.tokenizer, system_prompt="Answer briefly.")
    assert other.fingerprint != layout.fingerprint


def test_missing_chat_template_is_a_typed_error():
    tokenizer = embedded_tokenizer()
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = None
        with pytest.raises(ChatTemplateError, match="no chat template"):
            PromptLayout(tokenizer).prefix_ids  # noqa: B018
    finally:
        tokenizer.chat_template = saved
