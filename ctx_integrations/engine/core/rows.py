"""The row pool: every active stream of every request in one batched KV cache, advanced by one forward per step.

A *row* is one stream: a KV cache (a shared prefix, then the stream's own cached context, then the
tokens it has been fed) plus, per key column, a virtual position, a context id and a question id.
Rows of different requests have different lengths; they sit side by side in one right-padded
batched cache (preallocated and written in place, :class:`PoolLayer`), each row's columns contiguous
from column 0 and each row writing at its own next column, and padding columns get an infinite
virtual position so nothing attends to them.

Which key a new token may see is IPPD's rule (docs/methods.md#ippd), which also covers every plain stream:

    vpos(q) >= vpos(k)  and  (ctx(q) = ctx(k) or ctx(k) = 0)  and  (qid(q) = qid(k) or qid(k) = 0)

A plain stream has context and question id 0 everywhere, so the rule reduces to "causal, padding
hidden". Keys are stored after RoPE, so a key's column in the buffer does not change what it means: rows
can be merged and dropped freely, and every new token gets its position through ``position_ids``. A
key's column does change how a kernel's reductions are blocked, which is why each row keeps its own
columns where they would be if it ran alone (batch invariance, :class:`RowPool`).
The mask goes in as a 4D boolean ``attention_mask`` (transformers' standard input, SDPA; the reference)
or, with the ``"flex"`` kernel (the default on CUDA), as a FlexAttention block mask evaluated from the
same per-column tensors, so no ``[rows, Q, K]`` mask is built: a 64 x 2048-token prompt prefilled
through the pool (``concat``) would otherwise need a 16 G-element boolean mask.

transformers' cache classes batch sequences of one request; merging and splitting rows of many
requests at step boundaries (continuous batching) is what this module adds, by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ctx_integrations.engine.core.attention_swap import attention_swapped
from ctx_integrations.engine.core.flex import FLEX_ATTENTION, BlockMask, block_mask
from ctx_integrations.engine.core.grouped_attention import step_attention
from ctx_integrations.engine.core.row_attention import ROW_ATTENTION, RowRule
from ctx_integrations.engine.core.windows import in_window, windows

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
                          k_ctx: torch.Tensor, k_qid: torch.Tensor, window: int | None = None) -> BlockMask:
    """The same rule as a FlexAttention block mask (heads share it): no ``[B, Q, K]`` boolean tensor is kept.

    FlexAttention evaluates :func:`visible` per (row, query, key) from the same six tensors and skips
    the 128 x 128 tiles nobody sees (other contexts, other questions' answers, padding). Pass it as
    ``attention_mask`` with the model inside ``attention_swapped(model, FLEX_ATTENTION)``. ``window``: a sliding
    layer's, narrowing each real query to the keys less than ``window`` positions behind it
    (:func:`~ctx_integrations.engine.core.windows.in_window`).
    """

    def mask_mod(b, h, q, k):
        seen = visible(q_pos[b, q], q_ctx[b, q], q_qid[b, q], k_pos[b, k], k_ctx[b, k], k_qid[b, k])
        if window is None:
            return seen
        return seen & in_window(q_pos[b, q], k_pos[b, k], window, q_pos[b, q] != PAD_POSITION)

    return block_mask(mask_mod, q_pos.shape[0], q_pos.shape[1], k_pos.shape[1], q_pos.device)


class PoolLayer(CacheLayerMixin):
    """One layer of the pool as a transformers cache layer: preallocated buffers, new keys written in place.

    ``DynamicCache`` concatenates every step, copying each layer's whole cache (8 rows x 2048 columns
    of SmolLM2-135M: ~0.75 GB copied per step, 3x the step's own time on CPU). Like transformers'
    ``StaticLayer``, this layer writes the step's keys/values into preallocated buffers and returns the
    whole buffers (the columns not written yet are padding, hidden by the mask), so shapes stay fixed
    between the pool's growths. Unlike it, each row writes at its own next column (``columns``, ``[rows,
    step]``: row ``b``'s ``t``-th new token goes to ``columns[b, t]``), so a row's columns are the same
    whether it runs alone or beside longer rows. Its buffers belong to the pool (which merges and drops
    rows), hence this small subclass instead of a ``StaticCache``.
    """

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True
        self.rows, self.columns = rows, columns  # [rows, 1] and [rows, step]: where each new token is written

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("a pool layer is built over the pool's buffers")  # never called: is_initialized

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        # [rows, heads, step, dim] -> the buffers' [rows, (step), heads, dim] view at each row's own columns
        self.keys[self.rows, :, self.columns] = key_states.transpose(1, 2)
        self.values[self.rows, :, self.columns] = value_states.transpose(1, 2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return int(self.columns.max()) + 1 if self.columns.numel() else 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


# The pool's capacity grows (and is trimmed) in steps of this many columns when rows must round alike in any
# batch (``Engine(batch_invariant=True)``) or a compiled step wants few shapes: the key block of torch's CPU flash
# attention (its kv split is 512 columns from 512 keys on, the key count below that), so a row's keys fall
# into the same blocks at every capacity and trailing padding only adds fully hidden blocks.
GROW_COLUMNS = 512
# ... and otherwise (the eager step, the default on the CPU): attention costs per column of capacity, and 512
# made a PCED answer over 8 short demo passages 1.4x slower than 64 (benchmarks/serving.py, docs/scheduler.md).
TIGHT_COLUMNS = 64


@dataclass
class RowPool:
    """Rows in an arena of slots: one batched cache, with each key column's virtual position and ids.

    ``layers`` holds per layer a ``(keys, values)`` pair ``[slots, kv_heads, capacity, head_dim]``;
    ``positions`` / ``contexts`` / ``questions`` / ``documents`` are ``[slots, capacity]``. The pool's rows
    (what the scheduler knows, in its order) sit in slots (``slots[row]``); the other slots are free, all
    padding, and take padding tokens in a forward. With ``padded_slots`` (the runner's choice when its decode
    step is compiled) the slot count is a bucket (:func:`slot_bucket`: 1, 2, 4, 8, then multiples of 8), so a
    forward's shapes stay fixed while requests come and go within it (what a compiled or CUDA-graph step
    needs): a joining row takes a free slot (only its own columns are copied), a leaving row frees its slot
    (metadata only), and the arena is copied only when it grows to the next bucket or shrinks below half of
    it. Without (the eager step), the arena holds exactly its rows: a free slot would be computed at every step
    (PCED's 9 rows in 16 slots made a CPU step 1.7x slower), so a leaving row's slot is compacted away at once
    (one copy of the rows that stay) and a joining row grows the arena by its own rows.

    Row ``b`` holds its columns contiguously from column 0: ``lengths[b]`` of them (cached pieces, then every
    token it was fed, in order); every column from there on is padding. Each row writes its next tokens
    at its own next column, never at a column shared with longer rows, so a row's keys sit at the same
    columns and its attention reduces over the same blocks whether it runs alone or batched: with
    capacities in whole :data:`GROW_COLUMNS` (the CPU attention kernel's key block; ``grow_columns``) and the
    batch-invariant kernels (:mod:`~ctx_integrations.engine.core.batch_invariant`), its logits are bit for bit
    the same beside any neighbours, in bf16 as in fp32 (``tests/test_batch_invariance.py``). The capacity
    grows by ``grow_columns`` at a time (:data:`TIGHT_COLUMNS` when invariance is not asked for), so most
    steps write in place and keep every tensor's shape. Per row: ``attention``, its own attention rule
    (``row_attention.py``; APE's merge) or ``None``; ``next_positions``, the virtual position after its last fed
    token; ``fed``, how many of its columns were fed as tokens (after its pieces): what :meth:`rewind` may drop.
    """

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    positions: torch.Tensor
    contexts: torch.Tensor
    questions: torch.Tensor
    lengths: list[int] = field(default_factory=list)
    forwards: int = field(default=0)
    documents: torch.Tensor | None = None  # None: no column marks a document
    attention: list[RowRule | None] | None = None  # None: no row has its own rule
    next_positions: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # the slot of each row (default: row b in slot b)
    padded_slots: bool = True  # slots in buckets (a compiled step's fixed shapes) or exactly the rows
    grow_columns: int = GROW_COLUMNS  # the capacity's step (GROW_COLUMNS, or TIGHT_COLUMNS: see there)

    def bucket(self, rows: int) -> int:
        """The slot count for ``rows`` rows: :func:`slot_bucket`'s, or exactly ``rows`` without padded slots."""
        return slot_bucket(rows) if self.padded_slots else rows

    def __post_init__(self) -> None:
        if not self.slots:
            self.slots = list(range(self.positions.shape[0]))
        if not self.lengths:
            real = (self.positions != PAD_POSITION).sum(1).tolist()
            self.lengths = [int(real[slot]) for slot in self.slots]
        if self.documents is None:
            self.documents = torch.zeros_like(self.positions)
        if self.attention is None:
            self.attention = [None] * self.rows
        if not self.next_positions:
            self.next_positions = [0] * self.rows
        if not self.fed:
            self.fed = [0] * self.rows

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def slot_count(self) -> int:
        return self.positions.shape[0]

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]

    @property
    def width(self) -> int:
        """The columns the longest row uses (every column from there on is padding in every row)."""
        return max(self.lengths, default=0)

    @classmethod
    @torch.inference_mode()  # like every other method that allocates the arena: a compiled step guards on the
    # tensors' dispatch keys, and a normal tensor where an inference tensor was cost a recompile of the same bucket
    def build(cls, rows: list[list[Piece]], shape: tuple[int, int, int], device: torch.device,
              dtype: torch.dtype, attention: list[RowRule | None] | None = None,
              slots: int | None = None, grow_columns: int | None = None, padded_slots: bool = True,
              room: int = 0) -> RowPool:
        """Lay out ``rows`` (each a list of pieces) from column 0 of slots ``0 ..``, right-padded to whole
        ``grow_columns`` (default :data:`GROW_COLUMNS`): one copy per piece, and zeros written only where no piece
        is. ``slots``: how many slots (default: exactly the rows); ``padded_slots``: whether the slot count moves
        in buckets (see the class); ``room``: columns to leave after the longest row (the tokens its first
        forward appends), so that forward writes in place instead of copying the arena to a larger capacity.

        ``shape`` is ``(layers, kv_heads, head_dim)``, used for rows without any cached piece;
        ``attention``: per row, its own attention rule or ``None``.
        """
        layers, heads, dim = shape
        count = len(rows) if slots is None else slots
        widths = [sum(p.kv.shape[3] for p in pieces) for pieces in rows]
        grow = GROW_COLUMNS if grow_columns is None else grow_columns
        capacity = _room(max(widths, default=0) + room, grow)
        buffer = torch.empty(layers, 2, count, heads, capacity, dim, device=device, dtype=dtype)
        buffer[:, :, len(rows):] = 0  # free slots: padding keys and values must be finite (weight 0 x NaN is NaN)
        positions = torch.full((count, capacity), PAD_POSITION, dtype=torch.long)
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
            buffer[:, :, b, :, column:] = 0
        return cls([(buffer[i, 0], buffer[i, 1]) for i in range(layers)], positions.to(device), contexts.to(device),
                   questions.to(device), lengths=widths, documents=documents.to(device),
                   attention=list(attention) if attention is not None else None, slots=list(range(len(rows))),
                   padded_slots=padded_slots, grow_columns=grow)

    @torch.inference_mode()
    def merge(self, other: RowPool) -> None:
        """Add ``other``'s rows after this pool's rows, each in a free slot (the arena grows to the next bucket when
        it has too few; the side with fewer columns is padded on the right). Only ``other``'s rows are copied."""
        free = self._free_slots()
        if len(free) < other.rows:
            self.resize_slots(self.bucket(self.rows + other.rows))
            free = self._free_slots()
        capacity = max(self.capacity, other.capacity)
        if capacity > self.capacity:
            self._reserve(capacity)
        (other_layers, *other_ids) = other._padded(capacity)
        targets = free[:other.rows]
        index = torch.tensor(targets, dtype=torch.long, device=self.positions.device)
        source = torch.tensor(other.slots, dtype=torch.long, device=self.positions.device)
        for (keys, values), (their_keys, their_values) in zip(self.layers, other_layers):
            keys.index_copy_(0, index, their_keys.index_select(0, source))
            values.index_copy_(0, index, their_values.index_select(0, source))
        for mine, theirs in zip((self.positions, self.contexts, self.questions, self.documents), other_ids):
            mine.index_copy_(0, index, theirs.index_select(0, source))
        self.slots = self.slots + targets
        self.attention = self.attention + other.attention
        self.lengths = self.lengths + other.lengths
        self.next_positions = self.next_positions + other.next_positions
        self.fed = self.fed + other.fed

    @torch.inference_mode()
    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (in that order): the others' slots are freed (their metadata becomes padding,
        nothing is copied); the arena is compacted when its rows would fit a bucket under half its slots (so rows
        coming and going around a bucket's edge do not copy it back and forth), and the room no remaining row needs
        is trimmed."""
        freed = sorted(set(self.slots) - {self.slots[row] for row in keep})
        self.slots = [self.slots[row] for row in keep]
        self.attention = [self.attention[row] for row in keep]
        self.lengths = [self.lengths[row] for row in keep]
        self.next_positions = [self.next_positions[row] for row in keep]
        self.fed = [self.fed[row] for row in keep]
        if freed:
            index = torch.tensor(freed, dtype=torch.long, device=self.positions.device)
            self.positions.index_fill_(0, index, PAD_POSITION)
            self.contexts.index_fill_(0, index, PAD_ID)
            self.questions.index_fill_(0, index, PAD_ID)
            self.documents.index_fill_(0, index, 0)
        # padded: under a quarter full is worth one copy of what remains; exact: any free slot is
        if self.bucket(self.rows) < (self.slot_count // 2 if self.padded_slots else self.slot_count):
            self._compact(self.bucket(self.rows))
        if self.capacity >= _room(self.width, self.grow_columns) + self.grow_columns:  # a long row left: trim
            self.layers, self.positions, self.contexts, self.questions, self.documents = self._trimmed(
                _room(self.width, self.grow_columns))

    def _free_slots(self) -> list[int]:
        used = set(self.slots)
        return [slot for slot in range(self.slot_count) if slot not in used]

    @torch.inference_mode()
    def resize_slots(self, count: int) -> None:
        """Grow the arena to ``count`` slots (new slots free, all padding): one copy of the arena."""
        extra = count - self.slot_count
        if extra <= 0:
            return
        self.layers = [(_pad_rows(k, extra, 0), _pad_rows(v, extra, 0)) for k, v in self.layers]
        self.positions = _pad_rows(self.positions, extra, PAD_POSITION)
        self.contexts = _pad_rows(self.contexts, extra, PAD_ID)
        self.questions = _pad_rows(self.questions, extra, PAD_ID)
        self.documents = _pad_rows(self.documents, extra, 0)

    def _compact(self, count: int) -> None:
        """Move the rows to slots ``0 ..`` of an arena of ``count`` slots (one copy of the rows kept)."""
        index = torch.tensor(self.slots, dtype=torch.long, device=self.positions.device)
        self.layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.layers]
        self.positions = self.positions.index_select(0, index)
        self.contexts = self.contexts.index_select(0, index)
        self.questions = self.questions.index_select(0, index)
        self.documents = self.documents.index_select(0, index)
        self.slots = list(range(len(self.slots)))
        self.resize_slots(count)

    @torch.inference_mode()
    def rewind(self, rows: dict[int, int]) -> None:
        """Per row ``{row: position}``, drop the row's fed tokens at virtual positions ``>= position``: its last
        ``next_position - position`` columns become padding again (no copy; the next tokens overwrite them).

        Keys are stored after RoPE, so a later token at one of those positions is written in a new column. Only
        rows fed one sequence at consecutive positions (RAPID's target and drafter rows) may be rewound this way;
        a rewind into a row's cached pieces is a caller's bug and raises.
        """
        for row, position in rows.items():
            dropped = self.next_positions[row] - position
            if dropped <= 0:
                continue
            if dropped > self.fed[row]:
                raise AssertionError(f"row {row}: rewinding to position {position} would drop {dropped} columns, "
                                     f"more than the {self.fed[row]} it was fed")
            slot, end = self.slots[row], self.lengths[row]
            span = slice(end - dropped, end)
            self.positions[slot, span] = PAD_POSITION
            self.contexts[slot, span] = PAD_ID
            self.questions[slot, span] = PAD_ID
            self.documents[slot, span] = 0
            self.lengths[row] -= dropped
            self.fed[row] -= dropped
            self.next_positions[row] = position

    def select(self, rows: list[int]) -> RowPool:
        """A copy of some rows, same columns, one slot each: to run a forward of their own (:meth:`take_columns`
        brings back what it appended). Copies those rows' whole buffers."""
        index = torch.tensor([self.slots[r] for r in rows], dtype=torch.long, device=self.positions.device)
        return RowPool([(k.index_select(0, index), v.index_select(0, index)) for k, v in self.layers],
                       self.positions.index_select(0, index), self.contexts.index_select(0, index),
                       self.questions.index_select(0, index), lengths=[self.lengths[r] for r in rows],
                       documents=self.documents.index_select(0, index), attention=[self.attention[r] for r in rows],
                       next_positions=[self.next_positions[r] for r in rows], fed=[self.fed[r] for r in rows],
                       padded_slots=self.padded_slots, grow_columns=self.grow_columns)

    @torch.inference_mode()
    def take_columns(self, rows: list[int], selected: RowPool) -> None:
        """Bring back the columns a :meth:`select` copy of ``rows`` appended (each row's new columns follow its
        old ones, as in the copy); the other rows are untouched."""
        start = min(self.lengths[r] for r in rows)
        end = max(selected.lengths)
        self._reserve(end)
        index = torch.tensor([self.slots[r] for r in rows], dtype=torch.long, device=self.positions.device)
        new = slice(start, end)  # from the shortest row's old end: the others' older columns are the same in both
        for (keys, values), (their_keys, their_values) in zip(self.layers, selected.layers):
            keys[index, :, new] = their_keys[:, :, new]
            values[index, :, new] = their_values[:, :, new]
        for mine, theirs in ((self.positions, selected.positions), (self.contexts, selected.contexts),
                             (self.questions, selected.questions), (self.documents, selected.documents)):
            mine[index, new] = theirs[:, new]
        for i, row in enumerate(rows):
            self.lengths[row], self.next_positions[row], self.fed[row] = (
                selected.lengths[i], selected.next_positions[i], selected.fed[i])

    def _reserve(self, columns: int) -> None:
        """Make room for ``columns`` columns in every row (the capacity grows to a multiple of ``grow_columns``)."""
        if columns <= self.capacity:
            return
        self.layers, self.positions, self.contexts, self.questions, self.documents = self._padded(
            _room(columns, self.grow_columns))

    def _padded(self, capacity: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor,
                                              torch.Tensor, torch.Tensor]:
        """Layers, positions, contexts, questions and documents right-padded (as padding) to ``capacity`` columns."""
        return ([(_pad(k, capacity), _pad(v, capacity)) for k, v in self.layers],
                _pad_ids(self.positions, capacity, PAD_POSITION), _pad_ids(self.contexts, capacity, PAD_ID),
                _pad_ids(self.questions, capacity, PAD_ID), _pad_ids(self.documents, capacity, 0))

    def _trimmed(self, capacity: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor,
                                               torch.Tensor, torch.Tensor]:
        """The first ``capacity`` columns of everything, as new contiguous tensors (the rest is padding)."""
        def cut(t: torch.Tensor, dim: int) -> torch.Tensor:
            return t.narrow(dim, 0, capacity).contiguous()

        return ([(cut(k, 2), cut(v, 2)) for k, v in self.layers], cut(self.positions, 1), cut(self.contexts, 1),
                cut(self.questions, 1), cut(self.documents, 1))

    def slot_lengths(self) -> list[int]:
        """Per slot, its row's length (0 for a free slot)."""
        lengths = [0] * self.slot_count
        for row, slot in enumerate(self.slots):
            lengths[slot] = self.lengths[row]
        return lengths

    @torch.inference_mode()
    def forward(self, model: torch.nn.Module, runs: list[list[Run]], pad_token: int,
                kernel: str = "eager", step: Callable[..., torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Append every row's runs in ONE forward pass over every slot; return per row the logits after each run
        ([runs, V], fp32).

        Rows are padded to the longest step; a row's padding tokens (and a free slot's) are written after its real
        ones with an infinite virtual position (no real token sees them; the row's next tokens overwrite them), and
        only the columns that end a run are sent through the LM head. ``kernel``: ``"eager"`` (boolean mask, the
        model's own attention) or ``"flex"`` (block mask, FlexAttention; see :func:`visibility_block_mask`), as
        resolved by ``flex.resolve_kernel``. Rows with their own attention rule (``attention``) read their row
        of the boolean mask (built for those rows only on the flex kernel). ``step``: a compiled form of
        :func:`decode_step` to run instead of the eager forward when no row has its own rule
        (:mod:`~ctx_integrations.engine.core.compiled_step`): one token per row when decoding, an IPPD stack's
        tokens (one per unfinished answer) or a RAPID verification's drafts in one row, whatever the width.
        """
        device = self.positions.device
        fed = [sum(len(r.ids) for r in row) for row in runs]
        width = max(fed, default=0)
        if width == 0:
            return [torch.empty(0) for _ in runs]
        slots = self.slot_count
        ids = torch.full((slots, width), pad_token, dtype=torch.long)
        positions = torch.full((slots, width), PAD_POSITION, dtype=torch.long)
        contexts = torch.full_like(positions, PAD_ID)
        questions = torch.full_like(positions, PAD_ID)
        ends: list[list[int]] = []
        for b, row in enumerate(runs):
            slot, column, row_ends = self.slots[b], 0, []
            for run in row:
                span = slice(column, column + len(run.ids))
                ids[slot, span] = torch.tensor(run.ids)
                positions[slot, span] = torch.arange(run.first_position, run.first_position + len(run.ids))
                contexts[slot, span], questions[slot, span] = run.context, run.question
                column += len(run.ids)
                row_ends.append(column - 1)
            ends.append(row_ends)
        self._reserve(self.width + width)
        columns = torch.tensor(self.slot_lengths(), dtype=torch.long).unsqueeze(1) + torch.arange(width)
        ids, positions, contexts, questions, columns = (
            t.to(device) for t in (ids, positions, contexts, questions, columns))
        rows = torch.arange(slots, device=device).unsqueeze(1)
        rules = [(self.slots[b], rule, ends[b][-1]) for b, rule in enumerate(self.attention)
                 if rule is not None and ends[b]]
        try:
            if step is not None and not rules:
                logits = step(model, ids, positions, contexts, questions, rows, columns, self.positions,
                              self.contexts, self.questions, self.documents, self.layers)
                column_of = {c: c for c in range(width)}
            else:
                logits, column_of = self._eager_forward(model, kernel, ids, positions, contexts, questions, rows,
                                                        columns, ends, rules)
        except BaseException:
            self.positions[rows, columns] = PAD_POSITION  # the columns stay unused: no row may see what was written
            self.contexts[rows, columns] = self.questions[rows, columns] = PAD_ID
            raise
        for b, row in enumerate(runs):
            self.lengths[b] += fed[b]
            self.fed[b] += fed[b]
            if row:
                self.next_positions[b] = row[-1].first_position + len(row[-1].ids)
        self.forwards += 1
        return [logits[self.slots[b], [column_of[c] for c in row_ends]] for b, row_ends in enumerate(ends)]

    def _eager_forward(self, model: torch.nn.Module, kernel: str, ids: torch.Tensor, positions: torch.Tensor,
                       contexts: torch.Tensor, questions: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor,
                       ends: list[list[int]], rules: list[tuple[int, RowRule, int]]
                       ) -> tuple[torch.Tensor, dict[int, int]]:
        """The forward as transformers runs it (the reference; a grouped-query SDPA model's attention over the arena's
        own key/value heads, :mod:`~ctx_integrations.engine.core.grouped_attention`): fp32 logits of the kept columns,
        and where each is."""
        device = self.positions.device
        inputs = step_inputs(ids, positions, contexts, questions, rows, columns, self.positions, self.contexts,
                             self.questions, self.documents, self.layers)
        layout = (positions, contexts, questions, self.positions, self.contexts, self.questions)
        flex = kernel == "flex"
        own = getattr(getattr(model, "config", None), "_attn_implementation", None)
        base = FLEX_ATTENTION if flex else step_attention(model, kernel) or own  # SDPA over the arena's own heads
        extra = {}
        if rules:
            extra = {"row_base": base, "row_rules": rules, "row_documents": self.documents}
            if flex:  # no boolean mask for the batch: each rule row gets its own (one row, cheap)
                extra["row_visible"] = {b: visibility(*(t[b:b + 1] for t in layout)) for b, _, _ in rules}
        keep = sorted({c for row in ends for c in row})
        keep_all = keep == list(range(ids.shape[1]))
        # a sliding-window model's sliding layers see their window only (windows.py), on either kernel
        mask = step_block_mask(model, *layout) if flex else step_mask(model, *layout)
        swap = ROW_ATTENTION if rules else base if base != own else None
        with attention_swapped(model, swap) if swap else nullcontext():
            out = model(**inputs, attention_mask=mask,
                        logits_to_keep=0 if keep_all else torch.tensor(keep, device=device), **extra)
        return out.logits.float(), {c: i for i, c in enumerate(keep)}


def step_mask(model: torch.nn.Module, positions: torch.Tensor, contexts: torch.Tensor, questions: torch.Tensor,
              k_pos: torch.Tensor, k_ctx: torch.Tensor, k_qid: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """A step's boolean ``attention_mask`` over the arena (the eager forward's and :func:`decode_step`'s): the
    visibility rule, narrowed to the window on a sliding-window model's sliding layers (one mask per layer type when
    only some slide; a stand-in model without a config has no window)."""
    full = visibility(positions, contexts, questions, k_pos, k_ctx, k_qid)
    return windows(getattr(model, "config", None)).masks(full, positions, k_pos, positions != PAD_POSITION)


def step_block_mask(model: torch.nn.Module, positions: torch.Tensor, contexts: torch.Tensor, questions: torch.Tensor,
                    k_pos: torch.Tensor, k_ctx: torch.Tensor, k_qid: torch.Tensor) -> BlockMask | dict[str, BlockMask]:
    """:func:`step_mask` as FlexAttention block masks (the flex kernel's, eager or compiled): one per layer type when
    only some layers slide."""
    layout = (positions, contexts, questions, k_pos, k_ctx, k_qid)
    return windows(getattr(model, "config", None)).per_layer_type(
        lambda window: visibility_block_mask(*layout, window=window))


def decode_step(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, contexts: torch.Tensor,
                questions: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, k_pos: torch.Tensor,
                k_ctx: torch.Tensor, k_qid: torch.Tensor, documents: torch.Tensor,
                layers: list[tuple[torch.Tensor, torch.Tensor]], kernel: str = "eager") -> torch.Tensor:
    """The step's tokens of every slot (``[slots, width]``: one each when decoding) through the model, as one pure
    function of tensors (what ``torch.compile`` and CUDA graphs capture): the step's metadata written at each
    slot's columns, the mask from the visibility rule (and a sliding-window model's window,
    :mod:`~ctx_integrations.engine.core.windows`; a boolean mask, or block masks with ``kernel="flex"``, whose
    attention the caller swaps in), the keys written in place, fp32 logits ``[slots, width, V]``.
    Every shape is the arena's (and the step's width), fixed within a bucket of (slots, capacity), so a compiled
    step neither breaks its graph nor recompiles while requests come, go and decode within the bucket
    (``tests/test_compiled_step.py``)."""
    inputs = step_inputs(ids, positions, contexts, questions, rows, columns, k_pos, k_ctx, k_qid, documents, layers)
    layout = (positions, contexts, questions, k_pos, k_ctx, k_qid)
    mask = step_block_mask(model, *layout) if kernel == "flex" else step_mask(model, *layout)
    return model(**inputs, attention_mask=mask).logits.float()


def step_inputs(ids: torch.Tensor, positions: torch.Tensor, contexts: torch.Tensor, questions: torch.Tensor,
                rows: torch.Tensor, columns: torch.Tensor, k_pos: torch.Tensor, k_ctx: torch.Tensor,
                k_qid: torch.Tensor, documents: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> dict[str, object]:
    """What every step's forward shares (the eager reference's and :func:`decode_step`'s): the step's metadata written
    at each slot's columns (its tokens belong to no document), and the model's inputs but the mask: the ids, RoPE
    positions (a padding token's infinite position as 0: nothing sees it) and the arena as a transformers ``Cache``
    whose layers write the step's keys in place."""
    k_pos[rows, columns], k_ctx[rows, columns], k_qid[rows, columns] = positions, contexts, questions
    documents[rows, columns] = 0
    return {"input_ids": ids, "position_ids": positions.masked_fill(positions == PAD_POSITION, 0),
            "past_key_values": Cache(layers=[PoolLayer(k, v, rows, columns) for k, v in layers]), "use_cache": True}


def slot_bucket(rows: int) -> int:
    """The arena's slot count for ``rows`` rows: 0, 1, 2, 4, 8, then the next multiple of 8 (vLLM's CUDA-graph
    batch sizes follow the same shape): at most 2x the rows for small batches, +7 for large ones."""
    if rows <= 0:
        return 0
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 8) * 8



def _room(width: int, grow: int = GROW_COLUMNS) -> int:
    """The capacity for ``width`` columns in use: the next multiple of ``grow`` (0 for 0)."""
    return -(-width // grow) * grow


def _pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad a ``[rows, heads, columns, dim]`` tensor with zeros to ``width`` columns (itself if it has them)."""
    missing = width - tensor.shape[2]
    return tensor if missing == 0 else torch.nn.functional.pad(tensor, (0, 0, 0, missing))


def _pad_rows(tensor: torch.Tensor, extra: int, value: float) -> torch.Tensor:
    """``tensor`` with ``extra`` more rows (dim 0) filled with ``value``."""
    pad = torch.full((extra, *tensor.shape[1:]), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, pad])


def _pad_ids(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
    missing = width - tensor.shape[1]
    return tensor if missing == 0 else torch.nn.functional.pad(tensor, (0, missing), value=value)
