"""One answer as it is decoded (``engine/core/decoding.py``): incremental text, stop strings, EOS, length, streaming.

A byte-level fake tokenizer makes every case exact and fast: ids are byte strings, so a multi-byte character split
across two ids decodes to U+FFFD until its second half arrives, a special id decodes to nothing when skipped, and
(as SentencePiece does) a decoded text's leading space is dropped, so text decoded without the ids before it loses
the space between words. Bugs caught: partial characters emitted, text decoded without its left context, a stop
string found late, early or inside text already looked at, an EOS kept in the answer, an answer one token too long
or too short, a piece streamed twice or empty, time to first token reset by later tokens, NaN scores accepted.
(``tests/test_prepared_requests.py`` checks the same against the embedded model's real tokenizer.)
"""

from __future__ import annotations

import time

import pytest

from ctx_integrations.engine.core.decoding import Emitter, IncrementalText, StopCriteria, TraceStep
from ctx_integrations.errors import InvalidOptionError, NonFiniteScoresError

VOCAB = {1: b" a", 2: b" b", 3: b"\xc3", 4: b"\xa9", 5: b" ST", 6: b"OP", 7: b"x", 8: b"\xe6\x9d", 9: b"\xb1"}
SPECIAL = {0: b"<|end|>"}


class ByteTokenizer:
    def __init__(self):
        self.decoded: list[list[int]] = []  # every window decoded

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.decoded.append(list(ids))
        data = b"".join(VOCAB.get(i, b"") if i not in SPECIAL else (b"" if skip_special_tokens else SPECIAL[i])
                        for i in ids)
        return data.decode("utf-8", errors="replace").removeprefix(" ")


def full(ids: list[int]) -> str:
    return ByteTokenizer().decode(ids, skip_special_tokens=True)


def test_incremental_text_holds_a_split_character_back_and_keeps_the_space_between_words():
    pieces = IncrementalText(ByteTokenizer())
    expected = ["a", "a", "a\u00e9", "a\u00e9 b", "a\u00e9 b", "a\u00e9 b", "a\u00e9 b\u6771", "a\u00e9 bx"]
    shown = ["a", "a\ufffd", "a\u00e9", "a\u00e9 b", "a\u00e9 b", "a\u00e9 b\ufffd", "a\u00e9 b\u6771"]
    ids = [1, 3, 4, 2, 0, 8, 9]
    for count, token in enumerate(ids, start=1):
        assert pieces.push(token) == expected[count - 1] == pieces.safe_text
        assert pieces.text == shown[count - 1]  # the held-back tail too
        assert full(ids[:count]).startswith(pieces.safe_text) and pieces.text == full(ids[:count])
    assert pieces.ids == ids


def test_incremental_text_decodes_a_window_of_the_last_ids_only():
    tokenizer = ByteTokenizer()
    pieces = IncrementalText(tokenizer)
    ids = [1, 2] * 20 + [3, 4, 1]
    for token in ids:
        pieces.push(token)
    assert pieces.text == full(ids) == pieces.safe_text
    assert max(len(window) for window in tokenizer.decoded) <= 3  # the previous id as context, the held one, the new
    assert all(window for window in tokenizer.decoded)  # an empty window is never decoded
    tokenizer.decoded.clear()
    assert pieces.text == full(ids) and tokenizer.decoded == []  # nothing held back: nothing decoded again


def test_the_first_stop_string_is_found_looking_only_where_a_new_one_could_end():
    stop = StopCriteria(frozenset(), 50, ("STOP", "top", "xy"))
    starts = []

    class Text(str):
        def find(self, sub, start=0, *args):
            starts.append(start)
            return super().find(sub, start, *args)

    text = Text("aa top bb STOP")
    assert stop.first_stop(text, 0) == 3 and starts == [0, 0, 0]
    starts.clear()
    assert stop.first_stop(text, 12) == 10 and starts == [9] * 3  # 12 checked: a stop string ending after them
    assert stop.first_stop(text, 13) == 10 and stop.first_stop(text, 14) is None
    assert stop.first_stop(Text("xy"), 1) == 0
    assert stop.cut("aa to STOP xy") == ("aa to ", True) and stop.cut("aa to") == ("aa to", False)
    with pytest.raises(InvalidOptionError, match="stop strings must not be empty"):  # it would never match
        StopCriteria(frozenset(), 50, ("STOP", ""))
    assert StopCriteria(frozenset(), 50, "ab").first_stop("xxab") == 2


def emitter(max_new_tokens: int = 10, stop: tuple[str, ...] = (), started: float | None = None
            ) -> tuple[Emitter, list[str]]:
    streamed: list[str] = []
    return Emitter(ByteTokenizer(), StopCriteria(frozenset({0}), max_new_tokens, stop), streamed.append,
                   started), streamed


def test_an_answer_streams_its_text_piece_by_piece_and_ends_at_its_eos_which_it_does_not_keep():
    answer, streamed = emitter()
    steps = [TraceStep(token, 1, -0.5) for token in (1, 3, 4, 2)]
    assert [answer.push(step) for step in steps] == [False] * 4
    assert streamed == ["a", "\u00e9", " b"]  # nothing while the character was split
    assert answer.push(TraceStep(0, None, -1.0)) is True and (answer.reason, answer.done) == ("eos", True)
    assert answer.push(TraceStep(7, None, -1.0)) is True  # done: nothing more is taken
    result = answer.result()
    assert (result.token_ids, result.text, result.trace, result.finish_reason, result.steps) == (
        [1, 3, 4, 2], "a\u00e9 b", steps, "eos", 4)
    assert streamed == ["a", "\u00e9", " b"] and answer.pieces.ids == [1, 3, 4, 2]


def test_an_answer_stops_before_a_stop_string_split_across_tokens_and_never_streams_part_of_it():
    # OpenAI's API (and vLLM) never stream any of a stop string: text that may still become one is held back, so the
    # pieces streamed always add up to the beginning of the answer's text, and to all of it at the end
    answer, streamed = emitter(stop=("STOP",))
    assert [answer.push(TraceStep(token, None, 0.0)) for token in (1, 5, 6, 1)] == [False, False, True, True]
    result = answer.result()
    assert (result.text, result.finish_reason, result.token_ids) == ("a ", "stop", [1, 5, 6])
    assert streamed == ["a", " "]
    answer, streamed = emitter(stop=("STOP",))
    assert [answer.push(TraceStep(token, None, 0.0)) for token in (1, 5, 2, 2)] == [False] * 4
    assert streamed == ["a", " S", "T "]  # three characters (a stop string's length - 1) held back at every step
    assert answer.result().text == "a ST b b" == "".join(streamed) and streamed[-1] == "b b"  # sent at the end


def test_an_answer_ends_at_exactly_max_new_tokens():
    answer, streamed = emitter(max_new_tokens=3)
    assert [answer.push(TraceStep(token, None, 0.0)) for token in (1, 2, 3)] == [False, False, True]
    result = answer.result()
    assert (result.token_ids, result.finish_reason, result.text) == ([1, 2, 3], "length", "a b\ufffd")
    assert "".join(streamed) == "a b\ufffd"  # the end of the answer sends what was held back


def test_the_time_to_first_token_is_the_first_push_and_nan_scores_are_refused():
    answer, _ = emitter(started=time.perf_counter() - 100)
    assert answer.ttft is None and answer.result().ttft_s == 0.0
    answer.push(TraceStep(1, None, float("inf")))  # an infinite score is a choice the rule made: kept
    first = answer.ttft
    assert 100 <= first < 200
    answer.push(TraceStep(2, None, 0.0))
    assert answer.ttft == first and answer.result().ttft_s == first
    fresh, _ = emitter()
    assert 0 <= fresh.started <= time.perf_counter() and fresh.reason == "length" and not fresh.done
    with pytest.raises(NonFiniteScoresError, match="not finite"):
        fresh.push(TraceStep(1, None, float("nan")))
    assert fresh.trace == []
