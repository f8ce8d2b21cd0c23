"""Context-aware decoding (CAD) declared as a ctx-integrations mode: the declaration only, so no torch is imported.

The entry point ``cad = "ctx_cad_mode:CAD"`` names this :class:`ModeSpec`; the library reads it to list the mode and
check its options before a model loads, and imports :mod:`ctx_cad_mode.mode` (its ``module``) the first time the
mode answers.
"""

from __future__ import annotations

from ctx_integrations.engine.core.mode_spec import ModeSpec, Option

PAPER = ("Trusting Your Evidence: Hallucinate Less with Context-aware Decoding (Shi, Han, Lewis, Tsvetkov, "
         "Zettlemoyer, Yih; NAACL 2024, arXiv:2305.14739)")
PAPER_ALPHA = 0.5  # the paper's value for its QA and summarisation tasks
# Largest alpha: (1 + alpha) x logits overflows float32 near 1e38 (inf - inf = NaN), and far below that one logit's
# rounding already outweighs the model's preferences; the paper uses 0.5 to 1.
MAX_ALPHA = 100.0

CAD = ModeSpec(
    "cad", "every document in one prompt, its logits contrasted with those of the prompt without documents",
    PAPER,
    (Option("alpha", float, PAPER_ALPHA, "weight of the contrast: (1 + alpha) x logits with the documents - alpha x "
            "logits without them (0: concat)", minimum=0.0, maximum=MAX_ALPHA),),
    module="ctx_cad_mode.mode",
)
