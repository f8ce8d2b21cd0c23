"""Merge a saved LoRA adapter (from ``ctx-experts distill``) into a model's weights at load time.

Loading lives here, in the core, and training in ``engine/distill.py``: the model loader needs the
first and never the second, so neither imports the other.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import torch

from ctx_integrations.errors import ModelLoadError, missing_dependency


def require_peft() -> None:
    if importlib.util.find_spec("peft") is None:
        raise missing_dependency("peft", extra="distill")


def merge_adapter(model: torch.nn.Module, adapter: str | Path) -> tuple[torch.nn.Module, str]:
    """Apply a saved LoRA adapter to ``model`` and merge it into the weights (no per-step LoRA cost).

    Returns the merged model and a digest of the adapter files, which ``load_model`` puts in the
    model identity so KV caches computed with and without the adapter never mix.
    """
    require_peft()
    from peft import PeftModel

    folder = Path(adapter).expanduser()
    files = sorted(folder.glob("adapter_*")) if folder.is_dir() else []
    if not any(f.name == "adapter_config.json" for f in files):
        raise ModelLoadError(f"{folder} is not a LoRA adapter folder (no adapter_config.json); "
                             "create one with `ctx-experts distill`")
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\x1f" + file.read_bytes())
    try:  # PEFT has no trust_remote_code: an adapter folder is a config and weights, it never runs its own code
        merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    except (ValueError, KeyError, RuntimeError) as error:
        raise ModelLoadError(f"the adapter in {folder} does not fit this model: {error}") from error
    return merged.eval(), digest.hexdigest()
