"""The row pool: every active stream of every request in one batched KV cache, advanced by one forward per step.

A *row* is one stream: a KV cache (a shared prefix, then the stream's own cached context, then the
tokens it has been fed) plus, per key column, a virtual position, a context id and a question id.
Rows of different requests have different lengths; they sit side by side in one right-padded
batched cache (preallocated and written in place, :class:`PoolLayer`), and padding columns get an
infinite virtual position so nothing attends to them.

Which key a new token may see is IPPD's rule (docs/methods.md#ippd), which also covers every plain stream:

    vpos(q) >= vpos(k)  and  (ctx(q) = ctx(k) or ctx(k) = 0)  and  (qid(q) = qid(k) or qid(k) = 0)

A plain stream has context and question id 0 everywhere, so the rule reduces to "causal, padding
hidden". Keys are stored after RoPE, so a key's column in the buffer does not matter: rows can be
merged, dropped and left-packed freely, and every new token gets its position through ``position_ids``.
The mask goes in as a 4D boolean ``attention_mask`` (transformers' standard input, SDPA; the reference)
or, with the ``"flex"`` kernel (the default on CUDA), as a FlexAttention block mask evaluated from the
same per-column tensors, so no ``[rows, Q, K]`` mask is built: a 64 x 2048-token prompt prefilled
through the pool (``concat``) would otherwise need a 16 G-element boolean mask.

transformers' cache classes batch sequences of one request; merging and splitting rows of many
requests at step boundaries (continuous batching) is what this module adds, by hand.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ctx_integrations.engine.core.flex import FLEX_ATTENTION, BlockMask, attention_swapped, block_mask
from ctx_integrations.engine.core.row_attention import ROW_ATTENTION, RowRule

PAD_POSITION = 1 << 40  # the "infinite" virtual position of padding
PAD_ID = -1  # context / question id of padding (matches no real token's ids)


@dataclass(frozen=True)
class Piece:
    """Cached keys/values placed in a row: ``kv`` is ``[layers, 2, kv_heads, tokens, head_dim]``.

    Its tokens get virtual positions ``first_position ..`` and context id ``context`` (0 = shared);
    ``document`` marks them as document ``document`` (>= 1) for a row with its own attention rule (APE's
    merge, ``row_attention.py``), 0 otherwise.
    """

    kv: torch.Tensor
    first_position: int
    context: int = 0
    document: int = 0


@dataclass(frozen=True)
class Run:
    """Tokens appended to a row in one step: consecutive virtual positions from ``first_position``.

    The logits of a run's last token are returned (the next-token distribution after it).
    """

    ids: tuple[int, ...]
    first_position: int
    context: int = 0
    question: int = 0


def visible(q_pos: torch.Tensor, q_ctx: torch.Tensor, q_qid: torch.Tensor, k_pos: torch.Tensor,
            k_ctx: torch.Tensor, k_qid: torch.Tensor) -> torch.Tensor:
    """The rule itself, elementwise (True = the query token may attend to the key token); inputs broadcast."""
    return (q_pos >= k_pos) & ((q_ctx == k_ctx) | (k_ctx == 0)) & ((q_qid == k_qid) | (k_qid == 0))


def visibility(q_pos: torch.Tensor, q_ctx: torch.Tensor, q_qid: torch.Tensor, k_pos: torch.Tensor,
               k_ctx: torch.Tensor, k_qid: torch.Tensor) -> torch.Tensor:
    """The boolean mask ``[B, 1, Q, K]`` from per-token ``[B, Q]`` / ``[B, K]`` virtual positions and ids."""
    return visible(q_pos.unsqueeze(2), q_ctx.unsqueeze(2), q_qid.unsqueeze(2), k_pos.unsqueeze(1),
                   k_ctx.unsqueeze(1), k_qid.unsqueeze(1)).unsqueeze(1)


def visibility_block_mask(q_pos: torch.Tensor, q_ctx: torch.Tensor, q_qid: torch.Tensor, k_pos: torch.Tensor,
                          k_ctx: torch.Tensor, k_qid: torch.Tensor) -> BlockMask:
    """The same rule as a FlexAttention block mask (heads share it): no ``[B, Q, K]`` boolean tensor is kept.

    FlexAttention evaluates :func:`visible` per (row, query, key) from the same six tensors and skips
    the 128 x 128 tiles nobody sees (other contexts, other questions' answers, padding). Pass it as
    ``attention_mask`` with the model inside ``attention_swapped(model, FLEX_ATTENTION)``.
    """

    def mask_mod(b, h, q, k):
        return visible(q_pos[b, q], q_ctx[b, q], q_qid[b, q], k_pos[b, k], k_ctx[b, k], k_qid[b, k])

    return block_mask(mask_mod, q_pos.shape[0], q_pos.shape[1], k_pos.shape[1], q_pos.device)


class PoolLayer(CacheLayerMixin):
    """One layer of the pool as a transformers cache layer: preallocated buffers, new keys written in place.

    ``DynamicCache`` concatenates every step, copying each layer's whole cache (8 rows x 2048 columns
    of SmolLM2-135M: ~0.75 GB copied per step, 3x the step's own time on CPU). Like transformers'
    ``StaticLayer``, this layer writes the step's keys/values into columns ``start ..`` of buffers
    sized ``capacity`` and returns the whole buffers (the columns not written yet are padding, hidden
    by the mask), so shapes stay fixed between the pool's growths. Its buffers belong to the pool
    (which merges, drops and packs rows), hence this small subclass instead of a ``StaticCache``.
    """

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True
        self.start = start  # the first column to write: a tensor (as StaticLayer's), so no recompile per step

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("a pool layer is built over the pool's buffers")  # never called: is_initialized

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        columns = torch.arange(key_states.shape[-2], device=self.keys.device) + self.start
        self.keys.index_copy_(2, columns, key_states)
        self.values.index_copy_(2, columns, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return int(self.start)

    def get_max_length(self) -> int:
        return self.keys.shape[2]


@dataclass
class RowPool:
    """Rows side by side in one batched cache, with each key column's virtual position and ids.

    ``layers`` holds per layer a ``(keys, values)`` pair ``[rows, kv_heads, capacity, head_dim]``;
    ``positions`` / ``contexts`` / ``questions`` / ``documents`` are ``[rows, capacity]``. Columns
    ``width ..`` are room for the next steps (padding until written); the capacity grows by
    :data:`GROW_COLUMNS` at a time, so most steps write in place and keep every tensor's shape.
    ``attention`` holds per row its own attention rule (``row_attention.py``; APE's merge) or ``None``.
    """

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    positions: torch.Tensor
    contexts: torch.Tensor
    questions: torch.Tensor
    width: int = -1  # columns in use; -1: all of them
    forwards: int = field(default=0)
    documents: torch.Tensor | None = None  # None: no column marks a document
    attention: list[RowRule | None] | None = None  # None: no row has its own rule

    def __post_init__(self) -> None:
        if self.width < 0:
            self.width = self.capacity
        if self.documents is None:
            self.documents = torch.zeros_like(self.positions)
        if self.attention is None:
            self.attention = [None] * self.rows

    @property
    def rows(self) -> int:
        return self.positions.shape[0]

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]

    @classmethod
    def build(cls, rows: list[list[Piece]], shape: tuple[int, int, int], device: torch.device,
              dtype: torch.dtype, attention: list[RowRule | None] | None = None) -> RowPool:
        """Lay out ``rows`` (each a list of pieces) in one right-padded buffer: one copy per piece.

        ``shape`` is ``(layers, kv_heads, head_dim)``, used for rows without any cached piece;
        ``attention``: per row, its own attention rule or ``None``.
        """
        layers, heads, dim = shape
        widths = [sum(p.kv.shape[3] for p in pieces) for pieces in rows]
        width = max(widths, default=0)
        buffer = torch.zeros(layers, 2, len(rows), heads, width, dim, device=device, dtype=dtype)
        positions = torch.full((len(rows), width), PAD_POSITION, dtype=torch.long)
        contexts = torch.full_like(positions, PAD_ID)
        questions = torch.full_like(positions, PAD_ID)
        documents = torch.zeros_like(positions)
        for b, pieces in enumerate(rows):
            column = 0
            for piece in pieces:
                length = piece.kv.shape[3]
                span = slice(column, column + length)
                buffer[:, :, b, :, span] = piece.kv
                positions[b, span] = torch.arange(piece.first_position, piece.first_position + length)
                contexts[b, span] = piece.context
                questions[b, span] = 0
                documents[b, span] = piece.document
                column += length
        return cls([(buffer[i, 0], buffer[i, 1]) for i in range(layers)], positions.to(device), contexts.to(device),
                   questions.to(device), documents=documents.to(device),
                   attention=list(attention) if attention is not None else None)

    def merge(self, other: RowPool) -> None:
        """Append ``other``'s rows after this pool's rows (the smaller side is padded on the right)."""
        capacity = max(self.capacity, other.capacity)
        (layers, *ids), (other_layers, *other_ids) = self._padded(capacity), other._padded(capacity)
        self.layers = [(torch.cat([k, ok]), torch.cat([v, ov])) for (k, v), (ok, ov) in zip(layers, other_layers)]
        self.positions, self.contexts, self.questions, self.documents = (
            torch.cat(pair) for pair in zip(ids, other_ids))
        self.attention = self.attention + other.attention
        self.width = max(self.width, other.width)

    def keep_rows(self, keep: list[int]) -> None:
        """Drop every row not in ``keep`` (finished or cancelled requests), then left-pack what remains."""
        index = torch.tensor(keep, dtype=torch.long, device=self.positions.device)
        self.layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.layers]
        self.positions = self.positions.index_select(0, index)
        self.contexts = self.contexts.index_select(0, index)
        self.questions = self.questions.index_select(0, index)
        self.documents = self.documents.index_select(0, index)
        self.attention = [self.attention[row] for row in keep]
        self.pack()

    @torch.inference_mode()
    def rewind(self, rows: dict[int, int]) -> None:
        """Per row ``{row: position}``, drop the row's columns at virtual positions ``>= position`` (they become
        padding; :meth:`pack` reclaims them). A speculative row's rejected drafts leave its cache this way.

        Keys are stored after RoPE, so a later token at one of those positions is written in a new column;
        nothing else of the row moves. Only rows whose positions grow along their columns (one sequence, as
        RAPID's target and drafter rows) may be rewound by position.
        """
        if not rows:
            return
        index = torch.tensor(list(rows), dtype=torch.long, device=self.positions.device)
        limit = torch.tensor(list(rows.values()), dtype=torch.long, device=self.positions.device)
        used = self.positions[index, : self.width]
        dropped = (used >= limit.unsqueeze(1)) & (used != PAD_POSITION)
        self.positions[index, : self.width] = used.masked_fill(dropped, PAD_POSITION)
        for ids in (self.contexts, self.questions):
            ids[index, : self.width] = ids[index, : self.width].masked_fill(dropped, PAD_ID)
        self.documents[index, : self.width] = self.documents[index, : self.width].masked_fill(dropped, 0)

    def select(self, rows: list[int]) -> RowPool:
        """A copy of some rows, same columns: to run a forward of their own (:meth:`take_columns` brings back
        what it appended). Copies those rows' whole buffers."""
        index = torch.tensor(rows, dtype=torch.long, device=self.positions.device)
        return RowPool([(k.index_select(0, index), v.index_select(0, index)) for k, v in self.layers],
                       self.positions.index_select(0, index), self.contexts.index_select(0, index),
                       self.questions.index_select(0, index), width=self.width,
                       documents=self.documents.index_select(0, index), attention=[self.attention[r] for r in rows])

    @torch.inference_mode()
    def take_columns(self, rows: list[int], selected: RowPool) -> None:
        """Bring back the columns a :meth:`select` copy of ``rows`` appended past this pool's width; every other
        row gets padding there (no compute, only columns that :meth:`pack` reclaims)."""
        new = slice(self.width, selected.width)
        self._reserve(selected.width - self.width)
        index = torch.tensor(rows, dtype=torch.long, device=self.positions.device)
        for (keys, values), (their_keys, their_values) in zip(self.layers, selected.layers):
            keys[index, :, new] = their_keys[:, :, new]
            values[index, :, new] = their_values[:, :, new]
        for mine, theirs in ((self.positions, selected.positions), (self.contexts, selected.contexts),
                             (self.questions, selected.questions), (self.documents, selected.documents)):
            mine[index, new] = theirs[:, new]  # the other rows' columns past the width are padding already
        self.width = selected.width

    def padding_share(self) -> float:
        """The share of the columns in use that are padding (attention reads them for nothing)."""
        used = self.positions[:, : self.width]
        if used.numel() == 0:
            return 0.0
        return float((used == PAD_POSITION).float().mean())

    def pack(self) -> None:
        """Move each row's real columns to the left (order kept), cut the all-padding columns off the end and
        shrink the room for next steps to less than :data:`GROW_COLUMNS`.

        Rows that joined next to a much longer row, and rows that got padding while another row took
        several tokens per step (IPPD), otherwise keep making every later step attend over padding.
        """
        real = self.positions[:, : self.width] != PAD_POSITION
        counts = real.sum(1)
        width = int(counts.max()) if counts.numel() else 0
        packed = torch.arange(self.width, device=real.device) < counts.unsqueeze(1)
        if width == self.width and torch.equal(real, packed) and self.capacity < _room(width) + GROW_COLUMNS:
            return
        # stable order: real columns first, in their order; then padding
        order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices[:, :width]
        self.positions = self.positions.gather(1, order)
        self.contexts = self.contexts.gather(1, order)
        self.questions = self.questions.gather(1, order)
        self.documents = self.documents.gather(1, order)
        gather = order[:, None, :, None]
        self.layers = [(k.gather(2, gather.expand(-1, k.shape[1], -1, k.shape[3])),
                        v.gather(2, gather.expand(-1, v.shape[1], -1, v.shape[3]))) for k, v in self.layers]
        self.layers, self.positions, self.contexts, self.questions, self.documents = self._padded(_room(width))
        self.width = width

    def _reserve(self, columns: int) -> None:
        """Make room for ``columns`` more columns, growing the capacity to a multiple of :data:`GROW_COLUMNS`."""
        if self.width + columns <= self.capacity:
            return
        self.layers, self.positions, self.contexts, self.questions, self.documents = self._padded(
            _room(self.width + columns))

    def _padded(self, capacity: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor,
                                              torch.Tensor, torch.Tensor]:
        """Layers, positions, contexts, questions and documents right-padded (as padding) to ``capacity`` columns."""
        return ([(_pad(k, capacity), _pad(v, capacity)) for k, v in self.layers],
                _pad_ids(self.positions, capacity, PAD_POSITION), _pad_ids(self.contexts, capacity, PAD_ID),
                _pad_ids(self.questions, capacity, PAD_ID), _pad_ids(self.documents, capacity, 0))

    @torch.inference_mode()
    def forward(self, model: torch.nn.Module, runs: list[list[Run]], pad_token: int,
                kernel: str = "eager") -> list[torch.Tensor]:
        """Append every row's runs in ONE forward pass; return per row the logits after each run ([runs, V], fp32).

        Rows are padded to the longest step; padding tokens have an infinite virtual position, so no
        real token sees them, and only the columns that end a run are sent through the LM head.
        ``kernel``: ``"eager"`` (boolean mask, the model's own attention) or ``"flex"`` (block mask,
        FlexAttention; see :func:`visibility_block_mask`), as resolved by ``flex.resolve_kernel``. Rows with
        their own attention rule (``attention``) read their row of the boolean mask (built for those rows only
        on the flex kernel).
        """
        device = self.positions.device
        step = max((sum(len(r.ids) for r in row) for row in runs), default=0)
        if step == 0:
            return [torch.empty(0) for _ in runs]
        ids = torch.full((self.rows, step), pad_token, dtype=torch.long)
        positions = torch.full((self.rows, step), PAD_POSITION, dtype=torch.long)
        contexts = torch.full_like(positions, PAD_ID)
        questions = torch.full_like(positions, PAD_ID)
        ends: list[list[int]] = []
        for b, row in enumerate(runs):
            column, row_ends = 0, []
            for run in row:
                span = slice(column, column + len(run.ids))
                ids[b, span] = torch.tensor(run.ids)
                positions[b, span] = torch.arange(run.first_position, run.first_position + len(run.ids))
                contexts[b, span], questions[b, span] = run.context, run.question
                column += len(run.ids)
                row_ends.append(column - 1)
            ends.append(row_ends)
        ids, positions, contexts, questions = (t.to(device) for t in (ids, positions, contexts, questions))
        self._reserve(step)
        new = slice(self.width, self.width + step)
        self.positions[:, new], self.contexts[:, new], self.questions[:, new] = positions, contexts, questions
        self.documents[:, new] = 0
        layout = (positions, contexts, questions, self.positions, self.contexts, self.questions)
        flex = kernel == "flex"
        rules = [(b, rule, ends[b][-1]) for b, rule in enumerate(self.attention) if rule is not None and ends[b]]
        extra = {}
        if rules:
            extra = {"row_base": FLEX_ATTENTION if flex else model.config._attn_implementation, "row_rules": rules,
                     "row_documents": self.documents}
            if flex:  # no boolean mask for the batch: each rule row gets its own (one row, cheap)
                extra["row_visible"] = {b: visibility(*(t[b:b + 1] for t in layout)) for b, _, _ in rules}
        keep = sorted({c for row in ends for c in row})
        start = torch.tensor(self.width, device=device)  # one copy to the device per step, shared by the layers
        cache = Cache(layers=[PoolLayer(k, v, start) for k, v in self.layers])
        rope_positions = positions.masked_fill(positions == PAD_POSITION, 0)
        keep_all = keep == list(range(step))
        try:
            mask = visibility_block_mask(*layout) if flex else visibility(*layout)
            swap = ROW_ATTENTION if rules else FLEX_ATTENTION if flex else None
            with attention_swapped(model, swap) if swap else nullcontext():
                out = model(input_ids=ids, attention_mask=mask, position_ids=rope_positions, past_key_values=cache,
                            use_cache=True, logits_to_keep=0 if keep_all else torch.tensor(keep, device=device),
                            **extra)
        except BaseException:
            self.positions[:, new] = PAD_POSITION  # the columns stay unused: no row may see what was written
            self.contexts[:, new] = self.questions[:, new] = PAD_ID
            raise
        self.width += step
        self.forwards += 1
        logits = out.logits.float()
        column_of = {c: i for i, c in enumerate(keep)}
        return [logits[b, [column_of[c] for c in row_ends]] for b, row_ends in enumerate(ends)]


GROW_COLUMNS = 256  # the pool's capacity grows (and is trimmed) in steps of this many columns


def _room(width: int) -> int:
    """The capacity for ``width`` columns in use: the next multiple of :data:`GROW_COLUMNS` (0 for 0)."""
    return -(-width // GROW_COLUMNS) * GROW_COLUMNS


def _pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad a ``[rows, heads, columns, dim]`` tensor with zeros to ``width`` columns (itself if it has them)."""
    missing = width - tensor.shape[2]
    return tensor if missing == 0 else torch.nn.functional.pad(tensor, (0, 0, 0, missing))


def _pad_ids(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
    missing = width - tensor.shape[1]
    return tensor if missing == 0 else torch.nn.functional.pad(tensor, (0, missing), value=value)
