"""The batch-invariant CPU kernels (``Engine(batch_invariant=True)``): a row's output does not depend on how many
rows are beside it or where it sits.

Bugs caught: a GEMM whose height follows the batch (MKL and oneDNN round a row of a short matrix unlike a taller
one's, by CPU, dtype and thread count: measured here), a last block not padded to the block's height, the
padding's outputs not dropped or the shape not restored, the attention left on the flash kernel (its fp32 rows
depend on the batch's split over threads), a non-bool option accepted, two engines on one model disagreeing on
the option.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ctx_integrations import Engine
from ctx_integrations.engine.core import batch_invariant
from ctx_integrations.engine.core.batch_invariant import ROW_BLOCK, batch_invariant_kernels, linear_rows_invariant
from ctx_integrations.engine.core.model import load_model
from ctx_integrations.errors import InvalidOptionError


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (4096, 64)])
def test_a_row_gets_the_same_bits_at_every_height_and_place(dtype, shape, threads, monkeypatch):
    # Every height from 1 to 40 rows, at three places, against the same rows among 80, and the rows beside other
    # rows: plain F.linear fails this on the CPUs measured (heights 1-15 in fp32 on AMX, 1-3 on AVX-512).
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(1)
        weight = torch.randn(*shape, generator=generator).to(dtype)
        bias = torch.randn(shape[0], generator=generator).to(dtype)
        x = torch.randn(80, shape[1], generator=generator).to(dtype)
        every = linear_rows_invariant(x, weight, bias)
        for height in range(1, 41):
            for start in (0, 3, 7):
                rows = linear_rows_invariant(x[start:start + height], weight, bias)
                assert rows.shape == (height, shape[0])
                assert torch.equal(rows, every[start:start + height]), (height, start)
        others = torch.randn(5, shape[1], generator=generator).to(dtype)
        beside = linear_rows_invariant(torch.cat([others, x[:3]]), weight, bias)[5:]
        assert torch.equal(beside, every[:3])
    finally:
        torch.set_num_threads(previous)


class LinearHeights(TorchFunctionMode):
    """Records the height of every ``F.linear`` called while active."""

    def __init__(self):
        super().__init__()
        self.heights: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.heights.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


def test_every_gemm_has_the_blocks_height_and_the_shape_comes_back():
    weight = torch.randn(1536, 576)
    for rows in (1, 2, ROW_BLOCK - 1, ROW_BLOCK, ROW_BLOCK + 1, 40):
        with LinearHeights() as seen:
            out = linear_rows_invariant(torch.randn(rows, 576), weight)
        assert seen.heights == [ROW_BLOCK] * math.ceil(rows / ROW_BLOCK), rows
        assert out.shape == (rows, 1536)
    x = torch.randn(1, 1, 576)  # a decode step: [rows, tokens, hidden]
    out = linear_rows_invariant(x, weight)
    assert out.shape == (1, 1, 1536)
    assert torch.equal(out[0], F.linear(torch.cat([x[0], torch.zeros(ROW_BLOCK - 1, 576)]), weight)[:1])


def test_off_the_cpu_and_for_empty_inputs_it_is_plain_linear():
    weight, bias = torch.randn(8, 4, device="meta"), torch.randn(8, device="meta")
    with LinearHeights() as seen:
        out = linear_rows_invariant(torch.randn(1, 4, device="meta"), weight, bias)
    assert out.shape == (1, 8) and out.device.type == "meta" and seen.heights == [1]
    empty = torch.zeros(3, 0)
    out = linear_rows_invariant(empty, torch.zeros(5, 0), torch.ones(5))  # zero-width rows: the bias alone
    assert torch.equal(out, torch.ones(3, 5))
    assert linear_rows_invariant(torch.zeros(0, 4), torch.randn(5, 4)).shape == (0, 5)


@pytest.mark.parametrize("kv_heads", [9, 3])  # 9: the flash kernel's case (seen to vary); 3: GQA
def test_under_the_mode_linear_layers_and_attention_round_a_row_alike_in_any_batch(kv_heads):
    torch.manual_seed(0)
    layer = torch.nn.Linear(576, 1536)
    q, k, v = torch.randn(4, 9, 1, 64), torch.randn(4, kv_heads, 512, 64), torch.randn(4, kv_heads, 512, 64)
    mask = torch.zeros(4, 1, 1, 512, dtype=torch.bool)
    for b, keys in enumerate((60, 300, 228, 120)):
        mask[b, ..., :keys] = True
    gqa = kv_heads != 9
    with torch.no_grad(), batch_invariant_kernels():
        four = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        two = F.scaled_dot_product_attention(q[:2], k[:2], v[:2], attn_mask=mask[:2], enable_gqa=gqa)
        one = F.scaled_dot_product_attention(q[1:2], k[1:2], v[1:2], attn_mask=mask[1:2], enable_gqa=gqa)
        rows = layer(four.reshape(4, 576)[:, :576])
        row = layer(four.reshape(4, 576)[1:2])
        with_bias = F.linear(four.reshape(4, 576)[:1], layer.weight, bias=layer.bias)  # keywords pass through
        summed = torch.sum(four, dim=0)
    assert torch.equal(two, four[:2]) and torch.equal(one[0], four[1])
    assert torch.equal(row[0], rows[1]) and torch.equal(with_bias, rows[:1]) and summed.shape == four.shape[1:]
    # the math kernel, bit for bit (what makes it invariant: one matmul per batch entry), under the same mask
    additive = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    math = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, additive, enable_gqa=gqa)[0]
    assert torch.equal(four, math)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    assert torch.allclose(four, reference, atol=1e-5)  # the same attention as the default kernel computes


def test_a_given_scale_and_a_causal_mask_reach_the_math_kernel():
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 6, 32), torch.randn(2, 4, 6, 32), torch.randn(2, 4, 6, 32)
    for options in (dict(scale=0.3), dict(is_causal=True), dict(scale=0.05, is_causal=True)):
        with torch.no_grad(), batch_invariant_kernels():
            out = F.scaled_dot_product_attention(q, k, v, **options)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, **options), atol=1e-5, rtol=1e-5)
    with torch.no_grad(), batch_invariant_kernels():  # the mask, dropout and causality given by position
        out = F.scaled_dot_product_attention(q, k, v, None, 0.0, True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)


def test_the_math_kernel_takes_a_bf16_query_with_a_boolean_mask():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 3, 32).to(torch.bfloat16) for _ in range(3))
    mask = torch.rand(2, 1, 3, 3) > 0.4
    mask[..., 0] = True
    with torch.no_grad(), batch_invariant_kernels():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float(),
                               atol=2e-2, rtol=2e-2)


def test_a_forward_makes_its_mask_additive_once_and_a_new_mask_is_made_again(monkeypatch):
    from tests.helpers import tiny_loaded

    made = []
    real = batch_invariant.additive_mask
    monkeypatch.setattr(batch_invariant, "additive_mask", lambda mask, dtype: made.append(mask) or real(mask, dtype))
    loaded = tiny_loaded("llama")
    assert loaded.model.config.num_hidden_layers >= 2
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool)).expand(2, 1, 4, 4).clone()
    mask[1, ..., 0] = False  # row 1 does not see its first token
    mask[1, ..., 0, 0] = True
    with torch.no_grad(), batch_invariant_kernels():
        out = loaded.model(ids, attention_mask=mask).logits
    assert len(made) == 1  # one conversion for every layer
    with torch.no_grad():
        reference = loaded.model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    first, second = torch.ones(1, 1, 3, 3, dtype=torch.bool), torch.eye(3, dtype=torch.bool).expand(1, 1, 3, 3)
    with torch.no_grad(), batch_invariant_kernels():
        F.scaled_dot_product_attention(q, k, v, attn_mask=first)
        diagonal = F.scaled_dot_product_attention(q, k, v, attn_mask=second)
    torch.testing.assert_close(diagonal, v)  # each query sees only its own key: not the first mask reused


def test_the_option_is_a_bool_and_one_model_has_one_value():
    with pytest.raises(InvalidOptionError, match="batch_invariant must be True or False"):
        Engine(load_model(), batch_invariant=1)
    loaded = load_model()
    Engine(loaded, batch_invariant=True)
    with pytest.raises(InvalidOptionError, match="batch_invariant=True"):
        Engine(loaded)
