"""``engine/core/static_decode.py``: the fixed-shape decode step gives the same logits as the growing DynamicCache."""

from __future__ import annotations

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.cache import batch_sequences
from ctx_integrations.engine.core.decoding import forward_sequences
from ctx_integrations.engine.core.static_decode import StaticSequences, default_compile_mode
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import tiny_loaded

DOCS = ["Marrowgate is the capital of Veloria and lies on the river Ast.",
        "The mayor of Marrowgate is Ilsa Brenn, elected in 2019. She was born in the northern hills of Veloria."]


def two_copies(engine: Engine, question: str):
    """The same right-padded streams twice (an amateur and two documents of different lengths), after the question."""
    layout, store = engine.layout, engine.store
    suffix = torch.tensor([layout.suffix_ids(question)] * 3)
    copies = []
    for _ in range(2):
        streams = batch_sequences(store.prefix(layout), [None] + store.documents(layout, DOCS))
        copies.append((streams, forward_sequences(engine.loaded.model, streams, suffix)))
    return copies


@pytest.mark.parametrize("backend", ["none", "eager"])
def test_static_steps_equal_dynamic_steps(backend):
    # Padding columns between a short stream's tokens and its new tokens must stay hidden, each stream must keep its
    # own position, and the mask's next column must open before the step: any slip changes the logits.
    engine = Engine(tiny_loaded(seed=1))
    (dynamic, first), (source, _) = two_copies(engine, "Who is the mayor?")
    assert len(set(dynamic.positions.tolist())) == 3  # three different stream lengths
    static = StaticSequences(engine.loaded.model, source, max_new_tokens=5,
                           compile_mode=None, backend="inductor" if backend == "none" else backend)
    tokens = first.argmax(-1, keepdim=True)
    for _ in range(5):
        expected = forward_sequences(engine.loaded.model, dynamic, tokens)
        got = static.step(tokens)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        tokens = expected.argmax(-1, keepdim=True)
    assert static.remaining == 0
    with pytest.raises(InvalidOptionError, match="is full"):
        static.step(tokens)


def test_streams_with_per_step_kwargs_are_refused_and_cuda_gets_cuda_graphs():
    engine = Engine(tiny_loaded(seed=1))
    (streams, _), _ = two_copies(engine, "Who?")
    streams.forward_kwargs["ape_layout"] = object()
    with pytest.raises(InvalidOptionError, match="ape_layout"):
        StaticSequences(engine.loaded.model, streams, max_new_tokens=2)
    assert default_compile_mode(torch.device("cuda")) == "reduce-overhead"
    assert default_compile_mode(torch.device("cpu")) is None
