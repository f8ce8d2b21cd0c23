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
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import AttentionInterface

from ctx_integrations.engine.core.config import check_setting
from ctx_integrations.errors import InvalidOptionError

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # torch < 2.5 has no FlexAttention: every mode stays on its eager path
    BlockMask = create_block_mask = flex_attention = None
try:
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest
except ImportError:  # torch < 2.9 returns the log-sum-exp with return_lse=True instead
    AuxOutput = AuxRequest = None


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``"auto"`` -> ``"flex"`` on CUDA, ``"eager"`` elsewhere; ``"eager"`` / ``"flex"`` as given.

    Eager stays the default off CUDA: on CPU FlexAttention runs unfused (no gain), and eager is the
    reference every fast path is tested against.
    """
    check_setting("attention_kernel", kernel)
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


def _use_compiled(device: torch.device) -> bool:
    """Whether FlexAttention runs compiled (CUDA) rather than its unfused reference (CPU; see the module doc)."""
    return device.type == "cuda"


def _inside_compile() -> bool:
    """Whether this call is being traced by an enclosing ``torch.compile`` (the pool's compiled decode step): the
    enclosing compile then builds the kernel and the block mask itself, and a kernel it cannot build fails that
    compile, whose own fallback (``compiled_step.GuardedStep``) takes over."""
    return torch.compiler.is_compiling()


# Kernel options tried, in order, when the autotuned kernel cannot be built: Inductor raised "NoValidChoicesError:
# No choices to select ... target: flex_attention" on an H200 (torch 2.11) for every prefill-shaped call (a query
# of 39 to 120 tokens: bf16 with head dim 128 over 32k-131k keys, bf16 and fp32 with head dim 16), never for a
# one-token decode; the first options below built each of them (the H200 run of 2026-11-27: its benchmark and
# its CUDA tests). Smaller tiles and one pipeline stage fit more shapes; if none builds, the call is computed
# without the compiled kernel (:func:`_fallback`).
FALLBACK_KERNEL_OPTIONS: tuple[dict[str, int], ...] = ({"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1},
                                                       {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1})


class KernelKind(NamedTuple):
    """What the compiled kernel is specialised on under ``dynamic=True``: dtype, head dim, query heads per KV head,
    a one-token query or a longer one (Dynamo specialises sizes 0 and 1), the outputs asked and whether a score_mod
    is fused. Lengths are symbolic: a kind whose default build failed once fails again at every other length (each
    try a failed compile of seconds), so later calls of that kind go straight to what worked."""

    dtype: str
    head_dim: int
    groups: int
    one_token: bool
    return_lse: bool
    score_mod: bool


_FAILED_KERNELS: dict[KernelKind, dict[str, int] | None] = {}  # kernel kind -> options that built, or None: fallback


def _kernel_kind(query: torch.Tensor, key: torch.Tensor, return_lse: bool, score_mod: object) -> KernelKind:
    return KernelKind(str(query.dtype), query.shape[-1], query.shape[1] // key.shape[1], query.shape[2] == 1,
                      return_lse, score_mod is not None)


def run_flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask, scale: float,
             return_lse: bool = False, score_mod: Callable[..., torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlexAttention with GQA (``query`` [B, H, q, d], ``key``/``value`` [B, Hkv, K, d]); (out, lse or None).

    Compiled on CUDA; on CPU the unfused reference (see the module doc). ``lse`` is fp32, natural log.
    ``score_mod(score, b, h, q, k)``: FlexAttention's hook on each (already scaled) score. A
    compiled kernel that cannot be built for a shape never fails the request: the shape is retried with
    :data:`FALLBACK_KERNEL_OPTIONS`, then computed in query chunks with SDPA under the block mask's dense
    mask (:func:`_fallback`, which applies ``score_mod`` too); either way one warning names the shape, and later
    calls of that kind of shape (:func:`_kernel_kind`) go straight to what worked.
    """
    options: dict[str, object] = dict(block_mask=block_mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    if score_mod is not None:
        options["score_mod"] = score_mod
    if return_lse:
        options.update({"return_aux": AuxRequest(lse=True)} if AuxRequest is not None else {"return_lse": True})
    if _inside_compile():
        result = flex_attention(query, key, value, **options)
    elif _use_compiled(query.device):
        kind = _kernel_kind(query, key, return_lse, score_mod)
        if kind not in _FAILED_KERNELS:
            try:
                result = _compiled_flex()(query, key, value, **options)
            except Exception as error:  # noqa: BLE001 - Inductor's errors have many types; the request must not fail
                result = _recover(kind, error, query, key, value, block_mask, scale, return_lse, options)
        else:
            result = _recover(kind, None, query, key, value, block_mask, scale, return_lse, options)
    else:
        with warnings.catch_warnings():  # "called without torch.compile()": on CPU that is the point
            warnings.simplefilter("ignore", UserWarning)
            result = flex_attention(query, key, value, **options)
    if not return_lse:
        return result, None
    out, lse = result
    return out, (lse.lse if AuxRequest is not None else lse)


def _recover(kind: KernelKind, error: Exception | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             block_mask: BlockMask, scale: float, return_lse: bool, options: dict[str, object]) -> object:
    """The result of a call whose kind's default compiled kernel failed: smaller tiles, or the chunked fallback."""
    if kind in _FAILED_KERNELS:
        kernel = _FAILED_KERNELS[kind]
        if kernel is not None:
            return _compiled_flex()(query, key, value, kernel_options=kernel, **options)
        return _fallback(query, key, value, block_mask, scale, return_lse, options.get("score_mod"))
    shape = f"query {tuple(query.shape)}, keys {tuple(key.shape)}, {query.dtype}"
    query_kind = "one token" if kind.one_token else "many tokens"
    later = f"later calls of this dtype, head dim and query kind ({query_kind})"
    for kernel in FALLBACK_KERNEL_OPTIONS:
        try:
            result = _compiled_flex()(query, key, value, kernel_options=kernel, **options)
        except Exception:  # noqa: BLE001 - try the next configuration
            continue
        _FAILED_KERNELS[kind] = kernel
        warnings.warn(f"FlexAttention's compiled kernel could not be built for {shape} ({type(error).__name__}); "
                      f"it runs with kernel_options={kernel} for this shape and {later}", RuntimeWarning,
                      stacklevel=3)
        return result
    _FAILED_KERNELS[kind] = None
    warnings.warn(f"FlexAttention's compiled kernel could not be built for {shape} ({type(error).__name__}: "
                  f"{str(error)[:200]}); this shape and {later} are computed with SDPA in query chunks under the "
                  "block mask instead (slower, same result)", RuntimeWarning, stacklevel=3)
    return _fallback(query, key, value, block_mask, scale, return_lse, options.get("score_mod"))


FALLBACK_QUERY_CHUNK = 1024  # queries per SDPA call of the fallback: its dense mask is [B, 1, chunk, K]


def _fallback(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask, scale: float,
              return_lse: bool, score_mod: Callable[..., torch.Tensor] | None = None) -> object:
    """Attention under ``block_mask`` without the compiled kernel, in query chunks (the mask evaluated per chunk).

    Without ``return_lse`` and ``score_mod``: SDPA over each chunk's dense boolean mask. With either (APE's merge
    needs the log-sum-exp, its prior a ``score_mod``): the same scores computed explicitly, ``score_mod`` applied
    to them with broadcast indices, ``logsumexp`` and ``softmax @ V``, in fp32. A query row that sees no key
    gets zeros and an lse of -inf, as FlexAttention gives. Written by hand: torch has no attention that takes a
    ``mask_mod`` other than FlexAttention itself, whose uncompiled reference materialises every score at once.
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    mask_mod = block_mask.mask_mod
    outs, lses = [], []
    for start in range(0, q_len, FALLBACK_QUERY_CHUNK):
        rows = min(FALLBACK_QUERY_CHUNK, q_len - start)
        b = torch.arange(batch, device=query.device).view(batch, 1, 1, 1)
        q = torch.arange(start, start + rows, device=query.device).view(1, 1, rows, 1)
        k = torch.arange(kv_len, device=query.device).view(1, 1, 1, kv_len)
        mask = mask_mod(b, torch.zeros_like(b), q, k).expand(batch, 1, rows, kv_len)
        chunk = query[:, :, start:start + rows]
        if not return_lse and score_mod is None:
            out = torch.nn.functional.scaled_dot_product_attention(chunk, key, value, attn_mask=mask, scale=scale)
            outs.append(torch.where(mask.any(-1, keepdim=True), out, torch.zeros_like(out)))
            continue
        scores = (chunk.float() @ key.float().transpose(-1, -2)) * scale
        if score_mod is not None:
            heads = torch.arange(query.shape[1], device=query.device).view(1, -1, 1, 1)
            scores = score_mod(scores, b, heads, q, k)
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        outs.append((weights @ value.float()).to(query.dtype))
        lses.append(lse)
    out = torch.cat(outs, dim=2)
    if not return_lse:
        return out
    lse = torch.cat(lses, dim=2)
    return (out, AuxOutput(lse=lse)) if AuxRequest is not None else (out, lse)


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
    compiled = torch.device(device).type == "cuda" and not _inside_compile()
    build = _compiled_block_mask() if compiled else create_block_mask
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
    # a sliding layer's window (the ``sliding_window`` transformers passes) is already in its block mask: the pool
    # builds one per layer type (windows.py)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out, _ = run_flex(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FLEX_ATTENTION, flex_attention_forward)
