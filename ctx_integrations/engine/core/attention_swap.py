"""Switching a model's attention function for one call, cheaply enough to do at every decode step.

transformers looks each layer's attention function up by name at every forward
(``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``), so one model can run its own attention in one call and a
registered one (the pool's FlexAttention, a row's own rule, the compiled step's, APE's) in the next.
``set_attn_implementation`` changes the name after checking that the model supports it and walking every
submodule: 0.7 ms per call on a 32-layer model on this project's CPU, twice per decode step on the pool's flex
kernel. The check gives the same answer every time, so it runs once per model and name; later swaps of a model
whose modules all share its one config (the decoder-only models the pool serves) set that config's attribute,
which is all ``set_attn_implementation`` changes on such a model. Written by hand: transformers has no per-call
attention choice.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ctx_integrations.errors import InvalidOptionError

# model -> {requested name: the name set_attn_implementation resolved it to}, for models with one shared config
_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


def can_swap(model: torch.nn.Module) -> bool:
    """Whether ``model`` routes its attention through transformers' ``AttentionInterface`` (so a swap reaches it)."""
    check = getattr(model, "_can_set_attn_implementation", None)
    return check is not None and bool(check())


@contextmanager
def attention_swapped(model: torch.nn.Module, implementation: str, refusal: str | None = None) -> Iterator[None]:
    """Run ``model`` with attention ``implementation`` (a registered name) inside the block; restore its own after.

    A model that cannot take the swap raises :class:`InvalidOptionError` with ``refusal`` (what to do instead)."""
    if not can_swap(model):
        raise InvalidOptionError(refusal or f"{type(model).__name__} does not route its attention through "
                                 "transformers' AttentionInterface; use attention_kernel='eager' with this model")
    previous = model.config._attn_implementation
    set_attention(model, implementation)
    try:
        yield
    finally:
        set_attention(model, previous)


def set_attention(model: torch.nn.Module, implementation: str) -> None:
    """``model.set_attn_implementation(implementation)``, checked once per model and name (see the module doc)."""
    checked = _CHECKED.get(model)
    if checked is not None and implementation in checked:
        model.config._attn_implementation = checked[implementation]
        return
    model.set_attn_implementation(implementation)
    if _one_config(model):
        _CHECKED.setdefault(model, {})[implementation] = model.config._attn_implementation


def _one_config(model: torch.nn.Module) -> bool:
    """Whether every transformers model inside ``model`` reads ``model.config`` (a multimodal model's towers read
    configs of their own: those keep the full ``set_attn_implementation``)."""
    models = (module for module in model.modules() if hasattr(module, "set_attn_implementation"))
    return all(module.config is model.config for module in models)
