"""The row pool's arena of slots (``engine/core/rows.py``) without a model: what each operation leaves in every slot.

``tests/test_rows.py`` checks the pool through a model's logits (a row answers as if alone); these tests check
the arena itself, column by column, on hand-made tensors in milliseconds (fast enough for mutation testing,
``tools/mutate.py``'s ``rows`` target): after every operation each row must hold exactly its own keys, values,
positions, contexts, questions and document marks in its columns ``0 .. length``, every other column of its
slot and every free slot must be padding (infinite position, ids ``PAD_ID``, no document), and its bookkeeping
(slot, length, next position, fed count, attention rule) must follow it. Bugs caught: a joining row copied into
a taken slot or from the wrong slot of its pool, a leaving row's slot left visible or its neighbours moved, a
copy of the arena where only metadata should change (and none where the arena should shrink), compaction and
trimming at the wrong threshold, a rewind that drops the wrong columns, columns brought back to the wrong row.
"""

from __future__ import annotations

import pytest
import torch

from ctx_integrations.engine.core.rows import (
    GROW_COLUMNS,
    PAD_ID,
    PAD_POSITION,
    Piece,
    RowPool,
    Run,
    _pad_rows,
    _room,
    slot_bucket,
)

LAYERS, HEADS, DIM = 2, 1, 3
SHAPE = (LAYERS, HEADS, DIM)
CPU = torch.device("cpu")


def piece(seed: int, length: int, first_position: int = 0, context: int = 0, document: int = 0) -> Piece:
    """A piece of ``length`` columns of random keys/values (so every column says which row and column it is)."""
    kv = torch.randn(LAYERS, 2, HEADS, length, DIM, generator=torch.Generator().manual_seed(seed))
    return Piece(kv, first_position, context=context, document=document)


class Expected:
    """What one row must hold: its columns' keys / values (``[layers, 2, heads, length, dim]``), their metadata,
    and its bookkeeping."""

    def __init__(self, pieces: list[Piece], attention: object = None):
        self.kv = torch.cat([p.kv for p in pieces], dim=3) if pieces else torch.zeros(LAYERS, 2, HEADS, 0, DIM)
        self.positions = [p.first_position + i for p in pieces for i in range(p.kv.shape[3])]
        self.contexts = [p.context for p in pieces for _ in range(p.kv.shape[3])]
        self.questions = [0] * len(self.positions)
        self.documents = [p.document for p in pieces for _ in range(p.kv.shape[3])]
        self.attention, self.next_position, self.fed = attention, 0, 0

    @property
    def length(self) -> int:
        return len(self.positions)

    def feed(self, kv: torch.Tensor, run: Run) -> None:
        """The row took ``run``'s tokens, whose keys / values are ``kv``."""
        self.kv = torch.cat([self.kv, kv], dim=3)
        self.positions += list(range(run.first_position, run.first_position + len(run.ids)))
        self.contexts += [run.context] * len(run.ids)
        self.questions += [run.question] * len(run.ids)
        self.documents += [0] * len(run.ids)
        self.next_position, self.fed = run.first_position + len(run.ids), self.fed + len(run.ids)

    def drop(self, count: int) -> None:
        """The row's last ``count`` columns were rewound."""
        keep = self.length - count
        self.kv = self.kv[:, :, :, :keep]
        for name in ("positions", "contexts", "questions", "documents"):
            setattr(self, name, getattr(self, name)[:keep])
        self.next_position, self.fed = self.positions[-1] + 1, self.fed - count


def assert_holds(pool: RowPool, rows: list[Expected]) -> None:
    """Every row holds exactly its expected columns and bookkeeping; everything else in the arena is padding."""
    slots, capacity = pool.slot_count, pool.capacity
    assert pool.rows == len(rows) and len(set(pool.slots)) == len(rows) and all(0 <= s < slots for s in pool.slots)
    assert capacity % GROW_COLUMNS == 0 and capacity >= pool.width
    for tensor in (pool.positions, pool.contexts, pool.questions, pool.documents):
        assert tensor.shape == (slots, capacity) and tensor.dtype == torch.long
    assert len(pool.layers) == LAYERS
    for keys, values in pool.layers:
        assert keys.shape == values.shape == (slots, HEADS, capacity, DIM)
    assert pool.lengths == [row.length for row in rows]
    assert pool.next_positions == [row.next_position for row in rows]
    assert pool.fed == [row.fed for row in rows]
    assert pool.attention == [row.attention for row in rows]
    assert pool.width == max((row.length for row in rows), default=0)
    assert pool.slot_lengths() == [rows[pool.slots.index(s)].length if s in pool.slots else 0 for s in range(slots)]
    for b, row in enumerate(rows):
        slot, length = pool.slots[b], row.length
        for layer, (keys, values) in enumerate(pool.layers):
            assert torch.equal(keys[slot, :, :length], row.kv[layer, 0]), (b, layer)
            assert torch.equal(values[slot, :, :length], row.kv[layer, 1]), (b, layer)
        assert pool.positions[slot, :length].tolist() == row.positions, b
        assert pool.contexts[slot, :length].tolist() == row.contexts, b
        assert pool.questions[slot, :length].tolist() == row.questions, b
        assert pool.documents[slot, :length].tolist() == row.documents, b
    for slot in range(slots):
        start = rows[pool.slots.index(slot)].length if slot in pool.slots else 0
        assert (pool.positions[slot, start:] == PAD_POSITION).all(), slot
        assert (pool.contexts[slot, start:] == PAD_ID).all() and (pool.questions[slot, start:] == PAD_ID).all(), slot
        assert not pool.documents[slot, start:].any(), slot


def storage(pool: RowPool) -> list[int]:
    """Where the arena's tensors live (unchanged: nothing was copied)."""
    return [t.data_ptr() for t in tensors(pool)]


def tensors(pool: RowPool) -> list[torch.Tensor]:
    """The arena's tensors: every layer's keys and values, then the columns' positions, contexts, questions, marks."""
    return [t for pair in pool.layers for t in pair] + [pool.positions, pool.contexts, pool.questions, pool.documents]


def built(specs: list[list[Piece]], attention: list[object] | None = None, slots: int | None = None
          ) -> tuple[RowPool, list[Expected]]:
    pool = RowPool.build(specs, SHAPE, CPU, torch.float32, attention=attention, slots=slots)
    rules = attention or [None] * len(specs)
    return pool, [Expected(pieces, rule) for pieces, rule in zip(specs, rules)]


class FakeModel:
    """Stands in for the model in :meth:`RowPool.forward`: writes each token's keys / values through the cache
    (token ``t`` at layer ``l``: keys ``t + l / 8 + d / 64``, values their negation) and returns zero logits."""

    vocab = 5

    def __init__(self):
        self.calls = 0

    @staticmethod
    def kv(ids: list[int]) -> torch.Tensor:
        """The ``[layers, 2, heads, len(ids), dim]`` keys / values it writes for ``ids``."""
        token = torch.tensor(ids, dtype=torch.float32)[:, None]
        keys = torch.stack([token + layer / 8 + torch.arange(DIM) / 64 for layer in range(LAYERS)])
        return torch.stack([keys, -keys], dim=1)[:, :, None]

    def __call__(self, input_ids, past_key_values, **kwargs):
        from types import SimpleNamespace

        self.calls += 1
        batch, step = input_ids.shape
        written = self.kv(input_ids.flatten().tolist()).reshape(LAYERS, 2, HEADS, batch, step, DIM)
        for layer, cache_layer in enumerate(past_key_values.layers):
            cache_layer.update(written[layer, 0].transpose(0, 1), written[layer, 1].transpose(0, 1))
        keep = kwargs["logits_to_keep"]
        kept = step if isinstance(keep, int) else len(keep)
        return SimpleNamespace(logits=torch.zeros(batch, kept, self.vocab))


def feed(pool: RowPool, rows: list[Expected], new: dict[int, list[int]], context: int = 0, question: int = 0) -> None:
    """Feed ``new[row]`` tokens to some rows through a forward (the others take nothing), and expect them.

    The rows' attention rules (labels here, not callables) are set aside for the forward: they are only carried."""
    runs = [[Run(tuple(new[b]), row.next_position or row.length, context, question)] if b in new else []
            for b, row in enumerate(rows)]
    rules, pool.attention = pool.attention, [None] * pool.rows
    try:
        pool.forward(FakeModel(), runs, pad_token=0)
    finally:
        pool.attention = rules
    for b, row_runs in enumerate(runs):
        if row_runs:
            rows[b].feed(FakeModel.kv(list(row_runs[0].ids)), row_runs[0])


def test_a_pool_made_of_tensors_counts_its_rows_lengths_from_the_positions_of_their_slots():
    positions = torch.tensor([[0, 1, 2, PAD_POSITION], [5, PAD_POSITION, PAD_POSITION, PAD_POSITION]])
    kv = [(torch.zeros(2, 1, 4, 1), torch.zeros(2, 1, 4, 1))]
    pool = RowPool(kv, positions, torch.zeros_like(positions), torch.zeros_like(positions))
    assert (pool.slots, pool.lengths, pool.rows, pool.slot_count) == ([0, 1], [3, 1], 2, 2)
    assert (pool.attention, pool.next_positions, pool.fed) == ([None, None], [0, 0], [0, 0])
    assert torch.equal(pool.documents, torch.zeros(2, 4, dtype=torch.long))
    one = RowPool(kv, positions, torch.zeros_like(positions), torch.zeros_like(positions), slots=[1])
    assert (one.rows, one.lengths, one.attention, one.next_positions, one.fed) == (1, [1], [None], [0], [0])
    given = RowPool(kv, positions, torch.zeros_like(positions), torch.zeros_like(positions), lengths=[2, 1],
                    documents=torch.ones_like(positions), attention=["a", None], next_positions=[4, 6], fed=[1, 0])
    assert (given.lengths, given.attention, given.next_positions, given.fed) == ([2, 1], ["a", None], [4, 6], [1, 0])
    assert bool(given.documents.all())


def test_build_lays_rows_out_from_column_0_with_spare_slots_free():
    specs = [[piece(1, 3, 0), piece(2, 2, 3, context=1, document=1)], [], [piece(3, 4, 7, context=2)]]
    pool, rows = built(specs, attention=[None, "rule", None], slots=4)
    assert (pool.slot_count, pool.slots, pool.capacity) == (4, [0, 1, 2], GROW_COLUMNS)
    assert_holds(pool, rows)
    pool, rows = built([[piece(4, GROW_COLUMNS, 0)], [piece(5, 1, 0)]])
    assert (pool.slot_count, pool.capacity) == (2, GROW_COLUMNS)  # an exact fill: no second block
    assert_holds(pool, rows)
    pool, rows = built([[piece(6, GROW_COLUMNS + 1, 0)]])
    assert pool.capacity == 2 * GROW_COLUMNS
    assert_holds(pool, rows)


def arena(pool: RowPool) -> list[torch.Tensor]:
    return [pool.positions, pool.contexts, pool.questions, pool.documents, *(t for pair in pool.layers for t in pair)]


def test_every_arena_tensor_is_an_inference_tensor_however_it_was_made():
    # A compiled step guards on its inputs' dispatch keys: an arena built of normal tensors in one bucket and of
    # inference tensors (made by the methods running under inference mode) in another recompiled the step although
    # its shapes were symbolic.
    pool, _ = built([[piece(1, 3)], [piece(2, 5)]])
    made = {"built": arena(pool)}
    pool.resize_slots(4)
    made["resized"] = arena(pool)
    pool.merge(built([[piece(3, GROW_COLUMNS + 2)]] * 3)[0])
    made["merged"] = arena(pool)
    pool.keep_rows([0])
    made["compacted and trimmed"] = arena(pool)
    assert {name: [t.is_inference() for t in tensors] for name, tensors in made.items()} == \
        {name: [True] * len(tensors) for name, tensors in made.items()}


def test_a_joining_pools_rows_take_the_free_slots_and_only_they_are_copied():
    pool, rows = built([[piece(1, 5)], [piece(2, 9)], [piece(3, 2)]], attention=["a", None, None])
    pool.resize_slots(4)
    pool.keep_rows([0, 2])  # slot 1 is free, and slot 3
    rows = [rows[0], rows[2]]
    pool.next_positions, pool.fed = [5, 2], [0, 0]
    rows[0].next_position, rows[1].next_position = 5, 2
    joining, newcomers = built([[piece(4, 3)], [piece(5, 7, 2, context=3, document=2)], [piece(6, 1)]],
                               attention=[None, "b", None])
    joining.keep_rows([2, 1])  # the joining pool's rows sit in slots 2 and 1 of its own arena
    newcomers = [newcomers[2], newcomers[1]]
    feed(joining, newcomers, {0: [11, 12], 1: [13, 14]})
    before = storage(pool)
    pool.merge(joining)
    assert storage(pool) == before and pool.slots == [0, 2, 1, 3] and pool.slot_count == 4
    assert_holds(pool, rows + newcomers)


@pytest.mark.parametrize(("running", "joining_rows", "slots"), [(2, 1, 4), (3, 3, 8), (8, 1, 16), (0, 3, 4)])
def test_a_merge_without_enough_free_slots_grows_the_arena_to_the_bucket_of_all_rows(running, joining_rows, slots):
    pool, rows = built([[piece(b, 2 + b)] for b in range(running)])
    joining, newcomers = built([[piece(20 + b, 1 + b, context=b)] for b in range(joining_rows)])
    pool.merge(joining)
    assert pool.slot_count == slots == slot_bucket(running + joining_rows)
    assert pool.slots == list(range(running + joining_rows))
    assert_holds(pool, rows + newcomers)


@pytest.mark.parametrize(("mine", "theirs"), [(3, GROW_COLUMNS + 4), (GROW_COLUMNS + 4, 3), (0, 2), (2, 0)])
def test_the_narrower_side_of_a_merge_is_padded(mine, theirs):
    pool, rows = built([[piece(1, mine)] if mine else []])
    joining, newcomers = built([[piece(2, theirs, 1, context=2)] if theirs else []])
    pool.merge(joining)
    assert pool.capacity == _room(max(mine, theirs))
    assert_holds(pool, rows + newcomers)


def test_rows_leave_by_freeing_their_slots_metadata_only():
    pool, rows = built([[piece(b, 3 + b, document=b % 2)] for b in range(6)], attention=list("abcdef"), slots=8)
    before = storage(pool)
    pool.keep_rows([4, 0, 5, 2])  # 4 rows in 8 slots: half full, no compaction
    assert storage(pool) == before and pool.slots == [4, 0, 5, 2] and pool.slot_count == 8
    assert_holds(pool, [rows[4], rows[0], rows[5], rows[2]])
    pool.keep_rows([0, 1, 2, 3])  # nobody leaves: nothing changes
    assert storage(pool) == before and pool.slots == [4, 0, 5, 2]


@pytest.mark.parametrize(("slots", "kept", "compacted"),
                         [(8, 3, None), (8, 2, 2), (4, 2, None), (4, 1, 1), (2, 1, None), (16, 5, None), (16, 4, 4),
                          (16, 8, None), (24, 8, 8), (24, 9, None), (8, 0, 0)])
def test_the_arena_is_compacted_to_its_rows_bucket_when_that_is_under_half_its_slots(slots, kept, compacted):
    pool, rows = built([[piece(b, 2 + b % 3, context=b)] for b in range(slots)], attention=list(range(slots)))
    keep = list(range(slots - 1, slots - 1 - kept, -1))  # the last rows, in reverse
    before = storage(pool)
    pool.keep_rows(keep)
    if compacted is None:
        assert pool.slot_count == slots and pool.slots == keep and storage(pool) == before
    else:
        assert pool.slot_count == compacted and pool.slots == list(range(kept))
    assert_holds(pool, [rows[b] for b in keep])


@pytest.mark.parametrize(("widths", "capacity"), [((GROW_COLUMNS + 1, 5), 2 * GROW_COLUMNS),
                                                   ((GROW_COLUMNS, 5), GROW_COLUMNS), ((3, 5), GROW_COLUMNS),
                                                   ((0, 0), 0)])
def test_leaving_trims_the_room_no_remaining_row_needs(widths, capacity):
    long_row = [piece(1, 2 * GROW_COLUMNS + 7)]
    pool, rows = built([long_row] + [[piece(2 + b, width)] if width else [] for b, width in enumerate(widths)])
    pool.keep_rows([1, 2])
    assert pool.capacity == capacity
    assert_holds(pool, rows[1:])
    if capacity:  # the trimmed arena is a copy of its own: the long row's memory is freed
        for tensor in tensors(pool):
            assert tensor.is_contiguous()
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_growing_the_arena_adds_free_padding_slots_and_never_shrinks_it():
    pool, rows = built([[piece(1, 4, context=1, document=1)], [piece(2, 6)]])
    pool.resize_slots(4)
    assert (pool.slot_count, pool.slots) == (4, [0, 1])
    assert_holds(pool, rows)
    before = storage(pool)
    pool.resize_slots(4)
    pool.resize_slots(2)
    assert storage(pool) == before and pool.slot_count == 4


def test_padding_rows_are_added_after_the_rows_with_the_value_given():
    tensor = torch.arange(6).reshape(2, 3)
    padded = _pad_rows(tensor, 2, -7)
    assert padded.tolist() == [[0, 1, 2], [3, 4, 5], [-7] * 3, [-7] * 3] and padded.dtype == tensor.dtype


def test_rewinding_drops_a_rows_last_fed_columns_metadata_only():
    pool, rows = built([[piece(1, 4)], [piece(2, 6, context=1)], [piece(3, 2)]], slots=4)
    pool.keep_rows([2, 0, 1])  # rows out of slot order
    rows = [rows[2], rows[0], rows[1]]
    feed(pool, rows, {0: [5, 6, 7], 1: [8, 9, 10, 11], 2: [3]}, context=0, question=2)
    before = storage(pool)
    pool.rewind({1: rows[1].next_position - 3, 0: rows[0].next_position, 2: rows[2].next_position + 2})
    rows[1].drop(3)  # row 0 rewound to its next position and row 2 past it: nothing dropped
    assert storage(pool) == before
    assert_holds(pool, rows)
    pool.rewind({0: rows[0].next_position - rows[0].fed})  # exactly what it was fed
    rows[0].drop(3)
    assert_holds(pool, rows)
    with pytest.raises(AssertionError, match=r"row 1: rewinding to position 3 would drop 2 columns, more than the 1 "
                                             r"it was fed"):
        pool.rewind({1: 3})


def test_a_copy_of_some_rows_brings_back_the_columns_it_was_fed_to_those_rows_alone():
    pool, rows = built([[piece(1, 4)], [piece(2, 9, context=1, document=1)], [piece(3, 2)], [piece(4, 6)]],
                       attention=[None, "b", None, "d"])
    pool.keep_rows([3, 0, 2, 1])
    rows = [rows[3], rows[0], rows[2], rows[1]]
    feed(pool, rows, {0: [1], 1: [2], 2: [3], 3: [4]})
    chosen = [3, 0]  # rows of 9 + 1 and 6 + 1 columns
    selected = pool.select(chosen)
    copies = [rows[b] for b in chosen]
    assert (selected.slot_count, selected.slots) == (2, [0, 1])
    assert_holds(selected, copies)
    before = storage(pool)
    feed(selected, copies, {0: [5, 6, 7], 1: [8, 9, 10]}, context=4, question=5)
    pool.take_columns(chosen, selected)
    assert storage(pool) == before  # the columns fit: written in place
    assert_holds(pool, rows)
    feed(pool, rows, {0: [11], 1: [12], 2: [13], 3: [14]})  # the next step writes after the columns brought back
    assert_holds(pool, rows)


def test_columns_brought_back_past_the_arenas_capacity_grow_it():
    pool, rows = built([[piece(1, GROW_COLUMNS - 2)], [piece(2, 3)]])
    selected = pool.select([0])
    copies = [rows[0]]
    feed(selected, copies, {0: [7, 8, 9, 10]})
    pool.take_columns([0], selected)
    assert pool.capacity == 2 * GROW_COLUMNS
    assert_holds(pool, rows)
    pool.rewind({0: rows[0].next_position - 4})  # the columns brought back are its fed ones
    rows[0].drop(4)
    assert_holds(pool, rows)


def test_a_forward_writes_each_rows_tokens_at_its_own_columns_and_a_free_slots_padding_is_hidden():
    pool, rows = built([[piece(1, 3)], [piece(2, 8)], [piece(3, 1)]], slots=4)
    pool.keep_rows([2, 0])
    rows = [rows[2], rows[0]]
    feed(pool, rows, {0: [4, 5], 1: [6]}, context=2, question=3)
    assert_holds(pool, rows)
    feed(pool, rows, {1: [7, 8, 9]})
    assert_holds(pool, rows)
    assert pool.forwards == 2


@pytest.mark.parametrize(("width", "room"), [(0, 0), (1, GROW_COLUMNS), (GROW_COLUMNS, GROW_COLUMNS),
                                             (GROW_COLUMNS + 1, 2 * GROW_COLUMNS)])
def test_room_is_whole_blocks(width, room):
    assert _room(width) == room
