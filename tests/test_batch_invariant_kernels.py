"""The batch-invariant CPU kernels (``Engine(batch_invariant=True)``): a row's output does not depend on how many
rows are beside it or where it sits.

Bugs caught: short GEMMs not padded (MKL rounds an fp32 row of a 1-3-row matrix unlike a tall one's: measured
here), padded to a height that still rounds differently, the padding's outputs not dropped or the shape not
restored, the attention left on the flash kernel (its fp32 rows depend on the batch's split over threads), a
non-bool option accepted, two engines on one model disagreeing on the option.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ctx_integrations import Engine
from ctx_integrations.engine.core import batch_invariant
from ctx_integrations.engine.core.batch_invariant import (
    PROBED_ROWS,
    batch_invariant_kernels,
    linear_rows_invariant,
    padded_heights,
)
from ctx_integrations.engine.core.model import load_model
from ctx_integrations.errors import InvalidOptionError


@pytest.fixture(autouse=True)
def fresh_probe(monkeypatch):
    """Each test measures the heights itself (a probe cached by an earlier test would hide a broken probe)."""
    monkeypatch.setattr(batch_invariant, "_heights", {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (4096, 64)])
def test_every_height_gives_a_row_the_bits_of_a_tall_matrix(dtype, shape):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(*shape, generator=generator).to(dtype)
    bias = torch.randn(shape[0], generator=generator).to(dtype)
    x = torch.randn(80, shape[1], generator=generator).to(dtype)
    tall = F.linear(x, weight, bias)
    for height in range(1, 41):
        for start in (0, 3):
            rows = linear_rows_invariant(x[start:start + height], weight, bias)
            assert rows.shape == (height, shape[0])
            assert torch.equal(rows, tall[start:start + height]), (height, start)


def test_heights_are_padded_up_never_down_and_the_shape_comes_back():
    weight = torch.randn(1536, 576)
    heights = padded_heights(weight)
    assert len(heights) == PROBED_ROWS + 1
    assert all(m <= heights[m] <= PROBED_ROWS for m in range(1, PROBED_ROWS + 1))
    assert all(heights[heights[m]] == heights[m] for m in range(1, PROBED_ROWS + 1))  # a padded height is final
    x = torch.randn(1, 1, 576)  # a decode step: [rows, tokens, hidden]
    out = linear_rows_invariant(x, weight)
    assert out.shape == (1, 1, 1536)
    assert torch.equal(out[0], F.linear(torch.cat([x[0], torch.randn(15, 576)]), weight)[:1])


class LinearHeights(TorchFunctionMode):
    """Records the height of every ``F.linear`` called while active (the probe's own calls are not seen)."""

    def __init__(self):
        super().__init__()
        self.heights: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.heights.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


def test_a_short_matrix_is_padded_to_exactly_the_measured_height_and_others_not_at_all():
    weight = torch.randn(1536, 576)
    heights = padded_heights(weight)
    for rows in (1, 2, 3, PROBED_ROWS, PROBED_ROWS + 1, 40):
        with LinearHeights() as seen:
            linear_rows_invariant(torch.randn(rows, 576), weight)
        assert seen.heights == [heights[rows] if rows <= PROBED_ROWS else rows], rows


def test_off_the_cpu_and_for_empty_inputs_it_is_plain_linear():
    weight, bias = torch.randn(8, 4, device="meta"), torch.randn(8, device="meta")
    out = linear_rows_invariant(torch.randn(1, 4, device="meta"), weight, bias)  # no probe: it would fail on meta
    assert out.shape == (1, 8) and out.device.type == "meta" and batch_invariant._heights == {}
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
