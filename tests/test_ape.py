"""APE parity (docs/methods.md#ape): the merge formula, plain attention at T = S = 1, one document = sequential."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import AttentionInterface, LlamaForCausalLM

from ctx_integrations import Answer, Engine
from ctx_integrations.engine.core.model import LoadedModel, model_identity
from ctx_integrations.engine.modes.ape import ApeLayout, DevExample, ape_attention, ape_attention_swapped, search_knobs
from ctx_integrations.errors import DocumentTooLongError, InvalidOptionError
from tests.helpers import greedy_reference, tiny_loaded

DOCS = [
    "Marrowgate is the capital of Veloria and lies on the river Ast.",
    "The mayor of Marrowgate is Ilsa Brenn, elected in 2019. She was born in the northern hills.",
    "Veloria's national dish is smoked eel with plums.",
]
QUESTION = "Who is the mayor of Marrowgate?"


def reference_ape(query, key, value, start, end, temperature, scale, scaling):
    """docs/methods.md's formula in float64, one query head and one query token at a time (no batching tricks)."""
    batch, heads, q_len, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    out = torch.zeros(batch, q_len, heads, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            k, v = key[b, h // (heads // kv_heads)].double(), value[b, h // (heads // kv_heads)].double()
            for i in range(q_len):
                s = k @ query[b, h, i].double() * scaling
                own = keys - q_len + i  # this query's own key column
                context = s[start:end] / temperature
                outside = torch.cat([s[:start], s[end:own + 1]])
                v_outside = torch.cat([v[:start], v[end:own + 1]])
                lse_c, lse_o = torch.logsumexp(context, 0), torch.logsumexp(outside, 0)
                out_c = torch.softmax(context, 0) @ v[start:end]
                out_o = torch.softmax(outside, 0) @ v_outside
                w = torch.softmax(torch.stack([scale * temperature * lse_c, lse_o]), 0)
                out[b, i, h] = w[0] * out_c + w[1] * out_o
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "q_len"), [(4, 2, 1), (4, 2, 5), (6, 3, 3), (2, 2, 4)])
def test_attention_equals_the_reference_formula_for_random_knobs(heads, kv_heads, q_len):
    generator = torch.Generator().manual_seed(heads * 10 + q_len)
    dim, prefix, context = 8, 5, 11
    keys = prefix + context + q_len
    query = torch.randn(2, heads, q_len, dim, generator=generator)
    key = torch.randn(2, kv_heads, keys, dim, generator=generator)
    value = torch.randn(2, kv_heads, keys, dim, generator=generator)
    for _ in range(3):
        temperature, scale = (float(x) for x in torch.rand(2, generator=generator) * 0.9 + 0.1)
        layout = ApeLayout(prefix, prefix + context, temperature, scale)
        module = nn.Module()
        out, weights = ape_attention(module, query, key, value, None, scaling=dim ** -0.5, ape_layout=layout)
        expected = reference_ape(query, key, value, prefix, prefix + context, temperature, scale, dim ** -0.5)
        assert weights is None and out.shape == (2, q_len, heads, dim)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_knobs_change_the_attention():
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 1, 8, generator=generator), torch.randn(1, 2, 12, 8, generator=generator),
                         torch.randn(1, 2, 12, 8, generator=generator))
    plain, _ = ape_attention(nn.Module(), query, key, value, None, ape_layout=ApeLayout(3, 10, 1.0, 1.0))
    sharp, _ = ape_attention(nn.Module(), query, key, value, None, ape_layout=ApeLayout(3, 10, 0.6, 0.9))
    assert not torch.allclose(plain, sharp, atol=1e-3)


def block_mask_reference(loaded: LoadedModel, engine: Engine, documents: list[str], question: str) -> torch.Tensor:
    """Logits of the question tokens from ONE plain forward pass over the concatenated sequence with the block mask.

    Contexts see the prefix and themselves (causally) at positions L_p..; the question sees everything
    before it and starts at L_p + the longest document. No cache, no APE code: SDPA with a 4D mask.
    """
    layout = engine.layout
    prefix, suffix = layout.prefix_ids, layout.suffix_ids(question)
    contexts = [layout.context_ids(d) for d in documents]
    ids = prefix + [t for c in contexts for t in c] + suffix
    n, p = len(ids), len(prefix)
    positions = list(range(p))
    segment = [0] * p
    for k, c in enumerate(contexts, start=1):
        positions += list(range(p, p + len(c)))
        segment += [k] * len(c)
    start = p + max(len(c) for c in contexts)
    positions += list(range(start, start + len(suffix)))
    segment += [-1] * len(suffix)
    seg = torch.tensor(segment)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    allowed = (seg.unsqueeze(0) == 0) | (seg.unsqueeze(1) == seg.unsqueeze(0)) | (seg.unsqueeze(1) == -1)
    mask = (causal & allowed).view(1, 1, n, n)
    with torch.inference_mode():
        out = loaded.model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), attention_mask=mask)
    return out.logits[0, -len(suffix):].float()


def ape_question_logits(engine: Engine, documents: list[str], question: str, temperature: float,
                        scale: float) -> torch.Tensor:
    """The question tokens' logits as mode 'ape' computes them (cached documents + the APE attention)."""
    from ctx_integrations.engine.core.cache import concatenated_stream
    from ctx_integrations.engine.core.decoding import forward_sequences_keep

    layout, store = engine.layout, engine.store
    suffix = layout.suffix_ids(question)
    caches = store.documents(layout, documents)
    p = len(layout.prefix_ids)
    streams = concatenated_stream(store.prefix(layout), caches, p + max(c.length for c in caches))
    streams.forward_kwargs["ape_layout"] = ApeLayout(p, p + sum(c.length for c in caches), temperature, scale)
    with ape_attention_swapped(engine.loaded.model):
        return forward_sequences_keep(engine.loaded.model, streams, torch.tensor([suffix]), len(suffix))[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_knobs_at_one_equal_plain_attention_over_the_block_masked_concatenation(family):
    loaded = tiny_loaded(family, seed=11)
    engine = Engine(loaded)
    expected = block_mask_reference(loaded, engine, DOCS, QUESTION)
    torch.testing.assert_close(ape_question_logits(engine, DOCS, QUESTION, 1.0, 1.0), expected, atol=2e-4, rtol=1e-4)
    # the same comparison fails for T, S < 1, so the check above can fail
    corrected = ape_question_logits(engine, DOCS, QUESTION, 0.6, 0.8)
    assert (corrected - expected).abs().max() > 1e-2


def prompt_ids(engine: Engine, documents: list[str], question: str) -> list[int]:
    layout = engine.layout
    return layout.prefix_ids + [t for d in documents for t in layout.context_ids(d)] + layout.suffix_ids(question)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_document_at_knobs_one_is_sequential_greedy_decoding(family):
    engine = Engine(tiny_loaded(family, seed=4))
    answer = engine.generate(QUESTION, DOCS[1:2], mode="ape", attention_temperature=1.0, scale=1.0,
                             max_new_tokens=20)
    assert len(set(answer.token_ids)) > 3  # the reference is not one repeated token
    assert answer.token_ids == greedy_reference(engine.loaded, prompt_ids(engine, DOCS[1:2], QUESTION), 20)
    assert engine.loaded.model.config._attn_implementation == "sdpa"


def test_caches_are_reused_and_positions_follow_the_longest_document(tiny_engine):
    first = tiny_engine.generate(QUESTION, DOCS, mode="ape", max_new_tokens=4)
    second = tiny_engine.generate(QUESTION, DOCS, mode="ape", max_new_tokens=4)
    assert (first.cache_misses, second.cache_hits, second.cache_misses) == (3, 3, 0)
    layout = tiny_engine.layout
    lengths = [len(layout.context_ids(d)) for d in DOCS]
    assert first.extra["context_tokens"] == sum(lengths)
    assert first.extra["query_position"] == len(layout.prefix_ids) + max(lengths)
    assert first.token_ids == second.token_ids


@pytest.mark.parametrize("knobs", [dict(attention_temperature=0.0), dict(scale=1.5), dict(attention_temperature=-0.2),
                                   dict(scale=float("nan")), dict(scale=True)])
def test_knobs_outside_the_unit_interval_are_refused(tiny_engine, knobs):
    interval = r"\[0.01, 1\]" if "attention_temperature" in knobs else r"\(0, 1\]"  # T's floor keeps float32 finite
    with pytest.raises(InvalidOptionError, match=interval):
        tiny_engine.generate(QUESTION, DOCS, mode="ape", **knobs)


def test_only_the_longest_document_counts_against_the_window():
    engine = Engine(tiny_loaded("llama", max_position_embeddings=160))
    documents = ["word " * 40] * 4  # 160 document tokens in all, but they share positions
    answer = engine.generate(QUESTION, documents, mode="ape", max_new_tokens=4)
    assert len(answer.token_ids) == 4
    with pytest.raises(DocumentTooLongError, match="longest document"):
        engine.generate(QUESTION, ["word " * 150], mode="ape", max_new_tokens=4)


def full_sequence_ape_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, segments=None,
                                knobs=None, **kwargs):
    """APE over one uncached sequence, written from docs/methods.md independently of :func:`ape_attention`.

    ``segments[j]``: 0 = prefix, k >= 1 = document k, -1 = question / answer. Prefix and document
    tokens attend causally to the prefix and their own document (the block mask); a question or answer
    token merges two softmaxes: every document key with scores / T (set C) and the prefix plus the
    question / answer keys before it with plain scores (set O), weighted by softmax([S T LSE_C, LSE_O]).
    Float64, one query row at a time.
    """
    def mix(weights, values):  # [B, H, K] x [B, H, K, d] -> [B, H, d]
        return torch.einsum("bhk,bhkd->bhd", weights, values)

    temperature, scale = knobs
    heads, kv_heads = query.shape[1], key.shape[1]
    k = key.double().repeat_interleave(heads // kv_heads, 1)
    v = value.double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.matmul(query.double(), k.transpose(-1, -2)) * scaling  # [B, H, N, N]
    out = torch.zeros_like(query, dtype=torch.float64)
    for i, own in enumerate(segments.tolist()):
        past, s, vp = segments[: i + 1], scores[:, :, i, : i + 1], v[:, :, : i + 1]
        if own >= 0:
            allowed = (past == 0) | (past == own)
            out[:, :, i] = mix(torch.softmax(s.masked_fill(~allowed, -math.inf), -1), vp)
            continue
        documents = past > 0
        context, outside = s[..., documents] / temperature, s[..., ~documents]
        merge = torch.softmax(torch.stack([scale * temperature * torch.logsumexp(context, -1),
                                           torch.logsumexp(outside, -1)], -1), -1)
        out[:, :, i] = (merge[..., :1] * mix(torch.softmax(context, -1), vp[:, :, documents])
                        + merge[..., 1:] * mix(torch.softmax(outside, -1), vp[:, :, ~documents]))
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


AttentionInterface.register("test_full_sequence_ape", full_sequence_ape_attention)


def ape_reference_greedy(loaded: LoadedModel, engine: Engine, documents: list[str], question: str, temperature: float,
                         scale: float, steps: int) -> list[int]:
    """Greedy decoding with one full forward pass per step over [prefix | documents | question | answer]:
    documents at positions L_p.., the question from L_p + max_k len_k (documents share positions)."""
    layout = engine.layout
    prefix, suffix = layout.prefix_ids, layout.suffix_ids(question)
    contexts = [layout.context_ids(d) for d in documents]
    ids = prefix + [t for c in contexts for t in c] + suffix
    positions, segments = list(range(len(prefix))), [0] * len(prefix)
    for k, c in enumerate(contexts, start=1):
        positions += range(len(prefix), len(prefix) + len(c))
        segments += [k] * len(c)
    start = len(prefix) + max(len(c) for c in contexts)
    positions += range(start, start + len(suffix))
    segments += [-1] * len(suffix)
    model, tokens = loaded.model, []
    previous = model.config._attn_implementation
    model.set_attn_implementation("test_full_sequence_ape")
    try:
        with torch.inference_mode():
            for _ in range(steps):
                logits = model(input_ids=torch.tensor([ids + tokens]), position_ids=torch.tensor([positions]),
                               segments=torch.tensor(segments), knobs=(temperature, scale)).logits[0, -1]
                tokens.append(int(logits.argmax()))
                if tokens[-1] in loaded.eos_token_ids:
                    return tokens[:-1]
                positions.append(positions[-1] + 1)
                segments.append(-1)
    finally:
        model.set_attn_implementation(previous)
    return tokens


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_several_documents_with_distinct_knobs_equal_an_independent_full_sequence_reference(family):
    """Documents of different lengths, T = 0.6 != S = 0.8, on a position-sensitive model: mode 'ape' must
    decode like the full-sequence reference. Fails if the question starts after the sum instead of the
    max of the documents' lengths, if the prefix joins the tempered set C, or if T and S are swapped."""
    loaded = tiny_loaded(family, seed=7, position_sensitive=True)
    engine = Engine(loaded)
    answer = engine.generate(QUESTION, DOCS, mode="ape", attention_temperature=0.6, scale=0.8, max_new_tokens=10)
    expected = ape_reference_greedy(loaded, engine, DOCS, QUESTION, 0.6, 0.8, 10)
    assert len(set(expected)) > 3 and answer.token_ids == expected


class LegacyAttention(nn.Module):
    """An attention written by hand inside the model code, as remote-code models often have it."""


class LegacyLlama(LlamaForCausalLM):
    """A model class whose module defines its own attention: transformers cannot swap its implementation.

    (The parent's cached answer is cleared so that transformers' own check inspects this module.)
    """

    _can_set_attn_implementation_cached_value = None


def test_a_model_whose_attention_cannot_be_swapped_is_refused_and_nothing_changes():
    tiny = tiny_loaded("llama")
    model = LegacyLlama(tiny.model.config).eval()
    engine = Engine(LoadedModel(model, tiny.tokenizer, "legacy", model_identity(model, "legacy"), tiny.device,
                                tiny.dtype))
    with pytest.raises(InvalidOptionError, match="LegacyLlama.*AttentionInterface"):
        engine.generate(QUESTION, DOCS, mode="ape", max_new_tokens=2)
    assert len(engine.generate(QUESTION, DOCS, mode="concat", max_new_tokens=2).token_ids) == 2


def test_the_model_gets_its_attention_back_after_an_error(tiny_engine):
    model = tiny_engine.loaded.model
    with pytest.raises(RuntimeError, match="boom"), ape_attention_swapped(model):
        assert model.config._attn_implementation != "sdpa"
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_the_attention_refuses_to_run_outside_ape():
    with pytest.raises(InvalidOptionError, match="only valid inside mode='ape'"):
        ape_attention(nn.Module(), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), None)


@pytest.mark.slow
def test_embedded_model_one_document_parity_and_a_default_answer(embedded_engine):
    ids = prompt_ids(embedded_engine, DOCS[1:2], QUESTION)
    answer = embedded_engine.generate(QUESTION, DOCS[1:2], mode="ape", attention_temperature=1.0, scale=1.0,
                                      max_new_tokens=12)
    assert answer.token_ids == greedy_reference(embedded_engine.loaded, ids, 12)
    default = embedded_engine.generate(QUESTION, DOCS, mode="ape", max_new_tokens=24)
    assert "Ilsa Brenn" in default.text
    assert math.isfinite(default.timings["ttft_s"])


class RecordingEngine:
    """Answers with a text chosen by (T, S) and records every call, to check the search's bookkeeping."""

    def __init__(self, texts):
        self.texts, self.calls = texts, []

    def generate(self, question, documents, *, mode, attention_temperature, scale, max_new_tokens, **options):
        self.calls.append((mode, attention_temperature, scale))
        return Answer(text=self.texts(attention_temperature, scale), token_ids=[], trace=[], timings={},
                      documents=[], mode=mode, cache_hits=0, cache_misses=0, finish_reason="length", options={},
                      extra={})


def test_greedy_search_fixes_t_at_s_one_then_searches_s():
    # right answer only at T = 0.3 (any S), and at S = 0.6 with T = 0.3; elsewhere wrong
    engine = RecordingEngine(lambda t, s: "Paris" if t == 0.3 and s in (0.6, 1.0) else "Rome")
    dev = [("Capital of France?", ["France's capital is Paris."], ["Paris"])]
    found = search_knobs(engine, dev, grid=(0.3, 0.6, 1.0))
    assert (found.attention_temperature, found.scale) == (0.3, 1.0)  # tie at S=0.6 and 1.0: the lesser correction
    assert found.score == 1.0 and found.options == {"attention_temperature": 0.3, "scale": 1.0}
    assert [c[1:] for c in engine.calls] == [(0.3, 1.0), (0.6, 1.0), (1.0, 1.0), (0.3, 0.3), (0.3, 0.6)]
    assert all(c[0] == "ape" for c in engine.calls)


def test_grid_search_tries_every_pair_and_averages_over_the_dev_set():
    def texts(t, s):
        return {(0.5, 0.5): "Paris Berlin", (0.5, 1.0): "Paris"}.get((t, s), "no")

    engine = RecordingEngine(texts)
    dev = [DevExample("q1", ["d"], ["Paris"]), {"question": "q2", "documents": ["d"], "answers": "Berlin"}]
    found = search_knobs(engine, dev, grid=(1.0, 0.5), strategy="grid")
    assert (found.attention_temperature, found.scale, found.score) == (0.5, 0.5, 1.0)
    assert found.scores == {(0.5, 0.5): 1.0, (0.5, 1.0): 0.5, (1.0, 0.5): 0.0, (1.0, 1.0): 0.0}
    assert len(engine.calls) == 8  # 4 pairs x 2 examples, each pair once


@pytest.mark.parametrize(("bad", "match"), [
    (dict(dev_set=[]), "at least one"), (dict(grid=(0.0, 0.5)), "attention_temperature"),
    (dict(strategy="random"), "strategy"), (dict(dev_set=[("q", [], ["a"])]), "dev example")])
def test_search_refuses_bad_input(bad, match):
    options = dict(dev_set=[("q", ["d"], ["a"])], grid=(0.5, 1.0)) | bad
    with pytest.raises(InvalidOptionError, match=match):
        search_knobs(RecordingEngine(lambda t, s: "a"), options.pop("dev_set"), **options)


def test_search_on_a_tiny_model_finds_the_pair_that_reproduces_a_reference_answer():
    """End to end through mode='ape' on a tiny model (sharp init) whose answer depends on S (S < 1 gives one
    answer, S = 1 another, whatever T): the gold answer is the S < 1 one, so only a search that really
    decodes each pair with its own S scores the pairs right; the tie between T values goes to T = 1."""
    engine = Engine(tiny_loaded("llama", initializer_range=0.5))
    docs = ["The river town market sells water and stone.", "The hill road passes the old school and a tree."]
    question = "What does the market sell?"

    def answer(t, s):
        return engine.generate(question, docs, mode="ape", attention_temperature=t, scale=s, max_new_tokens=8).text

    gold = answer(1.0, 0.3)
    assert answer(1.0, 1.0) != gold and answer(0.3, 1.0) != gold and answer(0.3, 0.3) == gold
    dev = [(question, docs, [gold])]
    exact = dict(metric=lambda prediction, answers: float(prediction == answers[0]), max_new_tokens=8)
    found = search_knobs(engine, dev, grid=(0.3, 1.0), strategy="grid", **exact)
    assert found.scores == {(0.3, 0.3): 1.0, (0.3, 1.0): 0.0, (1.0, 0.3): 1.0, (1.0, 1.0): 0.0}
    assert (found.attention_temperature, found.scale) == (1.0, 0.3)
    greedy = search_knobs(engine, dev, grid=(0.3, 1.0), **exact)  # T at S = 1 (all wrong, T = 1 kept), then S
    assert greedy.options == {"attention_temperature": 1.0, "scale": 0.3} and len(greedy.scores) == 3


def random_attention_inputs(seed: int, q_len: int = 3, keys: int = 14):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, q_len, 8, generator=generator), torch.randn(1, 2, keys, 8, generator=generator),
            torch.randn(1, 2, keys, 8, generator=generator))


def test_the_attention_scaling_is_the_models_or_one_over_sqrt_dim():
    """A model's own scaling (e.g. Gemma's query_pre_attn_scalar) is used as given; without one, 1 / sqrt(d)."""
    query, key, value = random_attention_inputs(0)
    layout = ApeLayout(3, 9, 0.7, 0.8)
    for scaling in (0.2, 8 ** -0.5):
        out, _ = ape_attention(nn.Module(), query, key, value, None, scaling=scaling, ape_layout=layout)
        torch.testing.assert_close(out.double(), reference_ape(query, key, value, 3, 9, 0.7, 0.8, scaling),
                                   atol=1e-5, rtol=1e-5)
    default, _ = ape_attention(nn.Module(), query, key, value, None, ape_layout=layout)
    torch.testing.assert_close(default.double(), reference_ape(query, key, value, 3, 9, 0.7, 0.8, 8 ** -0.5),
                               atol=1e-5, rtol=1e-5)


def test_soft_capping_and_sliding_windows_are_refused_by_name():
    query, key, value = random_attention_inputs(1)
    layout = ApeLayout(3, 9, 0.9, 0.9)
    softcap = r"^APE does not support attention logit soft-capping \(e.g. Gemma 2\)$"
    with pytest.raises(InvalidOptionError, match=softcap):
        ape_attention(nn.Module(), query, key, value, None, ape_layout=layout, softcap=30.0)
    window = r"^APE does not support sliding-window attention over 14 keys \(window 13\)$"
    with pytest.raises(InvalidOptionError, match=window):
        ape_attention(nn.Module(), query, key, value, None, ape_layout=layout, sliding_window=13)
    # a window that holds every key changes nothing
    inside, _ = ape_attention(nn.Module(), query, key, value, None, ape_layout=layout, sliding_window=14)
    plain, _ = ape_attention(nn.Module(), query, key, value, None, ape_layout=layout)
    assert torch.equal(inside, plain)
    with pytest.raises(InvalidOptionError, match=r"^the APE attention ran without an ApeLayout: it is only valid "
                                                 r"inside mode='ape'$"):
        ape_attention(nn.Module(), query, key, value, None)


def test_attribution_records_each_documents_merged_attention_mass_for_the_last_query():
    # The mass the merge gives document j for the last query token, averaged over heads: w_context * (sum of the
    # context softmax over j's keys), per the reference formula above written out head by head in float64.
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, q_len, dim, prefix, ends = 4, 2, 3, 8, 5, (4, 9, 11)
    keys = prefix + ends[-1] + q_len
    query = torch.randn(2, heads, q_len, dim, generator=generator)
    key, value = torch.randn(2, 2, kv_heads, keys, dim, generator=generator)
    temperature, scale, scaling = 0.7, 0.8, dim ** -0.5
    layout = ApeLayout(prefix, prefix + ends[-1], temperature, scale, document_ends=ends, masses=[])
    ape_attention(nn.Module(), query, key, value, None, scaling=scaling, ape_layout=layout)
    expected = torch.zeros(len(ends), dtype=torch.float64)
    for h in range(heads):  # batch row 0, last query token
        k = key[0, h // (heads // kv_heads)].double()
        s = k @ query[0, h, -1].double() * scaling
        context = s[prefix:prefix + ends[-1]] / temperature
        outside = torch.cat([s[:prefix], s[prefix + ends[-1]:]])
        w = torch.softmax(torch.stack([scale * temperature * torch.logsumexp(context, 0),
                                       torch.logsumexp(outside, 0)]), 0)
        p = torch.softmax(context, 0)
        for j, (a, b) in enumerate(zip((0,) + ends[:-1], ends)):
            expected[j] += w[0] * p[a:b].sum() / heads
    assert len(layout.masses) == 1
    torch.testing.assert_close(layout.masses[0].double(), expected, atol=1e-5, rtol=1e-5)


def test_the_attention_returns_the_querys_dtype():
    query, key, value = (t.to(torch.bfloat16) for t in random_attention_inputs(3))
    out, _ = ape_attention(nn.Module(), query, key, value, None, ape_layout=ApeLayout(2, 9, 0.8, 0.9))
    assert out.dtype == torch.bfloat16


def test_knob_errors_name_the_knob_and_the_papers_range():
    from ctx_integrations.engine.modes.ape import check_knobs

    hint = r" \(a number in \(0, 1\]; the authors use 0.6-1.0; 1 = no correction\)"
    temperature_hint = r" \(a number in \[0.01, 1\]; the authors use 0.6-1.0; 1 = no correction\)"
    with pytest.raises(InvalidOptionError,
                       match=r"^APE's attention_temperature must be in \[0.01, 1\], got 0.0" + temperature_hint):
        check_knobs(0.0, 0.5)
    with pytest.raises(InvalidOptionError, match=r"^APE's scale must be in \(0, 1\], got 1.5" + hint):
        check_knobs(0.5, 1.5)


def test_the_layout_needs_a_non_empty_document_span_from_column_zero_on():
    assert ApeLayout(0, 4, 1.0, 1.0).context_start == 0  # a model without a system prompt: documents first
    for start, end in ((3, 3), (-1, 4), (5, 2)):
        with pytest.raises(InvalidOptionError, match=rf"^APE needs a non-empty document span, got \[{start}, {end}\)$"):
            ApeLayout(start, end, 1.0, 1.0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_ape_is_a_batch_row_on_every_model_it_computes(family):
    """A sliding-window model (Mistral, window 4096 here) is a row too: a window as wide as the request's keys hides
    none of them, so the row rule is the reference's math on its sliding layers as well."""
    engine = Engine(tiny_loaded(family, seed=7, position_sensitive=True))
    answer = engine.generate(QUESTION, DOCS, mode="ape", attention_temperature=0.6, scale=0.8, max_new_tokens=6)
    expected = ape_reference_greedy(engine.loaded, engine, DOCS, QUESTION, 0.6, 0.8, 6)
    assert answer.token_ids == expected
    assert engine.stats()["exclusive_s"] == 0 and engine.stats()["forwards"] > 0


def _ape_keys(engine: Engine, max_new_tokens: int) -> int:
    """The keys APE's last answer token attends to: prefix, every document, the question, the answer before it."""
    layout = engine.layout
    documents = sum(len(layout.context_ids(d)) for d in DOCS)
    return len(layout.prefix_ids) + documents + len(layout.suffix_ids(QUESTION)) + max_new_tokens - 1


def test_a_sliding_window_as_wide_as_apes_keys_answers_and_one_narrower_is_refused_before_any_work():
    keys = _ape_keys(Engine(tiny_loaded("mistral", seed=7, position_sensitive=True)), 6)
    wide = Engine(tiny_loaded("mistral", seed=7, position_sensitive=True, sliding_window=keys))
    answer = wide.generate(QUESTION, DOCS, mode="ape", attention_temperature=0.6, scale=0.8, max_new_tokens=6)
    assert answer.token_ids == ape_reference_greedy(wide.loaded, wide, DOCS, QUESTION, 0.6, 0.8, 6)
    assert len(answer.token_ids) == 6  # every answer token was decoded, the last one beside all the keys
    narrow = Engine(tiny_loaded("mistral", seed=7, position_sensitive=True, sliding_window=keys - 1))
    streamed: list[str] = []
    refused = rf"^APE does not support sliding-window attention over {keys} keys \(window {keys - 1}\): .* " \
              r"max_new_tokens=6 .*lower max_new_tokens$"
    with pytest.raises(InvalidOptionError, match=refused):
        narrow.generate(QUESTION, DOCS, mode="ape", max_new_tokens=6, on_token=streamed.append)
    stats = narrow.stats()
    assert streamed == [] and stats["forwards"] == 0 and stats["cache"]["misses"] == 0  # refused when planned
    # the same request with a shorter answer fits the window
    assert narrow.generate(QUESTION, DOCS, mode="ape", max_new_tokens=5).token_ids


def test_a_soft_capped_model_is_refused_when_planned_on_every_kernel():
    engine = Engine(tiny_loaded("gemma2", seed=1, head_dim=16))
    for kernel in ("auto", "eager", "flex"):
        with pytest.raises(InvalidOptionError, match=r"^APE does not support attention logit soft-capping \(e\.g\. "
                                                     r"Gemma 2\); use mode='pced' or mode='concat' with this model$"):
            engine.generate(QUESTION, DOCS, mode="ape", max_new_tokens=3, attention_kernel=kernel)
    assert engine.stats()["forwards"] == 0 and engine.stats()["cache"]["misses"] == 0
    assert engine.generate(QUESTION, DOCS, mode="pced", max_new_tokens=3).token_ids  # the advice holds
