"""The handle ``Engine.submit`` returns, under every request method: result, await, sync and async streams, cancel.

The first half drives :class:`AnswerHandle` with a stand-in for the scheduler's thread (pieces pushed, the future
settled by hand), so ordering and cancellation are checked without a model; the second half runs the engine.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from ctx_integrations import Engine
from ctx_integrations.engine.core.handle import AnswerHandle, Pieces
from ctx_integrations.engine.core.scheduler import Request, RequestHandle
from ctx_integrations.errors import InvalidOptionError, UnknownModeError
from tests.helpers import tiny_loaded


class _Scheduler:
    def wake(self) -> None:
        pass


class _Queued:
    """A request the test plays the scheduler's thread for: ``push`` pieces, then ``finish`` / ``fail``."""

    def __init__(self, start: bool = True):
        self.request = Request(owner=None)
        self.pieces = Pieces()
        self.queued = 0
        self.handle = AnswerHandle(self._queue, self.pieces, self.request.request_id)
        if start:
            self.handle.start()

    def _queue(self) -> RequestHandle:
        self.queued += 1
        return RequestHandle(self.request, _Scheduler())

    def push(self, *pieces: str) -> None:
        for piece in pieces:
            self.pieces.push(piece)

    def finish(self, answer: str = "the answer") -> None:
        self.request.future.set_result([answer])

    def fail(self, error: BaseException) -> None:
        self.request.future.set_exception(error)


def test_a_reader_that_starts_late_gets_every_piece_then_the_answer():
    queued = _Queued()
    queued.push("a", "b", "c")
    queued.finish()
    stream = queued.handle.stream()
    seen = []
    with pytest.raises(StopIteration) as finished:
        while True:
            seen.append(next(stream))
    assert seen == ["a", "b", "c"] and finished.value.value == "the answer"
    assert queued.handle.result() == "the answer" and queued.handle.done()


def test_the_sync_stream_hands_each_piece_over_before_the_next_is_decoded():
    queued = _Queued()
    read: list[threading.Event] = [threading.Event() for _ in range(3)]

    def scheduler_thread():
        for index, event in enumerate(read):
            queued.push(str(index))
            assert event.wait(5), "the reader did not get the piece while the answer was still being decoded"
        queued.finish()

    thread = threading.Thread(target=scheduler_thread)
    thread.start()
    seen = []
    for piece in queued.handle.stream():
        seen.append(piece)
        read[int(piece)].set()
    thread.join()
    assert seen == ["0", "1", "2"]


def test_the_async_stream_wakes_per_piece_and_keeps_the_answer():
    queued = _Queued()

    async def main():
        stream = queued.handle.astream()
        seen = []
        loop = asyncio.get_running_loop()
        async for piece in stream:
            seen.append(piece)
            if piece == "0":  # pushed from another thread while the loop waits for the next piece
                loop.run_in_executor(None, lambda: (queued.push("1"), queued.finish()))
        return seen, stream.answer

    queued.push("0")
    assert asyncio.run(main()) == (["0", "1"], "the answer")


def test_two_readers_each_get_every_piece():
    queued = _Queued()
    queued.push("x", "y")
    queued.finish()

    async def read_async():
        return [piece async for piece in queued.handle.astream()]

    assert list(queued.handle.stream()) == ["x", "y"]
    assert asyncio.run(read_async()) == ["x", "y"]


def test_await_the_handle():
    queued = _Queued()
    queued.finish("done")

    async def main():
        return await queued.handle

    assert asyncio.run(main()) == "done"


def test_the_request_error_is_raised_after_the_pieces():
    queued = _Queued()
    queued.push("a")
    queued.fail(ValueError("boom"))
    stream = queued.handle.stream()
    assert next(stream) == "a"
    with pytest.raises(ValueError, match="boom"):
        next(stream)

    async def main():
        return [piece async for piece in queued.handle.astream()]

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(main())


def test_leaving_a_sync_stream_early_cancels_the_request():
    queued = _Queued()
    queued.push("a", "b")
    stream = queued.handle.stream()
    assert next(stream) == "a"
    assert not queued.request.cancelled.is_set()
    stream.close()
    assert queued.request.cancelled.is_set()


def test_leaving_an_async_stream_early_cancels_the_request():
    queued = _Queued()
    queued.push("a", "b")

    async def main():
        stream = queued.handle.astream()
        assert await stream.__anext__() == "a"
        await stream.aclose()

    asyncio.run(main())
    assert queued.request.cancelled.is_set()


def test_cancelling_the_awaiting_task_cancels_the_request():
    queued = _Queued()

    async def main():
        task = asyncio.ensure_future(queued.handle.astream().__anext__())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert queued.request.cancelled.is_set()


def test_a_handle_not_started_is_queued_once_when_first_read():
    queued = _Queued(start=False)
    stream = queued.handle.astream()
    assert queued.queued == 0 and not queued.handle.done()
    queued.push("p")
    queued.finish()

    async def main():
        return [piece async for piece in stream], stream.answer

    assert asyncio.run(main()) == (["p"], "the answer")
    assert queued.handle.result() == "the answer"
    assert queued.queued == 1


def test_pieces_after_the_end_are_dropped():
    pieces = Pieces()
    pieces.push("a")
    pieces.close()
    pieces.push("late")  # a request that timed out while its last step ran
    assert pieces.after(0) == (["a"], True)


# -- the engine ----------------------------------------------------------------------------------------------------

QUESTION, DOCS = "What is the code?", ["The code is 4721.", "Paris is in France."]


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_loaded("llama"))


def test_every_way_of_reading_a_submitted_answer_gives_the_same_answer(engine):
    expected = engine.generate(QUESTION, DOCS, max_new_tokens=12)
    handle = engine.submit(QUESTION, DOCS, max_new_tokens=12)
    assert handle.request_id.startswith("req-")
    assert handle.result().token_ids == expected.token_ids

    stream = engine.submit(QUESTION, DOCS, max_new_tokens=12).stream()
    pieces = []
    with pytest.raises(StopIteration) as finished:
        while True:
            pieces.append(next(stream))
    assert "".join(pieces) == expected.text == finished.value.value.text

    async def main():
        awaited = await engine.submit(QUESTION, DOCS, max_new_tokens=12)
        streamed = engine.submit(QUESTION, DOCS, max_new_tokens=12).astream()
        return awaited, "".join([piece async for piece in streamed]), streamed.answer

    awaited, text, answer = asyncio.run(main())
    assert awaited.token_ids == answer.token_ids == expected.token_ids and text == expected.text


def test_a_callback_and_the_handle_both_get_the_pieces(engine):
    called: list[str] = []
    handle = engine.submit(QUESTION, DOCS, max_new_tokens=12, on_token=called.append)
    assert "".join(handle.stream()) == "".join(called) == handle.result().text


def test_engine_stream_closed_early_frees_the_engine(engine):
    assert len(engine.generate(QUESTION, DOCS, max_new_tokens=64).token_ids) > 32  # a long decode to interrupt
    forwards = engine.scheduler.stats.forwards
    stream = engine.stream(QUESTION, DOCS, max_new_tokens=64)
    next(stream)
    stream.close()
    deadline = threading.Event()
    for _ in range(100):  # the scheduler retires the cancelled request at its next step
        if engine.stats()["active_requests"] == 0:
            break
        deadline.wait(0.01)
    assert engine.stats()["active_requests"] == 0
    assert engine.scheduler.stats.forwards - forwards < 8  # decoding stopped instead of running 64 tokens for nobody


def test_a_sync_stream_holds_no_thread_of_its_own(engine):
    engine.generate(QUESTION, DOCS, max_new_tokens=2)  # the scheduler's threads are up
    before = threading.active_count()
    stream = engine.stream(QUESTION, DOCS, max_new_tokens=16)
    next(stream)
    assert threading.active_count() <= before
    assert "".join(stream) is not None


def test_astream_is_checked_now_and_queued_when_iterated(engine):
    with pytest.raises(UnknownModeError):
        engine.astream(QUESTION, DOCS, mode="no-such-mode")
    answered = engine.scheduler.stats.answered
    engine.astream(QUESTION, DOCS, max_new_tokens=4)  # never iterated: never runs
    engine.generate(QUESTION, DOCS, max_new_tokens=2)
    assert engine.scheduler.stats.answered == answered + 1


def test_submit_in_an_event_loop_leaves_tokenising_to_the_loader_thread(engine, monkeypatch):
    threads: list[str] = []
    prepare_all = engine.texts.prepare_all

    def recording(texts):
        threads.append(threading.current_thread().name)
        return prepare_all(texts)

    monkeypatch.setattr(engine.texts, "prepare_all", recording)
    engine.submit(QUESTION, ["A document seen once, from a plain thread."], max_new_tokens=2).result()
    assert threads[0] == threading.current_thread().name

    async def main():
        handle = engine.submit(QUESTION, ["A document seen once, from a loop."], max_new_tokens=2)
        assert threads[1:] == [] or threads[1] != threading.current_thread().name
        return await handle

    threads.clear()
    asyncio.run(main())
    assert threads and threading.current_thread().name not in threads


def test_stream_methods_refuse_a_callback(engine):
    with pytest.raises(InvalidOptionError, match="delivers tokens itself"):
        next(engine.stream(QUESTION, DOCS, on_token=print))
    with pytest.raises(InvalidOptionError, match="delivers tokens itself"):
        engine.astream_chat([{"role": "user", "content": "hi"}], on_token=print)


def test_chat_handles_agree(engine):
    messages = [{"role": "user", "content": "Say something."}]
    expected = engine.chat(messages, max_new_tokens=8)
    assert "".join(engine.stream_chat(messages, max_new_tokens=8)) == expected.text

    async def main():
        achat = await engine.achat(messages, max_new_tokens=8)
        stream = engine.astream_chat(messages, max_new_tokens=8)
        return achat, "".join([piece async for piece in stream]), stream.answer

    achat, text, answer = asyncio.run(main())
    assert achat.token_ids == answer.token_ids == expected.token_ids and text == expected.text


def test_a_reader_waits_for_a_new_piece_instead_of_spinning():
    pieces = Pieces()
    pieces.push("a")
    returned = threading.Event()
    thread = threading.Thread(target=lambda: (pieces.wait_after(1), returned.set()))
    thread.start()
    assert not returned.wait(0.1)  # nothing new yet: still waiting
    pieces.push("b")
    assert returned.wait(5)
    thread.join()


def test_an_async_reader_stops_listening_when_it_leaves_or_finishes():
    left, finished = _Queued(), _Queued()
    left.push("a", "b")
    finished.push("c")
    finished.finish()

    async def main():
        stream = left.handle.astream()
        assert stream.answer is None
        assert await stream.__anext__() == "a"
        await stream.aclose()
        whole = finished.handle.astream()
        return [piece async for piece in whole], whole.answer

    assert asyncio.run(main()) == (["c"], "the answer")
    # no waker of a closed loop stays behind (a later piece would call into that loop from the scheduler's thread)
    assert left.pieces._wakers == [] and finished.pieces._wakers == []
    left.push("late")
