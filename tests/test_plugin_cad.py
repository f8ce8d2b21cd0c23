"""The test plugin's mode ``cad`` (tests/plugin_modes, package ctx-cad-mode): found through its entry point, its
option checked from its declaration, and its answer the paper's formula.

Context-aware decoding (Shi et al. 2024): ``(1 + alpha) * logits(with the documents) - alpha * logits(without)``.
The reference is two plain forwards of the tiny model per step (fp32, no cache), so a row built wrong (the
documents in the no-context row, a position off) or a rule written wrong changes the tokens.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from ctx_integrations import Engine, available_modes, check_mode, mode_spec
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import last_logits, tiny_loaded

DOCS = ["Marrowgate is the capital of Veloria and lies on the river Ast.",
        "The mayor of Marrowgate is Ilsa Brenn, elected in 2019."]
QUESTION = "Who is the mayor of Marrowgate?"
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    assert "cad" in available_modes(), ("the test plugin is not installed: pip install --no-deps -e "
                                        "tests/plugin_modes (make .venv/.dev does)")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama", seed=2, position_sensitive=True))


def test_cad_is_found_through_the_plugins_entry_point():
    (point,) = [ep for ep in importlib.metadata.entry_points(group="ctx_integrations.modes") if ep.name == "cad"]
    assert point.value == "ctx_cad_mode:CAD" and point.dist.name == "ctx-cad-mode"
    spec = mode_spec("cad")
    assert point.load() is spec and spec.module == "ctx_cad_mode.mode"
    assert [(o.name, o.kind, o.default, o.minimum) for o in spec.options] == [("alpha", float, 0.5, 0.0)]
    assert "Context-aware Decoding" in spec.paper


@pytest.mark.parametrize(("options", "says"), [
    ({"alpha": "x"}, "mode 'cad': option alpha must be a number in [0, 100], got 'x'"),
    ({"alpha": -1}, "mode 'cad': option alpha must be a number in [0, 100], got -1"),
    ({"alpha": float("nan")}, "mode 'cad': option alpha must be a number in [0, 100], got nan"),
    ({"alpah": 1.0}, "mode 'cad' does not accept alpah; its options are: alpha (did you mean alpha?)"),
])
def test_its_option_is_checked_from_its_declaration(engine, options, says):
    with pytest.raises(InvalidOptionError) as caught:
        check_mode("cad", options)
    assert str(caught.value) == says
    with pytest.raises(InvalidOptionError) as caught:  # the engine refuses it too, before planning
        engine.generate(QUESTION, DOCS, mode="cad", max_new_tokens=1, **options)
    assert str(caught.value) == says


def _by_hand(engine: Engine, alpha: float) -> list[int]:
    """Greedy tokens of ``(1 + alpha) * l_ctx - alpha * l_noctx``, each from a plain forward of the whole prompt."""
    layout = engine.layout
    with_docs = layout.prefix_ids + [t for d in DOCS for t in layout.context_ids(d)] + layout.suffix_ids(QUESTION)
    without = layout.prefix_ids + layout.suffix_ids(QUESTION)
    tokens: list[int] = []
    for _ in range(STEPS):
        logits = last_logits(engine.loaded, [with_docs + tokens, without + tokens])
        tokens.append(int(torch.argmax((1 + alpha) * logits[0] - alpha * logits[1])))
    return tokens


@pytest.mark.parametrize("alpha", [0.5, 2.0])
def test_greedy_cad_is_the_argmax_of_the_contrast_of_two_plain_forwards(engine, alpha):
    answer = engine.generate(QUESTION, DOCS, mode="cad", alpha=alpha, max_new_tokens=STEPS)
    assert answer.token_ids == _by_hand(engine, alpha)


def test_the_contrast_changes_the_answer_and_alpha_zero_is_concat(engine):
    """Bug caught: a rule that ignores the no-context row (it would pass the parity above only where they agree)."""
    concat = engine.generate(QUESTION, DOCS, mode="concat", max_new_tokens=STEPS).token_ids
    assert engine.generate(QUESTION, DOCS, mode="cad", alpha=0.0, max_new_tokens=STEPS).token_ids == concat
    assert _by_hand(engine, 0.0) == concat
    assert _by_hand(engine, 2.0) != concat
