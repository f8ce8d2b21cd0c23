"""Is the logits' own dtype exact enough for PCED's rule? Its choices in bf16 / fp16 against fp32, on real logits.

The runner hands the rules fp32 logits (a bf16 model's are upcast: on a GPU one more pass over rows x vocabulary
per step). Whether the rule could stay in the model's dtype is a question of exactness: PCED's greedy token is
an argmax over max-over-experts scores, and a low-precision score changes the token wherever the best two
candidates are closer than the dtype resolves at their magnitude (bf16 keeps 8 significant bits: a step of
0.0625 between 8 and 16, where log-probabilities live; fp16 keeps 11: 0.0078). This script answers real
questions with ``mode="pced"`` (the engine's fp32 rule decides every token), and at every step evaluates the
same formula (:func:`~ctx_integrations.engine.modes.pced.max_fused`) on the same logits in each lower dtype,
counting the steps whose token or winning expert would differ, and the fp32 gap between the best two
candidates (how close the decisions come).

    python -m benchmarks.rule_dtype --model qwen2.5-coder-0.5b --questions 20 \\
        --data nq_open_passages.jsonl.gz nq_open_dev.jsonl.gz --store DIR    # NQ-open, real retrieval
    python -m benchmarks.rule_dtype --quick     # the embedded model, 2 invented-world questions (CI smoke)
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

# float32 is the control: the same formula in the engine's own dtype must never differ from the engine's choice
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _lower_step(rule: Any, logits: torch.Tensor, state: Any, dtype: torch.dtype) -> tuple[int, int]:
    """PCED's greedy token and winner from :func:`max_fused` evaluated in ``dtype`` (what the rule does in fp32)."""
    from ctx_integrations.engine.modes import pced

    low = logits.to(dtype)
    given = state.carry if state.carry is not None else rule.fixed_beta
    experts = low.shape[0] - 1
    beta = torch.zeros(1, experts, dtype=dtype) if given is None else given.to(dtype).unsqueeze(0)
    dynamic = torch.tensor([0] if given is None else [], dtype=torch.long)
    adjusted, _ = pced.max_fused(low.unsqueeze(0), None, rule.log_prior.to(dtype).unsqueeze(0),
                                 torch.tensor([rule.gamma], dtype=dtype), beta, dynamic, rule.score_space)
    token = int(adjusted[0].max(0).values.argmax())
    return token, int(adjusted[0][:, token].argmax())


@contextmanager
def watched(dtypes: list[str], record: dict[str, Any]) -> Iterator[None]:
    """Every PCED step of the engine also evaluated in ``dtypes``; counts land in ``record``."""
    from ctx_integrations.engine.modes import pced

    original = pced.PCEDFusion.__call__

    def call(rule: Any, logits: torch.Tensor, state: Any = pced.FIRST_STEP) -> Any:
        fused = original(rule, logits, state)
        token = int(fused.scores.argmax())
        winner = int(fused.evidence[:, token].argmax())
        best = fused.scores.topk(2).values
        record["gaps"].append(float(best[0] - best[1]))
        record["magnitudes"].append(float(best[0].abs()))
        for name in dtypes:
            low_token, low_winner = _lower_step(rule, logits.float(), state, DTYPES[name])
            record[name]["tokens"] += low_token != token
            record[name]["winners"] += low_token == token and low_winner != winner
        return fused

    pced.PCEDFusion.__call__ = call
    try:
        yield
    finally:
        pced.PCEDFusion.__call__ = original


def resolution(dtype: torch.dtype, magnitude: float) -> float:
    """The dtype's spacing between representable numbers at ``magnitude`` (what one rounding can move a score)."""
    value = torch.tensor(max(magnitude, 1e-3), dtype=dtype)
    return float(torch.nextafter(value, torch.tensor(float("inf"), dtype=dtype)) - value)


def _examples(args: argparse.Namespace) -> list[Any]:
    from ctx_integrations.evaluation.nq import nq_set
    from ctx_integrations.evaluation.sets import world_set

    if args.data:
        return nq_set(args.data, args.questions, seed=args.seed, store_dir=args.store)
    return world_set(args.questions, seed=args.seed)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from benchmarks.common import add_engine_arguments, engine_from_arguments, print_table, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(parser)
    parser.add_argument("--data", nargs=2, type=Path, default=None,
                        help="NQ-open passages and questions files (default: the invented-world set)")
    parser.add_argument("--store", type=Path, default=None, help="the NQ index folder (as `eval --store`)")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtypes", default="bfloat16,float16,float32",
                        help="comma-separated, of " + ", ".join(DTYPES) + " (float32: the control, always 0)")
    parser.add_argument("--quick", action="store_true", help="2 invented-world questions, 8 new tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.questions, args.max_new_tokens, args.data = 2, 8, None
    dtypes = args.dtypes.split(",")
    unknown = [name for name in dtypes if name not in DTYPES]
    if unknown:
        parser.error(f"--dtypes: {', '.join(unknown)} not among {', '.join(DTYPES)}")
    engine = engine_from_arguments(args)
    record: dict[str, Any] = {"gaps": [], "magnitudes": [], **{name: {"tokens": 0, "winners": 0} for name in dtypes}}
    with watched(dtypes, record):
        for example in _examples(args):
            engine.generate(example.question, list(example.documents), mode="pced",
                            max_new_tokens=args.max_new_tokens)
    gaps, steps = record["gaps"], len(record["gaps"])
    typical = statistics.median(record["magnitudes"]) if steps else 0.0
    rows = [{"dtype": name, "steps": steps, "tokens_differ": record[name]["tokens"],
             "winners_differ": record[name]["winners"], "min_gap": min(gaps, default=None),
             "median_gap": statistics.median(gaps) if gaps else None,
             "resolution_at_median_score": resolution(DTYPES[name], typical),
             "steps_closer_than_resolution": sum(gap < resolution(DTYPES[name], magnitude)
                                                 for gap, magnitude in zip(gaps, record["magnitudes"]))}
            for name in dtypes]
    print_table(rows, ["dtype", "steps", "tokens_differ", "winners_differ", "min_gap", "median_gap",
                       "resolution_at_median_score", "steps_closer_than_resolution"])
    write_results("rule_dtype", rows, {k: str(v) for k, v in vars(args).items()}, args.output)
    return rows


if __name__ == "__main__":
    main()
