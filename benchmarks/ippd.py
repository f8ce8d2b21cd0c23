"""IPPD throughput: many questions over one shared context, answered in one stacked decode.

For M questions per context (default 4, 16, 64), same questions, same greedy settings, same
``max_new_tokens`` (EOS stops an answer early in every method alike):
- ``ippd warm``: ``engine.generate_many(mode="ippd")`` with the context's KV cached beforehand;
- ``ippd cold``: the same, the context's KV computed inside the call;
- ``prefix-cached``: the strongest baseline a serving stack gives without IPPD (prefix caching, as in
  vLLM's automatic prefix caching; the IPPD paper's own comparison): prefix + context prefilled once,
  its KV cache expanded to the M questions, then transformers' batched ``generate`` over the question
  suffixes (padding between the shared prefix and each question is masked, positions continue the
  context); ``prefix-cached warm``: the same with the context's KV computed before the call (a prefix
  cache that outlives the request), the fair peer of ``ippd warm``;
- ``batched``: transformers' ``generate`` over the M full prompts at once (left padding), the naive
  batched alternative (no prefix reuse);
- ``sequential``: one question after another (``generate_many(mode="concat")``, a full prefill each).
Reported: questions answered per second, the ratio to ``prefix-cached`` (``vs_prefix_cached``, the
headline: IPPD warm against prefix-cached warm, cold against cold) and to ``batched``, and how many
answers equal the ``sequential`` answer token for token (IPPD's invariant, fp32).

Sets: ``synthetic``, a context of M "the code of locker K is NNNNN" facts among filler with one
question per locker; ``musique``, a reading-comprehension set from MuSiQue passages (the first
passages of a dev row as context; questions ask which words follow a span of it, plus the row's own
question).

    python benchmarks/ippd.py                               # 4, 16, 64 questions, both sets
    python benchmarks/ippd.py --questions 4 --max-new-tokens 8 --sets synthetic   # smoke run
    python benchmarks/ippd.py --methods ippd prefix-cached sequential             # without the slow naive batch
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import DynamicCache  # noqa: E402

from benchmarks.common import best_f1, load_musique, print_table, substring_match, write_results  # noqa: E402
from ctx_integrations import Engine  # noqa: E402

COLUMNS = ["set", "questions", "method", "context_tokens", "seconds", "questions_per_s", "vs_prefix_cached",
           "vs_batched", "same_as_sequential", "match", "f1"]
METHODS = ["ippd", "prefix-cached", "batched", "sequential"]
_FILLER = ("the river town market people water city day year time house school road field work light tree hill "
           "stone wind rain bridge north south east west small large old new green morning evening").split()


def synthetic_set(count: int, seed: int = 0) -> tuple[list[str], list[str], list[list[str]]]:
    """One context of ``count`` locker codes among filler sentences; one question per locker."""
    rng = random.Random(seed)
    codes = [str(rng.randint(10000, 99999)) for _ in range(count)]
    sentences = []
    for locker, code in enumerate(codes, start=1):
        sentences.append(" ".join(rng.choice(_FILLER) for _ in range(8)).capitalize() + ".")
        sentences.append(f"The code of locker {locker} is {code}.")
    questions = [f"What is the code of locker {k}? Answer with the code only." for k in range(1, count + 1)]
    return [" ".join(sentences)], questions, [[c] for c in codes]


def musique_set(count: int, passages: int = 2, span: int = 8, answer: int = 4,
                seed: int = 0) -> tuple[list[str], list[str], list[list[str]]]:
    """The first passages of a MuSiQue row as context; cloze questions over it plus the row's own question."""
    row = load_musique(1)[0]
    context = row["documents"][:passages]
    words = " ".join(context).split()
    rng = random.Random(seed)
    questions, answers = [row["question"]], [row["answers"]]
    while len(questions) < count:
        start = rng.randrange(0, len(words) - span - answer)
        cue = " ".join(words[start:start + span])
        questions.append(f"In the documents above, which {answer} words come right after \"{cue}\"?")
        answers.append([" ".join(words[start + span:start + span + answer])])
    return context, questions[:count], answers[:count]


def batched_generate(engine: Engine, documents: list[str], questions: list[str], max_new_tokens: int) -> list[str]:
    """transformers' batched greedy ``generate`` over the full prompts (left padding), the batched baseline."""
    layout, loaded = engine.layout, engine.loaded
    context = [t for d in documents for t in layout.context_ids(d)]
    prompts = [layout.prefix_ids + context + layout.suffix_ids(q) for q in questions]
    width, pad = max(map(len, prompts)), loaded.tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=loaded.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=loaded.device)
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=sorted(loaded.eos_token_ids), pad_token_id=pad)
    return loaded.tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def prefill_shared(engine: Engine, documents: list[str]) -> tuple[list[int], DynamicCache]:
    """The shared prompt (prefix + context) and its KV cache, computed once in one forward pass."""
    layout, loaded = engine.layout, engine.loaded
    shared = layout.prefix_ids + [t for d in documents for t in layout.context_ids(d)]
    cache = DynamicCache(config=loaded.model.config)
    with torch.inference_mode():
        loaded.model(torch.tensor([shared], device=loaded.device), past_key_values=cache, use_cache=True)
    return shared, cache


def prefix_cached_generate(engine: Engine, documents: list[str], questions: list[str], max_new_tokens: int,
                           warm: tuple[list[int], DynamicCache] | None = None) -> list[list[int]]:
    """Prefix caching + batched decoding: the shared prompt's KV (``warm``, or prefilled here) is copied to
    every question, then transformers' batched greedy ``generate`` runs over the question suffixes.

    Each row is ``shared + padding + question``; the padding sits between the cached prefix and the
    question, is masked out, and the question's positions continue the context's (``generate`` derives
    positions from the attention mask), so every row is its own prompt without recomputing the context.
    """
    layout, loaded = engine.layout, engine.loaded
    shared, cache = warm if warm is not None else prefill_shared(engine, documents)
    expanded = DynamicCache(config=loaded.model.config)
    for index, layer in enumerate(cache.layers):  # a copy per question; the warm cache stays intact
        expanded.update(layer.keys.repeat_interleave(len(questions), 0),
                        layer.values.repeat_interleave(len(questions), 0), index)
    suffixes = [layout.suffix_ids(q) for q in questions]
    width, pad = max(map(len, suffixes)), loaded.tokenizer.eos_token_id
    ids = torch.tensor([shared + [pad] * (width - len(s)) + s for s in suffixes], device=loaded.device)
    mask = torch.tensor([[1] * len(shared) + [0] * (width - len(s)) + [1] * len(s) for s in suffixes],
                        device=loaded.device)
    eos = sorted(loaded.eos_token_ids)
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=mask, past_key_values=expanded,
                                    max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    answers = []
    for row in out[:, ids.shape[1]:].tolist():  # cut at the first EOS, as the engine's answers are
        end = next((i for i, t in enumerate(row) if t in loaded.eos_token_ids), len(row))
        answers.append(row[:end])
    return answers


def run(engine: Engine, name: str, documents: list[str], questions: list[str], answers: list[list[str]],
        max_new_tokens: int, methods: list[str] = METHODS) -> list[dict]:
    layout = engine.layout
    context_tokens = sum(len(layout.context_ids(d)) for d in documents)
    results: dict[str, tuple[float, list[str], list[list[int]] | None]] = {}

    def measure(label: str, call) -> None:
        start = time.perf_counter()
        outputs = call()
        seconds = time.perf_counter() - start
        if isinstance(outputs[0], str):
            results[label] = (seconds, outputs, None)
        elif isinstance(outputs[0], list):  # token ids
            texts = engine.loaded.tokenizer.batch_decode(outputs, skip_special_tokens=True)
            results[label] = (seconds, texts, outputs)
        else:
            results[label] = (seconds, [a.text for a in outputs], [a.token_ids for a in outputs])

    if "ippd" in methods:
        engine.store.clear_memory()
        measure("ippd cold", lambda: engine.generate_many(questions, documents, max_new_tokens=max_new_tokens))
        measure("ippd warm", lambda: engine.generate_many(questions, documents, max_new_tokens=max_new_tokens))
    if "prefix-cached" in methods:
        measure("prefix-cached", lambda: prefix_cached_generate(engine, documents, questions, max_new_tokens))
        warm = prefill_shared(engine, documents)
        measure("prefix-cached warm", lambda: prefix_cached_generate(engine, documents, questions, max_new_tokens,
                                                                     warm))
    if "batched" in methods:
        measure("batched", lambda: batched_generate(engine, documents, questions, max_new_tokens))
    if "sequential" in methods:
        measure("sequential", lambda: engine.generate_many(questions, documents, mode="concat",
                                                           max_new_tokens=max_new_tokens))
    sequential_ids = results["sequential"][2] if "sequential" in results else None
    rows = []
    for label, (seconds, texts, token_ids) in results.items():
        row = {"set": name, "questions": len(questions), "method": label, "context_tokens": context_tokens,
               "seconds": seconds, "questions_per_s": len(questions) / seconds,
               "match": sum(substring_match(t, a) for t, a in zip(texts, answers)) / len(questions),
               "f1": sum(best_f1(t, a) for t, a in zip(texts, answers)) / len(questions)}
        peer = "prefix-cached warm" if label.endswith("warm") else "prefix-cached"
        if peer in results:
            row["vs_prefix_cached"] = results[peer][0] / seconds
        if "batched" in results:
            row["vs_batched"] = results["batched"][0] / seconds
        if token_ids is not None and sequential_ids is not None and label != "sequential":
            row["same_as_sequential"] = sum(a == b for a, b in zip(token_ids, sequential_ids)) / len(questions)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF id, local dir or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--questions", type=int, nargs="+", default=[4, 16, 64], help="questions per context")
    parser.add_argument("--sets", nargs="+", default=["synthetic", "musique"], choices=["synthetic", "musique"])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS,
                        help="methods to run (ippd runs cold and warm; prefix-cached runs both too)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model)
    rows = []
    for count in args.questions:
        for name in args.sets:
            documents, questions, answers = synthetic_set(count) if name == "synthetic" else musique_set(count)
            print(f"{name}: {count} questions ...", flush=True)
            rows += run(engine, name, documents, questions, answers, args.max_new_tokens, args.methods)
    print_table(rows, COLUMNS)
    write_results("ippd", rows, {**vars(args), "output": str(args.output), "model": engine.loaded.name,
                                 "device": str(engine.loaded.device), "dtype": str(engine.loaded.dtype)}, args.output)


if __name__ == "__main__":
    main()
