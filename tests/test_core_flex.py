"""``engine/core/flex.py``: IPPD's visibility rule (the row pool's mask) as a FlexAttention block mask, against the
boolean mask, on CPU (FlexAttention's unfused reference there; the compiled kernel is in tests/test_cuda.py)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ctx_integrations.engine.core import flex as flex_module
from ctx_integrations.engine.core.attention_swap import attention_swapped
from ctx_integrations.engine.core.flex import FLEX_ATTENTION, run_flex
from ctx_integrations.engine.core.rows import visibility_block_mask
from ctx_integrations.engine.modes.ippd import PAD_ID, PAD_POSITION, visibility
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import tiny_loaded


def random_layout(generator: torch.Generator, rows: int, keys: int, queries: int) -> tuple[torch.Tensor, ...]:
    """Virtual positions and ids of a stack-like batch: prefix, two contexts, three questions, padding at the end;
    the queries are ``queries`` of its columns (each sees at least itself)."""
    k_pos, k_ctx, k_qid = (torch.empty(rows, keys, dtype=torch.long) for _ in range(3))
    for b in range(rows):
        pieces = torch.randint(0, 6, (keys,), generator=generator).sort().values  # 0 prefix, 1-2 ctx, 3-5 questions
        pieces[: 3] = 0
        k_ctx[b] = torch.where(pieces == 0, 0, torch.where(pieces <= 2, pieces, 1 + (pieces % 2)))
        k_qid[b] = torch.where(pieces >= 3, pieces - 2, 0)
        k_pos[b] = torch.arange(keys)
        pad = int(torch.randint(0, keys // 4, (1,), generator=generator))
        if pad:
            k_pos[b, -pad:], k_ctx[b, -pad:], k_qid[b, -pad:] = PAD_POSITION, PAD_ID, PAD_ID
    q_cols = torch.stack([torch.randperm(keys, generator=generator)[:queries].sort().values for _ in range(rows)])
    gather = lambda t: t.gather(1, q_cols)  # noqa: E731
    return gather(k_pos), gather(k_ctx), gather(k_qid), k_pos, k_ctx, k_qid


def test_block_mask_attention_equals_attention_under_the_boolean_mask():
    # A mask_mod that dropped a clause of the conjunction (e.g. the "k_ctx == 0" shared prefix, or the question id
    # test), compared positions the wrong way, or indexed another row's ids would change which keys are averaged.
    generator = torch.Generator().manual_seed(0)
    for rows, keys, queries in ((1, 40, 7), (3, 300, 20), (2, 200, 1)):
        layout = random_layout(generator, rows, keys, queries)
        dense = visibility(*layout)  # [B, 1, Q, K]
        assert dense.any(-1).all() and not dense.all()  # every query sees something, and not everything
        query = torch.randn(rows, 4, queries, 16, generator=generator)
        key, value = torch.randn(2, rows, 2, keys, 16, generator=generator)
        expected = F.scaled_dot_product_attention(query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1),
                                                  attn_mask=dense)
        out, _ = run_flex(query, key, value, visibility_block_mask(*layout), 16 ** -0.5)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def pool_step_logits(model: torch.nn.Module, flex: bool, seed: int = 0, rows: int = 2, context: int = 150,
                     step: int = 12) -> list[torch.Tensor]:
    """Two forwards the way the row pool runs them: ``context`` columns into an empty cache, then ``step`` more.

    Every token carries virtual positions and ids (``random_layout``); the mask is IPPD's boolean
    ``visibility`` (SDPA, the reference) or its block mask under the flex attention. Returns both logits.
    """
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    _, _, _, k_pos, k_ctx, k_qid = (t.to(device) for t in random_layout(generator, rows, context + step, 1))
    ids = torch.randint(0, model.config.vocab_size, (rows, context + step), generator=generator).to(device)
    cache, logits = DynamicCache(), []
    for span in (slice(0, context), slice(context, context + step)):
        q = (k_pos[:, span], k_ctx[:, span], k_qid[:, span])
        keys = (k_pos[:, : span.stop], k_ctx[:, : span.stop], k_qid[:, : span.stop])
        mask = (visibility_block_mask if flex else visibility)(*q, *keys)
        rope = q[0].masked_fill(q[0] == PAD_POSITION, 0)
        with torch.inference_mode(), attention_swapped(model, FLEX_ATTENTION) if flex else torch.inference_mode():
            out = model(input_ids=ids[:, span], attention_mask=mask, position_ids=rope, past_key_values=cache,
                        use_cache=True)
        logits.append(out.logits.float())
    return logits


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_model_forward_with_the_block_mask_equals_the_boolean_mask(family):
    # The row pool's two calls through transformers: the BlockMask must pass the mask preprocessing untouched, reach
    # the flex attention function with GQA, and the model must get its own attention back. Mistral passes its sliding
    # window (4096) on every call: refusing it outright would refuse every request on such models.
    loaded = tiny_loaded(family, seed=3)
    for flex, eager in zip(pool_step_logits(loaded.model, True), pool_step_logits(loaded.model, False)):
        torch.testing.assert_close(flex, eager, atol=1e-4, rtol=1e-4)
    assert loaded.model.config._attn_implementation == "sdpa"


def test_the_flex_attention_refuses_a_dense_mask():
    from ctx_integrations.engine.core.flex import flex_attention_forward

    query, key = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(InvalidOptionError, match="BlockMask"):
        flex_attention_forward(torch.nn.Module(), query, key, key, torch.ones(1, 1, 1, 8, dtype=torch.bool))


def test_a_windowed_block_mask_is_the_windowed_boolean_mask():
    """A sliding layer's block mask (``window=``) allows exactly what the eager kernel's windowed mask allows,
    padding queries included (they keep their keys, so no query row is empty)."""
    from ctx_integrations.engine.core.windows import Windows

    generator = torch.Generator().manual_seed(5)
    layout = random_layout(generator, 3, 40, 12)
    q_pos = layout[0]
    q_pos[0, -1] = PAD_POSITION  # one padding query
    dense = Windows(6).masks(visibility(*layout), q_pos, layout[3], q_pos != PAD_POSITION)
    block = visibility_block_mask(*layout, window=6)
    b = torch.arange(3).view(3, 1, 1, 1)
    q = torch.arange(12).view(1, 1, 12, 1)
    k = torch.arange(40).view(1, 1, 1, 40)
    assert torch.equal(block.mask_mod(b, torch.zeros_like(b), q, k), dense)
    assert not torch.equal(dense, visibility(*layout))  # the window hides something here


# -- a compiled kernel that cannot be built must not fail a request (the H200 run: Inductor's NoValidChoicesError
#    for flex_attention at 32k tokens in bf16, and in fp32 with head dim 16)
class FailingCompile:
    """Stands in for ``torch.compile(flex_attention)``: raises like Inductor, unless given kernel options that
    ``works_with`` accepts, then runs the reference; records every call's kernel options."""

    def __init__(self, works_with=None):
        self.works_with, self.calls = works_with, []

    def __call__(self, query, key, value, kernel_options=None, **options):
        from torch.nn.attention.flex_attention import flex_attention

        self.calls.append(kernel_options)
        if self.works_with is None or kernel_options != self.works_with:
            raise RuntimeError("LoweringException: NoValidChoicesError: No choices to select, target: flex_attention")
        return flex_attention(query, key, value, **options)


@pytest.fixture
def failing_compile(monkeypatch):
    """The CUDA path on the CPU: run_flex believes it compiles, and every compile fails."""
    from ctx_integrations.engine.core import flex

    compiled = FailingCompile()
    monkeypatch.setattr(flex, "_use_compiled", lambda device: True)
    monkeypatch.setattr(flex, "_compiled_flex", lambda: compiled)
    monkeypatch.setattr(flex, "_FAILED_KERNELS", {})
    return compiled


def _prior_bias(score, b, h, q, k):
    """A score_mod like APE's prior: a bias by batch, head and key (so a fallback that drops it is caught)."""
    return score + 0.5 * ((k % 7) - 3) * (b + 1) - 0.1 * h


@pytest.mark.parametrize("score_mod", [None, _prior_bias])
@pytest.mark.parametrize("return_lse", [False, True])
def test_a_compile_that_fails_falls_back_once_per_shape_with_one_warning(failing_compile, return_lse, score_mod):
    from torch.nn.attention.flex_attention import flex_attention

    from ctx_integrations.engine.core import flex

    generator = torch.Generator().manual_seed(1)
    layout = random_layout(generator, 2, 300, 20)
    mask = visibility_block_mask(*layout)
    query = torch.randn(2, 4, 20, 16, generator=generator)
    key, value = torch.randn(2, 2, 2, 300, 16, generator=generator)
    options = dict(block_mask=mask, scale=0.25, enable_gqa=True, score_mod=score_mod)
    if return_lse:
        options["return_aux"] = flex.AuxRequest(lse=True)
    with pytest.warns(RuntimeWarning, match=r"query \(2, 4, 20, 16\), keys \(2, 2, 300, 16\).*SDPA in query chunks"):
        out, lse = run_flex(query, key, value, mask, 0.25, return_lse=return_lse, score_mod=score_mod)
    reference = flex_attention(query, key, value, **options)
    expected, expected_lse = (reference[0], reference[1].lse) if return_lse else (reference, None)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if return_lse:
        torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)
    tried = len(failing_compile.calls)
    assert tried == 1 + len(flex.FALLBACK_KERNEL_OPTIONS)  # the default, then each smaller configuration
    with warnings.catch_warnings():  # the same shape again: no new warning, no new compile attempt
        warnings.simplefilter("error")
        again, _ = run_flex(query, key, value, mask, 0.25, return_lse=return_lse, score_mod=score_mod)
    assert len(failing_compile.calls) == tried
    torch.testing.assert_close(again, out, atol=0, rtol=0)


def test_a_shape_that_builds_with_smaller_tiles_keeps_the_compiled_kernel(failing_compile):
    from ctx_integrations.engine.core import flex

    failing_compile.works_with = flex.FALLBACK_KERNEL_OPTIONS[1]
    generator = torch.Generator().manual_seed(2)
    layout = random_layout(generator, 1, 64, 5)
    query = torch.randn(1, 4, 5, 16, generator=generator)
    key, value = torch.randn(2, 1, 2, 64, 16, generator=generator)
    with pytest.warns(RuntimeWarning, match="kernel_options="):
        run_flex(query, key, value, visibility_block_mask(*layout), 0.25)
    assert failing_compile.calls == [None, *flex.FALLBACK_KERNEL_OPTIONS]
    run_flex(query, key, value, visibility_block_mask(*layout), 0.25)
    assert failing_compile.calls[-1] == flex.FALLBACK_KERNEL_OPTIONS[1] and len(failing_compile.calls) == 4


def test_other_lengths_of_a_failed_kind_skip_the_failing_build_and_a_one_token_query_tries_it(failing_compile):
    # Under dynamic=True a kind whose default build failed fails at every length (the H200: each try a failed
    # compile of seconds, at every new prompt or context length); a decode's one-token query is another kernel.
    from ctx_integrations.engine.core import flex

    failing_compile.works_with = flex.FALLBACK_KERNEL_OPTIONS[0]
    generator = torch.Generator().manual_seed(3)

    def call(q_len, kv_len, dtype=torch.float32, head_dim=16, kv_heads=2, return_lse=False, score_mod=None):
        layout = random_layout(generator, 1, kv_len, q_len)
        query = torch.randn(1, 4, q_len, head_dim, generator=generator).to(dtype)
        key, value = torch.randn(2, 1, kv_heads, kv_len, head_dim, generator=generator).to(dtype)
        return run_flex(query, key, value, visibility_block_mask(*layout), 0.25, return_lse, score_mod)

    with pytest.warns(RuntimeWarning, match=r"query \(1, 4, 20, 16\).*\(RuntimeError\); it runs with kernel_options=.*"
                                            r"for this shape and later calls of this dtype, head dim and query kind "
                                            r"\(many tokens\)") as warned:
        call(20, 300)
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutmut's trampolines add frames between run_flex and its caller
        assert [w.filename for w in warned if w.category is RuntimeWarning] == [__file__]  # at run_flex's caller
    assert failing_compile.calls == [None, flex.FALLBACK_KERNEL_OPTIONS[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(37, 700)  # another prompt and context length: straight to the options that built
    assert failing_compile.calls[2:] == [flex.FALLBACK_KERNEL_OPTIONS[0]]
    for other_kind in (dict(q_len=1, kv_len=300), dict(q_len=20, kv_len=300, head_dim=32),
                       dict(q_len=20, kv_len=300, dtype=torch.bfloat16), dict(q_len=20, kv_len=300, kv_heads=4),
                       dict(q_len=20, kv_len=300, return_lse=True), dict(q_len=20, kv_len=300, score_mod=_prior_bias)):
        before = len(failing_compile.calls)
        query_kind = "one token" if other_kind["q_len"] == 1 else "many tokens"
        with pytest.warns(RuntimeWarning, match=rf"kernel_options=.*query kind \({query_kind}\)"):
            call(**other_kind)
        assert failing_compile.calls[before:] == [None, flex.FALLBACK_KERNEL_OPTIONS[0]], other_kind


def test_a_model_step_under_a_failing_compile_gives_the_eager_logits(failing_compile):
    model = tiny_loaded("llama", seed=4).model
    eager = pool_step_logits(model, flex=False)
    with pytest.warns(RuntimeWarning, match="SDPA in query chunks"):
        fallen_back = pool_step_logits(model, flex=True)
    for a, b in zip(eager, fallen_back):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)



@pytest.mark.parametrize("compiling", [False, True])
def test_inside_an_enclosing_compile_the_block_mask_and_the_kernel_are_the_plain_functions(monkeypatch, compiling):
    # The pool's compiled step traces both into its own graph (and CUDA graphs capture them); outside it, CUDA
    # builds them with compiles of their own, the kernel behind its fallbacks. Caught: a compile of its own or the
    # kernel's fallbacks traced inside the step's graph, the plain functions run outside it on CUDA, either one
    # handed other tensors, sizes or options than its caller's.
    calls = []

    def recorder(name):
        return lambda *args, **kwargs: calls.append((name, args, kwargs)) or "out"

    monkeypatch.setattr(flex_module, "_inside_compile", lambda: compiling)
    monkeypatch.setattr(flex_module, "create_block_mask", recorder("plain mask"))
    monkeypatch.setattr(flex_module, "_compiled_block_mask", lambda: recorder("compiled mask"))
    monkeypatch.setattr(flex_module, "flex_attention", recorder("plain kernel"))
    monkeypatch.setattr(flex_module, "_compiled_flex", lambda: recorder("compiled kernel"))
    monkeypatch.setattr(flex_module, "_use_compiled", lambda device: True)  # as on CUDA
    mask_mod, cuda = (lambda b, h, q, k: q >= k), torch.device("cuda")
    flex_module.block_mask(mask_mod, 3, 4, 5, cuda)
    query, key, value = torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8)
    assert flex_module.run_flex(query, key, value, "the block mask", 0.5) == ("out", None)
    kind = "plain" if compiling else "compiled"
    assert [name for name, _, _ in calls] == [f"{kind} mask", f"{kind} kernel"]
    assert calls[0][1:] == ((mask_mod, 3, None, 4, 5), {"device": cuda})
    assert calls[1][1][0] is query and calls[1][1][1] is key and calls[1][1][2] is value
    assert calls[1][2] == {"block_mask": "the block mask", "scale": 0.5, "enable_gqa": True}
