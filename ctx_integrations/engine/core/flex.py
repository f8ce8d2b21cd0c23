"""FlexAttention plumbing: kernel choice, the kernel call, block masks, and a transformers attention function
over a block mask (the row pool's visibility rule as a block mask lives with the rule, in ``rows.py``).

``torch.nn.attention.flex_attention`` takes a ``mask_mod`` (compiled into a ``BlockMask`` that
skips fully hidden key blocks) and can return the log-sum-exp of every query row, which is all
APE's two-softmax merge needs. On CUDA it is compiled once (``torch.compile``) into a fused kernel
that never materialises the ``[q, K]`` score matrix. On CPU the compiled kernel cannot return the
log-sum-exp (torch 2.13: "torch.compile on CPU only supports inference and `return_lse` is not
supported yet"), so on CPU the *uncompiled* reference implementation runs: same ``mask_mod``,
same block mask, same code path around it, scores materialised. That is what the CPU tests check
the fast paths with; the fused CUDA kernel is checked by ``tests/test_cuda.py``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

from ctx_integrations.errors import InvalidOptionError

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # torch < 2.5 has no FlexAttention: every mode stays on its eager path
    BlockMask = create_block_mask = flex_attention = None
try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch < 2.9 returns the log-sum-exp with return_lse=True instead
    AuxRequest = None

ATTENTION_KERNELS = ("auto", "eager", "flex")


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``"auto"`` -> ``"flex"`` on CUDA, ``"eager"`` elsewhere; ``"eager"`` / ``"flex"`` as given.

    Eager stays the default off CUDA: on CPU FlexAttention runs unfused (no gain), and eager is the
    reference every fast path is tested against.
    """
    if kernel not in ATTENTION_KERNELS:
        raise InvalidOptionError(f"attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}")
    if kernel == "auto":
        return "flex" if torch.device(device).type == "cuda" and flex_attention is not None else "eager"
    if kernel == "flex" and flex_attention is None:
        raise InvalidOptionError(f"attention_kernel='flex' needs FlexAttention (torch >= 2.5; this is torch "
                                 f"{torch.__version__}); use attention_kernel='eager'")
    return kernel


@functools.cache
def _compiled_flex() -> Callable[..., object]:
    # dynamic=True: the key length grows by one every decode step; one graph serves them all.
    return torch.compile(flex_attention, dynamic=True)


def run_flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask, scale: float,
             return_lse: bool = False, score_mod: Callable[..., torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlexAttention with GQA (``query`` [B, H, q, d], ``key``/``value`` [B, Hkv, K, d]); (out, lse or None).

    Compiled on CUDA; on CPU the unfused reference (see the module doc). ``lse`` is fp32, natural log.
    ``score_mod(score, b, h, q, k)``: FlexAttention's hook on each (already scaled) score.
    """
    options: dict[str, object] = dict(block_mask=block_mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    if score_mod is not None:
        options["score_mod"] = score_mod
    if return_lse:
        options.update({"return_aux": AuxRequest(lse=True)} if AuxRequest is not None else {"return_lse": True})
    if query.device.type == "cuda":
        result = _compiled_flex()(query, key, value, **options)
    else:
        with warnings.catch_warnings():  # "called without torch.compile()": on CPU that is the point
            warnings.simplefilter("ignore", UserWarning)
            result = flex_attention(query, key, value, **options)
    if not return_lse:
        return result, None
    out, lse = result
    return out, (lse.lse if AuxRequest is not None else lse)


@functools.cache
def _compiled_block_mask() -> Callable[..., BlockMask]:
    return torch.compile(create_block_mask, dynamic=True)


def block_mask(mask_mod: Callable[..., torch.Tensor], batch: int | None, q_len: int, kv_len: int,
               device: torch.device) -> BlockMask:
    """``create_block_mask`` with every head sharing the mask (``H=None``).

    Uncompiled, ``create_block_mask`` evaluates ``mask_mod`` into a dense ``[B, 1, Q, K]`` tensor before
    reducing it to blocks; compiled (on CUDA) it fuses that away, so a 128k x 128k prefill mask is
    never materialised. On CPU the uncompiled reference runs (see the module doc).
    """
    build = _compiled_block_mask() if torch.device(device).type == "cuda" else create_block_mask
    return build(mask_mod, batch, None, q_len, kv_len, device=device)


FLEX_ATTENTION = "ctx_flex"


def flex_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: BlockMask | None, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs: object) -> tuple[torch.Tensor, None]:
    """A transformers attention function that runs :func:`run_flex` with the ``BlockMask`` given as the mask.

    transformers' own ``"flex_attention"`` compiles the kernel on CPU too (slow to start on a small
    machine, and a different code path from CUDA's); this one follows :func:`run_flex`'s rule.
    """
    if not isinstance(attention_mask, BlockMask):
        raise InvalidOptionError("the flex attention needs a BlockMask as attention_mask (built by the mode)")
    if kwargs.get("softcap") is not None:
        raise InvalidOptionError("attention_kernel='flex' does not support attention logit soft-capping (e.g. "
                                 "Gemma 2); use attention_kernel='eager' with this model")
    window = kwargs.get("sliding_window")  # Mistral passes its window on every call; it only matters beyond it
    if window is not None and key.shape[2] > window:
        raise InvalidOptionError(f"attention_kernel='flex' does not apply sliding-window attention, and "
                                 f"{key.shape[2]} keys exceed this model's window of {window}")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out, _ = run_flex(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FLEX_ATTENTION, flex_attention_forward)


@contextmanager
def attention_swapped(model: torch.nn.Module, implementation: str) -> Iterator[None]:
    """Run ``model`` with attention ``implementation`` inside the block, and restore its own after."""
    can_swap = getattr(model, "_can_set_attn_implementation", None)
    if can_swap is None or not can_swap():
        raise InvalidOptionError(f"{type(model).__name__} does not route its attention through transformers' "
                                 "AttentionInterface; use attention_kernel='eager' with this model")
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
