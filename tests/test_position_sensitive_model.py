"""The position-sensitive tiny model (``tiny_loaded(..., position_sensitive=True)``) really reacts to positions.

Position bugs (a question placed after the sum instead of the max of the documents' lengths, a
context at the wrong offset) only fail a greedy-parity test if the model's answer moves when a token
moves; the default tiny model's does not for shifts of 100 positions.
"""

from __future__ import annotations

import pytest
import torch

from ctx_integrations import Engine
from tests.helpers import tiny_loaded

DOCUMENT = "The mayor of Marrowgate is Ilsa Brenn, elected in 2019."
QUESTION = "Who is the mayor of Marrowgate?"


def greedy_with_positions(model: torch.nn.Module, ids: list[int], positions: list[int], steps: int) -> list[int]:
    """Greedy decoding with explicit position ids (each new token one position after the last)."""
    ids, positions, out = list(ids), list(positions), []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions])).logits[0, -1]
            out.append(int(logits.argmax()))
            ids.append(out[-1])
            positions.append(positions[-1] + 1)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_position_sensitive_model_reacts_to_a_one_position_shift(family):
    loaded = tiny_loaded(family, seed=0, position_sensitive=True)
    layout = Engine(loaded).layout
    context = layout.prefix_ids + layout.context_ids(DOCUMENT)
    ids = context + layout.suffix_ids(QUESTION)
    positions = list(range(len(ids)))
    shifted = positions[:len(context)] + [p + 1 for p in positions[len(context):]]  # the question one later
    plain = greedy_with_positions(loaded.model, ids, positions, 8)
    moved = greedy_with_positions(loaded.model, ids, shifted, 8)
    assert len(set(plain)) > 3  # not one repeated token
    assert plain != moved
    # a uniform shift of every position leaves RoPE attention unchanged: only relative moves matter
    uniform = greedy_with_positions(loaded.model, ids, [p + 1 for p in positions], 8)
    assert uniform == plain
