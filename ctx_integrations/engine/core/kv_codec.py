"""How a KV cache entry is stored at rest: in the compute dtype, in 16 bits, or quantised to 8 bits.

An entry is ``[layers, 2, kv_heads, tokens, head_dim]`` (keys, then values). Formats:

- ``"native"``: the model's dtype, bit for bit (logits equal a fresh prefill's);
- ``"fp16"`` / ``"bf16"``: rounded to 16 bits (half of an fp32 entry);
- ``"int8"``: KIVI's asymmetric 8-bit quantisation (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric
  2bit Quantization for KV Cache"; here at 8 bits): keys per channel (one scale and minimum per layer,
  head and head-dim channel, over the entry's tokens: keys have outlier channels) and values per token
  (one scale and minimum per layer, head and token, over head_dim), scales and minima in fp16. A quarter
  of an fp32 entry plus 4 bytes per token, layer and KV head for the values' scales.

Written by hand: transformers' quantised caches (``QuantizedCache`` over quanto / HQQ) quantise the
*running* cache of one ``generate`` call and keep a full-precision residual; an entry at rest needs a
plain tensor format that safetensors can store, checksum and sign, and that decodes on any device.
"""

from __future__ import annotations

import torch

from ctx_integrations.engine.core.config import KV_FORMATS  # defined there: the command line offers them, torch-free
from ctx_integrations.engine.core.validation import choice

_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
_SCALE_DTYPE = torch.float16
_LEVELS = 255


def check_format(kv_format: object) -> str:
    """One of :data:`KV_FORMATS`, refused by name otherwise."""
    return choice("kv_format", kv_format, KV_FORMATS)


def is_lossy(kv_format: str) -> bool:
    return kv_format != "native"


def _quantise(x: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
    """Asymmetric 8-bit codes of ``x`` with one fp16 scale and minimum per slice along ``dim``.

    The grid is built from the values decoding will use: the minimum rounded *down* to fp16 (rounded to
    nearest, a slice far from zero against its spread would have values below the grid) and the scale
    in fp16 (its rounding moves the top of the grid by at most 255 x half an fp16 ulp, an eighth of a
    step); each value is then within half a step of its decoded value.
    """
    x = x.to(torch.float32)
    low, high = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    nearest = low.to(_SCALE_DTYPE)
    below = torch.nextafter(nearest, torch.full_like(nearest, -torch.inf))
    stored_low = torch.where(nearest.float() > low, below, nearest)
    stored_scale = ((high - stored_low.float()) / _LEVELS).clamp(min=torch.finfo(_SCALE_DTYPE).tiny).to(_SCALE_DTYPE)
    codes = torch.round((x - stored_low.float()) / stored_scale.float()).clamp(0, _LEVELS).to(torch.uint8)
    return {"codes": codes, "scale": stored_scale, "min": stored_low}


def encode(kv: torch.Tensor, kv_format: str) -> dict[str, torch.Tensor]:
    """The tensors that store ``kv`` in ``kv_format`` (inputs are never modified)."""
    if kv_format == "native":
        return {"kv": kv.contiguous()}
    if kv_format in _HALF:
        return {"kv": kv.to(_HALF[kv_format]).contiguous()}
    keys = _quantise(kv[:, 0], dim=2)  # [L, H, T, D] -> one scale per (L, H, D): per channel, over tokens
    values = _quantise(kv[:, 1], dim=3)  # one scale per (L, H, T): per token, over head_dim
    return {"kv_codes": torch.stack([keys["codes"], values["codes"]], dim=1).contiguous(),
            "key_scale": keys["scale"].contiguous(), "key_min": keys["min"].contiguous(),
            "value_scale": values["scale"].contiguous(), "value_min": values["min"].contiguous()}


def storable_format(kv: torch.Tensor, kv_format: str) -> str:
    """``kv_format``, or ``"native"`` where it would not hold ``kv``: fp16 turns values beyond 65504 into inf.

    Such an entry, written in fp16, would fail the finite check on every load and be recomputed forever;
    bf16 and int8 (fp16 scales of a range, fp16 minima) hold any fp32 KV magnitude a model produces.
    """
    if kv_format == "fp16" and bool((kv.abs() > torch.finfo(torch.float16).max).any()):
        return "native"
    return kv_format


def readable_formats(kv_format: str) -> tuple[str, ...]:
    """The formats an entry written for ``kv_format`` may be stored in: ``kv_format``, and ``"native"`` for fp16
    (:func:`storable_format`'s fallback). A store serves no other: an entry in another format is a miss."""
    return (kv_format, "native") if kv_format == "fp16" else (kv_format,)


def stored_dtype(kv_format: str, native: torch.dtype) -> torch.dtype | None:
    """The dtype of a ``kv_format`` entry's ``kv`` tensor (``native``: the model's dtype); ``None`` for int8 (codes)."""
    if kv_format == "int8":
        return None
    return _HALF.get(kv_format, native)


def stored_names(kv_format: str) -> tuple[str, ...]:
    """The tensor names an entry of ``kv_format`` holds (besides its token ids)."""
    if kv_format == "int8":
        return "kv_codes", "key_scale", "key_min", "value_scale", "value_min"
    return ("kv",)


def check_stored(tensors: dict[str, torch.Tensor], kv_format: str, native: torch.dtype) -> str | None:
    """Why ``tensors`` are not a well-formed ``kv_format`` entry of a ``native``-dtype model (``None`` when they are):
    the dtype its format stores (an fp32 ``kv`` labelled fp16, a bf16 one labelled native, are refused), and the
    int8 tensors' shapes against each other."""
    wanted = stored_dtype(kv_format, native)
    if wanted is not None:
        dtype = tensors["kv"].dtype
        return None if dtype == wanted else f"kv of dtype {dtype}, but a {kv_format!r} entry stores {wanted}"
    codes = tensors["kv_codes"]
    if codes.dtype != torch.uint8 or codes.dim() != 5 or codes.shape[1] != 2:
        return (f"int8 codes of dtype {codes.dtype} and shape {tuple(codes.shape)}, "
                "not uint8 [layers, 2, heads, tokens, dim]")
    layers, _, heads, tokens, dim = codes.shape
    expected = {"key_scale": (layers, heads, 1, dim), "key_min": (layers, heads, 1, dim),
                "value_scale": (layers, heads, tokens, 1), "value_min": (layers, heads, tokens, 1)}
    for name, shape in expected.items():
        tensor = tensors[name]
        if tensor.dtype != _SCALE_DTYPE or tuple(tensor.shape) != shape:
            return f"{name} of dtype {tensor.dtype} and shape {tuple(tensor.shape)}, not {_SCALE_DTYPE} {shape}"
    scales = torch.cat([tensors["key_scale"].reshape(-1), tensors["value_scale"].reshape(-1)]).float()
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        return "quantisation scales that are not positive and finite"
    return None


def decode(tensors: dict[str, torch.Tensor], kv_format: str, dtype: torch.dtype,
           device: torch.device | str) -> torch.Tensor:
    """The ``[layers, 2, kv_heads, tokens, head_dim]`` entry in ``dtype`` on ``device``.

    Codes move to ``device`` before they are widened, so a GPU reads a quarter of the bytes.
    """
    if kv_format != "int8":
        return tensors["kv"].to(device=device, dtype=dtype)
    on = {name: tensors[name].to(device) for name in stored_names("int8")}
    codes = on["kv_codes"].to(torch.float32)
    keys = codes[:, 0] * on["key_scale"].float() + on["key_min"].float()
    values = codes[:, 1] * on["value_scale"].float() + on["value_min"].float()
    return torch.stack([keys, values], dim=1).to(dtype)


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_format: str, native: torch.dtype) -> float:
    """Bytes one token adds to an entry of ``kv_format`` (the keys' per-channel scales are per entry, not counted)."""
    values = layers * 2 * kv_heads * head_dim
    if kv_format == "native":
        return float(values * native.itemsize)
    if kv_format in _HALF:
        return float(values * 2)
    return float(values + layers * kv_heads * 2 * _SCALE_DTYPE.itemsize)
