"""IPPD on a FlexAttention block mask (``modes/ippd_flex.py``) against the eager boolean mask, on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctx_integrations import Engine
from ctx_integrations.engine.modes.flex import run_flex
from ctx_integrations.engine.modes.ippd import PAD_ID, PAD_POSITION, visibility
from ctx_integrations.engine.modes.ippd_flex import ippd_block_mask
from tests.helpers import tiny_loaded

DOCS = ["Marrowgate is the capital of Veloria and lies on the river Ast.",
        "The mayor of Marrowgate is Ilsa Brenn, elected in 2019."]
OTHER_DOCS = ["The Lantern Fair is held every October in Marrowgate; smoked eel with plums is served there."]
QUESTIONS = ["Who is the mayor?", "On which river does the capital lie?", "When was the mayor elected?",
             "What is the capital?"]


def random_layout(generator: torch.Generator, rows: int, keys: int, queries: int) -> tuple[torch.Tensor, ...]:
    """Virtual positions and ids of a stack-like batch: prefix, two contexts, three questions, padding at the end."""
    k_pos, k_ctx, k_qid = (torch.empty(rows, keys, dtype=torch.long) for _ in range(3))
    for b in range(rows):
        pieces = torch.randint(0, 6, (keys,), generator=generator).sort().values  # 0 prefix, 1-2 ctx, 3-5 questions
        pieces[: 3] = 0
        k_ctx[b] = torch.where(pieces == 0, 0, torch.where(pieces <= 2, pieces, 1 + (pieces % 2)))
        k_qid[b] = torch.where(pieces >= 3, pieces - 2, 0)
        k_pos[b] = torch.arange(keys)
        pad = int(torch.randint(0, keys // 4, (1,), generator=generator))
        if pad:
            k_pos[b, -pad:], k_ctx[b, -pad:], k_qid[b, -pad:] = PAD_POSITION, PAD_ID, PAD_ID
    q_cols = torch.stack([torch.randperm(keys, generator=generator)[:queries].sort().values for _ in range(rows)])
    gather = lambda t: t.gather(1, q_cols)  # noqa: E731
    return gather(k_pos), gather(k_ctx), gather(k_qid), k_pos, k_ctx, k_qid


def test_block_mask_attention_equals_attention_under_the_boolean_mask():
    # A mask_mod that dropped a clause of the conjunction (e.g. the "k_ctx == 0" shared prefix, or the question id
    # test), compared positions the wrong way, or indexed another row's ids would change which keys are averaged.
    generator = torch.Generator().manual_seed(0)
    for rows, keys, queries in ((1, 40, 7), (3, 300, 20), (2, 200, 1)):
        layout = random_layout(generator, rows, keys, queries)
        dense = visibility(*layout)  # [B, 1, Q, K]
        assert dense.any(-1).all() and not dense.all()  # every query sees something, and not everything
        query = torch.randn(rows, 4, queries, 16, generator=generator)
        key, value = torch.randn(2, rows, 2, keys, 16, generator=generator)
        expected = F.scaled_dot_product_attention(query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1),
                                                  attn_mask=dense)
        out, _ = run_flex(query, key, value, ippd_block_mask(*layout), 16 ** -0.5)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_generate_many_with_the_flex_kernel_answers_like_eager(family):
    # Whole IPPD decode, two contexts and two stacks in one batch: the block mask must follow the growing key set
    # step by step; a mask built from stale ids, or a model left on the flex attention afterwards, would show.
    # Mistral passes its sliding window (4096) to every attention call: refusing it outright refused every request.
    loaded = tiny_loaded(family, seed=3)
    engine = Engine(loaded)
    documents = [DOCS, OTHER_DOCS, DOCS, OTHER_DOCS]
    options = dict(max_new_tokens=8, max_stack_tokens=220)
    eager = engine.generate_many(QUESTIONS, documents, attention_kernel="eager", **options)
    flex = engine.generate_many(QUESTIONS, documents, attention_kernel="flex", **options)
    assert eager[0].timings["stacks"] >= 2
    assert [a.token_ids for a in flex] == [a.token_ids for a in eager]
    assert len({tuple(a.token_ids) for a in eager}) > 1
    assert loaded.model.config._attn_implementation == "sdpa"
