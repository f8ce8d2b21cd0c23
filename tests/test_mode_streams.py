"""Every mode streams its final answer and answers beside other requests as it answers alone (fp32).

Parametrised over every available mode (the test plugin's ``cad`` included, :func:`tests.mode_cases.every_mode`):
three requests, each with its own question, documents and scores, are answered alone, then together, one of them
streamed. Bugs caught: a streamed piece lost, doubled or detokenised differently from the final text (a piece cut
inside a multi-byte character or a word piece, a stop string's held-back text never flushed), a row of one request
reading another's columns or documents, a mode's state shared across requests (one rule object for every
request), a per-step rule that depends on the batch (its weights normalised over every row of the step, not its
own). fp32 with the batch-invariant kernels, which that equality needs on the CPU (docs/scheduler.md).
"""

from __future__ import annotations

import asyncio

import pytest

from ctx_integrations import Engine
from tests.helpers import tiny_loaded
from tests.mode_cases import every_mode, small_options
from tests.test_scheduler import DOCS

TOKENS = 5
REQUESTS = [dict(query="Who is the mayor of Marrowgate?", documents=DOCS[:3], scores=[0.9, 0.6, 0.3]),
            dict(query="What is the secret code of the vault?", documents=DOCS[2:], scores=[0.4, 0.5, 0.8]),
            dict(query="Where is Quillby?", documents=DOCS[1:4], scores=[0.7, 0.7, 0.2])]


@pytest.fixture(scope="module")
def engine() -> Engine:
    """A tiny random Llama in fp32 that never ends an answer early (no end-of-sequence token), so every answer has
    its :data:`TOKENS` tokens to differ in."""
    return Engine(tiny_loaded("llama", seed=2, eos_token_id=None), batch_invariant=True)


@every_mode()
def test_a_streamed_and_a_concurrent_answer_equal_the_answer_alone(engine, mode):
    settings = dict(mode=mode, max_new_tokens=TOKENS, **small_options(mode))
    alone = [engine.generate(**request, **settings) for request in REQUESTS]
    assert all(len(answer.token_ids) == TOKENS for answer in alone)
    assert len({tuple(answer.token_ids) for answer in alone}) > 1  # the requests' answers differ: a mix-up shows

    async def together():
        stream = engine.astream(**REQUESTS[0], **settings)

        async def read() -> list[str]:
            return [piece async for piece in stream]

        pieces, *answers = await asyncio.gather(read(), *(engine.agenerate(**r, **settings) for r in REQUESTS[1:]))
        return pieces, [stream.answer, *answers]

    pieces, answers = asyncio.run(together())
    assert "".join(pieces) == alone[0].text and len(pieces) > 1
    assert [a.token_ids for a in answers] == [a.token_ids for a in alone]
    assert [a.text for a in answers] == [a.text for a in alone]
