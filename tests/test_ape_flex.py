"""APE on FlexAttention (``modes/ape_flex.py``) against the eager reference ``ape_attention``, on CPU.

On CPU FlexAttention runs its unfused reference implementation, so these tests check the block
masks, the scales and the log-sum-exp merge; the fused CUDA kernel is checked in tests/test_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ctx_integrations import Engine
from ctx_integrations.engine.core.flex import resolve_kernel
from ctx_integrations.engine.modes.ape import ApeLayout, ape_attention
from ctx_integrations.engine.modes.ape_flex import ape_flex_attention
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import tiny_loaded

DOCS = ["Marrowgate is the capital of Veloria and lies on the river Ast.",
        "The mayor of Marrowgate is Ilsa Brenn, elected in 2019.",
        "Veloria's national dish is smoked eel with plums, served at every festival."]


# (heads, kv_heads, q_len, prefix, context, earlier): "earlier" = answer tokens already in the cache between the
# documents and the queries (a decode step), which the queries must see; prefix 0 = no prefix at all.
@pytest.mark.parametrize(("heads", "kv_heads", "q_len", "prefix", "context", "earlier"),
                         [(4, 2, 1, 5, 11, 0), (4, 2, 5, 5, 11, 3), (6, 3, 3, 7, 140, 2), (2, 2, 4, 0, 9, 0),
                          (4, 1, 1, 130, 300, 20)])
def test_flex_equals_the_eager_attention(heads, kv_heads, q_len, prefix, context, earlier):
    # A wrong block mask (documents leaking into O, a causal off-by-one, earlier answer tokens hidden), a scale
    # applied to the wrong set, or an LSE in log2 instead of nats would each move the output.
    generator = torch.Generator().manual_seed(heads * 100 + q_len + context)
    dim, keys = 16, prefix + context + earlier + q_len
    query = torch.randn(2, heads, q_len, dim, generator=generator)
    key = torch.randn(2, kv_heads, keys, dim, generator=generator)
    value = torch.randn(2, kv_heads, keys, dim, generator=generator)
    for temperature, scale in ((1.0, 1.0), (0.6, 0.9), (0.3, 0.5)):
        layout = ApeLayout(prefix, prefix + context, temperature, scale)
        expected, _ = ape_attention(nn.Module(), query, key, value, None, scaling=dim ** -0.5, ape_layout=layout)
        out, weights = ape_flex_attention(nn.Module(), query, key, value, None, scaling=dim ** -0.5, ape_layout=layout)
        assert weights is None and out.shape == expected.shape == (2, q_len, heads, dim)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_flex_refuses_what_eager_refuses():
    query, key = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(InvalidOptionError, match="only valid inside mode='ape'"):
        ape_flex_attention(nn.Module(), query, key, key, None)
    with pytest.raises(InvalidOptionError, match="soft-capping"):
        ape_flex_attention(nn.Module(), query, key, key, None, ape_layout=ApeLayout(1, 4, 1.0, 1.0), softcap=30.0)


def test_auto_picks_flex_only_on_cuda_and_a_typo_is_refused():
    assert resolve_kernel("auto", torch.device("cuda")) == "flex"
    assert resolve_kernel("auto", torch.device("cpu")) == "eager"
    assert resolve_kernel("flex", torch.device("cpu")) == "flex"
    with pytest.raises(InvalidOptionError, match="attention_kernel must be one of auto, eager, flex"):
        resolve_kernel("flash", torch.device("cpu"))


def test_ape_mode_with_the_flex_kernel_answers_like_eager():
    # Through the whole engine (prefill over the question, then decode steps with a growing key set): a dispatch
    # that ignored the option, or a mask cached across different key lengths, would change the answer.
    loaded = tiny_loaded()
    engine = Engine(loaded)
    options = dict(max_new_tokens=6, attention_temperature=0.7, scale=0.8)
    # attribution=False: the eager kernel would otherwise put attention-mass shares in the trace's scores
    eager = engine.generate("Who is the mayor?", DOCS, mode="ape", attention_kernel="eager", attribution=False,
                            **options)
    flex = engine.generate("Who is the mayor?", DOCS, mode="ape", attention_kernel="flex", **options)
    assert flex.token_ids == eager.token_ids and len(eager.token_ids) == 6
    assert [s.score for s in flex.trace] == pytest.approx([s.score for s in eager.trace], abs=1e-4)
    assert loaded.model.config._attn_implementation not in ("ctx_ape", "ctx_ape_flex")
    with pytest.raises(InvalidOptionError, match="attention_kernel"):
        engine.generate("Who?", DOCS, mode="ape", attention_kernel="flash")


def test_older_torch_falls_back(monkeypatch):
    # torch < 2.9 has no AuxRequest (the LSE comes with return_lse=True); torch < 2.5 has no FlexAttention at all, so
    # "auto" must stay eager on CUDA and "flex" must say why it cannot run, instead of an ImportError at import time.
    from ctx_integrations.engine.core import flex

    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, 3, 16, generator=generator)
    key, value = torch.randn(2, 1, 2, 40, 16, generator=generator)
    layout = ApeLayout(5, 30, 0.7, 0.9)
    expected, _ = ape_flex_attention(nn.Module(), query, key, value, None, ape_layout=layout)
    monkeypatch.setattr(flex, "AuxRequest", None)
    with pytest.warns(FutureWarning, match="return_lse"):
        legacy, _ = ape_flex_attention(nn.Module(), query, key, value, None, ape_layout=layout)
    torch.testing.assert_close(legacy, expected)
    monkeypatch.setattr(flex, "flex_attention", None)
    assert resolve_kernel("auto", torch.device("cuda")) == "eager"
    with pytest.raises(InvalidOptionError, match="needs FlexAttention"):
        resolve_kernel("flex", torch.device("cpu"))
