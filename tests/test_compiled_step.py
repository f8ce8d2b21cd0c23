"""The row pool's decode step under ``torch.compile``: one graph, no graph break, no recompile within a bucket of
(slots, capacity), answers equal to the eager step's; and the arena of slots under it.

On a GPU the step is compiled with ``mode="reduce-overhead"`` (CUDA graphs); here Dynamo traces it with the
``"eager"`` backend (no code generation: seconds instead of minutes), which is what decides graph breaks and
recompiles. Bugs caught: a Python value read from a tensor inside the step (a graph break, or a recompile at every
step), a shape that changes while requests come and go within a bucket (a recompile per join), the compiled step
fed other slots' tokens or writing at the wrong columns (other answers than the eager engine's), a failed compile
that fails the request instead of falling back.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from ctx_integrations import Engine
from ctx_integrations.engine.core import compiled_step, grouped_attention
from ctx_integrations.engine.core import runner as runner_module
from ctx_integrations.engine.core.config import COMPILE_MODES, EngineConfig
from ctx_integrations.engine.core.rows import slot_bucket
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import tiny_loaded

DOCS = ["Marrowgate is the capital of Veloria and lies on the river Ast.",
        "The mayor of Marrowgate is Ilsa Brenn, elected in 2019.",
        "The Lantern Fair is held every October; smoked eel with plums is served there."]
REQUESTS = [dict(query="Who is the mayor?", documents=DOCS, mode="pced"),
            dict(query="When is the fair?", documents=DOCS[1:], mode="soft_nbce", chunk_tokens=8),
            dict(query="Where is Marrowgate?", documents=DOCS[:2], mode="concat")]


@pytest.fixture
def traced(monkeypatch):
    """Engines built now compile their step with Dynamo's ``eager`` backend; Dynamo's counters start at zero."""
    monkeypatch.setattr(runner_module, "compiled_decode_step",
                        lambda mode: compiled_step.compiled_decode_step(mode, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def _answers(engine: Engine, max_new_tokens: int = 24) -> list[list[int]]:
    async def together():
        return await asyncio.gather(*(engine.agenerate(**{**r, "max_new_tokens": max_new_tokens}) for r in REQUESTS))

    return [a.token_ids for a in asyncio.run(together())]


def test_the_compiled_step_is_one_graph_per_bucket_that_never_breaks_nor_recompiles_within_it(traced):
    seed_model = dict(family="llama", seed=3, position_sensitive=True)
    eager = _answers(Engine(tiny_loaded(**seed_model), compile_mode=None))
    engine = Engine(tiny_loaded(**seed_model), compile_mode="default")
    buckets: list[tuple[int, int]] = []  # (slots, capacity) of every compiled step, in order
    step = engine.scheduler.runner.step.step

    def recording(*args, **kwargs):
        buckets.append((args[1].shape[0], args[7].shape[1]))
        return step(*args, **kwargs)

    engine.scheduler.runner.step.step = recording
    compiled = _answers(engine)
    assert compiled == eager and all(len(ids) >= 20 for ids in compiled)  # the same tokens as the eager step
    assert not traced["graph_break"], dict(traced["graph_break"])
    # PCED's experts, soft_nbce's chunk rows and concat's row share the arena and leave it as their answers end:
    # one graph per bucket visited, never a second one for the same bucket, and >= 20 steps within one bucket
    assert traced["stats"]["unique_graphs"] == len(set(buckets)), (dict(traced["stats"]), buckets)
    runs = [len(list(group)) for _, group in itertools.groupby(buckets)]
    assert max(runs) >= 20, buckets
    assert all(slots == slot_bucket(slots) for slots, _ in buckets) and {c for _, c in buckets} == {512}


def test_buckets_after_the_first_two_reuse_a_symbolic_graph_instead_of_compiling_their_own(traced):
    # Each graph is an Inductor compile of tens of seconds on a GPU (the H200's 32-concurrent case visits ~20
    # buckets). Caught: a step compiled with dynamic=False (one graph per bucket), and an arena whose tensors are
    # inference tensors in one bucket and normal ones in another (Dynamo guards on the dispatch keys: a recompile
    # although the shapes are symbolic).
    seed_model = dict(family="llama", seed=3, position_sensitive=True)
    eager = Engine(tiny_loaded(**seed_model), compile_mode=None)
    engine = Engine(tiny_loaded(**seed_model), compile_mode="default")
    buckets: set[tuple[int, int]] = set()
    step = engine.scheduler.runner.step.step

    def recording(*args, **kwargs):
        buckets.add((args[1].shape[0], args[7].shape[1]))
        return step(*args, **kwargs)

    engine.scheduler.runner.step.step = recording
    long_documents = [" ".join(f"word{i}" for i in range(300)) + " " + text for text in DOCS]
    # one request at a time (the buckets visited do not depend on the threads' timing): PCED's rows are its
    # documents and the no-context row, so 1 .. 20 documents walk the slot buckets 2, 4, 8, 16 and 24
    for documents in [[f"Note {i}. {DOCS[i % 3]}" for i in range(n)] for n in (1, 2, 4, 6, 11, 20)] + [long_documents]:
        expected = eager.generate("Who is the mayor?", documents, mode="pced", max_new_tokens=8).token_ids
        assert engine.generate("Who is the mayor?", documents, mode="pced", max_new_tokens=8).token_ids == expected
    assert {slots for slots, _ in buckets} == {2, 4, 8, 16, 24} and {c for _, c in buckets} == {512, 1536}, buckets
    assert traced["stats"]["unique_graphs"] <= 3 and not traced["graph_break"], (dict(traced["stats"]), buckets)


@pytest.mark.parametrize("mode", ["ippd", "rapid"])
def test_steps_of_several_tokens_in_a_row_run_the_compiled_step_and_answer_as_the_eager_one(traced, mode):
    # IPPD's stack takes one token per unfinished answer in its one row, RAPID's target row its drafts: on a GPU
    # those steps ran the eager forward beside a compiled batch (IPPD 0.6x prefix-cached batching on the H200).
    # Caught: the compiled step fed the wrong columns of a wide step, or its logits read at the wrong columns.
    seed_model = dict(family="llama", seed=3, position_sensitive=True)
    questions = ["Who is the mayor?", "When is the fair?", "Where is Marrowgate?", "What is served?"]
    run = (lambda engine: [a.token_ids for a in engine.generate_many(questions, DOCS, max_new_tokens=12)]) \
        if mode == "ippd" else \
        (lambda engine: [engine.generate(q, DOCS, mode="rapid", max_new_tokens=12).token_ids for q in questions])
    expected = run(Engine(tiny_loaded(**seed_model), compile_mode=None))
    engine = Engine(tiny_loaded(**seed_model), compile_mode="default")
    widths = []
    step = engine.scheduler.runner.step.step

    def recording(*args, **kwargs):
        widths.append(args[1].shape[1])
        return step(*args, **kwargs)

    engine.scheduler.runner.step.step = recording
    assert run(engine) == expected and all(len(ids) >= 6 for ids in expected)
    assert max(widths) > 1 and not traced["graph_break"] and not engine.scheduler.runner.step.failed, widths


def test_another_bucket_is_one_more_graph_and_a_failed_compile_falls_back_with_one_warning(traced, monkeypatch):
    engine = Engine(tiny_loaded("llama", seed=3), compile_mode="default")
    engine.generate("Who?", DOCS[:1], mode="concat", max_new_tokens=6)  # 1 slot
    engine.generate("Who?", DOCS, mode="pced", max_new_tokens=6)  # 4 slots: another bucket
    assert traced["stats"]["unique_graphs"] == 2 and not traced["graph_break"]

    def broken(*args, **kwargs):
        raise RuntimeError("NoValidChoicesError: No choices to select")

    engine.scheduler.runner.step.step = broken  # what a compile failing on a GPU looks like from here
    expected = Engine(tiny_loaded("llama", seed=3), compile_mode=None).generate("Who?", DOCS, mode="pced",
                                                                              max_new_tokens=6).token_ids
    with pytest.warns(RuntimeWarning, match="compiled decode step .* failed .*eager step"):
        assert engine.generate("Who?", DOCS, mode="pced", max_new_tokens=6).token_ids == expected
    assert engine.generate("Who?", DOCS, mode="pced", max_new_tokens=6).token_ids == expected  # no second warning


def test_the_compiled_step_writes_in_place_only_into_static_inputs_as_cuda_graph_trees_require(monkeypatch):
    # CUDA graph trees skip a graph that mutates an input not known to keep its address; the step writes the new
    # keys, values and column metadata into the arena in place, so every such tensor must be marked static (the
    # H200 run skipped CUDA graphs at every step for 68 unmarked ones). AOT autograd's metadata says which inputs
    # the traced graph mutates and which are static, the two lists the graph trees compare.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(graph, example_inputs):
        meta = torch._guards.TracingContext.try_get().fw_metadata
        graphs.append((set(meta.mutated_inp_runtime_indices), set(meta.static_input_indices)))
        return make_boxed_func(graph.forward)

    backend = aot_autograd(fw_compiler=capture)
    monkeypatch.setattr(runner_module, "compiled_decode_step",
                        lambda mode: compiled_step.compiled_decode_step(mode, backend=backend))
    torch._dynamo.reset()
    try:
        engine = Engine(tiny_loaded("llama", seed=3), compile_mode="default")
        expected = Engine(tiny_loaded("llama", seed=3), compile_mode=None).generate("Who?", DOCS, mode="pced",
                                                                                  max_new_tokens=6).token_ids
        assert engine.generate("Who?", DOCS, mode="pced", max_new_tokens=6).token_ids == expected
    finally:
        torch._dynamo.reset()
    assert graphs and not engine.scheduler.runner.step.failed
    for mutated, static in graphs:  # 2 layers' keys and values and 4 metadata tensors, all of them static
        assert len(mutated) == 8 and mutated <= static, (mutated, static)


@pytest.fixture
def graphs(traced, monkeypatch) -> list[torch.fx.GraphModule]:
    """The graphs Dynamo traces for the compiled steps of engines built now (run as traced, no code generated)."""
    recorded: list[torch.fx.GraphModule] = []

    def recording(graph, example_inputs):
        recorded.append(graph)
        return graph.forward

    monkeypatch.setattr(runner_module, "compiled_decode_step",
                        lambda mode: compiled_step.compiled_decode_step(mode, backend=recording))
    return recorded


def test_the_compiled_step_attends_over_the_arenas_own_key_value_heads_not_copies_of_them(graphs):
    # Under torch.compile transformers' "sdpa" repeats each key/value head for its query heads whenever it gets a
    # mask (repeat_kv): the compiled step copied every layer's slice of the arena `groups` times at every step and
    # read the copies, 9x the key/value bytes on the Llama-3 8B shape (the H200 ran that step at 15 steps/s, ~3.5
    # TB/s, where the eager step ran at 41). Caught: the step's attention left to transformers' "sdpa" (keys with 4
    # heads below), or the grouped attention swapped in for good (the model's own after the step).
    seed_model = dict(family="llama", seed=3, position_sensitive=True)
    questions = ["Who is the mayor?", "When is the fair?", "Where is Marrowgate?"]
    eager, engine = (Engine(tiny_loaded(**seed_model), compile_mode=mode) for mode in (None, "default"))
    for run in (lambda e: [e.generate("Who is the mayor?", DOCS, mode="pced", max_new_tokens=8).token_ids],
                lambda e: [a.token_ids for a in e.generate_many(questions, DOCS, max_new_tokens=8)]):
        assert run(engine) == run(eager)
    config = engine.loaded.model.config
    groups = config.num_attention_heads // config.num_key_value_heads
    calls = [node for graph in graphs for node in graph.graph.nodes
             if node.target is torch.nn.functional.scaled_dot_product_attention]
    assert calls and not engine.scheduler.runner.step.failed and config._attn_implementation == "sdpa"
    shapes = [[argument.meta["example_value"].shape for argument in node.args[:3]] for node in calls]
    assert all(query[1] == key[1] == value[1] == config.num_key_value_heads for query, key, value in shapes), shapes
    # one token per row (PCED's steps: its query heads folded into `groups` queries per key/value head) and
    # IPPD's stacks of several tokens (a wider graph, its width symbolic)
    assert any(query[2] == groups for query, _, _ in shapes), shapes
    assert any(isinstance(query[2], torch.SymInt) or query[2] > groups for query, _, _ in shapes), shapes


def test_on_the_flex_kernel_the_compiled_step_runs_flexattention_in_its_graph_over_the_arenas_own_heads(
        graphs, traced):
    # The pool's kernel on CUDA is FlexAttention (split-key decoding, tiles nobody sees skipped); its compiled step
    # builds the block mask and calls the kernel inside its one graph, so CUDA graphs capture both. Caught: the
    # compiled step on SDPA whatever the runner's kernel, the flex kernel's eager path traced inside the graph (a
    # graph break here), keys repeated per query head.
    seed_model = dict(family="llama", seed=3, position_sensitive=True)
    eager, engine = (Engine(tiny_loaded(**seed_model), compile_mode=mode, attention_kernel="flex")
                     for mode in (None, "default"))
    assert _answers(engine, 12) == _answers(eager, 12)
    config = engine.loaded.model.config
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = [node for graph in graphs for node in graph.graph.nodes
             if node.op == "call_function" and ("flex_attention" in str(node.target) or node.target is sdpa)]
    assert calls and all("flex_attention" in str(node.target) for node in calls)
    shapes = [[argument.meta["example_value"].shape for argument in node.args[1:3]] for node in calls]
    assert all(key[1] == value[1] == config.num_key_value_heads for key, value in shapes), shapes
    assert not traced["graph_break"] and not engine.scheduler.runner.step.failed
    assert config._attn_implementation == "sdpa"


def test_the_compiled_steps_attention_is_chosen_by_the_runners_kernel_for_sdpa_models_only():
    # Caught: a soft-capped model (its own eager attention) or a stand-in without a config given SDPA or
    # FlexAttention, which would drop its cap; a model a swap cannot reach given one (refused at its first join);
    # the kernel ignored.
    from ctx_integrations.engine.core.flex import FLEX_ATTENTION

    model = tiny_loaded("llama", seed=3).model
    assert grouped_attention.step_attention(model, "flex") == FLEX_ATTENTION
    assert grouped_attention.step_attention(model, "eager") == grouped_attention.GROUPED_SDPA
    model._can_set_attn_implementation = lambda: False  # a model that does not route through AttentionInterface
    assert grouped_attention.step_attention(model, "eager") is None
    del model._can_set_attn_implementation
    model.config._attn_implementation = "eager"  # what a soft-capped model (Gemma 2) runs
    assert grouped_attention.step_attention(model, "flex") is None
    assert grouped_attention.step_attention(model, "eager") is None
    assert grouped_attention.step_attention(torch.nn.Linear(2, 2), "flex") is None


@pytest.mark.parametrize("q_len", [1, 2, 3])
def test_grouped_attention_equals_sdpa_over_key_value_heads_repeated_for_their_query_heads(q_len):
    # The reference is the attention transformers computes eagerly with a mask: each key/value head repeated for
    # its query heads. Caught: query heads folded into the wrong key/value head (a head order of (group, kv head)),
    # a packed query given another token's row of the mask (repeat_interleave instead of one row per token).
    torch.manual_seed(0)
    batch, heads, kv_heads, keys, dim = 2, 6, 2, 40, 8
    query, key, value = (torch.randn(batch, n, length, dim)
                         for n, length in ((heads, q_len), (kv_heads, keys), (kv_heads, keys)))
    mask = torch.rand(batch, 1, q_len, keys) > 0.5
    mask[..., 0] = True  # every query sees a key
    groups = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask, scale=0.3)
    out, weights = grouped_attention.grouped_sdpa(torch.nn.Module(), query, key, value, mask, scaling=0.3)
    assert weights is None and out.shape == (batch, q_len, heads, dim)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["no mask", "a mask per head", "one query head per key/value head"])
def test_what_grouped_attention_does_not_fold_is_transformers_sdpa(case):
    # Caught: a mask per head folded as one shared by the heads, a model without grouping reshaped anyway, the
    # fallback handed other tensors or another scale than its caller's.
    torch.manual_seed(1)
    batch, q_len, keys, dim = 2, 3, 24, 8
    heads, kv_heads = (4, 4) if case == "one query head per key/value head" else (6, 2)
    query, key, value = (torch.randn(batch, n, length, dim)
                         for n, length in ((heads, q_len), (kv_heads, keys), (kv_heads, keys)))
    mask = None if case == "no mask" else torch.rand(batch, heads if case == "a mask per head" else 1, q_len,
                                                     keys) > 0.4
    if mask is not None:
        mask[..., 0] = True
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, False  # what transformers' sdpa reads
    groups = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask, scale=0.3)
    out, _ = grouped_attention.grouped_sdpa(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("heads", [6, 2])  # folded, and handed to transformers' sdpa
def test_grouped_attention_passes_on_the_dropout_and_options_transformers_gives_it(heads):
    # Caught: the attention dropout (0 in inference, but the model's setting in training) dropped on the way to the
    # kernel, or the model's other options (a soft cap, which SDPA cannot apply) dropped instead of refused.
    query, key, value = torch.randn(1, heads, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // 2, False
    out, _ = grouped_attention.grouped_sdpa(module, query, key, value, mask, dropout=1.0)
    assert not out.any()  # every attention weight dropped
    with pytest.raises(ValueError, match="softcap"):
        grouped_attention.grouped_sdpa(module, query, key, value, mask, softcap=5.0)


def test_compile_mode_is_checked_resolved_per_device_and_shared_by_the_engines_of_a_model():
    assert compiled_step.resolve_compile_mode("auto", torch.device("cpu")) is None
    assert compiled_step.resolve_compile_mode("auto", torch.device("cuda")) == "reduce-overhead"
    assert compiled_step.resolve_compile_mode("max-autotune", torch.device("cpu")) == "max-autotune"
    with pytest.raises(InvalidOptionError, match="compile_mode must be one of"):
        Engine(tiny_loaded("llama", seed=9), compile_mode="fast")
    loaded = tiny_loaded("llama", seed=10)
    assert Engine(loaded).scheduler.runner.step is None
    # the default is the eager step on CUDA too (measured faster for PCED's rows on an H200: compiled_step's docstring)
    assert compiled_step.resolve_compile_mode(EngineConfig().compile_mode, torch.device("cuda")) is None
    assert Engine(loaded, compile_mode="auto").scheduler.runner.step is None  # auto: eager on the CPU
    with pytest.raises(InvalidOptionError, match="compile_mode=None"):
        Engine(loaded, compile_mode="default")
    assert Engine(loaded, compile_mode=None).scheduler.runner.step is None


@pytest.mark.parametrize(("rows", "slots"), [(-1, 0), (0, 0), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16),
                                             (16, 16), (17, 24), (64, 64), (65, 72)])
def test_slot_buckets(rows, slots):
    assert slot_bucket(rows) == slots


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_every_compile_mode_is_accepted_and_anything_else_refused_by_name(mode):
    compiled_step.check_compile_mode(mode)
    expected = "compile_mode must be one of None, 'auto', 'default', 'reduce-overhead', 'max-autotune', " \
               "'max-autotune-no-cudagraphs', got "
    for wrong in ("fast", "", "AUTO", 1, True):
        with pytest.raises(InvalidOptionError) as refused:
            compiled_step.check_compile_mode(wrong)
        assert str(refused.value) == expected + repr(wrong)
    with pytest.raises(InvalidOptionError, match="got 'fast'"):
        compiled_step.resolve_compile_mode("fast", torch.device("cpu"))


@pytest.mark.parametrize(("mode", "device", "resolved"),
                         [("auto", "cpu", None), ("auto", "cuda", "reduce-overhead"),
                          ("auto", "cuda:1", "reduce-overhead"), ("auto", "meta", None), (None, "cuda", None),
                          ("default", "cpu", "default"),
                          ("reduce-overhead", "cpu", "reduce-overhead"), ("max-autotune", "cuda", "max-autotune")])
def test_auto_is_cuda_graphs_on_cuda_and_eager_elsewhere_and_other_modes_are_kept(mode, device, resolved):
    assert compiled_step.resolve_compile_mode(mode, torch.device(device)) == resolved
    assert compiled_step.resolve_compile_mode(mode, device) == resolved  # a device's name will do


def test_the_decode_step_is_compiled_once_per_mode_and_backend_with_a_raised_recompile_limit(monkeypatch):
    from ctx_integrations.engine.core.rows import decode_step

    compiles = []

    def compile_(function, **options):
        compiles.append((function, options))
        return lambda *args: (args, torch._dynamo.config.recompile_limit)

    monkeypatch.setattr(torch, "compile", compile_)
    compiled_step.compiled_decode_step.cache_clear()
    try:
        step = compiled_step.compiled_decode_step("reduce-overhead")
        assert compiled_step.compiled_decode_step("reduce-overhead") is step
        assert compiles == [(decode_step, {"dynamic": None, "backend": "inductor", "mode": "reduce-overhead"})]
        default_limit = torch._dynamo.config.recompile_limit
        args = (None, *range(6), *(torch.zeros(2) for _ in range(4)), [(torch.zeros(3), torch.zeros(3))])
        assert step(*args) == ((*args, "eager"), compiled_step.RECOMPILE_LIMIT) and compiled_step.RECOMPILE_LIMIT == 64
        assert torch._dynamo.config.recompile_limit == default_limit  # only while the step runs
        compiled_step.compiled_decode_step("default", backend="eager")
        assert compiles[1] == (decode_step, {"dynamic": None, "backend": "eager"})  # a mode is inductor's option
    finally:
        compiled_step.compiled_decode_step.cache_clear()


def test_a_guarded_step_runs_the_compiled_step_until_it_fails_then_the_eager_one_for_good(monkeypatch):
    from ctx_integrations.engine.core import rows

    calls = []
    monkeypatch.setattr(rows, "decode_step", lambda *args: calls.append(("eager", args)) or "eager")

    def compiled(*args, kernel):
        calls.append(("compiled", args, kernel))
        if len(calls) > 1:
            raise RuntimeError("NoValidChoicesError: " + "x" * 300)
        return "compiled"

    raised_line = compiled.__code__.co_firstlineno + 3

    guarded = compiled_step.GuardedStep(compiled, "max-autotune", "flex")
    assert (guarded.step, guarded.mode, guarded.kernel, guarded.failed) == (compiled, "max-autotune", "flex", False)
    assert guarded(1, 2) == "compiled" and calls == [("compiled", (1, 2), "flex")]  # on the runner's kernel
    with pytest.warns(RuntimeWarning) as warned:
        assert guarded(3) == "eager"
    # the fallback: the eager step over the boolean mask, whatever the kernel
    assert calls[1:] == [("compiled", (3,), "flex"), ("eager", (3,))] and guarded.failed
    assert [str(w.message) for w in warned] == [
        "the compiled decode step (compile_mode='max-autotune') failed (RuntimeError: NoValidChoicesError: "
        + "x" * (200 - len("NoValidChoicesError: ")) + f", raised at {__file__}:{raised_line} in compiled); "
        "decoding goes on with the eager step"]
    # the warning points at the step's caller (under mutation testing, mutmut's trampoline calls the step)
    caller = __file__ if "MUTANT_UNDER_TEST" not in os.environ else os.path.join("mutation", "trampoline.py")
    assert warned[0].filename.endswith(caller), warned[0].filename
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert guarded(4) == "eager"  # no second warning, no second try
    assert calls[3:] == [("eager", (4,))]


def _torch_2_11_lookup(attr: str) -> object:
    """``cudagraph_trees.get_obj`` as torch 2.11 has it (the H200's image): no set-up for a thread that lacks it."""
    from torch._inductor import cudagraph_trees as trees

    if hasattr(trees.local, attr):
        return getattr(trees.local, attr)
    assert torch._C._is_key_in_tls(attr)
    return torch._C._get_obj_in_tls(attr)


def _in_a_fresh_thread(function):
    """``function()``'s result, or the exception it raised, in a new thread (like the engine's step thread)."""
    result = []

    def run():
        try:
            result.append(function())
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            result.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


def test_a_step_thread_gets_the_state_cuda_graph_trees_look_up():
    # On torch 2.11 CUDA graph trees failed with a bare AssertionError in any thread but the one that imported them:
    # the H200 run's compiled step, on the scheduler's thread. Caught: the set-up skipped, done in the wrong thread,
    # redone over a thread's existing state (its tree managers lost), or stashed in torch's C++ thread-local state
    # (a process exit abort: tests/test_scheduler_exit.py).
    from torch._inductor import cudagraph_trees  # noqa: F401 - imported here, in this thread, whatever ran before

    assert isinstance(_in_a_fresh_thread(lambda: _torch_2_11_lookup("tree_manager_containers")), AssertionError)

    def set_up_twice():
        compiled_step.cudagraph_trees_in_this_thread()
        containers, locks = (_torch_2_11_lookup(name) for name in ("tree_manager_containers", "tree_manager_locks"))
        containers["mine"] = "a tree manager"
        compiled_step.cudagraph_trees_in_this_thread()
        assert _torch_2_11_lookup("tree_manager_containers") is containers
        return containers, locks, torch._C._is_key_in_tls("tree_manager_containers")

    containers, locks, stashed = _in_a_fresh_thread(set_up_twice)
    assert containers == {"mine": "a tree manager"} and isinstance(locks[0], type(threading.Lock()))
    assert not stashed  # nothing left in the C++ thread-local state
    def another_threads_state():
        compiled_step.cudagraph_trees_in_this_thread()
        return _torch_2_11_lookup("tree_manager_containers")

    assert _in_a_fresh_thread(another_threads_state) == {}  # each thread its own state

    guarded = compiled_step.GuardedStep(
        lambda *args, **kwargs: _torch_2_11_lookup("tree_manager_containers") is not None, "reduce-overhead")
    assert _in_a_fresh_thread(lambda: guarded(1)) is True and not guarded.failed


@pytest.mark.parametrize("removable", [True, False], ids=["torch 2.13", "torch 2.11"])
def test_a_stash_in_the_step_threads_cpp_state_is_taken_out_where_torch_can(monkeypatch, removable):
    # What importing cudagraph_trees in the step's thread leaves there (torch's _initialize_tls), made by hand in this
    # process (the subprocess tests run unmutated code under mutation testing). Caught: the stash left where torch
    # can take it out (an exit abort), a removal called where torch cannot (2.11: AttributeError, the H200 run's
    # failed compiled step), the wrong key removed, or keys removed that were never stashed.
    if not removable:
        monkeypatch.delattr(torch._C, "_remove_obj_from_tls")

    def stashed_then_set_up():
        torch._C._stash_obj_in_tls("tree_manager_containers", {})
        torch._C._stash_obj_in_tls("tree_manager_locks", {})
        compiled_step.cudagraph_trees_in_this_thread()
        return [torch._C._is_key_in_tls(key) for key in compiled_step.TREE_STATE], \
            _torch_2_11_lookup("tree_manager_containers")

    left, containers = _in_a_fresh_thread(stashed_then_set_up)
    assert left == ([False, False] if removable else [True, True]) and containers == {}

    def only_one_stashed():
        torch._C._stash_obj_in_tls("tree_manager_locks", {})
        compiled_step.cudagraph_trees_in_this_thread()
        return [torch._C._is_key_in_tls(key) for key in compiled_step.TREE_STATE]

    assert _in_a_fresh_thread(only_one_stashed) == ([False, False] if removable else [False, True])


def test_a_step_thread_that_first_imports_cuda_graph_trees_keeps_nothing_in_cpp_thread_local_state():
    # Importing cudagraph_trees runs torch's _initialize_tls in the importing thread, which stashes Python objects in
    # its C++ thread-local state; when that thread is the scheduler's, their destructor runs after join() returned and
    # needs the GIL while the interpreter finalises: "terminate called without an active exception" (1 run in 8
    # under load, tests/test_scheduler_exit.py). A fresh process, so that the import happens in the step thread.
    script = textwrap.dedent("""
        import sys, threading
        sys.path.insert(0, {repo!r})
        import torch
        from ctx_integrations.engine.core import compiled_step

        assert "torch._inductor.cudagraph_trees" not in sys.modules
        seen = []

        def step_thread():
            compiled_step.cudagraph_trees_in_this_thread()
            from torch._inductor import cudagraph_trees
            seen.append([torch._C._is_key_in_tls(key) for key in compiled_step.TREE_STATE])
            seen.append(hasattr(cudagraph_trees.local, "tree_manager_containers"))

        thread = threading.Thread(target=step_thread)
        thread.start()
        thread.join()
        print(seen)
    """).format(repo=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[[False, False], True]"


def test_a_guarded_step_built_on_torch_2_11_runs_in_another_thread_and_leaves_it_no_cpp_state():
    # torch 2.11 has no torch._C._remove_obj_from_tls: calling it failed the H200 run's first compiled step
    # (AttributeError), and its engine decoded eagerly for the whole benchmark. Caught: the removal called where
    # torch lacks it, or the module imported in the step's thread (which 2.11 cannot clean up: an exit abort).
    # A fresh process, torch 2.11's C API imitated by deleting the call.
    script = textwrap.dedent("""
        import sys, threading
        sys.path.insert(0, {repo!r})
        import torch
        del torch._C._remove_obj_from_tls
        from ctx_integrations.engine.core import compiled_step

        assert "torch._inductor.cudagraph_trees" not in sys.modules
        guarded = compiled_step.GuardedStep(lambda *args, **kwargs: "compiled", "reduce-overhead")
        assert "torch._inductor.cudagraph_trees" in sys.modules  # imported here, in the building thread
        seen = []

        def step_thread():
            seen.append(guarded(1))
            from torch._inductor import cudagraph_trees
            seen.append([torch._C._is_key_in_tls(key) for key in compiled_step.TREE_STATE])
            seen.append(cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers"))

        thread = threading.Thread(target=step_thread)
        thread.start()
        thread.join()
        print(seen, guarded.failed)
    """).format(repo=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['compiled', [False, False], {}] False", done.stderr[-2000:]


def test_a_failures_place_is_the_innermost_frame_of_its_traceback():
    def inner():
        raise AssertionError

    def middle():
        inner()

    try:
        middle()
    except AssertionError as error:
        raised = error
    assert compiled_step.raised_at(raised) == f"{__file__}:{inner.__code__.co_firstlineno + 1} in inner"
    assert compiled_step.raised_at(AssertionError()) == "an unknown place"  # never raised: no traceback
