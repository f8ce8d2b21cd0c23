"""APE mode: Adaptive Parallel Encoding over the cached documents (docs/methods.md#ape).

One sequence ``[prefix | doc_1 | ... | doc_N | question | answer]``. The documents' KV caches come
from the store as they are: each was encoded after the shared prefix at positions ``L_p..``, so all
documents share one position range, and they are concatenated without padding. The question starts
at position ``L_p + max_i len_i`` and the answer continues sequentially.

Question and answer tokens attend to two key sets, each with its own softmax, merged by log-sum-exp:

    C = every document key, scores s / T (no causal mask: all of it lies in the past)
    O = prefix + question/answer keys, plain causal scores s
    out = softmax([S * T * LSE_C, LSE_O]) . [out_C, out_O]

With ``T = S = 1`` this is plain attention over the concatenated cache. No attention kernel exposes
this merge, so :func:`ape_attention` is written by hand (fp32 math whatever the model dtype; the
public code's bf16 LSE is a pitfall, docs/methods.md#ape) and registered through transformers'
``AttentionInterface``; :func:`ape_attention_swapped` switches a model to it only for one APE call.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from transformers import AttentionInterface

from ctx_integrations.engine.core.attention_swap import attention_swapped
from ctx_integrations.engine.core.cache import CachedKV, concatenated_stream
from ctx_integrations.engine.core.decoding import DecodeResult, forward_sequences, fused_steps, single_stream
from ctx_integrations.engine.core.flex import resolve_kernel
from ctx_integrations.engine.core.jobs import ExclusiveJob, FusedJob, Job, Stream, single_result
from ctx_integrations.engine.core.registry import DecodeContext, register_mode
from ctx_integrations.engine.core.rows import Piece
from ctx_integrations.engine.core.validation import real_number
from ctx_integrations.engine.core.windows import windows
from ctx_integrations.engine.modes.ape_flex import APE_FLEX_ATTENTION, check_call
from ctx_integrations.engine.modes.priors import check_prior, log_prior
from ctx_integrations.engine.modes.specs import (
    APE,
    APE_MAX_GAMMA,
    ATTENTION_TEMPERATURE,
    DEFAULT_FLOOR,
    DEFAULT_PRIOR,
    DEFAULT_TAU,
    MIN_ATTENTION_TEMPERATURE,
    SCALE,
)
from ctx_integrations.engine.modes.specs import APE_GAMMA as PRIOR_GAMMA
from ctx_integrations.errors import InvalidOptionError

APE_ATTENTION = "ctx_ape"


@dataclass(frozen=True)
class ApeLayout:
    """Where the documents sit among the cached keys, and the two knobs of the merge."""

    context_start: int  # key column of the first document token (= L_p)
    context_end: int  # key column after the last document token
    temperature: float  # T
    scale: float  # S
    # attribution recorded: each document's end column (relative to context_start), and where the attention
    # calls append the merged attention mass per document of the last query position (one entry per layer).
    document_ends: tuple[int, ...] = ()
    masses: list[torch.Tensor] | None = field(default=None, compare=False)
    # the retrieval prior: added to the tempered scores of every key of document i (needs document_ends)
    document_bias: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        check_knobs(self.temperature, self.scale)
        if self.document_bias and len(self.document_bias) != len(self.document_ends):
            raise InvalidOptionError(f"APE got {len(self.document_bias)} document biases for "
                                     f"{len(self.document_ends)} documents")
        if not 0 <= self.context_start < self.context_end:
            raise InvalidOptionError(f"APE needs a non-empty document span, got [{self.context_start}, "
                                     f"{self.context_end})")




def check_knobs(temperature: float, scale: float) -> None:
    real_number("APE's attention_temperature", temperature, minimum=MIN_ATTENTION_TEMPERATURE, maximum=1.0,
                hint=" (a number in [0.01, 1]; the authors use 0.6-1.0; 1 = no correction)")
    real_number("APE's scale", scale, minimum=0.0, maximum=1.0, min_inclusive=False,
                hint=" (a number in (0, 1]; the authors use 0.6-1.0; 1 = no correction)")


def ape_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  ape_layout: ApeLayout | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """APE attention for the question/answer queries (``query`` [B, H, q, d], ``key``/``value`` [B, Hkv, K, d]).

    The last ``q`` key columns are the queries' own tokens (causal among themselves); columns
    ``[context_start, context_end)`` are the documents; everything else is the prefix. Query heads
    are grouped by their KV head (GQA) instead of repeating keys, so no key is copied.
    """
    check_call(ape_layout, key, kwargs)
    batch, heads, q_len, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    start, end = ape_layout.context_start, ape_layout.context_end
    temperature, scale = ape_layout.temperature, ape_layout.scale
    scaling = dim ** -0.5 if scaling is None else scaling

    q = query.float().reshape(batch, kv_heads, groups * q_len, dim)  # row g * q_len + i
    k, v = key.float(), value.float()
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, Hkv, G*q, K]
    context = scores[..., start:end] / temperature
    if ape_layout.document_bias:
        context = context + column_bias(ape_layout.document_bias, ape_layout.document_ends, context.device)
    outside = torch.cat([scores[..., :start], scores[..., end:]], dim=-1)
    columns = torch.arange(outside.shape[-1], device=query.device)
    own_column = outside.shape[-1] - q_len + torch.arange(q_len, device=query.device)
    visible = (columns.unsqueeze(0) <= own_column.unsqueeze(1)).repeat(groups, 1)  # [G*q, prefix + own]
    outside = outside.masked_fill(~visible, -math.inf)

    p_context, p_outside, weights = merge_softmaxes(context, outside, temperature, scale)
    out_context = torch.matmul(p_context, v[:, :, start:end])
    out_outside = (torch.matmul(p_outside[..., :start], v[:, :, :start])
                   + torch.matmul(p_outside[..., start:], v[:, :, end:keys]))
    out = weights[..., :1] * out_context + weights[..., 1:] * out_outside
    if ape_layout.masses is not None:
        ape_layout.masses.append(document_mass(p_context, weights[..., :1], ape_layout.document_ends, groups, q_len))
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).to(query.dtype).contiguous(), None


def merge_softmaxes(context: torch.Tensor, outside: torch.Tensor, temperature: float,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """APE's merge of the tempered document scores ``context`` (already divided by T) and the rest: each set's
    softmax, and the two sets' weights ``softmax([S T LSE_C, LSE_O])`` ([..., 2])."""
    lse_context = torch.logsumexp(context, dim=-1, keepdim=True)
    lse_outside = torch.logsumexp(outside, dim=-1, keepdim=True)
    weights = torch.softmax(torch.cat([scale * temperature * lse_context, lse_outside], dim=-1), dim=-1)
    return torch.softmax(context, dim=-1), torch.softmax(outside, dim=-1), weights


@dataclass(frozen=True)
class ApeRowAttention:
    """APE's attention for its row of the scheduler's shared batch (a per-row rule, ``row_attention.py``).

    The same merge as :func:`ape_attention`, which works on one APE sequence of its own by column ranges;
    here the row sits in a padded batch beside other requests, so the two key sets come from the row's
    mask and the document index its pieces gave each key column: C = the visible document keys, O = every
    other visible key (the prefix, the question and the answer so far). ``masses``: where each forward
    appends, per layer, the merged attention mass on each of the ``documents`` documents for the row's
    last query (as :func:`document_mass` does for the exclusive path).
    """

    temperature: float
    scale: float
    documents: int
    masses: list[torch.Tensor] | None = field(default=None, compare=False)
    document_bias: tuple[float, ...] = ()  # the retrieval prior per document (see ApeLayout), () for none

    def __post_init__(self) -> None:
        check_knobs(self.temperature, self.scale)
        if self.document_bias and len(self.document_bias) != self.documents:
            raise InvalidOptionError(f"APE got {len(self.document_bias)} document biases for {self.documents} "
                                     "documents")

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                 documents: torch.Tensor, scaling: float, last_query: int) -> torch.Tensor:
        _, heads, q_len, dim = query.shape
        kv_heads = key.shape[1]
        groups = heads // kv_heads
        q = query.float().reshape(1, kv_heads, groups * q_len, dim)  # row g * q_len + i, as ape_attention
        v = value.float()
        scores = torch.matmul(q, key.float().transpose(-1, -2)) * scaling  # [1, Hkv, G*q, K]
        seen = visible.repeat(1, 1, groups, 1)  # [1, 1, G*q, K]
        is_document = (documents > 0)[:, None, None, :]
        context = scores / self.temperature
        if self.document_bias:  # index 0 of the table: keys that belong to no document
            table = torch.tensor((0.0, *self.document_bias), dtype=context.dtype, device=context.device)
            context = context + table[documents[0]]
        context = context.masked_fill(~(seen & is_document), -math.inf)
        outside = scores.masked_fill(~(seen & ~is_document), -math.inf)
        p_context, p_outside, weights = merge_softmaxes(context, outside, self.temperature, self.scale)
        out = weights[..., :1] * torch.matmul(p_context, v) + weights[..., 1:] * torch.matmul(p_outside, v)
        if self.masses is not None:
            merged = (weights[..., :1] * p_context).reshape(1, kv_heads, groups, q_len, -1)[:, :, :, last_query]
            per_key = merged.mean(dim=(1, 2))[0]  # [K]
            mass = torch.zeros(self.documents + 1, dtype=per_key.dtype, device=per_key.device)
            self.masses.append(mass.index_add_(0, documents[0], per_key)[1:])  # on the device: read once, at the end
        return out.reshape(1, heads, q_len, dim).transpose(1, 2).to(query.dtype)


def column_bias(bias: tuple[float, ...], document_ends: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Each document's bias repeated over its key columns ([C], the columns of the concatenated documents)."""
    lengths = torch.diff(torch.tensor(document_ends), prepend=torch.zeros(1, dtype=torch.long))
    return torch.repeat_interleave(torch.tensor(bias, dtype=torch.float32), lengths).to(device)


def document_mass(p_context: torch.Tensor, context_weight: torch.Tensor, document_ends: tuple[int, ...], groups: int,
                  q_len: int) -> torch.Tensor:
    """Merged attention mass on each document block for the last query position, averaged over heads ([N]).

    ``p_context`` [B, Hkv, G*q, C] is the softmax over the document keys, ``context_weight`` [B, Hkv, G*q, 1]
    the documents' weight in the merge, so their product is the final attention on each document key.
    """
    batch, kv_heads = p_context.shape[:2]
    merged = (context_weight * p_context).reshape(batch, kv_heads, groups, q_len, -1)[:, :, :, -1]
    per_key = merged.mean(dim=(1, 2))  # [B, C]
    ends = torch.tensor(document_ends, device=per_key.device)
    cumulative = torch.cumsum(per_key, dim=-1)[:, ends - 1]  # [B, N]
    return torch.diff(cumulative, dim=-1, prepend=torch.zeros_like(cumulative[:, :1]))[0]


AttentionInterface.register(APE_ATTENTION, ape_attention)


def ape_attention_swapped(model: torch.nn.Module, implementation: str = APE_ATTENTION
                          ) -> AbstractContextManager[None]:
    """Run the model with :func:`ape_attention` (or ``implementation``) inside the block, restore its own after."""
    return attention_swapped(model, implementation, refusal=(
        f"{type(model).__name__} does not route its attention through transformers' AttentionInterface, so APE's "
        "attention cannot be swapped in (custom or remote-code models often do not); use mode='pced' or 'concat' "
        "with this model"))


@dataclass(frozen=True)
class _ApeInputs:
    """What both APE paths start from: the question suffix, the documents' caches and where the question goes."""

    suffix: list[int]
    prefix: CachedKV
    caches: list[CachedKV]
    prefix_len: int
    query_position: int  # L_p + the longest document: documents share positions

    @property
    def total(self) -> int:
        return sum(c.length for c in self.caches)

    def finish(self, result: DecodeResult, masses: list[torch.Tensor] | None, layers: int,
               unavailable_note: str | None) -> DecodeResult:
        result.extra.update(context_tokens=self.total, query_position=self.query_position)
        if masses is not None:
            _attribute(result, masses, layers)
        elif unavailable_note is not None:
            result.extra.update(attribution="unavailable", attribution_note=unavailable_note)
        return result


def _ape_inputs(ctx: DecodeContext) -> _ApeInputs:
    """Check the request (window, per-request budget, a model whose attention APE computes and can swap) and get its
    caches: everything APE refuses is refused here, before any cache is computed or any token streamed."""
    engine, layout = ctx.engine, ctx.engine.layout
    suffix = list(ctx.suffix_ids)
    prefix_len, longest = len(layout.prefix_ids), max(p.tokens for p in ctx.prepared)
    # Documents share positions, so only the longest one (not their sum) counts against the window.
    ctx.check_window(prefix_len + longest + len(suffix), "the longest document with the question")
    with ape_attention_swapped(engine.loaded.model):  # refuse a model that cannot take the swap before any work
        pass
    keys = prefix_len + sum(p.tokens for p in ctx.prepared) + len(suffix) + ctx.stop.max_new_tokens
    check_model(engine.loaded.model.config, keys - 1, ctx.stop.max_new_tokens)
    ctx.check_streams(1, keys, "APE's caches")
    caches = engine.store.documents_prepared(layout, ctx.prepared, stats=ctx.cache)
    return _ApeInputs(suffix, engine.store.prefix(layout), caches, prefix_len, prefix_len + longest)


def check_model(config: object, keys: int, max_new_tokens: int) -> None:
    """Refuse, when the request is planned, a model whose attention APE does not compute: logit soft-capping
    (Gemma 2), or a sliding window narrower than the ``keys`` the last answer token attends to (the prefix, every
    document, the question and the answer before it). A window at least that wide hides none of them (APE's
    positions span fewer than its keys), so the row rule is exact on every layer, sliding or not; the same limits
    the attention functions check call by call (:func:`~ctx_integrations.engine.modes.ape_flex.check_call`) would
    otherwise fail the request after its first tokens were streamed."""
    text = getattr(config, "get_text_config", lambda: config)()
    if getattr(text, "attn_logit_softcapping", None) is not None:
        raise InvalidOptionError("APE does not support attention logit soft-capping (e.g. Gemma 2); use mode='pced' "
                                 "or mode='concat' with this model")
    window = windows(config).size
    if window is not None and keys > window:
        raise InvalidOptionError(
            f"APE does not support sliding-window attention over {keys} keys (window {window}): the prefix, the "
            f"documents, the question and max_new_tokens={max_new_tokens} put that many keys before the last answer "
            "token; retrieve fewer or shorter documents or lower max_new_tokens")


def _ape_row_job(ctx: DecodeContext, attention_temperature: float, scale: float, attribution: bool,
                 bias: tuple[float, ...] = ()) -> FusedJob:
    """APE as one row of the scheduler's shared batch: the prefix, every document at positions ``L_p ..``
    (marked as documents for the row's merge), then the question; :class:`ApeRowAttention` is the row's rule."""
    inputs = _ape_inputs(ctx)
    pieces = (Piece(inputs.prefix.kv, 0),) + tuple(Piece(cache.kv, inputs.prefix_len, document=index)
                                                   for index, cache in enumerate(inputs.caches, start=1))
    masses: list[torch.Tensor] | None = [] if attribution else None
    rule = ApeRowAttention(attention_temperature, scale, len(inputs.caches), masses, bias)
    layers = ctx.engine.loaded.model.config.num_hidden_layers
    ctx.timings["cache_s"] = time.perf_counter() - ctx.started
    return FusedJob(ctx, [Stream(pieces, tuple(inputs.suffix), inputs.query_position)], single_stream,
                    lambda result: inputs.finish(result, masses, layers, None), attention=rule)


def _ape_flex_steps(ctx: DecodeContext, attention_temperature: float, scale: float, unavailable_note: str | None,
                    bias: tuple[float, ...] = ()) -> Generator[None, None, DecodeResult]:
    """APE on FlexAttention's merge (``attention_kernel="flex"``): an exclusive job over a sequence of its own, one
    forward of its own per scheduler step. The one APE path beside the pool: the long-context fast path
    (docs/scheduler.md measures it against the row)."""
    engine, inputs = ctx.engine, _ape_inputs(ctx)
    model = engine.loaded.model
    streams = concatenated_stream(inputs.prefix, inputs.caches, next_position=inputs.query_position)
    ends = tuple(itertools.accumulate(c.length for c in inputs.caches))
    streams.forward_kwargs["ape_layout"] = ApeLayout(inputs.prefix_len, inputs.prefix_len + inputs.total,
                                                     attention_temperature, scale, ends, None, bias)
    ctx.timings["cache_s"] = time.perf_counter() - ctx.started

    def forward(ids: torch.Tensor) -> torch.Tensor:
        # the swap spans one forward only: the scheduler runs other requests' forwards between APE's steps
        with ape_attention_swapped(model, APE_FLEX_ATTENTION):
            return forward_sequences(model, streams, ids)

    first_logits = forward(torch.tensor([inputs.suffix], device=engine.loaded.device))
    ctx.timings["prefill_s"] = time.perf_counter() - ctx.started
    yield
    result = yield from fused_steps(forward, engine.loaded.tokenizer, first_logits, single_stream, ctx.sampler,
                                    ctx.stop, ctx.on_token, ctx.started)
    return inputs.finish(result, None, model.config.num_hidden_layers, unavailable_note)


# Said in the answer (``extra["attribution_note"]``) when the default attribution=None ran the flex kernel.
FLEX_ATTRIBUTION_NOTE = ("the flex attention kernel does not expose per-document attention mass; pass attribution=True "
                         "(CLI: --option attribution=true) to run APE's row in the shared batch, which records it")


class ApePlan(NamedTuple):
    """Where an APE request runs: ``flex`` FlexAttention's merge on an exclusive job, else APE's row in the shared
    batch; ``record`` the per-document attention mass (citations); ``note`` said in the answer when it cannot."""

    flex: bool
    record: bool
    note: str | None


def ape_plan(attribution: object, attention_kernel: str, device: object) -> ApePlan:
    """The plan for APE's ``attention_kernel`` and ``attribution`` options.

    ``"auto"`` / ``"eager"``: APE's row (on whichever kernel the shared batch runs), recording the attention mass
    unless ``attribution=False``. ``"flex"``: FlexAttention's merge, which does not expose the mass: with
    ``attribution=None`` (default) the answer says so (:data:`FLEX_ATTRIBUTION_NOTE`), ``True`` takes the row
    instead (it records), ``False`` records nothing and says nothing.
    """
    if attribution is not None and not isinstance(attribution, bool):
        raise InvalidOptionError(f"APE's attribution must be True, False or None (record per-document attention "
                                 f"mass whenever the attention kernel can), got {attribution!r}")
    resolve_kernel(attention_kernel, device)  # an unknown kernel, or flex without FlexAttention, is refused
    if attention_kernel == "flex" and attribution is not True:
        return ApePlan(True, False, FLEX_ATTRIBUTION_NOTE if attribution is None else None)
    return ApePlan(False, attribution is not False, None)


@register_mode(APE)
def run_ape(ctx: DecodeContext, *, attention_temperature: float = ATTENTION_TEMPERATURE, scale: float = SCALE,
            attention_kernel: str = "auto", attribution: bool | None = None, gamma: float = PRIOR_GAMMA,
            prior: str = DEFAULT_PRIOR, prior_tau: float = DEFAULT_TAU, prior_floor: float = DEFAULT_FLOOR) -> Job:
    """Adaptive Parallel Encoding over the documents' cached KV.

    attention_temperature: T, divides the question's attention scores over the documents (sharper
    for T < 1; named so because ``temperature`` is the sampler's). scale: S, scales the documents'
    log-sum-exp in the merge (less total weight on the documents for S < 1). T in [0.01, 1], S in (0, 1];
    T = S = 1 (the defaults, measured best with the prior on NQ-open; the paper tunes both per task, the authors'
    code has 0.9 / 0.9) is plain attention over the concatenated caches, the prior's bias apart.
    attention_kernel: ``"auto"`` (default) or ``"eager"``: one row of the shared batch (on either batch
    kernel) with its own attention rule (:class:`ApeRowAttention`, the reference's math), for every model APE
    computes; ``"flex"``: FlexAttention's merge over APE's own sequence (``ape_flex.py``), an exclusive job, one
    forward of its own per step (faster to the first token on long contexts; no citations). A model with
    logit soft-capping (Gemma 2), or a sliding window narrower than the request's keys with its answer, is
    refused when the request is planned (:func:`check_model`).
    attribution: record, per generated token, the merged attention mass on each document (mean over
    layers and heads, ``extra["attention_mass"]``) and put the document with the most mass in the trace,
    so APE answers have citations. ``None`` (default): whenever the path can (APE's row; FlexAttention does not
    expose the per-document mass: its answers carry ``extra["attribution"] = "unavailable"`` and
    ``extra["attribution_note"]`` saying why and what to pass). ``True`` runs APE's row even with
    ``attention_kernel="flex"``; ``False`` records nothing. It never changes the tokens (:func:`ape_plan`).
    gamma: weight of a retrieval prior (our variant, the default 3.0; 0 is the paper's APE, which uses no
    scores): the question's tempered attention scores on every key of document k get
    gamma * (log_prior_k - max log_prior), so the top document's attention is unchanged and a low-ranked
    one's is scaled down by its prior (measured on NQ-open: docs/evaluation.md, "NQ-open with real retrieval").
    prior, prior_tau, prior_floor: how the scores become that log-prior, as PCED's (see :mod:`.priors`).
    Every kernel applies it (FlexAttention through a ``score_mod``).
    """
    check_knobs(attention_temperature, scale)
    bias = document_bias(ctx, gamma, prior, prior_tau, prior_floor)
    plan = ape_plan(attribution, attention_kernel, ctx.engine.loaded.device)
    if plan.flex:
        return ExclusiveJob([ctx], single_result(_ape_flex_steps(ctx, attention_temperature, scale, plan.note, bias)))
    return _ape_row_job(ctx, attention_temperature, scale, plan.record, bias)


def document_bias(ctx: DecodeContext, gamma: float, prior: str, prior_tau: float,
                  prior_floor: float) -> tuple[float, ...]:
    """gamma * (log_prior_k - max log_prior) per document, or () when gamma is 0 (the paper's APE)."""
    real_number("gamma", gamma, minimum=0.0, maximum=APE_MAX_GAMMA, hint=" (weight of APE's retrieval prior; 0: none)")
    check_prior(prior, prior_tau, prior_floor)
    if gamma == 0:
        return ()
    logs = log_prior([d.score for d in ctx.documents], prior, tau=prior_tau, floor=prior_floor)
    return tuple(float(x) for x in gamma * (logs - logs.max()))


PAPER_GRID = tuple(round(0.1 * i, 1) for i in range(1, 11))  # 0.1 .. 1.0, the paper's search range and step
SEARCH_STRATEGIES = ("greedy", "grid")


@dataclass(frozen=True)
class DevExample:
    """One validation example for :func:`search_knobs`: a question, its documents and its gold answers."""

    question: str
    documents: list
    answers: list[str]


@dataclass(frozen=True)
class KnobSearch:
    """The outcome of :func:`search_knobs`: the best pair, its mean dev score, and every pair tried."""

    attention_temperature: float
    scale: float
    score: float
    scores: dict[tuple[float, float], float]

    @property
    def options(self) -> dict[str, float]:
        """Keyword options for ``engine.generate(..., mode="ape", **search.options)``."""
        return {"attention_temperature": self.attention_temperature, "scale": self.scale}


def normalized_words(text: str) -> str:
    """Lower case, no punctuation or articles, single spaces (SQuAD's answer normalisation)."""
    text = "".join(c for c in text.lower() if c.isalnum() or c.isspace())
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def answer_match(prediction: str, answers: list[str]) -> float:
    """1.0 when a normalised gold answer occurs in the normalised prediction (the default dev metric)."""
    predicted = normalized_words(prediction)
    return float(any(normalized_words(a) and normalized_words(a) in predicted for a in answers))


def _dev_example(example: object) -> DevExample:
    if isinstance(example, DevExample):
        return example
    if isinstance(example, dict):
        question, documents, answers = example.get("question"), example.get("documents"), example.get("answers")
    elif isinstance(example, (tuple, list)) and len(example) == 3:
        question, documents, answers = example
    else:
        question = documents = answers = None
    if not isinstance(question, str) or not documents or not answers:
        raise InvalidOptionError("each dev example must be a DevExample, a (question, documents, answers) tuple or a "
                                 f"dict with those keys, with documents and answers non-empty; got {example!r}")
    return DevExample(question, list(documents), [answers] if isinstance(answers, str) else list(answers))


def search_knobs(engine: object, dev_set: list, *, grid: tuple[float, ...] = PAPER_GRID, strategy: str = "greedy",
                 metric: object = answer_match, max_new_tokens: int = 32, **generate_options: object) -> KnobSearch:
    """APE's hyperparameter search (paper Sec. 4.3): the (T, S) pair with the best mean ``metric`` on ``dev_set``.

    The paper does "a greedy search over a small validation set", T and S in [0.1, 1.0] by 0.1 (``grid``).
    ``strategy="greedy"`` (default, our reading of it): T over the grid with S at the grid's largest
    value (1 in the paper's grid), then S over the grid with that T (2 x len(grid) decodes per
    example); ``"grid"``: every pair. Ties go to the pair
    closest to (1, 1), the least correction. ``metric(prediction, answers) -> float`` (default
    :func:`answer_match`); ``dev_set``: :class:`DevExample` s, ``(question, documents, answers)``
    tuples or dicts. Decoding is greedy unless ``generate_options`` say otherwise. Written by hand:
    no library searches decoding knobs of a custom attention.
    """
    examples = [_dev_example(e) for e in dev_set]
    if not examples:
        raise InvalidOptionError("search_knobs needs at least one dev example")
    if strategy not in SEARCH_STRATEGIES:
        raise InvalidOptionError(f"strategy must be one of {', '.join(SEARCH_STRATEGIES)}, got {strategy!r}")
    values = tuple(sorted({float(v) for v in grid}))
    for value in values:
        check_knobs(value, value)
    if not values:
        raise InvalidOptionError("grid must hold at least one value in (0, 1]")
    scores: dict[tuple[float, float], float] = {}

    def evaluate(temperature: float, scale: float) -> float:
        if (temperature, scale) not in scores:
            total = 0.0
            for example in examples:
                answer = engine.generate(example.question, example.documents, mode="ape",
                                         attention_temperature=temperature, scale=scale,
                                         max_new_tokens=max_new_tokens, **generate_options)
                total += float(metric(answer.text, example.answers))
            scores[(temperature, scale)] = total / len(examples)
        return scores[(temperature, scale)]

    def best(pairs: list[tuple[float, float]]) -> tuple[float, float]:
        return max(pairs, key=lambda pair: (evaluate(*pair), pair[0] + pair[1], pair[0]))

    if strategy == "grid":
        pair = best([(t, s) for t in values for s in values])
    else:
        top = max(values)
        temperature, _ = best([(t, top) for t in values])
        pair = best([(temperature, s) for s in values])
    return KnobSearch(pair[0], pair[1], scores[pair], dict(scores))


def _attribute(result: DecodeResult, masses: list[torch.Tensor], layers: int) -> None:
    """Token i's logits came from forward pass i (the prefill for token 0): average its layers' masses. The masses
    stay on the device while the answer decodes (a read per layer per step would stall every step); they are read
    back here, once."""
    shares = []
    recorded = torch.stack(masses).cpu() if masses else torch.zeros(0)
    for i, step in enumerate(result.trace):
        mass = recorded[i * layers:(i + 1) * layers].mean(0)
        share = mass / mass.sum().clamp_min(1e-12)
        winner = int(share.argmax())
        result.trace[i] = replace(step, document=winner, score=float(share[winner]))
        shares.append([round(float(x), 4) for x in share])
    result.extra["attention_mass"] = shares
