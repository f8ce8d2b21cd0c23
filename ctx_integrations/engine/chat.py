"""Plain chat with no documents: the conversation rendered with the model's own chat template, one stream.

The engine's ``generate`` always answers from documents (its prompt layout is prefix + documents +
question); a chat model (LangChain's ``ChatContextOfExperts``, LlamaIndex's ``ExpertDecoderLLM``) must
also answer ``"hello"``. This renders the whole conversation and runs
the core's own single-stream path (``forward_streams`` + ``decode_fused`` with the identity rule),
so no decode loop is copied here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from ctx_integrations.engine.core.answer import Answer
from ctx_integrations.engine.core.cache import StreamBatch
from ctx_integrations.engine.core.engine import Engine
from ctx_integrations.engine.core.streams import StopCriteria, TokenSampler, decode_fused, forward_streams
from ctx_integrations.engine.modes.baselines import single_stream
from ctx_integrations.errors import ChatTemplateError, DocumentTooLongError, InvalidOptionError

CHAT_MODE = "chat"


def conversation_ids(engine: Engine, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, ending with the assistant's turn opener."""
    if not messages:
        raise InvalidOptionError("no messages were given: pass at least one message")
    tokenizer = engine.loaded.tokenizer
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    except Exception as error:  # templates raise jinja errors of many kinds (e.g. unsupported roles)
        raise ChatTemplateError(f"the chat template could not render this conversation: {error}") from error
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_answer(engine: Engine, messages: Sequence[dict[str, str]], *, max_new_tokens: int = 128,
                temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
                on_token: Callable[[str], None] | None = None) -> Answer:
    """Answer a conversation (``[{"role": ..., "content": ...}, ...]``) with the engine's model, no documents."""
    loaded = engine.loaded
    sampler = TokenSampler(temperature, top_p, seed)
    criteria = StopCriteria(loaded.eos_token_ids, max_new_tokens, tuple(stop))
    ids = conversation_ids(engine, messages)
    if len(ids) + max_new_tokens > loaded.max_positions:
        raise DocumentTooLongError(
            f"the conversation has {len(ids)} tokens + max_new_tokens={max_new_tokens}, more than the model's "
            f"window of {loaded.max_positions}: drop earlier turns or lower max_tokens")
    device = loaded.device
    with engine._lock:  # one request at a time per engine, like Engine.generate
        started = time.perf_counter()
        streams = StreamBatch(DynamicCache(), torch.zeros(1, 0, dtype=torch.long, device=device),
                              torch.zeros(1, dtype=torch.long, device=device))
        first_logits = forward_streams(loaded.model, streams, torch.tensor([ids], device=device))
        prefill = time.perf_counter() - started
        result = decode_fused(loaded.model, loaded.tokenizer, streams, first_logits, single_stream, sampler, criteria,
                              on_token, started)
        total = time.perf_counter() - started
    decode_s = max(total - result.ttft_s, 1e-9)
    timings = {"ttft_s": result.ttft_s, "total_s": total, "decode_s": decode_s, "prefill_s": prefill,
               "tokens_per_s": (len(result.token_ids) - 1) / decode_s if len(result.token_ids) > 1 else 0.0,
               "new_tokens": float(len(result.token_ids)), "prompt_tokens": float(len(ids))}
    return Answer(text=result.text, token_ids=result.token_ids, trace=result.trace, timings=timings, documents=[],
                  mode=CHAT_MODE, finish_reason=result.finish_reason)
