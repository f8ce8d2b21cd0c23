"""The tiny Qwen2 of the parity suite is really Qwen2-shaped, and every mode stops at a tied Qwen2's own EOS.

The parity tests of each mode run on tiny Llama and tiny Qwen2 models (``family`` parameters); this file
checks what makes the second family different (grouped-query attention with two KV heads, q/k/v biases,
tied embeddings, an EOS other than the tokenizer's) so that a config change cannot quietly make the
Qwen2 case a copy of the Llama one.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.layout import SUMMARY_QUESTION_TEMPLATE, SUMMARY_SYSTEM_PROMPT, PromptLayout
from ctx_integrations.engine.core.model import LoadedModel
from ctx_integrations.engine.core.registry import available_modes
from tests.helpers import greedy_reference, last_logits, tiny_loaded, tiny_tied_qwen2
from tests.test_core_pced import DOCS, QUESTION, prompt_ids

MAX_NEW_TOKENS = 8
MODE_OPTIONS = {"map_reduce": dict(summary_tokens=4)}


def test_the_tiny_qwen2_has_grouped_kv_heads_biases_that_count_and_a_tied_head():
    loaded = tiny_loaded("qwen2", seed=0)
    config = loaded.model.config
    assert config.model_type == "qwen2" and config.num_key_value_heads == 2 < config.num_attention_heads
    for layer in loaded.model.model.layers:
        attention = layer.self_attn
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
            assert projection.bias is not None and projection.bias.abs().max() > 0
        assert attention.o_proj.bias is None
    prompt = prompt_ids(Engine(loaded), DOCS[:1], QUESTION)
    with_biases = last_logits(loaded, [prompt])
    unbiased = copy.deepcopy(loaded.model)
    with torch.no_grad():
        for layer in unbiased.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.zero_()
    assert (with_biases - last_logits(dataclasses.replace(loaded, model=unbiased), [prompt])).abs().max() > 1e-3
    assert not loaded.model.config.tie_word_embeddings

    tied = tiny_tied_qwen2()
    assert tied.model.get_output_embeddings().weight is tied.model.get_input_embeddings().weight
    eos = tied.model.config.eos_token_id
    assert eos != tied.tokenizer.eos_token_id and eos in tied.tokenizer.all_special_ids
    assert tied.model.generation_config.eos_token_id == eos


@contextmanager
def swapped(loaded: LoadedModel, a: int, b: int) -> Iterator[None]:
    """Tokens ``a`` and ``b`` swapped in the tied embedding (so in the output head too) inside the block.

    While neither token is an input, the model computes what it did with the two logits swapped: where it
    chose ``b``, it now chooses ``a``. The engine's document caches stay valid (no prompt holds either token).
    """
    rows = loaded.model.get_input_embeddings().weight
    with torch.no_grad():
        rows[[a, b]] = rows[[b, a]].clone()
    try:
        yield
    finally:
        with torch.no_grad():
            rows[[a, b]] = rows[[b, a]].clone()


def test_every_mode_stops_at_the_tied_qwen2_models_own_eos():
    """Each registered mode decodes the tied Qwen2 freely (its EOS ``<|endoftext|>`` never wins), then a
    copy in which the EOS takes the place of the k-th answer token must give the first k tokens, finished by
    "eos". Fails if a mode stops only on the tokenizer's (Llama's) ``<|im_end|>``, or reads logits from
    anything but the model's tied output head (the swap lives in the shared embedding)."""
    loaded = tiny_tied_qwen2(seed=1)
    eos = loaded.model.config.eos_token_id
    engine = Engine(loaded)
    summary_layout = PromptLayout(loaded.tokenizer, SUMMARY_SYSTEM_PROMPT, SUMMARY_QUESTION_TEMPLATE)
    inputs = set(prompt_ids(engine, DOCS, QUESTION)) | set(summary_layout.prefix_ids + summary_layout.suffix_ids(""))
    modes = available_modes()
    assert {"pced", "ape", "rapid", "ippd", "soft_nbce", "concat", "single", "map_reduce", "truncated"} <= set(modes)
    for mode in modes:
        options = MODE_OPTIONS.get(mode, {})
        free = engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=MAX_NEW_TOKENS, **options)
        assert free.finish_reason == "length" and len(free.token_ids) == MAX_NEW_TOKENS, mode
        seen = inputs | {t for s in free.extra.get("summaries", []) for t in engine.layout.context_ids(s.strip())}
        tokens = free.token_ids
        k = next(i for i in range(2, MAX_NEW_TOKENS) if tokens[i] not in seen and tokens[i] not in tokens[:i])
        with swapped(loaded, eos, tokens[k]):
            answer = engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=MAX_NEW_TOKENS, **options)
            if mode == "concat":  # transformers' own generate stops there too
                assert greedy_reference(loaded, prompt_ids(engine, DOCS, QUESTION), MAX_NEW_TOKENS) == tokens[:k]
        assert (answer.token_ids, answer.finish_reason) == (tokens[:k], "eos"), mode
