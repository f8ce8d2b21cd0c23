"""Per-row attention rules in the shared batch (``row_attention.py``) and APE's row rule.

Bugs these catch: a rule applied to the wrong row, rows without a rule computed differently from the
model's own attention, APE's row rule taking the prefix or the padding into its document set, its
temperature and scale swapped, its heads grouped wrongly, its attention mass attributed to the wrong
document or the wrong query.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ctx_integrations.engine.core.row_attention import row_attention
from ctx_integrations.engine.modes.ape import ApeLayout, ApeRowAttention, ape_attention
from ctx_integrations.errors import InvalidOptionError

HEADS, KV_HEADS, DIM = 4, 2, 8
PREFIX, ENDS, Q_LEN, PADDING = 3, (4, 9), 3, 5  # prefix | doc 1 (4) | doc 2 (5) | queries | padding columns


def _inputs(seed: int, rows: int = 2):
    generator = torch.Generator().manual_seed(seed)
    keys = PREFIX + ENDS[-1] + Q_LEN + PADDING
    query = torch.randn(rows, HEADS, Q_LEN, DIM, generator=generator)
    key, value = torch.randn(2, rows, KV_HEADS, keys, DIM, generator=generator)
    return query, key, value, keys


def _ape_row_mask(keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's mask for an APE row (query i sees the prefix, every document, and queries <= i; never the
    padding columns after them) and its document marks."""
    visible = torch.zeros(1, 1, Q_LEN, keys, dtype=torch.bool)
    own = PREFIX + ENDS[-1]
    for i in range(Q_LEN):
        visible[0, 0, i, : own + i + 1] = True
    documents = torch.zeros(1, keys, dtype=torch.long)
    documents[0, PREFIX:PREFIX + ENDS[0]] = 1
    documents[0, PREFIX + ENDS[0]:PREFIX + ENDS[1]] = 2
    return visible, documents


def test_rows_without_a_rule_get_the_models_own_attention_and_a_rule_row_its_rule():
    query, key, value, keys = _inputs(0, rows=3)
    mask = torch.rand(3, 1, Q_LEN, keys, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True  # every query sees something
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = HEADS // KV_HEADS, False  # what transformers' attention reads
    base, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    marker = torch.full((1, Q_LEN, HEADS, DIM), 7.0)
    documents = torch.arange(3 * keys).reshape(3, keys)
    seen = []

    def rule(q, k, v, visible, marks, scaling, last_query):
        seen.append((torch.equal(q, query[1:2]), torch.equal(k, key[1:2]), torch.equal(v, value[1:2]),
                     torch.equal(visible, mask[1:2]), torch.equal(marks, documents[1:2]), scaling, last_query))
        return marker

    out, _ = row_attention(module, query, key, value, mask, scaling=0.3, row_base="sdpa",
                           row_rules=[(1, rule, 2)], row_documents=documents)
    assert torch.equal(out[0], base[0]) and torch.equal(out[2], base[2]) and torch.equal(out[1], marker[0])
    assert seen == [(True, True, True, True, True, 0.3, 2)]
    plain, _ = row_attention(module, query, key, value, mask, scaling=0.3, row_base="sdpa", row_rules=(),
                             row_documents=documents)
    assert torch.equal(plain, base)
    row_attention(module, query, key, value, mask, scaling=None, row_base="sdpa", row_rules=[(1, rule, 2)],
                  row_documents=documents)
    assert seen[-1][-2] == DIM ** -0.5  # a model that passes no scaling: 1 / sqrt(d), as its own attention


def test_a_model_on_eager_attention_keeps_its_own_eager_function():
    from transformers.models.llama import modeling_llama

    from tests.helpers import tiny_loaded

    module = tiny_loaded("llama").model.model.layers[0].self_attn
    query, key, value, keys = _inputs(4)
    additive = torch.zeros(2, 1, Q_LEN, keys)  # eager attention's mask is added to the scores
    expected, _ = modeling_llama.eager_attention_forward(module, query, key, value, additive, scaling=0.3)
    out, _ = row_attention(module, query, key, value, additive, scaling=0.3, row_base="eager", row_rules=(),
                           row_documents=torch.zeros(2, keys, dtype=torch.long))
    assert torch.equal(out, expected)


def test_apes_row_rule_equals_its_sequence_attention_on_the_same_keys_padding_ignored():
    # ape_attention reads one APE sequence by column ranges (no padding); the row rule reads the batch's mask
    # and document marks. On the same keys, with padding columns after the queries, they must agree.
    query, key, value, keys = _inputs(2, rows=1)
    visible, documents = _ape_row_mask(keys)
    real = PREFIX + ENDS[-1] + Q_LEN
    layout = ApeLayout(PREFIX, PREFIX + ENDS[-1], 0.6, 0.8, document_ends=ENDS, masses=[])
    expected, _ = ape_attention(nn.Module(), query, key[:, :, :real], value[:, :, :real], None, scaling=0.35,
                                ape_layout=layout)
    rule = ApeRowAttention(0.6, 0.8, len(ENDS), masses=[])
    out = rule(query, key, value, visible, documents, 0.35, Q_LEN - 1)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rule.masses[0], layout.masses[0], atol=1e-6, rtol=1e-5)


def _reference_with_prior(query, key, value, temperature, scale, scaling, bias):
    """APE's merge with the retrieval prior, in float64, one head and one query at a time: document k's keys get
    ``bias[k]`` added to their tempered scores (docs/ape.md), the prefix and the queries' own keys none."""
    real = PREFIX + ENDS[-1] + Q_LEN
    column_bias = torch.tensor([bias[0]] * ENDS[0] + [bias[1]] * (ENDS[1] - ENDS[0]), dtype=torch.float64)
    out = torch.zeros(1, Q_LEN, HEADS, DIM, dtype=torch.float64)
    for h in range(HEADS):
        k, v = key[0, h // (HEADS // KV_HEADS), :real].double(), value[0, h // (HEADS // KV_HEADS), :real].double()
        for i in range(Q_LEN):
            s = k @ query[0, h, i].double() * scaling
            own = PREFIX + ENDS[-1] + i
            context = s[PREFIX:PREFIX + ENDS[-1]] / temperature + column_bias
            outside = torch.cat([s[:PREFIX], s[PREFIX + ENDS[-1]:own + 1]])
            v_outside = torch.cat([v[:PREFIX], v[PREFIX + ENDS[-1]:own + 1]])
            w = torch.softmax(torch.stack([scale * temperature * torch.logsumexp(context, 0),
                                           torch.logsumexp(outside, 0)]), 0)
            out[0, i, h] = (w[0] * torch.softmax(context, 0) @ v[PREFIX:PREFIX + ENDS[-1]]
                            + w[1] * torch.softmax(outside, 0) @ v_outside)
    return out


def test_the_retrieval_prior_lowers_a_documents_attention_by_its_bias_in_the_row_rule_and_the_reference():
    # The prior (gamma * (log p_k - max log p) <= 0) is added to document k's tempered scores: a sign flip would
    # raise the low-ranked document's attention, a bias on the prefix or the wrong document would move others.
    query, key, value, keys = _inputs(4, rows=1)
    visible, documents = _ape_row_mask(keys)
    real, bias = PREFIX + ENDS[-1] + Q_LEN, (0.0, -2.5)
    expected = _reference_with_prior(query, key, value, 0.7, 0.9, 0.35, bias)
    rule = ApeRowAttention(0.7, 0.9, len(ENDS), masses=[], document_bias=bias)
    out = rule(query, key, value, visible, documents, 0.35, Q_LEN - 1)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    layout = ApeLayout(PREFIX, PREFIX + ENDS[-1], 0.7, 0.9, document_ends=ENDS, masses=[], document_bias=bias)
    sequence, _ = ape_attention(nn.Module(), query, key[:, :, :real], value[:, :, :real], None, scaling=0.35,
                                ape_layout=layout)
    torch.testing.assert_close(sequence.double(), expected, atol=1e-5, rtol=1e-5)
    plain = ApeRowAttention(0.7, 0.9, len(ENDS), masses=[])
    plain(query, key, value, visible, documents, 0.35, Q_LEN - 1)
    assert rule.masses[0][1] < plain.masses[0][1]  # the second document, biased down, holds less of the attention
    torch.testing.assert_close(rule.masses[0], layout.masses[0], atol=1e-6, rtol=1e-5)


def test_apes_row_rule_with_swapped_knobs_or_another_last_query_differs():
    query, key, value, keys = _inputs(3, rows=1)
    visible, documents = _ape_row_mask(keys)
    out = ApeRowAttention(0.6, 0.8, 2)(query, key, value, visible, documents, 0.35, 2)
    swapped = ApeRowAttention(0.8, 0.6, 2)(query, key, value, visible, documents, 0.35, 2)
    assert torch.isfinite(out).all() and not torch.allclose(out, swapped)
    last, first = [], []
    ApeRowAttention(0.6, 0.8, 2, last)(query, key, value, visible, documents, 0.35, 2)
    ApeRowAttention(0.6, 0.8, 2, first)(query, key, value, visible, documents, 0.35, 0)
    assert last[0].shape == (2,) and 0 < float(last[0].sum()) <= 1  # the documents' share of that query
    assert not torch.allclose(last[0], first[0])


def test_ape_refuses_soft_capping_and_windows_narrower_than_its_keys_whatever_the_config_says_it_by():
    from types import SimpleNamespace as Config

    from ctx_integrations.engine.modes.ape import check_model

    window = r"^APE does not support sliding-window attention over 9 keys \(window 8\): .*max_new_tokens=3 "
    check_model(Config(), 10**6, 3)  # Llama: neither
    with pytest.raises(InvalidOptionError, match=r"^APE does not support attention logit soft-capping \(e\.g\. Gemma"):
        check_model(Config(attn_logit_softcapping=50.0), 1, 3)  # Gemma 2, at any length
    check_model(Config(attn_logit_softcapping=None, sliding_window=None), 10**6, 3)
    for config in (Config(sliding_window=8),  # Mistral: a window and no switch
                   Config(sliding_window=8, use_sliding_window=True),
                   Config(sliding_window=8, layer_types=["full_attention", "sliding_attention"])):  # mixed
        check_model(config, 8, 3)  # a window as wide as the keys hides none of them
        with pytest.raises(InvalidOptionError, match=window):
            check_model(config, 9, 3)
    check_model(Config(sliding_window=8, use_sliding_window=False), 10**6, 3)  # Qwen2 without layer types
    check_model(Config(sliding_window=8, layer_types=["full_attention"] * 2), 10**6, 3)
    nested = Config(get_text_config=lambda: Config(attn_logit_softcapping=30.0))  # a multimodal model's text config
    with pytest.raises(InvalidOptionError, match="soft-capping"):
        check_model(nested, 1, 3)


def test_apes_row_rule_groups_heads_for_any_kv_head_count():
    # one and four KV heads (MQA, and no grouping): the row rule must still equal the sequence attention
    for kv_heads in (1, 4):
        generator = torch.Generator().manual_seed(kv_heads)
        keys = PREFIX + ENDS[-1] + Q_LEN + PADDING
        query = torch.randn(1, HEADS, Q_LEN, DIM, generator=generator)
        key, value = torch.randn(2, 1, kv_heads, keys, DIM, generator=generator)
        visible, documents = _ape_row_mask(keys)
        real = PREFIX + ENDS[-1] + Q_LEN
        expected, _ = ape_attention(nn.Module(), query, key[:, :, :real], value[:, :, :real], None, scaling=0.35,
                                    ape_layout=ApeLayout(PREFIX, PREFIX + ENDS[-1], 0.6, 0.8))
        out = ApeRowAttention(0.6, 0.8, len(ENDS))(query, key, value, visible, documents, 0.35, Q_LEN - 1)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_a_prior_for_another_number_of_documents_is_refused_by_count():
    with pytest.raises(InvalidOptionError, match=r"^APE got 1 document biases for 2 documents$"):
        ApeRowAttention(0.7, 0.9, 2, document_bias=(0.0,))
    with pytest.raises(InvalidOptionError, match=r"^APE got 3 document biases for 2 documents$"):
        ApeLayout(PREFIX, PREFIX + ENDS[-1], 0.7, 0.9, document_ends=ENDS, document_bias=(0.0, -1.0, -2.0))
