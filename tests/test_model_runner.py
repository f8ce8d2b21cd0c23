"""The model runner (``engine/core/runner.py``): one forward per token count, and the running pool it keeps.

``ModelRunner._run`` sends each row's tokens through a forward whose query length is its own token count
(batch invariance): the group with the most rows (of those, the fewest tokens) runs in place in the running pool,
with the compiled decode step when it has one, and every other group on a copy of its rows whose columns come
back after. ``ModelRunner.execute`` rewinds and decodes the running rows, then prefills the joining rows and
makes them the pool (in an arena of a whole bucket of slots) or merges them in; a forward that raises is
reported, not raised. Every logit is checked against the row's tokens run alone on the position-sensitive tiny
model. Bugs caught: a group run in place that should run apart (a row padded to a longer forward), the compiled
step given to a copy or a prefill, logits handed to the wrong row, a joining pool left without spare slots, a
rewind skipped, an error raised out of the step instead of reported.
"""

from __future__ import annotations

import pytest
import torch

from ctx_integrations.engine.core import rows as rows_module
from ctx_integrations.engine.core import runner as runner_module
from ctx_integrations.engine.core.compiled_step import GuardedStep
from ctx_integrations.engine.core.rows import Run
from ctx_integrations.engine.core.runner import ModelRunner
from ctx_integrations.engine.core.step import ScheduledStep
from tests.helpers import tiny_loaded
from tests.test_rows import Row, alone, tokens

# The position-sensitive tiny model amplifies rounding: a row's logits beside padding and rows run apart were
# measured up to 3e-4 from its own full forward (the test_rows tolerance, 2e-4, is for a plain model), while a
# wrong position, column or cache moves them by far more than 1e-3 (the runner's mutants in tools/mutate.py).
TOLERANCE = 1e-3


def check(model: torch.nn.Module, rows: list[Row], logits: list[torch.Tensor], runs: list[list[Run]]) -> None:
    """Each row's logits after each of its runs equal its own full forward's, within :data:`TOLERANCE`."""
    for row, got, row_runs in zip(rows, logits, runs):
        ends = [run.first_position + len(run.ids) - 1 for run in row_runs]
        assert got.shape == (len(ends), model.config.vocab_size)
        torch.testing.assert_close(got, alone(model, row.ids)[ends], atol=TOLERANCE, rtol=TOLERANCE)


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded("llama", seed=5, position_sensitive=True)


class Forwards:
    """Records every pool forward: which pool (the runner's own or another), each row's token count, the step."""

    def __init__(self, monkeypatch, runner: ModelRunner):
        self.calls: list[tuple[bool, list[int], object]] = []
        forward = rows_module.RowPool.forward

        def recorded(pool, model, runs, pad_token, kernel="eager", step=None):
            self.calls.append((pool is runner.pool, [sum(len(r.ids) for r in row) for row in runs], step))
            return forward(pool, model, runs, pad_token, kernel, step)

        monkeypatch.setattr(rows_module.RowPool, "forward", recorded)


def joined(runner: ModelRunner, model, rows: list[Row], seed: int) -> list[list[Run]]:
    """Join ``rows`` (their cached pieces and a first token each) into the runner's pool; returns their runs."""
    first = [[row.run(tokens(seed + b, 1, model))] for b, row in enumerate(rows)]
    out = runner.forward(ScheduledStep(joining=[r.pieces for r in rows], joining_runs=first))
    assert out.join_error is None
    check(model, rows, out.joined, first)
    return first


@pytest.mark.parametrize(("counts", "in_place"), [((1, 3, 1, 3), 1), ((3, 1, 3, 3, 1), 3), ((2, 0, 2, 5), 2),
                                                  ((4, 4, 0, 1), 4), ((3, 1, 2, 1), 1)])
def test_the_group_with_most_rows_runs_in_place_with_the_step_and_the_others_apart(loaded, monkeypatch, counts,
                                                                                  in_place):
    # (1, 3, 1, 3): two groups of two rows: the one with fewer tokens runs in place (the decode step's shape)
    model = loaded.model
    runner = ModelRunner(loaded, "eager")
    runner.step = step = rows_module.decode_step  # what a compiled step is called with
    rows = [Row(model, 10 + b, 4 + 3 * b) for b in range(len(counts))]
    joined(runner, model, rows, 20)
    forwards = Forwards(monkeypatch, runner)
    runs = [[row.run(tokens(30 + b, count, model))] if count else [] for b, (row, count) in enumerate(zip(rows,
                                                                                                         counts))]
    out = runner.forward(ScheduledStep(decode=runs))
    groups = [count for count in dict.fromkeys(counts) if count not in (0, in_place)]  # in the order they appear
    assert out.forwards == 1 + len(groups) == len(forwards.calls) and out.decode_error is None
    assert forwards.calls[0] == (True, [c if c == in_place else 0 for c in counts], step)
    assert [(mine, tokens_, given) for mine, tokens_, given in forwards.calls[1:]] == [
        (False, [count] * counts.count(count), None) for count in groups]
    assert out.rows == runner.pool.rows == len(rows) and out.forward_s > 0
    for b, (row, row_runs) in enumerate(zip(rows, runs)):
        if row_runs:
            check(model, [row], [out.decoded[b]], [row_runs])
        else:
            assert out.decoded[b].shape == (0, model.config.vocab_size)
    assert runner.pool.lengths == [len(row.ids) for row in rows]  # the columns of the rows run apart came back
    for b, row in enumerate(rows):
        assert runner.pool.positions[runner.pool.slots[b], :len(row.ids)].tolist() == list(range(len(row.ids)))
    runs = [[row.run(tokens(40 + b, 1, model))] for b, row in enumerate(rows)]
    out = runner.forward(ScheduledStep(decode=runs))  # one token each: one forward, in place, every row exact
    assert out.forwards == 1 and forwards.calls[-1] == (True, [1] * len(rows), step)
    check(model, rows, out.decoded, runs)


@pytest.mark.parametrize(("compiled", "batch_invariant", "padded", "grow"),
                         [(False, False, False, rows_module.TIGHT_COLUMNS),
                          (False, True, False, rows_module.GROW_COLUMNS),
                          (True, False, True, rows_module.GROW_COLUMNS)])
def test_the_eager_step_holds_exactly_its_rows_in_tight_columns(loaded, compiled, batch_invariant, padded, grow):
    # the eager step (the CPU's default) computes every slot and every column of capacity: PCED's 9 rows in 16
    # slots and 512 columns made a demo answer 1.4-1.7x slower; buckets and 512-column blocks only where a compiled
    # step wants few shapes or batch invariance wants whole key blocks
    model = loaded.model
    runner = ModelRunner(loaded, "eager", batch_invariant=batch_invariant)
    runner.step = rows_module.decode_step if compiled else None
    rows = [Row(model, 90 + b, 20 + b) for b in range(9)]
    joined(runner, model, rows, 100)
    pool = runner.pool
    assert (pool.rows, pool.slot_count) == (9, 16 if padded else 9) and pool.padded_slots == padded
    assert pool.grow_columns == grow and pool.capacity == grow  # 30 columns at most: one step of growth
    runner.keep_rows([0, 2, 4, 6, 8, 1, 3, 5])  # one row leaves
    assert runner.pool.slot_count == (16 if padded else 8)  # exact: compacted away at once
    rows = [rows[b] for b in (0, 2, 4, 6, 8, 1, 3, 5)]
    runs = [[row.run(tokens(110 + b, 1, model))] for b, row in enumerate(rows)]
    check(model, rows, runner.forward(ScheduledStep(decode=runs)).decoded, runs)


def test_joining_rows_become_the_pool_in_a_whole_bucket_of_slots_then_merge_into_it(loaded, monkeypatch):
    model = loaded.model
    runner = ModelRunner(loaded, "eager")
    runner.step = rows_module.decode_step
    forwards = Forwards(monkeypatch, runner)
    assert runner.forward(ScheduledStep(decode=[[Run((5,), 0)]])).forwards == 0  # no pool: nothing to decode
    rows = [Row(model, 50 + b, 3 + 2 * b) for b in range(3)]
    joined(runner, model, rows, 60)
    assert (runner.pool.rows, runner.pool.slot_count) == (3, 4)  # room for one more without a copy
    assert forwards.calls == [(False, [1, 1, 1], None)]  # the prefill never runs the decode step
    newcomer = [Row(model, 70, 5)]
    runs = [[row.run(tokens(71 + b, 1, model))] for b, row in enumerate(rows)]
    first = [[newcomer[0].run(tokens(75, 2, model))]]
    out = runner.forward(ScheduledStep(decode=runs, joining=[newcomer[0].pieces], joining_runs=first))
    assert out.forwards == 2 and out.rows == 3 and (out.decode_error, out.join_error) == (None, None)
    check(model, rows, out.decoded, runs)
    check(model, newcomer, out.joined, first)
    assert (runner.pool.rows, runner.pool.slot_count) == (4, 4)
    rows += newcomer
    runs = [[row.run(tokens(80 + b, 1, model))] for b, row in enumerate(rows)]
    check(model, rows, runner.forward(ScheduledStep(decode=runs)).decoded, runs)
    runner.keep_rows([3, 1])
    rows = [rows[3], rows[1]]
    assert runner.pool.rows == 2
    runs = [[row.run(tokens(90 + b, 1, model))] for b, row in enumerate(rows)]
    check(model, rows, runner.forward(ScheduledStep(decode=runs)).decoded, runs)
    runner.keep_rows([])
    assert runner.pool is None
    runner.keep_rows([0])  # nothing to keep rows of: still nothing
    assert runner.pool is None


def test_a_running_row_is_rewound_before_its_decode_and_joining_rows_carry_their_rules(loaded):
    model = loaded.model
    runner = ModelRunner(loaded, "eager")
    rows = [Row(model, 100, 6), Row(model, 101, 9)]
    joined(runner, model, rows, 102)
    runs = [[rows[0].run(tokens(104, 3, model))], [rows[1].run(tokens(105, 3, model))]]
    runner.forward(ScheduledStep(decode=runs))
    rows[0].ids = rows[0].ids[:-2]
    runs = [[rows[0].run(tokens(106, 1, model))], [rows[1].run(tokens(107, 1, model))]]
    out = runner.forward(ScheduledStep(decode=runs, rewind={0: len(rows[0].ids) - 1}))
    check(model, rows, out.decoded, runs)  # as if the two rejected tokens had never been fed

    def rule(query, key, value, visible, documents, scaling, last_query):
        return torch.zeros(1, query.shape[2], query.shape[1], query.shape[3])

    newcomers = [Row(model, 108, 4), Row(model, 109, 5)]
    first = [[row.run(tokens(110 + b, 1, model))] for b, row in enumerate(newcomers)]
    out = runner.forward(ScheduledStep(joining=[r.pieces for r in newcomers], joining_runs=first,
                                       joining_attention=[None, rule]))
    assert runner.pool.attention == [None, None, None, rule]
    check(model, newcomers[:1], out.joined[:1], first[:1])


def test_a_forward_that_raises_is_reported_and_the_joining_rows_never_join(loaded, monkeypatch):
    model = loaded.model
    runner = ModelRunner(loaded, "eager")
    rows = [Row(model, 120, 5)]
    joined(runner, model, rows, 121)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(rows_module.RowPool, "forward", broken)
    newcomer = Row(model, 122, 3)
    lengths = list(runner.pool.lengths)
    out = runner.forward(ScheduledStep(decode=[[rows[0].run([7])]], joining=[newcomer.pieces],
                                       joining_runs=[[newcomer.run([8])]]))
    assert str(out.decode_error) == str(out.join_error) == "out of memory"
    assert (out.decoded, out.joined) == (None, None) and runner.pool.rows == 1 and runner.pool.lengths == lengths
    fresh = ModelRunner(loaded, "eager")
    out = fresh.execute(ScheduledStep(joining=[newcomer.pieces], joining_runs=[[Run((8,), 3)]]))
    assert isinstance(out.join_error, RuntimeError) and fresh.pool is None


def test_the_runner_compiles_its_step_only_when_asked_and_its_model_takes_a_boolean_mask(loaded, monkeypatch):
    monkeypatch.setattr(runner_module, "compiled_decode_step", lambda mode: f"decode_step compiled with {mode}")
    assert ModelRunner(loaded, "eager").step is None
    assert ModelRunner(loaded, "eager", compile_mode=None).step is None
    step = ModelRunner(loaded, "eager", compile_mode="default").step
    assert isinstance(step, GuardedStep) and (step.step, step.mode, step.kernel, step.failed) == (
        "decode_step compiled with default", "default", "eager", False)
    assert ModelRunner(loaded, "flex", compile_mode="default").step.kernel == "flex"  # the runner's kernel
    flex = tiny_loaded("llama", seed=5)
    flex.model.config._attn_implementation = "flex_attention"  # a model whose own attention takes no boolean mask
    assert ModelRunner(flex, "flex", compile_mode="default").step is None
    assert ModelRunner(loaded, "flex").attention_kernel == "flex"
