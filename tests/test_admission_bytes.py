"""Admission by KV bytes with a real (tiny) model.

What a request reserves must cover the KV it really holds (else the budget would not bound memory)
and be no looser than the answer it may still write; a budget that fits one request at a time must
still answer every request exactly as alone. Bugs these catch: a job that forgets its prompt,
prefix or answer budget when counting its tokens, a row counted once instead of per stream, a held
request that never joins, answers changed by waiting.
"""

from __future__ import annotations

import asyncio

import pytest

from ctx_integrations import Engine
from ctx_integrations.engine.core.rows import PAD_POSITION, RowPool
from ctx_integrations.errors import InvalidOptionError, RequestTooLargeError
from tests.helpers import tiny_loaded

DOCS = [
    "Marrowgate is the capital of Veloria and lies on the river Ast.",
    "The mayor of Marrowgate is Ilsa Brenn, elected in 2019. She grew up in the harbour district.",
    "The Lantern Fair is held every October; smoked eel with plums is served there.",
]
NEW = 6


def held_tokens(monkeypatch) -> list[tuple[int, int]]:
    """After every pooled forward: (real KV tokens held in the batch, rows)."""
    seen: list[tuple[int, int]] = []
    forward = RowPool.forward

    def spy(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        seen.append((int((self.positions[:, : self.width] != PAD_POSITION).sum()), self.rows))
        return out

    monkeypatch.setattr(RowPool, "forward", spy)
    return seen


def reserved_tokens(engine: Engine) -> int:
    kv = engine.stats()["kv_bytes"]
    return kv["peak"] // kv["bytes_per_token"]


@pytest.mark.parametrize("mode, options", [("pced", {}), ("concat", {}), ("single", {}),
                                           ("soft_nbce", {"chunk_tokens": 8}), ("nbce", {})])
def test_a_request_reserves_exactly_what_its_rows_can_hold(monkeypatch, mode, options):
    engine = Engine(tiny_loaded("llama", seed=5))
    seen = held_tokens(monkeypatch)
    answer = engine.generate("Who is the mayor?", DOCS, mode=mode, max_new_tokens=NEW, **options)
    assert len(answer.token_ids) == NEW  # ran to its budget (a random model does not stop early)
    held, rows = seen[-1]  # after the last forward: every token but the last one fed to each row
    assert reserved_tokens(engine) == held + rows


def test_ippd_reserves_every_stacked_answer(monkeypatch):
    engine = Engine(tiny_loaded("llama", seed=5))
    seen = held_tokens(monkeypatch)
    answers = engine.generate_many(["Who is the mayor?", "When is the fair?"], DOCS[:2], mode="ippd",
                                   max_new_tokens=NEW)
    assert [len(a.token_ids) for a in answers] == [NEW, NEW]
    held, _ = seen[-1]
    assert reserved_tokens(engine) == held + 2  # one last token per question never fed


def test_a_budget_for_one_request_at_a_time_answers_everyone_as_alone():
    solo = Engine(tiny_loaded("llama", seed=5, position_sensitive=True))
    questions = ["Who is the mayor?", "When is the fair?", "What river?"]
    alone = [solo.generate(q, DOCS, max_new_tokens=NEW).token_ids for q in questions]
    one = solo.stats()["kv_bytes"]["peak"]
    tight = Engine(tiny_loaded("llama", seed=5, position_sensitive=True), max_batch_bytes=one + one // 2)

    async def together():
        return await asyncio.gather(*(tight.agenerate(q, DOCS, max_new_tokens=NEW) for q in questions))

    answers = asyncio.run(together())
    assert [a.token_ids for a in answers] == alone
    stats = tight.stats()
    assert stats["kv_bytes"]["peak"] == one  # never two at once
    assert tight.scheduler.stats.held >= 1 and stats["kv_bytes"]["reserved"] == 0


def test_a_request_over_the_batch_budget_fails_alone_with_a_typed_error():
    engine = Engine(tiny_loaded("llama", seed=5), max_batch_bytes=1000)  # a few tokens of this model
    with pytest.raises(RequestTooLargeError, match="max_batch_bytes"):
        engine.generate("Who is the mayor?", DOCS, max_new_tokens=NEW)
    assert engine.stats()["kv_bytes"]["reserved"] == 0


def test_engines_on_one_model_share_one_batch_budget():
    loaded = tiny_loaded("llama", seed=5)
    first = Engine(loaded, max_batch_bytes=1 << 30)
    assert Engine(loaded).scheduler.max_batch_bytes == 1 << 30  # none given: the shared one
    with pytest.raises(InvalidOptionError, match="max_batch_bytes"):
        Engine(loaded, max_batch_bytes=1 << 20)
    with pytest.raises(InvalidOptionError, match="max_batch_bytes"):
        Engine(tiny_loaded("llama", seed=6), max_batch_bytes=0)
    assert first.stats()["kv_bytes"]["budget"] == 1 << 30
