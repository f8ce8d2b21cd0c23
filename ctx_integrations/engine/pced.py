"""PCED mode: an amateur stream plus one expert per document, fused per token (METHODS.md "PCED")."""

from __future__ import annotations

from ctx_integrations.engine.experts import run_expert_streams
from ctx_integrations.engine.fusion import PCEDFusion
from ctx_integrations.engine.modes import DecodeContext, register_mode
from ctx_integrations.engine.streams import DecodeResult


@register_mode("pced")
def run_pced(ctx: DecodeContext, *, beta: float | None = None, gamma: float = 2.5, score_space: str = "logprobs",
             aggregation: str = "max") -> DecodeResult:
    """Parallel Context-of-Experts Decoding.

    beta: None = dynamic (per-expert JSD at the first token, then fixed), or a fixed float >= 0.
    gamma: weight of the retrieval prior gamma * log r_k (2.5, the paper's default).
    score_space: "logprobs" (default: experts comparable) or "logits" (the paper's literal rule).
    aggregation: "max" (token-level expert switching, default), "mixture" or "product".
    """
    rule = PCEDFusion([d.score for d in ctx.documents], beta=beta, gamma=gamma, score_space=score_space,
                      aggregation=aggregation)
    result = run_expert_streams(ctx, rule)
    result.extra["beta"] = [round(float(b), 6) for b in rule.beta] if rule.beta is not None else None
    return result
