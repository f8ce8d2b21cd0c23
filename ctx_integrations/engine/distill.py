"""Consistency Distillation for Soft-NBCE (the Soft-NBCE paper's optional training step, Sec. 4.3).

Soft-NBCE reads a long text as independent chunks; the model never saw the other chunks, so its
fused prediction drifts from what it would say with the whole text in view. Distillation trains a
small LoRA adapter (q/v projections, rank 64) so that the chunked prediction matches the
full-context one, unsupervised, on plain text the user already has (e.g. the ingested corpus).

The paper's settings: wikitext-103 as the corpus, 5000 training samples, 2048-token chunks, LoRA
rank 64 on W_q/W_v, lr 5e-6 cosine-annealed. This command's defaults keep rank, targets, lr, tau
and beta but are sized for a quick CPU run: 200 steps (one window each), 4 chunks of 256 tokens and
64 target tokens, LoRA alpha 128 (not given in the paper), any text. ``--steps 5000 --chunk-tokens
2048`` on wikitext-style text is closer to the paper (see docs/soft_nbce.md).

One training example is a window of ``n_chunks * chunk_tokens + target_tokens`` tokens:
context C (the first part) and continuation Y (the rest).
- Teacher: the base model (adapter disabled) over C + Y, predicting each token of Y.
- Student: the adapted model over n streams ``chunk_k + Y`` and a prior stream ``Y`` alone, fused
  with the Soft-NBCE rule (entropy weights, prior contrast) into one distribution per token of Y.
Loss: KL(teacher || student) averaged over Y's tokens (the first token of Y is skipped: the prior
stream has nothing to predict it from). No top-p filter in training (rho = 1, where the paper's rule
and the ``nbce_code`` variant coincide: full entropy, unfiltered prior): the nucleus masks have no
gradient and all tokens carry teacher mass. Optimiser: AdamW, lr 5e-6, cosine schedule.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ctx_integrations.engine.core.lora import require_peft
from ctx_integrations.engine.core.model import LoadedModel
from ctx_integrations.engine.modes.soft_nbce import contrast_chunks, truncated_entropy
from ctx_integrations.errors import InvalidOptionError

CONFIG_FILE = "ctx_distill.json"
DESCRIPTION = ("Train a LoRA adapter by Consistency Distillation (Soft-NBCE) on plain text. The paper trains on "
               "wikitext-103, 5000 samples, 2048-token chunks, rank 64, lr 5e-6; the defaults here are sized for a "
               "quick CPU run (200 steps, 4 chunks of 256 tokens): raise --steps and --chunk-tokens to follow it.")


@dataclass
class DistillConfig:
    """Training settings. Rank 64 on q/v, lr 5e-6 cosine, tau 0.1 and beta 0.25 are the paper's; the sizes
    are not: the paper trains on 5000 samples with 2048-token chunks (wikitext-103), these defaults run
    200 steps over 4 chunks of 256 tokens for a quick CPU run. Alpha is not given in the paper."""

    rank: int = 64
    alpha: float = 128.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    lr: float = 5e-6
    steps: int = 200
    warmup_steps: int = 10
    chunk_tokens: int = 256
    n_chunks: int = 4
    target_tokens: int = 64
    tau: float = 0.1
    beta: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        self.target_modules = tuple(self.target_modules)
        for name in ("rank", "steps", "chunk_tokens", "n_chunks"):
            if getattr(self, name) < 1:
                raise InvalidOptionError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.target_tokens < 2:
            raise InvalidOptionError(f"target_tokens must be >= 2, got {self.target_tokens}")
        if not (self.lr > 0 and self.tau > 0 and self.alpha > 0) or self.beta < 0 or self.warmup_steps < 0:
            raise InvalidOptionError("lr, tau and alpha must be > 0; beta and warmup_steps >= 0")

    @property
    def window(self) -> int:
        return self.n_chunks * self.chunk_tokens + self.target_tokens


@dataclass
class DistillReport:
    """What a run did: the KL per step and where the adapter went."""

    losses: list[float] = field(default_factory=list)
    windows: int = 0
    output_dir: str | None = None


def token_windows(tokenizer: object, texts: Iterable[str], config: DistillConfig) -> list[torch.Tensor]:
    """Non-overlapping windows of ``config.window`` tokens from the texts joined by blank lines."""
    ids: list[int] = []
    for text in texts:
        if text.strip():
            ids.extend(tokenizer(text.strip() + "\n\n", add_special_tokens=False)["input_ids"])
    count = len(ids) // config.window
    if count == 0:
        raise InvalidOptionError(
            f"the text has {len(ids)} tokens but one training window needs {config.window} "
            f"(n_chunks * chunk_tokens + target_tokens): give more text or lower those settings")
    return [torch.tensor(ids[i * config.window:(i + 1) * config.window]) for i in range(count)]


def _next_token_logprobs(model: torch.nn.Module, ids: torch.Tensor, first: int) -> torch.Tensor:
    """Log-probs predicting tokens ``first+1 .. end`` of each row of ``ids`` ([B, T]) -> [B, T-first-1, V]."""
    logits = model(input_ids=ids, use_cache=False).logits[:, first:-1]
    return torch.log_softmax(logits.float(), -1)


def consistency_kl(model: torch.nn.Module, window: torch.Tensor, config: DistillConfig,
                   teacher: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> torch.Tensor:
    """KL(full-context teacher || chunked Soft-NBCE student) on one window, averaged over Y's tokens.

    ``teacher(ids, first)`` gives the teacher's log-probs; by default ``model`` itself without
    gradient (use the adapter-disabled model while training).
    """
    window = window.to(next(model.parameters()).device)
    context_len = config.n_chunks * config.chunk_tokens
    target = window[context_len:]
    teacher = teacher or (lambda ids, first: _next_token_logprobs(model, ids, first).detach())
    with torch.no_grad():
        teacher_lp = teacher(window.unsqueeze(0), context_len)[0]  # predicts Y[1:]
    chunks = window[:context_len].view(config.n_chunks, config.chunk_tokens)
    streams = torch.cat([chunks, target.expand(config.n_chunks, -1)], dim=1)
    chunk_lp = _next_token_logprobs(model, streams, config.chunk_tokens)  # [n, |Y|-1, V]
    prior_lp = _next_token_logprobs(model, target.unsqueeze(0), 0)[0]  # [|Y|-1, V]
    keep = torch.ones_like(chunk_lp, dtype=torch.bool)
    weights = torch.softmax(-truncated_entropy(chunk_lp, keep) / config.tau, dim=0).unsqueeze(-1)
    scores = contrast_chunks(prior_lp, chunk_lp, keep[0], keep, config.beta)
    student_lp = torch.log_softmax((weights * scores).sum(0), -1)
    return (teacher_lp.exp() * (teacher_lp - student_lp)).sum(-1).mean()


def _cosine(step: int, config: DistillConfig) -> float:
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def distill(loaded: LoadedModel, texts: Iterable[str], output_dir: str | Path | None,
            config: DistillConfig | None = None, log: Callable[[int, float], None] | None = None) -> DistillReport:
    """Train a LoRA adapter by Consistency Distillation on ``texts``; save it to ``output_dir``.

    The loaded model is restored unchanged afterwards (the adapter is unloaded, not merged);
    load the result with ``Engine.from_pretrained(model, adapter=output_dir)``. ``log(step, kl)``
    is called after every step.
    """
    require_peft()
    from peft import LoraConfig, get_peft_model

    config = config or DistillConfig()
    windows = token_windows(loaded.tokenizer, texts, config)
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    model = loaded.model
    grad_flags = {name: p.requires_grad for name, p in model.named_parameters()}
    peft_model = get_peft_model(model, LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0,
                                                  target_modules=list(config.target_modules)))

    def teacher(ids: torch.Tensor, first: int) -> torch.Tensor:
        with peft_model.disable_adapter():
            return _next_token_logprobs(peft_model, ids, first)

    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _cosine(step, config))
    report = DistillReport(windows=len(windows))
    order: list[int] = []
    try:
        peft_model.train()
        for step in range(config.steps):
            if not order:
                order = rng.sample(range(len(windows)), len(windows))
            loss = consistency_kl(peft_model, windows[order.pop()], config, teacher)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            report.losses.append(float(loss.detach()))
            if log is not None:
                log(step, report.losses[-1])
        if output_dir is not None:
            save_adapter(peft_model, Path(output_dir), loaded.name, config, report)
            report.output_dir = str(output_dir)
    finally:
        peft_model.unload()
        for name, p in model.named_parameters():
            p.requires_grad_(grad_flags.get(name, p.requires_grad))
        model.eval()
    return report


def save_adapter(peft_model: torch.nn.Module, output_dir: Path, base_name: str, config: DistillConfig,
                 report: DistillReport) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(output_dir))
    info = {"base_model": base_name, "config": asdict(config), "losses": report.losses, "windows": report.windows}
    (output_dir / CONFIG_FILE).write_text(json.dumps(info, indent=2))


def read_texts(paths: Sequence[str | Path]) -> list[str]:
    """Plain text from files, or from every ``.txt``/``.md`` file under a folder."""
    texts = []
    for path in map(Path, paths):
        files = sorted(f for f in path.rglob("*") if f.suffix in (".txt", ".md")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise InvalidOptionError(f"{path} has no readable text files (.txt, .md)")
        texts.extend(f.read_text(encoding="utf-8", errors="replace") for f in files)
    return texts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``ctx-experts distill`` options (and, when the parser has none, its description)."""
    parser.description = parser.description or DESCRIPTION
    defaults = DistillConfig()
    parser.add_argument("texts", nargs="+", help="plain-text files or folders (.txt/.md) to distill on "
                        "(the paper: wikitext-103; any prose works)")
    parser.add_argument("--output", "-o", required=True, help="folder to save the LoRA adapter in")
    parser.add_argument("--model", default=None, help="HF id, local folder or .gguf (default: the embedded model)")
    paper = {"rank": "the paper: 64", "steps": "the paper: 5000 samples", "chunk_tokens": "the paper: 2048",
             "lr": "the paper: 5e-6, cosine", "tau": "the paper: 0.1", "beta": "the paper: 0.25",
             "n_chunks": "up to 16 in the paper's NIAH evaluation; not given for training",
             "alpha": "not given in the paper"}
    for name in ("rank", "steps", "warmup_steps", "chunk_tokens", "n_chunks", "target_tokens", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name),
                            help=f"default %(default)s ({paper[name]})" if name in paper else "default %(default)s")
    for name in ("alpha", "lr", "tau", "beta"):
        parser.add_argument(f"--{name}", type=float, default=getattr(defaults, name),
                            help=f"default %(default)s ({paper[name]})")
    parser.add_argument("--target-modules", nargs="+", default=list(defaults.target_modules))


def run_command(args: argparse.Namespace) -> int:
    """Run ``ctx-experts distill`` from parsed arguments."""
    from ctx_integrations.engine.core.model import load_model

    names = ("rank", "alpha", "lr", "steps", "warmup_steps", "chunk_tokens", "n_chunks", "target_tokens", "tau",
             "beta", "seed")
    config = DistillConfig(target_modules=tuple(args.target_modules), **{n: getattr(args, n) for n in names})
    loaded = load_model(args.model)
    report = distill(loaded, read_texts(args.texts), args.output, config,
                     log=lambda step, kl: print(f"step {step + 1}/{config.steps}  KL {kl:.5f}", flush=True))
    print(f"trained on {report.windows} windows; adapter saved to {report.output_dir}. "
          f"Use it with Engine.from_pretrained({args.model!r}, adapter={report.output_dir!r})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ctx-experts distill", description=DESCRIPTION, allow_abbrev=False)
    add_arguments(parser)
    return run_command(parser.parse_args(argv))
