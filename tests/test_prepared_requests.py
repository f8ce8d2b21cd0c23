"""One request, prepared once: documents tokenised and keyed once per text, answers detokenised in O(1) per token.

Bugs caught: a document tokenised again by the loader thread, the mode's stream budget, its cache lookup or an
adapter's prompt-token count (a warm request over 64 x 2048 tokens spent 44 % of its host time there); a cache
key hashed more than once per document; the answer text decoded from all its ids at every token (O(n^2) per
answer); incremental text that differs from decoding all ids at once (a multi-byte character split across
tokens, a word-initial space); a stop string missed because it straddles two tokens; ``Answer.prompt_tokens``
off the concatenated prompt's length.
"""

from __future__ import annotations

import random

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core import cache as cache_module
from ctx_integrations.engine.core.decoding import IncrementalText, StopCriteria
from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.engine.core.prepared import PreparedTexts
from tests.helpers import embedded_tokenizer, tiny_loaded
from tests.mode_cases import every_mode, small_options

DOCS = ["Marrowgate is the capital of Veloria and lies on the river Ast.",
        "The mayor of Marrowgate is Ilsa Brenn, elected in 2019.",
        "The Lantern Fair is held every October; smoked eel with plums is served there.",
        "Quillby is a fishing town north of Marrowgate whose harbour master is Aled Venn."]
QUESTION = "Who is the mayor of Marrowgate?"
# Cache keys a warm request hashes: IPPD and RAPID the one entry of their concatenated context (a cache of its own);
# every other mode none (per-document modes look their documents up by the keys prepared before, concat and
# truncated look nothing up), a new mode included unless it says otherwise here.
WARM_KEYS = {"ippd": 1, "rapid": 1}


class Counting:
    """Counts ``PromptLayout._encode`` calls by text, and cache keys hashed, while active."""

    def __init__(self, monkeypatch):
        self.encoded: list[str] = []
        self.keys = 0
        encode, key = PromptLayout._encode, cache_module._int64_bytes

        def counted_encode(layout, text, **kwargs):
            self.encoded.append(text)
            return encode(layout, text, **kwargs)

        def counted_key(ids):
            self.keys += 1
            return key(ids)

        monkeypatch.setattr(PromptLayout, "_encode", counted_encode)
        monkeypatch.setattr(cache_module, "_int64_bytes", counted_key)

    def reset(self) -> None:
        self.encoded, self.keys = [], 0

    def documents_encoded(self) -> list[str]:
        return [text for text in self.encoded if any(doc.strip() in text for doc in DOCS)]


@pytest.fixture
def engine() -> Engine:
    return Engine(tiny_loaded("llama", seed=1))


@every_mode("reuses_prepared_texts")
def test_a_warm_request_tokenises_no_document_and_hashes_no_key(engine, monkeypatch, mode):
    options = small_options(mode)
    engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=3, **options)  # cold: prepared and remembered
    counting = Counting(monkeypatch)
    answer = engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=3, **options)
    assert counting.documents_encoded() == []  # the question suffix is tokenised (once), no document
    assert len([text for text in counting.encoded if QUESTION in text]) == 1
    assert counting.keys == WARM_KEYS.get(mode, 0)
    layout = engine.layout
    expected = len(layout.prefix_ids) + sum(len(layout.context_ids(d)) for d in DOCS) + len(layout.suffix_ids(QUESTION))
    assert answer.prompt_tokens == expected == answer.timings["prompt_tokens"]


def test_a_cold_request_tokenises_and_keys_each_document_once(engine, monkeypatch):
    counting = Counting(monkeypatch)
    engine.generate(QUESTION, DOCS, mode="pced", max_new_tokens=3)
    assert sorted(counting.documents_encoded()) == sorted(engine.layout.context_text(d) for d in DOCS)
    assert counting.keys == len(DOCS) + 1  # each document once, and the shared prefix (once per layout)
    counting.reset()
    engine.generate("Where is Quillby?", DOCS[:2], mode="pced", max_new_tokens=3)
    assert counting.keys == 0 and counting.documents_encoded() == []


def test_the_memo_is_bounded_by_tokens_and_drops_the_least_recently_used(engine):
    texts = PreparedTexts(engine.layout, engine.store, max_tokens=60)
    sizes = {d: len(engine.layout.context_ids(d)) for d in DOCS}
    assert sum(sizes.values()) > 60 and max(sizes.values()) < 30
    first = texts.prepare(DOCS[0])
    assert texts.prepare(DOCS[0]) is first  # remembered
    for doc in DOCS[1:]:
        texts.prepare(doc)
    assert texts._tokens <= 60 and DOCS[0] not in texts._memo  # the oldest went first
    assert texts.prepare(DOCS[0]) == first  # computed again, the same
    assert texts.prepare(DOCS[0]).key == engine.store.entry_key(engine.layout, first.ids)


def _full(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_incremental_text_equals_decoding_everything_and_decodes_a_bounded_window_per_token():
    tokenizer = embedded_tokenizer()
    rng = random.Random(0)
    text = "Ünïcödé — naïve café 東京 🙂 déjà vu, the quick brown fox: 3.14159 <|im_end|> done."
    base = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = [0]
    decode = tokenizer.decode

    def counted(ids, *args, **kwargs):
        decoded[0] += len(ids)
        return decode(ids, *args, **kwargs)

    for trial in range(20):
        ids = base + [rng.randrange(len(tokenizer)) for _ in range(40)] if trial else base * 8
        pieces = IncrementalText(tokenizer)
        tokenizer.decode = counted
        decoded[0] = 0
        try:
            for token in ids:
                pieces.push(token)
        finally:
            tokenizer.decode = decode
        assert pieces.text == _full(tokenizer, ids)
        assert _full(tokenizer, ids).startswith(pieces.safe_text)
        # a window of a few ids per token, whatever the answer's length (decoding everything: ~len(ids) / 2)
        assert decoded[0] / len(ids) < 8, decoded[0] / len(ids)


def test_a_stop_string_split_across_tokens_is_found_and_cut():
    stop = StopCriteria(frozenset(), 50, ("STOP here",))
    text = "abc STOP here and more"
    for checked in range(len(text) + 1):
        # whatever was looked at before, a stop string ending after `checked` is found at its start
        found = stop.first_stop(text, checked)
        assert found == (4 if checked <= 4 + len("STOP here") - 1 else None) or found == 4
    assert stop.cut(text) == ("abc ", True)
    assert StopCriteria(frozenset(), 5, ()).first_stop(text, 0) is None


def test_the_answer_streams_exactly_its_text_piece_by_piece(engine):
    pieces: list[str] = []
    answer = engine.generate(QUESTION, DOCS, mode="pced", max_new_tokens=12, on_token=pieces.append)
    assert "".join(pieces) == answer.text == _full(engine.loaded.tokenizer, answer.token_ids)


def test_a_chat_answer_counts_its_conversation(engine):
    messages = [{"role": "user", "content": "Say hello."}]
    answer = engine.chat(messages, max_new_tokens=3)
    from ctx_integrations.engine.core.chat import conversation_ids

    assert answer.prompt_tokens == len(conversation_ids(engine.layout, messages)) > 0


@pytest.mark.parametrize("mode", ["pced", "concat"])
def test_prepared_requests_answer_as_before_in_fp32(mode):
    """The prepared path is the same maths: an fp32 answer equals transformers' greedy generate for one document."""
    from tests.helpers import greedy_reference

    engine = Engine(tiny_loaded("llama", seed=3, position_sensitive=True, dtype=torch.float32))
    layout = engine.layout
    prompt = layout.prefix_ids + layout.context_ids(DOCS[1]) + layout.suffix_ids(QUESTION)
    options = dict(beta=0.0, gamma=0.0) if mode == "pced" else {}
    assert engine.generate(QUESTION, [DOCS[1]], mode=mode, max_new_tokens=8, **options).token_ids == \
        greedy_reference(engine.loaded, prompt, 8)


def test_an_async_caller_never_tokenises_a_document_on_its_event_loop(engine, monkeypatch):
    """agenerate / astream / agenerate_many prepare their documents on the scheduler's loader thread (a server's event
    loop must keep answering while a cold request's 64 x 2048 tokens are tokenised); generate in the caller's."""
    import asyncio
    import threading

    threads: list[str] = []
    encode = PromptLayout._encode

    def recording(layout, text, **kwargs):
        if any(doc.strip() in text for doc in DOCS):
            threads.append(threading.current_thread().name)
        return encode(layout, text, **kwargs)

    monkeypatch.setattr(PromptLayout, "_encode", recording)

    async def calls():
        loop_thread = threading.current_thread().name
        await engine.agenerate(QUESTION, DOCS[:1], max_new_tokens=2)
        async for _ in engine.astream(QUESTION, DOCS[1:2], max_new_tokens=2):
            pass
        await engine.agenerate_many([QUESTION, "Where?"], DOCS[2:], mode="concat", max_new_tokens=2)
        return loop_thread

    loop_thread = asyncio.run(calls())
    assert len(threads) == 4 and loop_thread not in threads  # 1 + 1 + 2 documents (each once), none on the loop
    threads.clear()
    engine.texts.clear()
    engine.generate(QUESTION, DOCS[:1], max_new_tokens=2)
    assert threads == [threading.current_thread().name]


class FakeLayout:
    """A layout whose context tokens are one id per word (counted), for the memo's unit tests."""

    def __init__(self):
        self.computed: list[str] = []
        self.during: dict[str, object] = {}  # text -> called while it is being tokenised (another thread's turn)

    def context_ids(self, text: str) -> list[int]:
        self.computed.append(text)
        if text in self.during:
            self.during.pop(text)()
        return [len(word) for word in text.split()]


class FakeStore:
    def entry_key(self, layout, token_ids, kind: str = "doc") -> str:
        return f"key of {list(token_ids)}"


def test_the_memo_keeps_texts_up_to_its_token_bound_least_recently_used_first_out():
    layout = FakeLayout()
    memo = PreparedTexts(layout, FakeStore(), max_tokens=6)
    a, b = memo.prepare("a b"), memo.prepare("c d e")  # 2 + 3 tokens
    assert (a.ids, a.key, a.tokens) == ((1, 1), "key of [1, 1]", 2) and memo._tokens == 5
    assert memo.prepare("a b") is a  # a is now the most recently used: b goes first
    assert memo.prepare("f") and memo._tokens == 6  # exactly the bound: nothing dropped
    g = memo.prepare("g h")
    assert list(memo._memo) == ["a b", "f", "g h"] and memo._tokens == 5
    assert layout.computed == ["a b", "c d e", "f", "g h"]
    assert memo.prepare_all(["g h", "c d e"]) == [g, b]  # in order: g h remembered, c d e again (a b goes)
    assert layout.computed[-1] == "c d e" and list(memo._memo) == ["f", "g h", "c d e"] and memo._tokens == 6
    memo.clear()
    assert (list(memo._memo), memo._tokens) == ([], 0)
    memo.prepare("a b")
    assert layout.computed[-1] == "a b" and memo._tokens == 2


def test_a_text_over_the_whole_bound_is_prepared_but_not_remembered_and_a_fitting_one_is():
    layout = FakeLayout()
    memo = PreparedTexts(layout, FakeStore(), max_tokens=3)
    memo.prepare("a")
    assert memo.prepare("b c d e").tokens == 4 and list(memo._memo) == ["a"] and memo._tokens == 1
    assert memo.prepare("f g h").tokens == 3 and list(memo._memo) == ["f g h"] and memo._tokens == 3
    assert PreparedTexts(layout, FakeStore()).max_tokens == 1 << 19


def test_a_text_prepared_twice_at_once_is_remembered_and_counted_once():
    layout = FakeLayout()
    memo = PreparedTexts(layout, FakeStore(), max_tokens=10)
    inner = []
    layout.during["a b c"] = lambda: inner.append(memo.prepare("a b c"))  # another caller finishes first
    outer = memo.prepare("a b c")
    assert outer == inner[0] and memo._tokens == 3 and list(memo._memo) == ["a b c"]
    assert memo._memo["a b c"] is inner[0]
