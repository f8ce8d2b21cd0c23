"""Sliding-window models in the row pool (engine/core/windows.py): each sliding layer sees its window only, as
transformers' own mask functions apply it, so answers past the window are transformers' ``generate``'s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from ctx_integrations import Engine
from ctx_integrations.engine.core import compiled_step
from ctx_integrations.engine.core import runner as runner_module
from ctx_integrations.engine.core.windows import FULL, SLIDING, Windows, windows
from tests.helpers import greedy_reference, tiny_loaded
from tests.test_ape import prompt_ids

QUESTION = "What is the code of room 3?"
DOCUMENT = " ".join(f"The code of room {i} is {1000 + 7 * i}." for i in range(12))
WINDOW = 8
# Qwen2 with its window switched on from the second layer: one full and one sliding layer, one mask for each
FAMILIES = [("mistral", {}), ("qwen2", {"use_sliding_window": True, "max_window_layers": 1})]


def _loaded(family: str, window: int, overrides: dict):
    return tiny_loaded(family, seed=3, dtype=torch.float32, position_sensitive=True, sliding_window=window,
                       **overrides)


@pytest.mark.parametrize("family, overrides", FAMILIES)
def test_answers_past_the_window_are_transformers_own(family, overrides):
    engine = Engine(_loaded(family, WINDOW, overrides))
    ids = prompt_ids(engine, [DOCUMENT], QUESTION)
    assert len(ids) > 20 * WINDOW
    reference = greedy_reference(engine.loaded, ids, 12)
    # the window changes this model's answer, so a pool that ignored it would fail below (it did before windows.py)
    assert greedy_reference(_loaded(family, 4096, overrides), ids, 12) != reference
    for mode, options in (("concat", {}), ("single", {}), ("pced", {"beta": 0.0, "gamma": 0.0})):
        answer = engine.generate(QUESTION, [DOCUMENT], mode=mode, max_new_tokens=12, **options)
        assert answer.token_ids == reference, mode


def test_the_compiled_decode_step_applies_the_window_too(monkeypatch):
    monkeypatch.setattr(runner_module, "compiled_decode_step",
                        lambda mode: compiled_step.compiled_decode_step(mode, backend="eager"))
    torch._dynamo.reset()
    try:
        engine = Engine(_loaded("mistral", WINDOW, {}), compile_mode="default")
        reference = greedy_reference(engine.loaded, prompt_ids(engine, [DOCUMENT], QUESTION), 12)
        assert engine.generate(QUESTION, [DOCUMENT], mode="concat", max_new_tokens=12).token_ids == reference
        assert not engine.scheduler.runner.step.failed
    finally:
        torch._dynamo.reset()


def _config(family: str, **settings):
    return AutoConfig.for_model(family, vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, **settings)


def test_which_layers_slide_is_read_as_transformers_reads_it():
    assert windows(_config("llama")) == Windows()
    assert windows(None) == Windows()  # a stand-in for a model (the pool's tests), without a config
    assert windows(_config("mistral", sliding_window=16)) == Windows(16)  # every layer
    assert windows(_config("mistral", sliding_window=None)) == Windows()
    assert windows(_config("qwen2", sliding_window=16)) == Windows()  # use_sliding_window is off by default
    assert windows(_config("qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=1)) \
        == Windows(16, mixed=True)
    assert windows(_config("qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=0)) == Windows(16)
    gemma3 = AutoConfig.for_model("gemma3")  # multimodal: the window is its text model's, one layer in six full
    assert getattr(gemma3, "sliding_window", None) is None and windows(gemma3) == Windows(4096, mixed=True)
    # a config that keeps its window with the switch off (Qwen2 before transformers cleared it) slides nowhere
    assert windows(SimpleNamespace(sliding_window=16, use_sliding_window=False)) == Windows()
    assert windows(SimpleNamespace(sliding_window=16, use_sliding_window=True)) == Windows(16)


def test_a_window_narrows_real_queries_only_and_mixed_models_get_a_mask_per_layer_type():
    k_pos = torch.arange(12).unsqueeze(0)  # [1, K]
    q_pos = torch.tensor([[10, 11, 1 << 40]])  # two real queries, then padding
    real = torch.tensor([[True, True, False]])
    full = (q_pos.unsqueeze(2) >= k_pos.unsqueeze(1)).unsqueeze(1)  # [1, 1, Q, K]
    assert Windows().masks(full, q_pos, k_pos, real) is full
    sliding = Windows(4).masks(full, q_pos, k_pos, real)
    assert sliding[0, 0, 0].nonzero().flatten().tolist() == [7, 8, 9, 10]
    assert sliding[0, 0, 1].nonzero().flatten().tolist() == [8, 9, 10, 11]
    assert torch.equal(sliding[0, 0, 2], full[0, 0, 2])  # padding keeps its keys: no query row is left empty
    mixed = Windows(4, mixed=True).masks(full, q_pos, k_pos, real)
    assert set(mixed) == {FULL, SLIDING} and mixed[FULL] is full and torch.equal(mixed[SLIDING], sliding)


@pytest.mark.parametrize("family, overrides", FAMILIES)
def test_the_flex_kernel_applies_the_window_as_the_eager_one_does(family, overrides):
    """FlexAttention (CUDA's default kernel, here unfused on the CPU) gets a block mask per layer type with the same
    window, where it used to refuse a pool wider than the window."""
    engine = Engine(_loaded(family, WINDOW, overrides), attention_kernel="flex")
    reference = greedy_reference(engine.loaded, prompt_ids(engine, [DOCUMENT], QUESTION), 12)
    for mode, options in (("concat", {}), ("pced", {"beta": 0.0, "gamma": 0.0})):
        answer = engine.generate(QUESTION, [DOCUMENT], mode=mode, max_new_tokens=12, **options)
        assert answer.token_ids == reference, mode
