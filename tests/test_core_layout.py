"""Prompt layout: separately tokenised pieces must equal the tokens of the whole rendered prompt."""

from __future__ import annotations

import pytest

from ctx_integrations import Engine
from ctx_integrations.engine.core.layout import PromptLayout, prompt_template
from ctx_integrations.errors import ChatTemplateError, InvalidOptionError
from tests.helpers import embedded_tokenizer, greedy_reference, tiny_loaded

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


def test_icl_template_is_the_pced_papers_figure_5():
    icl = PromptLayout(embedded_tokenizer(), **prompt_template("icl"))
    text = icl.render(["Input: 2 + 2\nOutput: ['4']", "Input: 3 + 1\nOutput: ['4']"], "Input: 1 + 1")
    assert "<|im_start|>system\nPlease answer the following questions and ensure you follow a consistent" in text
    assert "Do NOT write anything else.<|im_end|>" in text
    # each exemplar in the context template, then the question template
    expected = ("Example(s): Input: 2 + 2\nOutput: ['4']\nExample(s): Input: 3 + 1\nOutput: ['4']\n"
                "\nNow begin! Input: 1 + 1")
    assert expected in text
    for question in ("Input: 1 + 1", "Where?"):
        icl.check(DOCUMENTS, question)  # the pieces still tokenise exactly like the whole prompt
    assert icl.fingerprint != PromptLayout(embedded_tokenizer(), **prompt_template("rag")).fingerprint
    assert PromptLayout(embedded_tokenizer(), **prompt_template("rag")) == PromptLayout(embedded_tokenizer())


def test_bad_templates_are_typed_errors():
    with pytest.raises(InvalidOptionError, match="icl"):
        prompt_template("fewshot")
    with pytest.raises(InvalidOptionError, match="context_template"):
        PromptLayout(embedded_tokenizer(), context_template="Example(s):")


def test_engine_with_the_icl_template_decodes_its_prompt():
    engine = Engine(tiny_loaded("llama"), **prompt_template("icl"))
    docs, question = ["Input: 2 + 2\nOutput: ['4']", "Input: 5 - 1\nOutput: ['4']"], "Input: 1 + 3"
    answer = engine.generate(question, docs, mode="concat", max_new_tokens=5)
    layout = engine.layout
    assert layout.context_ids(docs[0])[:4] == layout.tokenizer("Example(s):", add_special_tokens=False)["input_ids"][:4]
    prompt = layout.tokenizer(layout.render(docs, question), add_special_tokens=False)["input_ids"]
    assert answer.token_ids == greedy_reference(engine.loaded, list(prompt), 5)
    assert len(engine.generate(question, docs, mode="pced", max_new_tokens=3).token_ids) == 3
