"""Switching a model's attention for one call: every layer reached, its own attention back after, and the check
``set_attn_implementation`` makes paid once per model and name (it walks every module: 0.7 ms per call on a
32-layer model here, twice per decode step on the pool's flex kernel and the compiled step)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ctx_integrations.engine.core.attention_swap import attention_swapped
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import tiny_loaded

SPY = "test_spy_attention"
CALLS: list[str] = []


def spy_attention(module, query, key, value, attention_mask, **kwargs):
    CALLS.append(SPY)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(SPY, spy_attention)


def _counted(model: torch.nn.Module, monkeypatch) -> list[str]:
    """The names ``model.set_attn_implementation`` is called with from now on."""
    calls: list[str] = []
    original = model.set_attn_implementation

    def counting(implementation, *args, **kwargs):
        calls.append(implementation)
        return original(implementation, *args, **kwargs)

    monkeypatch.setattr(model, "set_attn_implementation", counting)
    return calls


def _layers_run(model: torch.nn.Module) -> int:
    """How many layers ran the spy attention in one forward."""
    CALLS.clear()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    return len(CALLS)


def test_every_swap_reaches_every_layer_and_only_the_first_pays_the_full_check(monkeypatch):
    # Caught: a cheap swap that sets a name no layer reads (the spy would not run), or that is not undone (it would
    # run outside the block), or the full check at every swap (4 calls per round trip below instead of 2 in all).
    model = tiny_loaded("llama", num_hidden_layers=3).model
    checks = _counted(model, monkeypatch)
    for _ in range(4):
        with attention_swapped(model, SPY):
            assert model.config._attn_implementation == SPY and _layers_run(model) == 3
        assert model.config._attn_implementation == "sdpa" and _layers_run(model) == 0
    assert checks == [SPY, "sdpa"]


def test_a_model_whose_parts_have_configs_of_their_own_keeps_the_full_check_at_every_swap(monkeypatch):
    # A model with another config inside (a multimodal model's towers) needs transformers to set each of them:
    # setting the outer config alone would leave them on their old attention.
    model = tiny_loaded("llama", num_hidden_layers=2).model
    model.model.config = copy.deepcopy(model.config)
    checks = _counted(model, monkeypatch)
    for _ in range(3):
        with attention_swapped(model, SPY):
            assert model.model.config._attn_implementation == SPY
        assert model.model.config._attn_implementation == "sdpa"
    assert checks == [SPY, "sdpa"] * 3


def test_the_models_own_attention_comes_back_after_an_error_and_a_model_that_cannot_swap_is_refused():
    model = tiny_loaded("llama", num_hidden_layers=2).model
    with pytest.raises(RuntimeError, match="boom"), attention_swapped(model, SPY):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa" and _layers_run(model) == 0
    with pytest.raises(InvalidOptionError, match="AttentionInterface; use attention_kernel='eager'"), \
            attention_swapped(torch.nn.Linear(2, 2), SPY):
        pass
    with pytest.raises(InvalidOptionError, match="^use mode='pced'$"), \
            attention_swapped(torch.nn.Linear(2, 2), SPY, refusal="use mode='pced'"):
        pass
