"""The row pool (``engine/core/rows.py``) on its own: every row's logits equal its tokens run alone.

The reference for a row is one plain forward of the model over the row's whole token sequence, so a
pool bug (a key written to the wrong column, a wrong virtual position after a merge or a drop, a
row that sees another row's keys or padding, logits handed to the wrong row) changes the logits.
The model is the position-sensitive tiny model, so a one-position error is visible too. Every test
runs with both kernels: the boolean mask (eager, the reference) and the FlexAttention block mask.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ctx_integrations.engine.core.cache import kv_from_cache
from ctx_integrations.engine.core.rows import (
    GROW_COLUMNS,
    PAD_ID,
    PAD_POSITION,
    Piece,
    RowPool,
    Run,
    visibility,
    visibility_block_mask,
)
from tests.helpers import tiny_loaded

KERNELS = ["eager", "flex"]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_loaded("llama", seed=5, position_sensitive=True).model


def shape(model: torch.nn.Module) -> tuple[int, int, int]:
    config = model.config
    return config.num_hidden_layers, config.num_key_value_heads, config.hidden_size // config.num_attention_heads


def tokens(seed: int, count: int, model: torch.nn.Module) -> list[int]:
    return torch.randint(5, model.config.vocab_size, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def encoded(model: torch.nn.Module, ids: list[int], start: int = 0) -> torch.Tensor:
    """The post-RoPE keys/values ``[layers, 2, heads, len, dim]`` of ``ids`` at positions ``start..`` (no prefix)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None],
          past_key_values=cache, use_cache=True)
    return kv_from_cache(cache)


@torch.inference_mode()
def alone(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits ``[len, V]`` of one plain causal forward over ``ids`` at positions 0.. (fp32)."""
    return model(input_ids=torch.tensor([ids])).logits[0].float()


class Row:
    """A row's tokens so far (the reference's input) and the pool pieces that hold them."""

    def __init__(self, model: torch.nn.Module, seed: int, cached: int):
        self.ids = tokens(seed, cached, model)
        self.pieces = [Piece(encoded(model, self.ids), 0)] if cached else []

    def run(self, new: list[int]) -> Run:
        run = Run(tuple(new), len(self.ids))
        self.ids = self.ids + new
        return run


def check(model: torch.nn.Module, rows: list[Row], logits: list[torch.Tensor], runs: list[list[Run]]) -> None:
    for row, got, row_runs in zip(rows, logits, runs):
        reference = alone(model, row.ids)
        ends = [run.first_position + len(run.ids) - 1 for run in row_runs]
        assert got.shape == (len(ends), model.config.vocab_size)
        torch.testing.assert_close(got, reference[ends], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_of_different_lengths_step_together_as_if_alone(model, kernel):
    # Rows with 0, 7 and 19 cached tokens take runs of different lengths (two runs in one row, as IPPD does
    # with two questions), then three single-token steps; every logit equals the row's own full forward.
    rows = [Row(model, 1, 7), Row(model, 2, 19), Row(model, 3, 0)]
    pool = RowPool.build([r.pieces for r in rows], shape(model), torch.device("cpu"), torch.float32)
    assert pool.rows == 3 and pool.width == 19
    runs = [[rows[0].run(tokens(11, 5, model))],
            [rows[1].run(tokens(12, 2, model)), rows[1].run(tokens(13, 3, model))],
            [rows[2].run(tokens(14, 9, model))]]
    check(model, rows, pool.forward(model, runs, pad_token=0, kernel=kernel), runs)
    for step in range(3):
        runs = [[row.run(tokens(20 + 3 * step + b, 1, model))] for b, row in enumerate(rows)]
        check(model, rows, pool.forward(model, runs, pad_token=0, kernel=kernel), runs)
    assert pool.forwards == 4


@pytest.mark.parametrize("kernel", KERNELS)
def test_merged_and_dropped_rows_keep_their_answers(model, kernel):
    # A pool merges a narrower pool and a wider one (each side padded) and drops a row: positions, ids and keys
    # must move together, and the room the long row needed is trimmed when it leaves.
    first = [Row(model, 4, 600), Row(model, 5, 3)]  # 600 + 2 columns: a capacity of 1024, the joining pool's 512
    pool = RowPool.build([r.pieces for r in first], shape(model), torch.device("cpu"), torch.float32)
    runs = [[row.run(tokens(40 + b, 2, model))] for b, row in enumerate(first)]
    check(model, first, pool.forward(model, runs, 0, kernel), runs)

    second = [Row(model, 6, 5)]
    joining = RowPool.build([r.pieces for r in second], shape(model), torch.device("cpu"), torch.float32)
    runs = [[second[0].run(tokens(50, 4, model))]]
    check(model, second, joining.forward(model, runs, 0, kernel), runs)
    assert (pool.capacity, joining.capacity) == (2 * GROW_COLUMNS, GROW_COLUMNS)
    pool.merge(joining)
    rows = first + second
    assert pool.rows == 3 and pool.lengths == [602, 5, 9] and pool.capacity == 2 * GROW_COLUMNS

    runs = [[row.run(tokens(60 + b, 1, model))] for b, row in enumerate(rows)]
    check(model, rows, pool.forward(model, runs, 0, kernel), runs)

    pool.keep_rows([1, 2])  # the long row leaves: the room only it needed goes with it
    rows = rows[1:]
    assert pool.rows == 2 and pool.lengths == [len(r.ids) for r in rows] and pool.capacity == GROW_COLUMNS
    for step in range(2):
        runs = [[row.run(tokens(70 + 2 * step + b, 1, model))] for b, row in enumerate(rows)]
        check(model, rows, pool.forward(model, runs, 0, kernel), runs)


def test_each_row_writes_its_tokens_at_its_own_next_columns_and_padding_after_them(model):
    # Rows of 7 and 19 cached columns take 2 and 5 tokens in one forward: row 0's tokens land at columns 7-8 (not
    # after row 1's 19 columns, where a shared write column would put them) and its 3 padding tokens after them,
    # hidden; its next token is written over the first of those.
    rows = [Row(model, 21, 7), Row(model, 22, 19)]
    pool = RowPool.build([r.pieces for r in rows], shape(model), torch.device("cpu"), torch.float32)
    runs = [[rows[0].run(tokens(23, 2, model))], [rows[1].run(tokens(24, 5, model))]]
    check(model, rows, pool.forward(model, runs, 0), runs)
    assert pool.lengths == [9, 24] and pool.width == 24
    assert pool.positions[0, :9].tolist() == list(range(9)) and (pool.positions[0, 9:] == PAD_POSITION).all()
    assert pool.positions[1, :24].tolist() == list(range(24)) and (pool.positions[1, 24:] == PAD_POSITION).all()
    written = pool.layers[0][0][0, :, 9:12].clone()
    assert written.any()  # the padding tokens' keys were written there (hidden by their positions)
    runs = [[rows[0].run(tokens(25, 1, model))], [rows[1].run(tokens(26, 1, model))]]
    check(model, rows, pool.forward(model, runs, 0), runs)
    assert pool.lengths == [10, 25] and pool.positions[0, 9] == 9
    assert not torch.equal(pool.layers[0][0][0, :, 9], written[:, 0])


def test_build_places_every_piece_at_its_positions_and_context():
    kv = torch.randn(2, 2, 1, 4, 3, dtype=torch.bfloat16)
    other = torch.randn(2, 2, 1, 2, 3, dtype=torch.bfloat16)
    third = torch.randn(2, 2, 1, 1, 3, dtype=torch.bfloat16)
    pool = RowPool.build([[Piece(kv, 0), Piece(other, 4, context=2), Piece(third, 4, context=3)], [Piece(other, 10)]],
                         (2, 1, 3), torch.device("cpu"), torch.bfloat16)
    assert pool.capacity == GROW_COLUMNS and pool.lengths == [7, 2]
    pad = GROW_COLUMNS - 7
    assert pool.positions.tolist() == [[0, 1, 2, 3, 4, 5, 4] + [PAD_POSITION] * pad,
                                       [10, 11] + [PAD_POSITION] * (pad + 5)]
    assert pool.contexts.tolist() == [[0, 0, 0, 0, 2, 2, 3] + [PAD_ID] * pad, [0, 0] + [PAD_ID] * (pad + 5)]
    assert pool.questions.tolist() == [[0] * 7 + [PAD_ID] * pad, [0, 0] + [PAD_ID] * (pad + 5)]
    for layer, (keys, values) in enumerate(pool.layers):
        assert keys.dtype == values.dtype == torch.bfloat16  # the model's dtype, not the default float32
        torch.testing.assert_close(keys[0, :, :7], torch.cat([kv[layer, 0], other[layer, 0], third[layer, 0]], dim=1),
                                   rtol=0, atol=0)
        torch.testing.assert_close(values[1, :, :2], other[layer, 1], rtol=0, atol=0)
        assert not keys[1, :, 2:].any()
    empty = RowPool.build([], (2, 1, 3), torch.device("cpu"), torch.float32)
    assert (empty.rows, empty.width, empty.capacity) == (0, 0, 0)


def test_lengths_are_counted_from_the_positions_and_the_helpers_pad_by_exactly_what_is_missing():
    from ctx_integrations.engine.core.rows import _pad, _pad_ids

    positions = torch.tensor([[0, 1, PAD_POSITION, PAD_POSITION], [PAD_POSITION] * 4])
    pool = RowPool([(torch.zeros(2, 1, 4, 1), torch.zeros(2, 1, 4, 1))], positions, torch.zeros_like(positions),
                   torch.zeros_like(positions))
    assert (pool.lengths, pool.width, pool.capacity) == ([2, 0], 2, 4)
    keys = torch.ones(2, 1, 3, 2)
    for missing in (0, 1, 2):
        padded = _pad(keys, 3 + missing)
        assert padded.shape == (2, 1, 3 + missing, 2) and not padded[:, :, 3:].any() and padded[:, :, :3].all()
        ids = _pad_ids(torch.zeros(2, 3, dtype=torch.long), 3 + missing, PAD_POSITION)
        assert ids.shape == (2, 3 + missing) and (ids[:, 3:] == PAD_POSITION).all() and not ids[:, :3].any()


def brute_force(q_pos, q_ctx, q_qid, k_pos, k_ctx, k_qid) -> torch.Tensor:
    """The rule of docs/methods.md#ippd written out one (row, query, key) at a time."""
    rows, queries, keys = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    out = torch.zeros(rows, 1, queries, keys, dtype=torch.bool)
    for b, q, k in itertools.product(range(rows), range(queries), range(keys)):
        out[b, 0, q, k] = (bool(q_pos[b, q] >= k_pos[b, k])
                           and (int(q_ctx[b, q]) == int(k_ctx[b, k]) or int(k_ctx[b, k]) == 0)
                           and (int(q_qid[b, q]) == int(k_qid[b, k]) or int(k_qid[b, k]) == 0))
    return out


def test_visibility_and_its_block_mask_equal_the_rule_written_out():
    generator = torch.Generator().manual_seed(0)
    rows, keys, queries = 3, 24, 6
    k_pos = torch.randint(0, 12, (rows, keys), generator=generator)
    k_pos[:, -3:] = PAD_POSITION
    k_ctx = torch.randint(0, 3, (rows, keys), generator=generator)
    k_qid = torch.randint(0, 3, (rows, keys), generator=generator)
    q_pos = torch.randint(0, 14, (rows, queries), generator=generator)
    q_ctx = torch.randint(1, 3, (rows, queries), generator=generator)
    q_qid = torch.randint(1, 3, (rows, queries), generator=generator)
    layout = (q_pos, q_ctx, q_qid, k_pos, k_ctx, k_qid)
    expected = brute_force(*layout)
    assert 0.1 < expected.float().mean() < 0.9  # neither trivial
    assert torch.equal(visibility(*layout), expected)
    dense = visibility_block_mask(*layout).to_dense()  # [B, 1, q blocks, k blocks]: which tiles are not skipped
    assert dense.shape[:2] == (rows, 1) and bool(dense.all())  # one 128-tile here: kept for every row
    from torch.nn.attention.flex_attention import create_mask

    rule = visibility_block_mask(*layout).mask_mod
    assert torch.equal(create_mask(rule, rows, 1, queries, keys, device="cpu"), expected)


@pytest.mark.parametrize("kernel", KERNELS)
def test_an_empty_step_returns_empty_logits_without_a_forward(model, kernel):
    pool = RowPool.build([[], []], shape(model), torch.device("cpu"), torch.float32)
    assert (pool.lengths, pool.capacity) == ([0, 0], 0)
    out = pool.forward(model, [[], []], 0, kernel)
    assert [t.numel() for t in out] == [0, 0] and pool.forwards == 0


def test_steps_write_in_place_until_the_capacity_is_used_up(model):
    # Single-token steps must reuse the preallocated buffers (same storage, same shapes: what a CUDA graph needs),
    # and the pool grows by whole GROW_COLUMNS only when a step does not fit.
    rows = [Row(model, 8, 10), Row(model, 9, 4)]
    pool = RowPool.build([r.pieces for r in rows], shape(model), torch.device("cpu"), torch.float32)
    runs = [[row.run(tokens(80 + b, 3, model))] for b, row in enumerate(rows)]
    pool.forward(model, runs, 0)
    assert (pool.width, pool.capacity) == (13, GROW_COLUMNS)
    storage = [k.data_ptr() for k, _ in pool.layers]
    for step in range(3):
        runs = [[row.run(tokens(90 + 2 * step + b, 1, model))] for b, row in enumerate(rows)]
        check(model, rows, pool.forward(model, runs, 0), runs)
    assert [k.data_ptr() for k, _ in pool.layers] == storage and pool.width == 16
    filling = [[rows[0].run(tokens(97, GROW_COLUMNS - 16, model))], [rows[1].run(tokens(96, 2, model))]]
    check(model, rows, pool.forward(model, filling, 0), filling)  # exactly fills the capacity: no growth
    assert [k.data_ptr() for k, _ in pool.layers] == storage and pool.width == pool.capacity == GROW_COLUMNS
    long_run = [[rows[0].run(tokens(99, 5, model))], [rows[1].run(tokens(98, 1, model))]]
    check(model, rows, pool.forward(model, long_run, 0), long_run)
    assert pool.capacity == 2 * GROW_COLUMNS and pool.width == GROW_COLUMNS + 5
    pool.keep_rows([1])  # the long row leaves: the room only it needed is trimmed
    assert pool.width == len(rows[1].ids) and pool.capacity == GROW_COLUMNS


def test_a_failed_forward_leaves_the_pool_as_it_was(model):
    rows = [Row(model, 10, 6), Row(model, 11, 9)]
    pool = RowPool.build([r.pieces for r in rows], shape(model), torch.device("cpu"), torch.float32)

    def broken(**kwargs):
        model(**kwargs)  # writes its keys into the buffers, then fails (say, out of memory in the LM head)
        raise RuntimeError("boom")

    before = (list(pool.lengths), pool.positions.clone(), pool.contexts.clone(), pool.questions.clone())
    with pytest.raises(RuntimeError, match="boom"):
        pool.forward(broken, [[Run((5, 6), 6)], [Run((7,), 9)]], 0)
    assert pool.lengths == before[0] and pool.forwards == 0
    assert torch.equal(pool.positions, before[1]) and torch.equal(pool.contexts, before[2])
    assert torch.equal(pool.questions, before[3])  # every column the failed step wrote is padding again
    runs = [[row.run(tokens(110 + b, 2, model))] for b, row in enumerate(rows)]
    check(model, rows, pool.forward(model, runs, 0), runs)  # the half-written columns are overwritten, unseen


def test_dropping_every_row_leaves_an_empty_pool():
    positions = torch.tensor([[0, 1, PAD_POSITION], [0, PAD_POSITION, PAD_POSITION]])
    pool = RowPool([(torch.zeros(2, 1, 3, 1), torch.zeros(2, 1, 3, 1))], positions, torch.zeros_like(positions),
                   torch.zeros_like(positions))
    pool.keep_rows([])
    assert (pool.rows, pool.width, pool.lengths) == (0, 0, [])


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_smaller_pool_takes_a_larger_pools_rows(model, kernel):
    # The pool already running has 512 columns, the joining one 1024: the running rows are the ones padded.
    small_rows, large_rows = [Row(model, 12, 3)], [Row(model, 13, 600)]
    small = RowPool.build([r.pieces for r in small_rows], shape(model), torch.device("cpu"), torch.float32)
    large = RowPool.build([r.pieces for r in large_rows], shape(model), torch.device("cpu"), torch.float32)
    for pool, rows in ((small, small_rows), (large, large_rows)):
        runs = [[row.run(tokens(120 + len(row.ids), 2, model))] for row in rows]
        check(model, rows, pool.forward(model, runs, 0, kernel), runs)
    assert (small.capacity, large.capacity) == (GROW_COLUMNS, 2 * GROW_COLUMNS)
    small.merge(large)
    rows = small_rows + large_rows
    assert (small.rows, small.lengths, small.capacity) == (2, [5, 602], 2 * GROW_COLUMNS)
    for step in range(2):
        runs = [[row.run(tokens(130 + 2 * step + b, 1, model))] for b, row in enumerate(rows)]
        check(model, rows, small.forward(model, runs, 0, kernel), runs)


def _marked(value: float, length: int, first_position: int, document: int = 0) -> Piece:
    """A piece whose keys all hold ``value`` (so a column's key says which piece it came from)."""
    return Piece(torch.full((1, 2, 1, length, 1), value), first_position, document=document)


def _check_marks(pool: RowPool, document_of_value: dict[float, int]) -> None:
    keys = pool.layers[0][0][:, 0, :, 0]  # [rows, capacity]
    real = pool.positions != PAD_POSITION
    for row in range(pool.rows):
        for column in range(pool.capacity):
            expected = document_of_value.get(float(keys[row, column]), 0) if real[row, column] else 0
            assert int(pool.documents[row, column]) == expected, (row, column)


def test_document_marks_and_row_rules_follow_their_rows_through_merge_and_drop():
    # An APE row's key columns carry their document's index and the row carries its attention rule; a merge and
    # a drop that reorders rows must move both with the keys (else APE's merge takes the wrong keys as
    # documents, or another request's row gets APE's attention).
    first = RowPool.build([[_marked(1.0, 2, 0), _marked(2.0, 3, 2, document=1)], [_marked(3.0, 1, 0)]],
                          (1, 1, 1), torch.device("cpu"), torch.float32, attention=["rule a", None])
    second = RowPool.build([[_marked(5.0, 1, 0), _marked(4.0, 4, 1, document=2)]], (1, 1, 1), torch.device("cpu"),
                           torch.float32, attention=["rule b"])
    marks = {2.0: 1, 4.0: 2}
    first.merge(second)
    assert first.attention == ["rule a", None, "rule b"]
    _check_marks(first, marks)
    first.keep_rows([2, 0])
    assert first.attention == ["rule b", "rule a"] and first.width == 5
    _check_marks(first, marks)
    assert RowPool.build([[_marked(1.0, 1, 0)]], (1, 1, 1), torch.device("cpu"), torch.float32).attention == [None]


def test_a_rows_own_attention_rule_gets_its_row_and_last_query_and_leaves_the_other_rows_alone(model):
    rows = [Row(model, 61, 5), Row(model, 62, 8)]
    calls = []

    def rule(query, key, value, visible, documents, scaling, last_query):
        calls.append((query.shape[0], int(visible[0, 0, last_query].sum()), last_query, int(documents.sum())))
        return torch.zeros(1, query.shape[2], query.shape[1], query.shape[3])

    pieces = [rows[0].pieces, [Piece(rows[1].pieces[0].kv, 0, document=1)]]
    plain = RowPool.build(pieces, shape(model), torch.device("cpu"), torch.float32)
    ruled = RowPool.build(pieces, shape(model), torch.device("cpu"), torch.float32, attention=[None, rule])
    runs = [[rows[0].run(tokens(63, 3, model))], [rows[1].run(tokens(64, 2, model))]]
    expected = plain.forward(model, runs, pad_token=0)
    got = ruled.forward(model, runs, pad_token=0)
    check(model, rows[:1], got[:1], runs[:1])
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)  # the other row: bit for bit
    assert not torch.allclose(got[1], expected[1])  # the rule row got the rule's output
    layers = model.config.num_hidden_layers
    # row 1's last real query is column 1 of a 3-column step (row 0 takes 3 tokens); it sees its 8 keys and
    # its own 2 tokens; its 8 cached keys are marked document 1 (in a capacity of 256)
    assert calls == [(1, 10, 1, 8)] * layers
    # written tokens are never documents: row 0's at its columns 5-7, row 1's (and its padding token) at 8-10
    assert (ruled.documents[0, 5:8] == 0).all() and (ruled.documents[1, 8:11] == 0).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_rewound_row_answers_as_if_it_never_held_the_dropped_tokens(model, kernel):
    # RAPID's rejection: a row takes 4 drafts, drops the last 3 (positions >= p), takes 2 other tokens at those
    # positions; its logits must equal a forward over the kept tokens only. Catches a rewind that leaves the
    # dropped keys visible (their positions are <= the new queries'), drops one column too many or too few,
    # or touches a row it was not asked to (the neighbour keeps stepping as if alone).
    rows = [Row(model, 1, 9), Row(model, 2, 12)]
    pool = RowPool.build([r.pieces for r in rows], shape(model), torch.device("cpu"), torch.float32)
    drafts = tokens(30, 4, model)
    runs = [[rows[0].run(drafts)], [rows[1].run(tokens(31, 1, model))]]
    check(model, rows, pool.forward(model, runs, 0, kernel), runs)
    kept = len(rows[0].ids) - 3
    storage = [k.data_ptr() for k, _ in pool.layers]
    pool.rewind({0: kept})
    assert [k.data_ptr() for k, _ in pool.layers] == storage  # metadata only: nothing is copied
    assert pool.lengths == [kept, len(rows[1].ids)]
    assert int((pool.positions[0] != PAD_POSITION).sum()) == kept
    assert int((pool.positions[1] != PAD_POSITION).sum()) == len(rows[1].ids)
    rows[0].ids = rows[0].ids[:kept]
    for step in range(2):
        runs = [[row.run(tokens(40 + 2 * step + b, 1, model))] for b, row in enumerate(rows)]
        check(model, rows, pool.forward(model, runs, 0, kernel), runs)
    pool.rewind({1: len(rows[1].ids)})  # nothing at or after that position: nothing is dropped
    assert pool.lengths == [len(rows[0].ids), len(rows[1].ids)]
    with pytest.raises(AssertionError, match="more than the 3 it was fed"):
        pool.rewind({1: len(rows[1].ids) - 4})  # into its cached piece: a caller's bug


def test_rows_fed_through_a_copy_can_be_rewound_after_their_columns_come_back(model):
    rows = [Row(model, 3, 6)]
    pool = RowPool.build([r.pieces for r in rows], shape(model), torch.device("cpu"), torch.float32)
    selected = pool.select([0])
    runs = [[rows[0].run(tokens(33, 4, model))]]
    check(model, rows, selected.forward(model, runs, 0), runs)
    pool.take_columns([0], selected)
    assert (pool.lengths, pool.fed, pool.next_positions) == ([10], [4], [10])
    pool.rewind({0: 8})
    assert pool.lengths == [8] and (pool.positions[0, 8:] == PAD_POSITION).all()


def test_rows_taking_several_tokens_run_apart_and_answer_as_in_one_padded_forward():
    # Three rows take one token, one row takes five (RAPID's verification): the runner runs the long row on a copy
    # of its own (two forwards: no row's tokens go through a forward longer than its own) and brings its columns
    # back. Catches columns brought back to the wrong row or position, the long row's logits handed to another
    # row, and other rows given the long row's tokens; the next step (every row one token) must still be exact.
    from ctx_integrations.engine.core.runner import ModelRunner
    from ctx_integrations.engine.core.step import ScheduledStep

    loaded = tiny_loaded("llama", seed=5, position_sensitive=True)
    model = loaded.model
    rows = [Row(model, 1, 30), Row(model, 2, 12), Row(model, 3, 21), Row(model, 4, 9)]
    runner = ModelRunner(loaded, "eager")
    first = [[row.run(tokens(60 + b, 1, model))] for b, row in enumerate(rows)]
    joined = runner.forward(ScheduledStep(joining=[r.pieces for r in rows], joining_runs=first)).joined
    check(model, rows, joined, first)
    def tagged(run: Run) -> Run:  # the long row's tokens carry ids (as IPPD's do): they must come back with them
        return Run(run.ids, run.first_position, context=3, question=4)

    runs = [[rows[0].run(tokens(70, 1, model))], [rows[1].run(tokens(71, 1, model))],
            [tagged(rows[2].run([t])) for t in tokens(72, 5, model)], [rows[3].run(tokens(73, 1, model))]]
    out = runner.forward(ScheduledStep(decode=runs))
    assert out.forwards == 2  # the long row ran apart
    check(model, rows, out.decoded, runs)
    pool = runner.pool
    assert pool.lengths == [len(row.ids) for row in rows]  # each row's columns end where its tokens do
    back = slice(len(rows[2].ids) - 5, len(rows[2].ids))
    assert pool.positions[2, back].tolist() == list(range(len(rows[2].ids) - 5, len(rows[2].ids)))
    assert pool.contexts[2, back].tolist() == [3] * 5 and pool.questions[2, back].tolist() == [4] * 5
    for b in (0, 1, 3):
        assert (pool.positions[b, len(rows[b].ids):] == PAD_POSITION).all()
    pool.rewind({2: len(rows[2].ids) - 2})  # RAPID rejects the last two: found by the positions brought back
    rows[2].ids = rows[2].ids[:-2]
    runs = [[row.run(tokens(80 + b, 1, model))] for b, row in enumerate(rows)]
    runs[2] = [tagged(runs[2][0])]
    out = runner.forward(ScheduledStep(decode=runs))
    assert out.forwards == 1
    check(model, rows, out.decoded, runs)


def test_rows_leave_and_join_through_free_slots_without_copying_the_arena(model):
    # 3 rows in a 4-slot arena: a row leaving frees its slot (metadata only: the buffers stay where they are), a
    # joining row takes a free slot (only its own columns are copied), and every row still answers as if alone.
    # Catches a leave that copies the batch (index_select), a join that concatenates it, a free slot whose old
    # columns stay visible to the row that takes it, logits read from another row's slot.
    rows = [Row(model, 71, 6), Row(model, 72, 11), Row(model, 73, 3)]
    pool = RowPool.build([r.pieces for r in rows], shape(model), torch.device("cpu"), torch.float32)
    pool.resize_slots(4)
    runs = [[row.run(tokens(80 + b, 2, model))] for b, row in enumerate(rows)]
    check(model, rows, pool.forward(model, runs, 0), runs)
    storage = [k.data_ptr() for k, _ in pool.layers]
    pool.keep_rows([0, 2])  # the middle row leaves: its slot is free, nothing moves
    rows = [rows[0], rows[2]]
    assert [k.data_ptr() for k, _ in pool.layers] == storage and pool.slots == [0, 2] and pool.slot_count == 4
    assert (pool.positions[1] == PAD_POSITION).all()
    newcomers = [Row(model, 74, 9), Row(model, 75, 4)]
    joining = RowPool.build([r.pieces for r in newcomers], shape(model), torch.device("cpu"), torch.float32)
    first = [[row.run(tokens(90 + b, 3, model))] for b, row in enumerate(newcomers)]
    check(model, newcomers, joining.forward(model, first, 0), first)
    pool.merge(joining)  # two free slots (1 and 3): the arena is not copied
    rows = rows + newcomers
    assert [k.data_ptr() for k, _ in pool.layers] == storage and pool.slots == [0, 2, 1, 3]
    for step in range(2):
        runs = [[row.run(tokens(100 + 4 * step + b, 1, model))] for b, row in enumerate(rows)]
        check(model, rows, pool.forward(model, runs, 0), runs)
    third = [Row(model, 76, 5)]
    joining = RowPool.build([r.pieces for r in third], shape(model), torch.device("cpu"), torch.float32)
    runs = [[third[0].run(tokens(110, 2, model))]]
    check(model, third, joining.forward(model, runs, 0), runs)
    pool.merge(joining)  # no free slot: the arena grows to the next bucket
    rows = rows + third
    assert pool.slot_count == 8 and pool.rows == 5
    runs = [[row.run(tokens(120 + b, 1, model))] for b, row in enumerate(rows)]
    check(model, rows, pool.forward(model, runs, 0), runs)
    pool.keep_rows([4])  # one row left of five: compacted to a 1-slot arena
    assert (pool.slot_count, pool.slots) == (1, [0])
    runs = [[rows[4].run(tokens(130, 1, model))]]
    check(model, [rows[4]], pool.forward(model, runs, 0), runs)


def test_the_decode_step_answers_and_writes_as_the_eager_forward_and_runs_unless_a_row_has_its_own_rule(model):
    # rows.decode_step is what torch.compile captures (tests/test_compiled_step.py); here it runs as plain Python
    # beside the eager forward over an arena with a free slot: the same logits bit for bit, the same keys and
    # metadata written, at any width (a row of several tokens beside a row of one: padding written after the
    # shorter), and it runs whenever no row has its own rule.
    from ctx_integrations.engine.core.rows import decode_step

    rows = [Row(model, 81, 6), Row(model, 82, 11), Row(model, 83, 3)]
    pools = [RowPool.build([r.pieces for r in rows], shape(model), torch.device("cpu"), torch.float32, slots=4)
             for _ in range(2)]
    for pool in pools:
        pool.keep_rows([2, 0])  # slots 0 and 2 in use, 1 and 3 free
    rows = [rows[2], rows[0]]
    calls = []

    def step(*args):
        calls.append(args[1].shape)
        return decode_step(*args)

    for runs in ([[rows[0].run(tokens(84, 1, model))], [rows[1].run(tokens(85, 1, model))]],
                 [[rows[0].run(tokens(86, 1, model))], []],  # a row that takes nothing: one token or none
                 [[rows[0].run(tokens(87, 2, model))], [rows[1].run(tokens(88, 1, model))]]):
        before = len(calls)
        eager, stepped = pools[0].forward(model, runs, 0), pools[1].forward(model, runs, 0, step=step)
        assert len(calls) - before == 1
        check(model, rows, stepped, runs)
        for got, expected in zip(stepped, eager):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        for name in ("positions", "contexts", "questions", "documents", "lengths", "next_positions", "fed"):
            assert torch.equal(torch.as_tensor(getattr(pools[0], name)), torch.as_tensor(getattr(pools[1], name))), name
        for (keys, values), (their_keys, their_values) in zip(pools[0].layers, pools[1].layers):
            assert torch.equal(keys, their_keys) and torch.equal(values, their_values)
    assert calls == [(4, 1), (4, 1), (4, 2)]  # every slot of the arena takes the step's width (padding in the free)

    def rule(query, key, value, visible, documents, scaling, last_query):
        return torch.zeros(1, query.shape[2], query.shape[1], query.shape[3])

    ruled = RowPool.build([[], []], shape(model), torch.device("cpu"), torch.float32, attention=[None, rule])
    ruled.forward(model, [[Run((5,), 0)], [Run((6,), 0)]], 0, step=step)  # a row with its own rule: eager
    assert len(calls) == 3 and ruled.forwards == 1
