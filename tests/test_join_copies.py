"""What a warm request's join copies: its documents' cached KV laid into rows once, nothing per query head, no
arena copied to a larger capacity (``benchmarks/host_overhead.py`` counts it at the documents' real sizes)."""

from __future__ import annotations

import torch

from benchmarks.host_overhead import _documents, copied_bytes, first_step_copies
from ctx_integrations import Engine
from ctx_integrations.engine.core.registry import kv_bytes_per_token
from tests.helpers import tiny_loaded


def test_the_counter_sees_a_copy_a_view_and_an_in_place_source():
    x = torch.zeros(4, 8)
    _, viewed = copied_bytes(lambda: x.reshape(8, 4))
    _, copied = copied_bytes(lambda: x.t().reshape(32))
    _, written = copied_bytes(lambda: x.index_copy_(0, torch.tensor([1]), torch.ones(1, 8)))
    assert (viewed, copied, written) == (0, 4 * 8 * 4, 8 * 4)


def test_a_warm_requests_first_step_copies_its_documents_kv_about_once():
    # the bytes the join copies, per byte its documents' KV grows (what a fixed cost such as the logits does not
    # blur): the rows' layout (1), the no-context row's padding zeros and the grouped mask (the tiny model's small
    # heads make these large); transformers' SDPA repeating each key/value head per query head (2.4 more on this
    # 4 / 2-head model), zeroing the whole arena (1.2) or copying it to a larger capacity for the question's tokens
    # (1.3) would each fail it
    loaded = tiny_loaded("llama", seed=0, max_position_embeddings=4096)
    loaded.model.generation_config.eos_token_id = []
    engine = Engine(loaded)
    question = "Which record names the lantern quarry?"
    copied, kv = [], []
    for tokens in (512, 1024):
        texts = _documents(4, tokens, seed=tokens)
        engine.generate(question, texts, mode="pced", max_new_tokens=2)  # cold: the caches are computed
        kv.append(sum(p.tokens for p in engine.texts.prepare_all(texts)) * kv_bytes_per_token(loaded))
        copied.append(first_step_copies(engine, question, texts, new_tokens=2))
    slope = (copied[1] - copied[0]) / (kv[1] - kv[0])
    assert 1.0 <= slope <= 2.0, slope
