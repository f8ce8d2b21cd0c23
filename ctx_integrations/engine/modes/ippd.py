"""IPPD mode: many questions over shared contexts, answered in one stacked prompt (METHODS.md "IPPD").

A stack is one sequence ``[prefix | c_1 | c_2 | ... | x_11 | x_12 | ... | x_21 | ... | answers]``:
the shared prefix, each context once (the concatenation of a question group's documents, its KV
from the store), then every question's suffix, then the answers' tokens appended as they grow. Each
token has a *virtual position*, the position it would have if its own (prefix, context, question)
were decoded alone, a context id and a question id (0 = shared), and may see a key iff

    vpos(q) >= vpos(k)  and  (ctx(q) = ctx(k) or ctx(k) = 0)  and  (qid(q) = qid(k) or qid(k) = 0)

so every answer sees exactly what independent decoding would, while the context's keys are read
once per step for all of its questions. The mask goes in as a 4D boolean ``attention_mask`` and
the virtual positions as ``position_ids``, transformers' standard inputs: no model patching.

Questions are packed into stacks of at most ``max_stack_tokens`` tokens (prompt plus answer
budget; default the model's window) and the stacks run as one batch. Each step appends the next
token of every unfinished answer (rows padded to the longest step); padding has an infinite virtual
position, so no real token ever attends to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ctx_integrations.engine.core.cache import CachedKV, cache_from_kv
from ctx_integrations.engine.core.registry import DecodeContext, register_mode
from ctx_integrations.engine.core.streams import DecodeResult, Emitter, TraceStep
from ctx_integrations.errors import DocumentTooLongError, InvalidOptionError

PAD_POSITION = 1 << 40  # the "infinite" virtual position of padding
PAD_ID = -1  # context / question id of padding (matches no real token's ids)


@dataclass
class _Question:
    """One question of a stack: where its answer stands."""

    index: int  # position in the caller's list
    ctx: DecodeContext
    stack: int  # which stack (batch row) holds it
    context: int  # context id in its stack (>= 1)
    qid: int  # question id in its stack (>= 1)
    suffix: list[int]
    emitter: Emitter
    next_position: int  # virtual position of the answer's next token


@dataclass
class _Stack:
    """One stacked prompt: its contexts (store entries) and its questions."""

    contexts: list[CachedKV] = field(default_factory=list)
    context_keys: list[str] = field(default_factory=list)
    questions: list[_Question] = field(default_factory=list)
    tokens: int = 0  # prompt tokens + answer budget


@dataclass
class StackBatch:
    """Stacks side by side in one batched cache, with each key column's virtual position and ids."""

    cache: DynamicCache
    positions: torch.Tensor  # [B, columns] virtual positions (PAD_POSITION for padding)
    contexts: torch.Tensor  # [B, columns] context ids (0 = prefix, PAD_ID = padding)
    questions: torch.Tensor  # [B, columns] question ids (0 = prefix / context, PAD_ID = padding)


def visibility(q_pos: torch.Tensor, q_ctx: torch.Tensor, q_qid: torch.Tensor, k_pos: torch.Tensor,
               k_ctx: torch.Tensor, k_qid: torch.Tensor) -> torch.Tensor:
    """IPPD's conjunction mask ``[B, 1, Q, K]`` (True = may attend) from per-token virtual positions and ids."""
    later = q_pos.unsqueeze(2) >= k_pos.unsqueeze(1)
    same_context = (q_ctx.unsqueeze(2) == k_ctx.unsqueeze(1)) | (k_ctx.unsqueeze(1) == 0)
    same_question = (q_qid.unsqueeze(2) == k_qid.unsqueeze(1)) | (k_qid.unsqueeze(1) == 0)
    return (later & same_context & same_question).unsqueeze(1)


@torch.inference_mode()
def step_forward(model: torch.nn.Module, batch: StackBatch, input_ids: torch.Tensor, positions: torch.Tensor,
                 contexts: torch.Tensor, questions: torch.Tensor, keep: torch.Tensor | int = 0) -> torch.Tensor:
    """Append tokens ([B, S], with their virtual positions and ids) to every stack; return their logits (fp32).

    ``keep``: which of the S columns need logits (a 1D index tensor, or 0 for all).
    """
    all_positions = torch.cat([batch.positions, positions], dim=1)
    all_contexts = torch.cat([batch.contexts, contexts], dim=1)
    all_questions = torch.cat([batch.questions, questions], dim=1)
    mask = visibility(positions, contexts, questions, all_positions, all_contexts, all_questions)
    rope_positions = positions.masked_fill(positions == PAD_POSITION, 0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=rope_positions, past_key_values=batch.cache,
                use_cache=True, logits_to_keep=keep)
    batch.positions, batch.contexts, batch.questions = all_positions, all_contexts, all_questions
    return out.logits.float()


def _pack(ctx_groups: list[tuple[CachedKV, list[_Question]]], prefix_len: int, budget: int,
          max_new_tokens: int) -> list[_Stack]:
    """Fill stacks in order: a context joins a stack with its first question; more follow while they fit."""
    stacks: list[_Stack] = []
    for entry, questions in ctx_groups:
        for question in questions:
            need = len(question.suffix) + max_new_tokens
            stack = stacks[-1] if stacks else None
            joins_context = stack is not None and stack.context_keys and stack.context_keys[-1] == entry.key
            extra = need + (0 if joins_context else entry.length)
            if stack is None or stack.tokens + extra > budget:
                stack, joins_context = _Stack(tokens=prefix_len), False
                stacks.append(stack)
                extra = need + entry.length
            if not joins_context:
                stack.contexts.append(entry)
                stack.context_keys.append(entry.key)
            question.stack, question.context = len(stacks) - 1, len(stack.contexts)
            question.qid = len(stack.questions) + 1
            stack.questions.append(question)
            stack.tokens += extra
    return stacks


def _stack_batch(prefix: CachedKV, stacks: list[_Stack], device: torch.device) -> StackBatch:
    """The prefix and contexts of every stack in one right-padded batched cache (one copy per context)."""
    widths = [prefix.length + sum(c.length for c in s.contexts) for s in stacks]
    layers, _, heads, _, dim = prefix.kv.shape
    buffer = prefix.kv.new_zeros(layers, 2, len(stacks), heads, max(widths), dim)
    positions = torch.full((len(stacks), max(widths)), PAD_POSITION, dtype=torch.long)
    contexts = torch.full_like(positions, PAD_ID)
    questions = torch.full_like(positions, PAD_ID)
    for b, stack in enumerate(stacks):
        buffer[:, :, b, :, : prefix.length] = prefix.kv
        positions[b, : prefix.length] = torch.arange(prefix.length)
        contexts[b, : prefix.length] = 0
        questions[b, : prefix.length] = 0
        column = prefix.length
        for context_id, entry in enumerate(stack.contexts, start=1):
            span = slice(column, column + entry.length)
            buffer[:, :, b, :, span] = entry.kv
            positions[b, span] = torch.arange(prefix.length, prefix.length + entry.length)
            contexts[b, span] = context_id
            questions[b, span] = 0
            column += entry.length
    return StackBatch(cache_from_kv(buffer), positions.to(device), contexts.to(device), questions.to(device))


def _check_devices(model_device: torch.device, entries: list[CachedKV]) -> None:
    devices = {str(e.kv.device) for e in entries}
    if len(devices) > 1 or torch.device(devices.pop()) != model_device:
        raise InvalidOptionError(f"IPPD got cached contexts on {sorted({str(e.kv.device) for e in entries})} for a "
                                 f"model on {model_device}: compute the caches with this engine (its store moves "
                                 "them to the model's device) instead of mixing engines or devices")


def _row_inputs(rows: list[list[tuple[list[int], int, int, int]]], device: torch.device,
                pad_token: int) -> tuple[torch.Tensor, ...]:
    """Pad per-stack token runs ``(ids, first virtual position, context id, question id)`` into [B, S] tensors."""
    width = max(sum(len(ids) for ids, *_ in row) for row in rows)
    ids = torch.full((len(rows), width), pad_token, dtype=torch.long)
    positions = torch.full((len(rows), width), PAD_POSITION, dtype=torch.long)
    contexts = torch.full_like(positions, PAD_ID)
    questions = torch.full_like(positions, PAD_ID)
    for b, row in enumerate(rows):
        column = 0
        for tokens, first, context_id, qid in row:
            span = slice(column, column + len(tokens))
            ids[b, span] = torch.tensor(tokens)
            positions[b, span] = torch.arange(first, first + len(tokens))
            contexts[b, span], questions[b, span] = context_id, qid
            column += len(tokens)
    return tuple(t.to(device) for t in (ids, positions, contexts, questions))


@register_mode("ippd", many=True)
def run_ippd(contexts: list[DecodeContext], *, max_stack_tokens: int | None = None) -> list[DecodeResult]:
    """Intra-prompt parallel decoding: every question answered in one stacked decode.

    Questions with the same documents (same texts, same order) share one context: the
    concatenation of their documents, as ``concat`` would prompt it, so each answer equals
    ``concat``'s greedy answer token for token. max_stack_tokens: the most tokens (prompt plus
    ``max_new_tokens`` per question) one stacked prompt may hold; default the model's window. More
    questions go into further stacks of the same batch.
    """
    first = contexts[0]
    engine, layout, loaded = first.engine, first.engine.layout, first.engine.loaded
    window = loaded.max_positions
    budget = window if max_stack_tokens is None else max_stack_tokens
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InvalidOptionError(f"max_stack_tokens must be a positive int or None, got {max_stack_tokens!r}")
    prefix_len, max_new = len(layout.prefix_ids), first.stop.max_new_tokens

    groups: dict[tuple[str, ...], list[_Question]] = {}
    group_ids: dict[tuple[str, ...], list[int]] = {}
    for index, ctx in enumerate(contexts):
        texts = tuple(d.text for d in ctx.documents)
        if texts not in group_ids:
            group_ids[texts] = [t for text in texts for t in layout.context_ids(text)]
        suffix = layout.suffix_ids(ctx.query)
        ctx.check_window(prefix_len + len(group_ids[texts]) + len(suffix), f"question {index} with its documents")
        position = prefix_len + len(group_ids[texts]) + len(suffix)
        emitter = Emitter(loaded.tokenizer, ctx.stop, ctx.on_token, ctx.started)
        groups.setdefault(texts, []).append(_Question(index, ctx, 0, 0, 0, suffix, emitter, position))
    entries = engine.store.documents_tokens(layout, list(group_ids.values()))
    _check_devices(loaded.device, entries)
    for questions, entry in zip(groups.values(), entries):
        need = prefix_len + entry.length + max(len(q.suffix) for q in questions) + max_new
        if need > budget:
            raise DocumentTooLongError(
                f"one stacked prompt may hold {budget} tokens (max_stack_tokens), but the prefix, a context of "
                f"{entry.length} tokens and its longest question with max_new_tokens={max_new} need {need}, so not "
                f"even one of its {len(questions)} questions fits. Raise max_stack_tokens, retrieve fewer or shorter "
                "documents, or lower max_new_tokens.")
    stacks = _pack(list(zip(entries, groups.values())), prefix_len, budget, max_new)
    batch = _stack_batch(engine.store.prefix(layout), stacks, loaded.device)
    timings = {"cache_s": time.perf_counter() - first.started, "stacks": float(len(stacks)),
               "questions_per_stack": len(contexts) / len(stacks)}

    pad_token = min(loaded.eos_token_ids) if loaded.eos_token_ids else 0
    rows = [[(q.suffix, q.next_position - len(q.suffix), q.context, q.qid) for q in s.questions] for s in stacks]
    ends = [torch.tensor([len(q.suffix) for q in s.questions]).cumsum(0).sub(1).tolist() for s in stacks]
    keep = sorted({column for row in ends for column in row})
    logits = step_forward(loaded.model, batch, *_row_inputs(rows, loaded.device, pad_token),
                          keep=torch.tensor(keep, device=loaded.device))
    timings["prefill_s"] = time.perf_counter() - first.started
    pending = [(q, logits[q.stack, keep.index(column)]) for s, row in zip(stacks, ends)
               for q, column in zip(s.questions, row)]
    while pending:
        growing: list[list[_Question]] = [[] for _ in stacks]
        for question, scores in pending:
            token = question.ctx.sampler(scores)
            if not question.emitter.push(TraceStep(token, None, float(torch.log_softmax(scores, -1)[token]))):
                growing[question.stack].append(question)
        if not any(growing):
            break
        rows = [[([q.emitter.trace[-1].token_id], q.next_position, q.context, q.qid) for q in row] for row in growing]
        logits = step_forward(loaded.model, batch, *_row_inputs(rows, loaded.device, pad_token))
        pending = []
        for row in growing:
            for column, question in enumerate(row):
                question.next_position += 1
                pending.append((question, logits[question.stack, column]))
    results: list[DecodeResult | None] = [None] * len(contexts)
    for stack in stacks:
        for question in stack.questions:
            question.ctx.timings.update(timings)
            result = question.emitter.result()
            # Each answer sees only its own question's context: that is its per-token attribution (citations.py).
            result.extra.update(stack=question.stack, stacked_questions=len(stack.questions), attribution="context")
            results[question.index] = result
    return results  # type: ignore[return-value]

