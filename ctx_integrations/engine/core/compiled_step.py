"""The row pool's decode step under ``torch.compile``: CUDA graphs per bucket of (slots, capacity) on a GPU.

A decode step of an 8B model on an H200 ran at ~12 % of the memory-bandwidth limit: every step launched its ~30
layers' kernels one by one from Python. :func:`~ctx_integrations.engine.core.rows.decode_step` is the step as one
pure function of the arena's tensors, whose shapes change only when the arena moves to another bucket of slots
(:func:`~ctx_integrations.engine.core.rows.slot_bucket`) or its capacity grows by a 512-column block;
``torch.compile(mode="reduce-overhead")`` compiles it a few times (static, then once more the first time the slot
count, the capacity or the step's width changes, made symbolic: :func:`compiled_decode_step`), captures it once per
bucket as a CUDA graph (as vLLM captures one per batch size) and replays it at every later step of the bucket. Its
attention follows the runner's kernel (:func:`~ctx_integrations.engine.core.grouped_attention.step_attention`): on
``"flex"`` (CUDA's default) the block mask is built and FlexAttention called inside the step's graph, so the graph
holds the split-key decoding kernel the eager step uses; on ``"eager"``, SDPA with each query head over its own
key/value head (:func:`~ctx_integrations.engine.core.grouped_attention.grouped_sdpa`). On the CPU the compile costs
minutes for seconds of gain, so the default there is the eager step; the CPU tests run the step under
``torch.compile`` with the ``"eager"`` backend (Dynamo's tracing alone) and assert that it never breaks, never
recompiles within a bucket, takes a few graphs across many buckets and writes in place only into static inputs
(``tests/test_compiled_step.py``): the preconditions a GPU then only has to confirm.

``compile_mode`` values: ``None`` (the eager step, the reference, and the default), ``"auto"``
(``"reduce-overhead"`` on CUDA, ``None`` elsewhere) or a ``torch.compile`` mode. A step that fails to compile or
run compiled warns once and the engine goes on with the eager step.

Why the eager step is the default on CUDA too: measured on one H200 (random-weight Llama-3.1-8B shape, bf16,
torch 2.11, ``benchmarks/gpu.py --budget``, docs/gpu-benchmark.md), the compiled step with CUDA graphs captured
(6 graphs, no CUDA-graph skip) decoded PCED's 65 rows x ~2k columns at 15.1 steps/s, the eager step at 41.3;
``concat``'s one row of 131k columns went the other way (17.9 vs 10.8 tokens/s), and the first compile cost
~90 s. The cause, found afterwards on the CPU: under compile transformers' SDPA attention copied every layer's
slice of the arena once per query head of its key/value head (``repeat_kv``) at every step, so that step moved
~9x the key/value bytes of reading the arena once; it now attends over the arena's own heads
(:func:`~ctx_integrations.engine.core.grouped_attention.grouped_sdpa`).
Until a GPU shows the compiled step winning on the pool's many-row shapes it stays an opt-in.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import traceback
import warnings
from collections.abc import Callable

import torch

from ctx_integrations.engine.core.attention_swap import attention_swapped
from ctx_integrations.engine.core.config import check_compile_mode  # the command line offers the modes, torch-free
from ctx_integrations.engine.core.flex import FLEX_ATTENTION
from ctx_integrations.engine.core.grouped_attention import step_attention

# Shapes one compiled step may be specialised to before Dynamo stops compiling new ones (its default is 8):
# every (slot bucket, capacity) pair the arena visits is one.
RECOMPILE_LIMIT = 64


def resolve_compile_mode(mode: str | None, device: torch.device) -> str | None:
    """``"auto"``: ``"reduce-overhead"`` (CUDA graphs) on CUDA, ``None`` (eager) elsewhere; other values as given."""
    check_compile_mode(mode)
    if mode == "auto":
        return "reduce-overhead" if torch.device(device).type == "cuda" else None
    return mode


@functools.cache
def compiled_decode_step(mode: str, backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """``decode_step`` compiled with ``mode`` (one compiled function per mode and backend, shared by every model:
    Dynamo guards on the tensors it is given, so each model and bucket gets its own graph)."""
    from ctx_integrations.engine.core.rows import decode_step

    options = {} if backend != "inductor" else {"mode": mode}
    # dynamic=None (Dynamo's automatic dynamic shapes): the first bucket compiles with static shapes; the first
    # time the slot count, the capacity or the step's width changes, that dimension is recompiled as a symbol once
    # (a slot count of 1 is its own graph: Dynamo specialises sizes 0 and 1), and every later bucket reuses the
    # graph (CUDA graph trees still record one graph per concrete shape, a cheap capture). With dynamic=False each
    # bucket was an Inductor compile of its own: about 20 buckets at 32 concurrent requests.
    compiled = torch.compile(decode_step, dynamic=None, backend=backend, **options)

    def step(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, contexts: torch.Tensor,
             questions: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, k_pos: torch.Tensor,
             k_ctx: torch.Tensor, k_qid: torch.Tensor, documents: torch.Tensor,
             layers: list[tuple[torch.Tensor, torch.Tensor]], kernel: str = "eager") -> torch.Tensor:
        mark_arena_static(k_pos, k_ctx, k_qid, documents, *(tensor for pair in layers for tensor in pair))
        attention = step_attention(model, kernel)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), \
                attention_swapped(model, attention) if attention else contextlib.nullcontext():
            return compiled(model, ids, positions, contexts, questions, rows, columns, k_pos, k_ctx, k_qid,
                            documents, layers, "flex" if attention == FLEX_ATTENTION else "eager")

    return step


def mark_arena_static(*arena: torch.Tensor) -> None:
    """Tell Dynamo that the arena's tensors (the keys, values and per-column metadata the step writes in place)
    keep their address: CUDA graph trees capture a step that mutates its inputs only when those inputs are static
    (parameters or marked so). Unmarked, the H200 run skipped CUDA graphs for every step ("skipping cudagraphs
    due to mutated inputs (68 instances)": 32 layers' keys and values and 4 metadata tensors) and ran the
    compiled step without them. ``guard=False``: an arena re-allocated at the same shape is re-recorded by the
    graph trees, not recompiled by Dynamo."""
    for tensor in arena:
        torch._dynamo.mark_static_address(tensor, guard=False)


TREE_STATE = ("tree_manager_containers", "tree_manager_locks")  # what cudagraph_trees stashes in C++ TLS


def cudagraph_trees_in_this_thread() -> None:
    """Give this thread the thread-local state CUDA graph trees look up, if it has none.

    Inductor keeps its CUDA graph tree managers in thread-local storage set up only in the thread that imported
    it (and autograd's threads); torch 2.11's lookup then fails with a bare ``AssertionError`` in any other thread
    (``cudagraph_trees.get_obj``: ``assert torch._C._is_key_in_tls(attr_name)``), and the engine's steps run on
    its scheduler's own thread: on the H200 the compiled step failed so, and decoded eagerly from then on. The
    lookup reads the Python thread-local attributes first, so those are set here (an empty manager dict and a
    lock per device, as torch sets them). Not torch's ``_initialize_tls`` (2.13+): it also stashes the objects in
    the C++ thread-local state autograd copies into its threads, and a scheduler thread holding Python objects
    there aborted the process at exit ("terminate called without an active exception", 3 runs in 4 on the CPU).
    Importing the module stashes its state in the importing thread's C++ thread-local state; the thread's
    destructor of it, run after ``join`` has returned, needs the GIL while the interpreter finalises, and aborted
    1 run in 8 under load. :class:`GuardedStep` therefore imports the module in the thread that builds it; where
    this thread imported it anyway, the stash is taken out again, on torches that can (2.13 has
    ``_remove_obj_from_tls``; 2.11 has not, and calling it failed the H200 run's first compiled step). Written
    by hand: torch has no public call for it."""
    from torch._inductor import cudagraph_trees as trees

    remove = getattr(torch._C, "_remove_obj_from_tls", None)
    for key in TREE_STATE:
        if remove is not None and torch._C._is_key_in_tls(key):
            remove(key)
    if hasattr(trees.local, "tree_manager_containers"):
        return
    trees.local.tree_manager_containers = {}
    trees.local.tree_manager_locks = collections.defaultdict(threading.Lock)


class GuardedStep:
    """A compiled step that falls back to the eager one for good, with one warning, the first time it fails."""

    def __init__(self, step: Callable[..., torch.Tensor], mode: str, kernel: str = "eager"):
        # imported in the building thread, not in the step's: see cudagraph_trees_in_this_thread
        from torch._inductor import cudagraph_trees  # noqa: F401

        self.step, self.mode, self.kernel, self.failed = step, mode, kernel, False

    def __call__(self, *args: object) -> torch.Tensor:
        """The compiled step on the runner's attention kernel; after a failure, the eager step over the boolean mask
        (the reference)."""
        from ctx_integrations.engine.core.rows import decode_step

        if not self.failed:
            try:
                cudagraph_trees_in_this_thread()
                return self.step(*args, kernel=self.kernel)
            except Exception as error:  # noqa: BLE001 - compile errors come in many types; the request must not fail
                self.failed = True
                warnings.warn(f"the compiled decode step (compile_mode={self.mode!r}) failed ({type(error).__name__}: "
                              f"{str(error)[:200]}, raised at {raised_at(error)}); decoding goes on with the eager "
                              "step", RuntimeWarning, stacklevel=2)
        return decode_step(*args)


def raised_at(error: BaseException) -> str:
    """``file:line in function`` of the frame that raised ``error`` (a bare ``AssertionError`` from inside
    torch, as the H200 run gave, says nothing without it)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "an unknown place"
    last = frames[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"
