"""Decode levers: every way torch offers to speed up one CPU decode step, each against fp32 eager in the same run.

The library decodes the embedded SmolLM2-135M (a dequantised Q4_1 GGUF) in fp32 eager on the CPU; a
one-row step reads all ~540 MB of fp32 weights. Each lever below is a small named function that returns
a transformed copy of the model (or the same model with a compiled step):

* ``fp32-eager``: the model as the library runs it, ``DynamicCache``; the reference of every ratio.
* ``fp32-compiled``: ``torch.compile`` (inductor, ``fullgraph=True``, ``dynamic=False``) of the model's
  forward, decoding over transformers' ``StaticCache`` (fixed shapes; the prefill runs eager).
* ``bf16``: weights and activations in bfloat16.
* ``int8-dynamic-per-channel`` / ``int8-dynamic-per-tensor``: ``torch.ao.quantization.quantize_dynamic``
  (int8 weights, activations quantised per call; the ``x86``/fbgemm engine) of every ``nn.Linear``,
  decoder and ``lm_head``.
* ``torchao-int8-weight-only``: torchao's ``Int8WeightOnlyConfig`` on every ``nn.Linear``, eager. torchao is
  not a dependency: without it the lever is reported as skipped with the pip command.
* ``int4-g32`` / ``int4-g32-fp32``: the decoder's linears as 4-bit groups of 32 (min/max, the GGUF's own
  Q4_1 layout, so requantising its dequantised weights is exact) through torch's CPU int4 kernel
  ``aten._weight_int4pack_mm_for_cpu``, with bf16 (``int4-g32``) or fp32 activations; ``lm_head``
  (the GGUF's Q8_0 embedding, tied) stays in the activation dtype.

Per lever: milliseconds per decode step at 1 and 8 rows over a cache of ``--context`` random tokens
(their keys and values computed once by fp32 eager and copied into each lever's cache), tokens/s, the
speedup over fp32 eager (per repeat, the levers alternating within each repeat, then the median), the
seconds to build the lever and to run its first steps (compiling included), and quality against fp32
eager on the demo questions (each over its source document, the prompt ``concat`` builds): the largest
|logit difference| at the first step and over the steps whose inputs still agree, and greedy agreement,
the tokens before the first difference over the reference's tokens (``--new-tokens`` each, stopping at
EOS). ``--llama-bench-json`` adds llama.cpp's decode speed from a ``benchmarks/peer_llamacpp.py``
results file, labelled as that run's.

Hand-written here, because no installed library does it: the int4 linear (torch ships the kernel and
its packing op, not a module; torchao's int4 configs are an optional dependency), and the prefill/step
loop over a ``StaticCache`` (transformers' ``generate`` would hide the per-step time; positions come from
the cache's own length, as transformers 5 computes them). Everything else is torch, torch.ao, torchao or
transformers as they ship.

Run::

    python -m benchmarks.decode_levers --threads 1 --repeats 3 --output benchmarks/results/decode_levers.json
    python -m benchmarks.decode_levers --quick --levers fp32-eager,int8-dynamic-per-channel
    PYTHONPATH=/path/to/torchao python -m benchmarks.decode_levers ...   # torchao outside the venv

Measured table and conclusions: docs/decode-levers.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import median, print_table, write_results  # noqa: E402

REFERENCE = "fp32-eager"
TORCHAO_PIP = "pip install torchao==0.18.0"
COLUMNS = ("lever", "rows", "ms_per_step", "tok_s", "speedup_vs_fp32_eager", "prepare_s", "warmup_s",
           "max_abs_dlogit", "max_abs_dlogit_steps", "agreement", "status")
INT4_GROUP = 32


class LeverUnavailableError(RuntimeError):
    """A lever cannot be built here (a missing optional package); the message says how to get it."""


@dataclass
class Prepared:
    """A lever applied: the module to run, the forward its decode steps call, and whether they need fixed shapes."""

    model: torch.nn.Module
    step_forward: Callable[..., Any]
    static_cache: bool = False


# -- the levers ----------------------------------------------------------------------------------------
def fp32_eager(model: torch.nn.Module) -> Prepared:
    """The model untouched (the library's CPU default): the reference of every ratio and of quality."""
    return Prepared(model, model.forward)


def fp32_compiled(model: torch.nn.Module) -> Prepared:
    """The same weights, decode steps through inductor; ``dynamic=False`` compiles one graph per row count
    (a dynamic batch dimension would cost the static graph its specialisation)."""
    return Prepared(model, torch.compile(model.forward, fullgraph=True, dynamic=False), static_cache=True)


def bf16(model: torch.nn.Module) -> Prepared:
    """Half the bytes per weight; Zen 3 has no bf16 arithmetic, so the gain can only come from memory traffic."""
    copied = copy.deepcopy(model).to(torch.bfloat16)
    return Prepared(copied, copied.forward)


def _int8_dynamic(model: torch.nn.Module, qconfig: Any) -> Prepared:
    from torch.ao.quantization import quantize_dynamic

    copied = quantize_dynamic(model, {torch.nn.Linear: qconfig}, dtype=torch.qint8)  # a copy (inplace=False)
    return Prepared(copied, copied.forward)


def int8_dynamic_per_channel(model: torch.nn.Module) -> Prepared:
    """int8 weights with one scale per output channel; activations quantised per tensor at every call."""
    from torch.ao.quantization import per_channel_dynamic_qconfig

    return _int8_dynamic(model, per_channel_dynamic_qconfig)


def int8_dynamic_per_tensor(model: torch.nn.Module) -> Prepared:
    """int8 weights with one scale per matrix: coarser than per channel, measured to show what that costs."""
    from torch.ao.quantization import default_dynamic_qconfig

    return _int8_dynamic(model, default_dynamic_qconfig)


def torchao_int8_weight_only(model: torch.nn.Module) -> Prepared:
    """torchao's int8 weight-only tensors (activations stay fp32); skipped when torchao is not importable."""
    try:
        quantization = importlib.import_module("torchao.quantization")
    except ImportError as error:
        raise LeverUnavailableError(f"torchao is not installed ({error}); {TORCHAO_PIP}") from error
    copied = copy.deepcopy(model)
    quantization.quantize_(copied, quantization.Int8WeightOnlyConfig())
    return Prepared(copied, copied.forward)


class Int4Linear(torch.nn.Module):
    """A linear layer of 4-bit weights in groups of ``group`` input columns (min/max per group), run by
    ``aten._weight_int4pack_mm_for_cpu``; torch ships the kernel and its packing op but no module.

    The kernel computes ``(q - 8) * scale + zero`` per weight, so ``zero = min + 8 * scale``. Scales and
    zeros are kept in the activations' dtype, which the kernel requires to match.
    """

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype, group: int = INT4_GROUP):
        super().__init__()
        weight = linear.weight.detach().float()
        out_features, in_features = weight.shape
        if in_features % group:
            raise ValueError(f"{in_features} input features are not a multiple of the group size {group}")
        groups = weight.reshape(out_features, in_features // group, group)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-8)
        quantised = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        self.group, self.out_features = group, out_features
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            quantised.reshape(out_features, in_features), 1))
        # the kernel's layout: [in_features / group, out_features, (scale, zero)]
        self.register_buffer("scales_and_zeros",
                             torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(dtype))
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_zeros)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def _int4(model: torch.nn.Module, dtype: torch.dtype) -> Prepared:
    """Every decoder ``nn.Linear`` (``model.model``) as :class:`Int4Linear`, quantised from the fp32 weights
    before the rest of the model is cast to ``dtype``; ``lm_head`` stays a plain linear in ``dtype``."""
    copied = copy.deepcopy(model)
    for module in list(copied.model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, Int4Linear(child, dtype))
    copied = copied.to(dtype)  # casts the floating buffers too; the packed weights are uint8 and stay
    return Prepared(copied, copied.forward)


def int4_g32(model: torch.nn.Module) -> Prepared:
    """4-bit weights (a quarter of bf16's bytes) with bf16 activations: the kernel's fast path on this CPU."""
    return _int4(model, torch.bfloat16)


def int4_g32_fp32(model: torch.nn.Module) -> Prepared:
    """The same 4-bit weights with fp32 activations: separates the cost of 4 bits from the cost of bf16."""
    return _int4(model, torch.float32)


LEVERS: dict[str, Callable[[torch.nn.Module], Prepared]] = {
    "fp32-eager": fp32_eager,
    "fp32-compiled": fp32_compiled,
    "bf16": bf16,
    "int8-dynamic-per-channel": int8_dynamic_per_channel,
    "int8-dynamic-per-tensor": int8_dynamic_per_tensor,
    "torchao-int8-weight-only": torchao_int8_weight_only,
    "int4-g32": int4_g32,
    "int4-g32-fp32": int4_g32_fp32,
}


# -- decoding ------------------------------------------------------------------------------------------
class Decoder:
    """Prefill and one-token steps of one lever, ``rows`` sequences at a time.

    Levers with ``static_cache`` keep one ``StaticCache`` of ``max_len`` columns per row count and reset it
    for each prefill: a compiled step guards on the cache's shapes, so one size for every measurement and
    question means one compilation per row count. Positions need no argument: the model takes them from
    the cache's length.
    """

    def __init__(self, prepared: Prepared, max_len: int):
        self.prepared, self.max_len = prepared, max_len
        self._static: dict[int, Any] = {}
        self._cache: Any = None
        self._length = 0

    def _fresh_cache(self, rows: int) -> Any:
        from transformers import DynamicCache, StaticCache

        if not self.prepared.static_cache:
            return DynamicCache()
        cache = self._static.get(rows)
        if cache is None:
            cache = self._static[rows] = StaticCache(config=self.prepared.model.config, max_cache_len=self.max_len)
        else:
            cache.reset()
        return cache

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` ``[rows, length]`` into a fresh cache (eagerly); return the last position's logits (fp32)."""
        rows, length = ids.shape
        if length > self.max_len:
            raise ValueError(f"a prompt of {length} tokens does not fit a cache of {self.max_len}")
        self._cache = self._fresh_cache(rows)
        out = self.prepared.model(input_ids=ids, past_key_values=self._cache, use_cache=True, logits_to_keep=1)
        self._length = length
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def resume(self, keys_values: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start from keys and values computed elsewhere (``[rows, heads, length, dim]`` per layer), copied into a
        fresh cache of this lever's kind and activation dtype (its embedding's)."""
        rows, _, length, _ = keys_values[0][0].shape
        if length > self.max_len:
            raise ValueError(f"a context of {length} tokens does not fit a cache of {self.max_len}")
        self._cache = self._fresh_cache(rows)
        dtype = self.prepared.model.get_input_embeddings().weight.dtype
        for index, (keys, values) in enumerate(keys_values):
            self._cache.update(keys.to(dtype), values.to(dtype), index)
        self._length = length

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row (``[rows, 1]``); return the next logits ``[rows, vocab]`` (fp32)."""
        if self._length >= self.max_len:
            raise ValueError(f"the cache holds {self.max_len} tokens and is full")
        out = self.prepared.step_forward(input_ids=tokens, past_key_values=self._cache, use_cache=True,
                                         logits_to_keep=1)
        self._length += 1
        return out.logits[:, -1].float()


@dataclass(frozen=True)
class Plan:
    """What one run measures: the same for every lever."""

    rows: tuple[int, ...] = (1, 8)
    context: int = 300
    warmup_steps: int = 3
    steps: int = 32
    repeats: int = 3
    new_tokens: int = 32

    def max_len(self, prompts: Sequence[Sequence[int]]) -> int:
        """One cache size for the speed runs and every question (so a compiled step compiles once per row count)."""
        longest = max((len(p) for p in prompts), default=0)
        return max(self.context + self.warmup_steps + self.steps, longest + self.new_tokens)


@torch.inference_mode()
def context_keys_values(model: torch.nn.Module, rows: int, length: int,
                        seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the keys and values of ``rows`` x ``length`` random tokens, computed once by ``model``.

    Every lever's timed steps start from a copy of these: a step's cost depends on the cache's shape, not
    its values, and some levers' own prefill is slow (the fp32 int4 kernel takes ~0.2 s a token, bf16 runs
    without bf16 arithmetic here) without that being what this benchmark measures.
    """
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(model.config.vocab_size), (rows, length), generator=generator)
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers]


def time_decode(decoder: Decoder, context: Sequence[tuple[torch.Tensor, torch.Tensor]], plan: Plan,
                seed: int) -> tuple[float, float]:
    """(ms per step, seconds of the warm-up steps), the lever's cache holding ``context`` (one row per its row).

    The first step's tokens are random; later steps feed back their own argmax, as greedy decoding does.
    The warm-up steps come first and are timed apart: for a compiled lever their time is the compilation's.
    """
    generator = torch.Generator().manual_seed(seed)
    rows = context[0][0].shape[0]
    decoder.resume(context)
    tokens = torch.randint(0, int(decoder.prepared.model.config.vocab_size), (rows, 1), generator=generator)
    start = time.perf_counter()
    for _ in range(plan.warmup_steps):
        tokens = decoder.step(tokens).argmax(-1, keepdim=True)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(plan.steps):
        tokens = decoder.step(tokens).argmax(-1, keepdim=True)
    return (time.perf_counter() - start) * 1000 / plan.steps, warmup_s


def greedy(decoder: Decoder, prompt: Sequence[int], new_tokens: int,
           eos: set[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy answer tokens (at most ``new_tokens``, the EOS included) and the logits ``[vocab]`` of each choice."""
    logits = decoder.prefill(torch.tensor([list(prompt)]))[0]
    tokens, chosen_from = [], []
    while True:
        token = int(logits.argmax())
        tokens.append(token)
        chosen_from.append(logits)
        if token in eos or len(tokens) >= new_tokens:
            return tokens, chosen_from
        logits = decoder.step(torch.tensor([[token]]))[0]


def common_prefix(tokens: Sequence[int], reference: Sequence[int]) -> int:
    """How many tokens agree with the reference before the first difference."""
    agreed = 0
    for ours, theirs in zip(tokens, reference):
        if ours != theirs:
            break
        agreed += 1
    return agreed


@dataclass
class Quality:
    """A lever's answers against fp32 eager's on the same prompts.

    ``max_abs_dlogit``: at the first step (the prefill's last position). ``max_abs_dlogit_steps``: over
    every step whose inputs still equal the reference's (up to and including the first differing token);
    the first alone says nothing of a compiled lever, whose prefill runs eager.
    """

    max_abs_dlogit: float
    max_abs_dlogit_steps: float
    agreed_tokens: int
    reference_tokens: int

    def fields(self) -> dict[str, Any]:
        return {"max_abs_dlogit": self.max_abs_dlogit, "max_abs_dlogit_steps": self.max_abs_dlogit_steps,
                "agreed_tokens": self.agreed_tokens, "reference_tokens": self.reference_tokens,
                "agreement": f"{self.agreed_tokens}/{self.reference_tokens}"}


def measure_quality(decoder: Decoder, prompts: Sequence[Sequence[int]],
                    reference: Sequence[tuple[list[int], list[torch.Tensor]]], new_tokens: int,
                    eos: set[int]) -> Quality:
    """Logit differences where the inputs are the same, and the greedy prefix agreement summed over the prompts."""
    first = steps = 0.0
    agreed = total = 0
    for prompt, (reference_tokens, reference_logits) in zip(prompts, reference, strict=True):
        tokens, logits = greedy(decoder, prompt, new_tokens, eos)
        same = common_prefix(tokens, reference_tokens)
        differences = [float((ours - theirs).abs().max()) for ours, theirs in zip(logits[:same + 1], reference_logits)]
        first, steps = max(first, differences[0]), max(steps, *differences)
        agreed += same
        total += len(reference_tokens)
    return Quality(first, steps, agreed, total)


# -- rows ----------------------------------------------------------------------------------------------
@dataclass
class LeverRun:
    """Everything measured of one lever: build time, warm-up per row count, ms per step per repeat, quality."""

    name: str
    prepare_s: float | None = None
    warmup_s: dict[int, float] = field(default_factory=dict)  # first measurement's warm-up (compile included)
    ms: dict[int, list[float]] = field(default_factory=dict)  # rows -> ms per step, one per repeat, in order
    quality: Quality | None = None
    skipped: str | None = None


def lever_rows(runs: Sequence[LeverRun], rows: Sequence[int], reference: str = REFERENCE) -> list[dict[str, Any]]:
    """One row per (lever, row count): medians, and the speedup over the reference of the same run.

    The speedup is taken per repeat (reference ms / lever ms, both from that repeat, the levers having
    alternated within it) and then the median, so drift on a shared machine between repeats cancels.
    """
    base = next(run for run in runs if run.name == reference)
    out = []
    for run in runs:
        for count in rows:
            row: dict[str, Any] = {"lever": run.name, "rows": count, "prepare_s": run.prepare_s,
                                   "warmup_s": run.warmup_s.get(count), "ms_per_step": None, "tok_s": None,
                                   "speedup_vs_fp32_eager": None, "runs": len(run.ms.get(count, []))}
            if run.skipped is not None:
                row["status"] = f"skipped: {run.skipped}"
            else:
                times = run.ms[count]
                row["status"] = "ok"
                row["ms_per_repeat"] = times
                row["ms_per_step"] = median(times)
                row["tok_s"] = count * 1000 / row["ms_per_step"]
                row["speedup_vs_fp32_eager"] = median([ref / ours for ref, ours in zip(base.ms[count], times,
                                                                                        strict=True)])
            row.update(run.quality.fields() if run.quality else dict.fromkeys(
                ("max_abs_dlogit", "max_abs_dlogit_steps", "agreed_tokens", "reference_tokens", "agreement")))
            out.append(row)
    return out


def llama_bench_row(path: Path, threads: int) -> dict[str, Any]:
    """llama.cpp's decode speed at ``threads`` from a ``benchmarks/peer_llamacpp.py`` JSON, labelled as that run's.

    llama-bench's decode test (``tg``) starts from an empty context, not from ``--context`` tokens, and ran
    at another time: the row carries no speedup, which this table keeps for same-run comparisons.
    """
    payload = json.loads(path.read_text())
    decode = [r for r in payload["rows"] if r.get("table") == "raw" and str(r.get("test", "")).startswith("decode")
              and r.get("system") in ("llama-bench", "llama.cpp") and r.get("threads") == threads]
    if not decode:
        found = sorted({r.get("threads") for r in payload["rows"] if r.get("table") == "raw"})
        raise ValueError(f"{path} has no llama-bench decode row at {threads} threads (threads there: {found})")
    row = decode[0]
    return {**dict.fromkeys(COLUMNS), "lever": f"llama.cpp llama-bench {row['test'].split()[-1]} (earlier run: "
            f"{path.name})", "rows": 1, "ms_per_step": 1000 / row["tok_s"], "tok_s": row["tok_s"],
            "runs": row.get("runs"), "status": "earlier run, empty context", "source": str(path),
            "baseline": payload.get("settings", {}).get("baseline")}


# -- the run -------------------------------------------------------------------------------------------
def demo_prompts(tokenizer: object) -> list[list[int]]:
    """Each demo question over its source document, as the library's ``concat`` mode lays it out."""
    from ctx_integrations.cli import load_demo_corpus
    from ctx_integrations.engine.core.layout import PromptLayout

    documents, questions = load_demo_corpus()
    by_id = {d.id: d for d in documents}
    layout = PromptLayout(tokenizer)
    return [layout.prefix_ids + layout.context_ids(by_id[q["source"]].text) + layout.suffix_ids(q["question"])
            for q in questions]


def run_levers(loaded: Any, names: Sequence[str], plan: Plan, log: Callable[[str], None] = print) -> list[LeverRun]:
    """Build every lever from ``loaded`` (a ``LoadedModel``), time them alternating per repeat, then compare their
    greedy answers to the reference's. Repeat ``r`` starts with the ``r``-th lever (the order rotates), so a burst
    of load on a shared machine does not always land on the same lever, the reference included."""
    if REFERENCE not in names:
        raise ValueError(f"the levers must include {REFERENCE}, the reference of every ratio")
    names = [REFERENCE] + [n for n in names if n != REFERENCE]
    model = loaded.model.eval()
    prompts = demo_prompts(loaded.tokenizer)
    max_len = plan.max_len(prompts)
    runs = {name: LeverRun(name) for name in names}
    decoders: dict[str, Decoder] = {}
    for name in names:
        start = time.perf_counter()
        try:
            decoders[name] = Decoder(LEVERS[name](model), max_len)
        except LeverUnavailableError as error:
            runs[name].skipped = str(error)
            log(f"  {name}: skipped ({error})")
            continue
        runs[name].prepare_s = time.perf_counter() - start
        log(f"  {name}: built in {runs[name].prepare_s:.1f} s")
    contexts = {rows: context_keys_values(model, rows, plan.context) for rows in plan.rows}
    timed = list(decoders)
    for repeat in range(plan.repeats):
        first = repeat % len(timed)
        for name in timed[first:] + timed[:first]:
            for rows in plan.rows:
                ms, warmup_s = time_decode(decoders[name], contexts[rows], plan, seed=repeat)
                runs[name].ms.setdefault(rows, []).append(ms)
                runs[name].warmup_s.setdefault(rows, warmup_s)
                log(f"  r={repeat} {name} rows={rows}: {ms:.1f} ms/step (warm-up {warmup_s:.1f} s)")
    eos = set(loaded.eos_token_ids)
    reference = [greedy(decoders[REFERENCE], p, plan.new_tokens, eos) for p in prompts]
    for name, decoder in decoders.items():
        runs[name].quality = measure_quality(decoder, prompts, reference, plan.new_tokens, eos)
        log(f"  {name}: agreement {runs[name].quality.agreed_tokens}/{runs[name].quality.reference_tokens}, "
            f"max |dlogit| {runs[name].quality.max_abs_dlogit:.3g}")
    return [runs[name] for name in names]


def cpu_description() -> dict[str, Any]:
    """The CPU's model name and the features that decide which kernels torch can use."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), None)
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return {"model": model, "features": {flag: flag in flags for flag in wanted},
            "quantized_engine": torch.backends.quantized.engine}


def package_version(name: str) -> str | None:
    try:
        return importlib.import_module(name).__version__
    except ImportError:
        return None


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF id, local dir or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--levers", default=",".join(LEVERS), help=f"comma list (default all: {', '.join(LEVERS)})")
    parser.add_argument("--rows", default="1,8", help="rows per decode step (default 1,8)")
    parser.add_argument("--context", type=int, default=300, help="tokens in the cache before the timed steps")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement (default 32)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps before them (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats (default 3)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per demo question (default 32)")
    parser.add_argument("--llama-bench-json", type=Path, default=None,
                        help="a benchmarks/peer_llamacpp.py results JSON: adds its llama-bench decode row")
    parser.add_argument("--quick", action="store_true", help="8 steps, 1 warm-up step, 1 repeat, 8 new tokens")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup_steps, args.repeats, args.new_tokens = 8, 1, 1, 8
    unknown = [n for n in _names(args.levers) if n not in LEVERS]
    if unknown:
        parser.error(f"unknown levers {unknown}: choose from {', '.join(LEVERS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from ctx_integrations.engine.core.model import load_model

    llama = llama_bench_row(args.llama_bench_json, args.threads) if args.llama_bench_json else None  # fail early
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device="cpu", dtype=torch.float32)
    plan = Plan(tuple(int(r) for r in _names(args.rows)), args.context, args.warmup_steps, args.steps, args.repeats,
                args.new_tokens)
    started, load_before = time.perf_counter(), os.getloadavg()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {text}", flush=True)

    runs = run_levers(loaded, _names(args.levers), plan, log)
    rows = lever_rows(runs, plan.rows) + ([llama] if llama else [])
    print(f"\n{loaded.name}, {args.threads} thread(s), cache of {plan.context} tokens; speedup: fp32 eager ms / "
          "lever ms, same run (above 1: faster)\n")
    print_table(rows, COLUMNS)
    settings = {**{k: v for k, v in vars(args).items() if k != "output"}, "model_name": loaded.name,
                "date": date, "cpu": cpu_description(),
                "transformers": package_version("transformers"), "torchao": package_version("torchao"),
                "static_cache_len": plan.max_len(demo_prompts(loaded.tokenizer)),
                "load_average": {"before": load_before, "after": os.getloadavg()},
                "wall_s": time.perf_counter() - started}
    write_results("decode_levers", rows, settings, args.output)


if __name__ == "__main__":
    main()
