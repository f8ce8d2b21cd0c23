"""FlagEmbedding models: BGE-M3 (dense, sparse and ColBERT scores) and FlagReranker-style rerankers.

Why a wrapper rather than FlagEmbedding's classes directly:

- **Devices are explicit.** Without ``devices=``, FlagEmbedding spreads work over every visible GPU
  with a multi-process pool; we always pass exactly one device.
- **No silently random heads.** ``BGEM3FlagModel`` builds the sparse and ColBERT heads as fresh
  ``torch.nn.Linear`` layers and only loads ``sparse_linear.pt`` / ``colbert_linear.pt`` when *both*
  files exist; otherwise it logs one info line and scores with random weights. We refuse such a
  folder (:class:`~ctx_integrations.errors.ModelLoadError`) before FlagEmbedding sees it.
- **Raw scores, our normalisation.** The reranker returns raw logits (FlagEmbedding's
  ``normalize=False``); :func:`ctx_integrations.retrieval.scores.normalize_reranker` applies the
  sigmoid, which equals FlagReranker's ``normalize=True``. BGE-M3's sparse score (lexical matching
  weight, >= 0) and ColBERT score (in [-1, 1]) are returned raw too, and normalised by the retriever.

A hub id is resolved to a local snapshot with ``huggingface_hub.snapshot_download`` first (honouring
``HF_HUB_OFFLINE`` and the Hugging Face cache), so the same head check applies to hub models and the
ONNX copy in the BGE-M3 repository is never downloaded.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ctx_integrations.errors import InvalidOptionError, ModelLoadError, missing_dependency
from ctx_integrations.retrieval.embedders import files_fingerprint, main_weights, remote_code_error

M3_HEADS = ("colbert_linear.pt", "sparse_linear.pt")
# What FlagEmbedding itself skips, plus the ONNX export and README images of the BGE-M3 repository.
_HUB_IGNORE = ["flax_model.msgpack", "rust_model.ot", "tf_model.h5", "onnx/*", "imgs/*"]
RERANKER_KINDS = ("auto", "encoder", "llm")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def flag_embedding() -> ModuleType:
    """Import FlagEmbedding, or raise the typed error that names the ``flag`` extra."""
    try:
        import FlagEmbedding
    except ImportError as error:
        raise missing_dependency(error.name or "FlagEmbedding", extra="flag") from error
    return FlagEmbedding


def resolve_model(model: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """A local folder for ``model``: the folder itself, or the hub snapshot (downloaded on first use).

    Something that looks like a path but does not exist is an error rather than a hub lookup, so a
    typo in a folder name is reported as such.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    text = str(model)
    if path.exists() or not _HUB_ID.match(text):
        raise ModelLoadError(f"model folder {text} does not exist: give an existing folder or a hub id like "
                             "'BAAI/bge-m3'")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=text, cache_dir=cache_dir, ignore_patterns=_HUB_IGNORE))
    except (OSError, ValueError) as error:  # offline / not found / HTTP errors are OSErrors; a bad id a ValueError
        raise ModelLoadError(
            f"{text!r} is no local folder and cannot be had from the Hugging Face hub ({type(error).__name__}: "
            f"{error}). Download it once where there is network (`hf download {text}`) and run with "
            "HF_HUB_OFFLINE=1, or give its local folder") from error


def check_m3_heads(folder: Path) -> None:
    """Refuse a BGE-M3 folder without both heads: FlagEmbedding would score with random ones."""
    missing = [name for name in M3_HEADS if not (folder / name).is_file()]
    if missing:
        raise ModelLoadError(
            f"{folder} has no {' or '.join(missing)}: FlagEmbedding would then give both the sparse and the "
            "ColBERT head random weights, and their scores would be noise. Use the complete BGE-M3 folder "
            "(BAAI/bge-m3 ships both files).")


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{folder} has no readable config.json ({error}): is it a transformers model folder?"
                             ) from error


def _position_limit(config: dict[str, Any]) -> int:
    """Longest input the encoder takes: RoBERTa-style models (BGE-M3) start positions after the pad id."""
    positions = int(config.get("max_position_embeddings", 512))
    if config.get("model_type") in ("xlm-roberta", "roberta"):
        positions -= int(config.get("pad_token_id", 1)) + 1
    return positions


def _check_sizes(batch_size: int, max_length: int) -> None:
    if batch_size < 1 or max_length < 2:
        raise InvalidOptionError("batch_size must be >= 1 and max_length >= 2")


class BGEM3Embedder:
    """BGE-M3 through FlagEmbedding's ``BGEM3FlagModel``: an :class:`Embedder` (dense) and a ``Scorer``.

    As an embedder it gives unit dense vectors (CLS pooling, L2 norm) for the vector store; as a
    scorer it rescores candidate texts with BGE-M3's two other heads, the paper's other two PCED
    variants: ``sparse`` (lexical matching weight, sum over shared tokens of query weight x document
    weight) and ``colbert`` (mean over query tokens of the best cosine with any document token).

    ``model``: hub id (e.g. ``BAAI/bge-m3``) or local folder holding ``colbert_linear.pt`` and
    ``sparse_linear.pt``. ``device``: the one torch device to run on. ``use_fp16`` applies on GPUs
    (FlagEmbedding runs fp32 on CPU). ``max_length``: tokens kept per text; by default all the model's
    positions allow (8192 for BGE-M3), more is refused (FlagEmbedding retries failing batches at
    ever smaller sizes instead of reporting the error).
    The folder is checked now; the weights load on first use.
    """

    kinds = ("sparse", "colbert")

    def __init__(self, model: str | os.PathLike, *, device: str = "cpu", use_fp16: bool = False,
                 batch_size: int = 16, max_length: int | None = None, cache_dir: str | os.PathLike | None = None):
        self._flag = flag_embedding()
        self.model_ref = str(model)
        self.folder = resolve_model(model, cache_dir)
        check_m3_heads(self.folder)
        self._config = _read_config(self.folder)
        limit = _position_limit(self._config)
        max_length = limit if max_length is None else max_length
        _check_sizes(batch_size, max_length)
        if max_length > limit:
            raise InvalidOptionError(f"max_length {max_length} is more than the {limit} positions of {self.folder}")
        self.name = Path(self.model_ref).name or self.folder.name
        self.device = str(device)
        self.use_fp16 = use_fp16
        self.batch_size = batch_size
        self.max_length = max_length
        self._model: Any = None
        self._lock = threading.Lock()

    @property
    def identity(self) -> str:
        """Name plus a fingerprint of the encoder weights, both heads and ``max_length``."""
        weights = main_weights(self.folder)
        if weights is None:
            raise ModelLoadError(f"{self.folder} holds no *.safetensors or *.bin weights")
        files = [weights, *(self.folder / name for name in M3_HEADS)]
        return f"bge-m3:{self.name}:{files_fingerprint(files, str(self.max_length))}"

    @property
    def dimension(self) -> int:
        return int(self._config["hidden_size"])

    @property
    def spec(self) -> str:
        """How :func:`~ctx_integrations.retrieval.specs.embedder_from_spec` rebuilds this embedder."""
        path = Path(self.model_ref).expanduser()
        return f"bge-m3:{path.resolve() if path.is_dir() else self.model_ref}"

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                try:
                    self._model = self._flag.BGEM3FlagModel(
                        str(self.folder), devices=self.device, use_fp16=self.use_fp16, normalize_embeddings=True,
                        batch_size=self.batch_size, query_max_length=self.max_length,
                        passage_max_length=self.max_length, trust_remote_code=False)
                except OSError as error:
                    raise ModelLoadError(f"cannot load BGE-M3 from {self.folder}: {error}") from error
                except ValueError as error:
                    raise remote_code_error(str(self.folder), error) from error
        return self._model

    def _encode(self, texts: Sequence[str], *, query: bool, dense: bool) -> dict[str, Any]:
        model = self._load()
        encode = model.encode_queries if query else model.encode_corpus
        return encode(list(texts), return_dense=dense, return_sparse=not dense, return_colbert_vecs=not dense)

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        """Unit dense vectors ``[N, D]`` (float32)."""
        if isinstance(texts, str):
            raise InvalidOptionError("embed_documents takes a list of texts; use embed_query for one text")
        if len(texts) == 0:  # FlagEmbedding cannot pad an empty batch
            return np.zeros((0, self.dimension), dtype=np.float32)
        return _unit(self._encode(texts, query=False, dense=True)["dense_vecs"])

    def embed_query(self, text: str) -> np.ndarray:
        """One unit dense vector ``[D]`` (BGE-M3 needs no query instruction)."""
        return _unit(self._encode([text], query=True, dense=True)["dense_vecs"])[0]

    def score(self, query: str, texts: Sequence[str]) -> dict[str, list[float]]:
        """Raw ``sparse`` and ``colbert`` scores of each text against ``query`` (texts re-encoded now)."""
        if len(texts) == 0:
            return {"sparse": [], "colbert": []}
        model = self._load()
        q = self._encode([query], query=True, dense=False)
        p = self._encode(texts, query=False, dense=False)
        q_weights, q_vectors = q["lexical_weights"][0], q["colbert_vecs"][0]
        return {
            "sparse": [float(model.compute_lexical_matching_score(q_weights, w)) for w in p["lexical_weights"]],
            "colbert": [float(model.colbert_score(q_vectors, v)) for v in p["colbert_vecs"]],
        }

    def __repr__(self) -> str:
        return f"BGEM3Embedder({self.model_ref!r}, device={self.device!r})"


def _unit(vectors: Any) -> np.ndarray:
    """float32 rows of norm 1 (FlagEmbedding normalises in the model's dtype, fp16 on GPUs)."""
    vectors = np.asarray(vectors, dtype=np.float32)
    return vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)


class FlagRerankerModel:
    """A FlagEmbedding reranker as a :class:`~ctx_integrations.retrieval.retriever.Reranker`: raw logits.

    ``kind``: ``encoder`` (``FlagReranker``: a cross-encoder, e.g. ``BAAI/bge-reranker-v2-m3``),
    ``llm`` (``FlagLLMReranker``: a decoder scoring the logit of "Yes" after a yes/no prompt, e.g.
    ``BAAI/bge-reranker-v2-gemma``) or ``auto`` (from the config's architecture). Both return the
    logit that FlagEmbedding's ``normalize=True`` would pass through a sigmoid; the retriever applies
    that sigmoid itself (``normalize_reranker``), so r_rer is exactly FlagEmbedding's normalised score.
    Layer-wise and lightweight LLM rerankers need remote model code and per-layer cut-offs, and are
    refused. The weights load on first use, on ``device`` only.
    """

    def __init__(self, model: str | os.PathLike, *, device: str = "cpu", use_fp16: bool = False,
                 batch_size: int = 32, max_length: int = 512, kind: str = "auto",
                 cache_dir: str | os.PathLike | None = None):
        _check_sizes(batch_size, max_length)
        if kind not in RERANKER_KINDS:
            raise InvalidOptionError(f"unknown reranker kind {kind!r}: use one of {', '.join(RERANKER_KINDS)}")
        self._flag = flag_embedding()
        self.model_ref = str(model)
        self.folder = resolve_model(model, cache_dir)
        self.kind = _reranker_kind(self.folder) if kind == "auto" else kind
        self.name = Path(self.model_ref).name or self.folder.name
        self.device = str(device)
        self.use_fp16 = use_fp16
        self.batch_size = batch_size
        self.max_length = max_length
        self._model: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                cls = self._flag.FlagReranker if self.kind == "encoder" else self._flag.FlagLLMReranker
                try:
                    self._model = cls(str(self.folder), devices=self.device, use_fp16=self.use_fp16,
                                      batch_size=self.batch_size, max_length=self.max_length, normalize=False,
                                      trust_remote_code=False)
                except OSError as error:
                    raise ModelLoadError(f"cannot load reranker {self.model_ref!r} from {self.folder}: {error}"
                                         ) from error
                except ValueError as error:
                    raise remote_code_error(str(self.folder), error) from error
        return self._model

    def rerank(self, query: str, texts: Sequence[str]) -> list[float]:
        """Raw relevance logits of ``(query, text)`` pairs, in the order of ``texts``."""
        if len(texts) == 0:
            return []
        scores = self._load().compute_score([(query, text) for text in texts], normalize=False)
        return [float(s) for s in np.atleast_1d(np.asarray(scores, dtype=np.float64))]

    def __repr__(self) -> str:
        return f"FlagRerankerModel({self.model_ref!r}, kind={self.kind!r}, device={self.device!r})"


def _reranker_kind(folder: Path) -> str:
    config = _read_config(folder)
    architectures = config.get("architectures") or []
    if config.get("auto_map"):
        raise ModelLoadError(
            f"{folder} needs its own model code (auto_map): layer-wise and lightweight LLM rerankers are not "
            "supported here. Use a cross-encoder (e.g. BAAI/bge-reranker-v2-m3) or a plain LLM reranker "
            "(e.g. BAAI/bge-reranker-v2-gemma)")
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "encoder"
    if any(a.endswith("ForCausalLM") for a in architectures):
        return "llm"
    raise ModelLoadError(f"cannot tell what kind of reranker {folder} is (architectures {architectures}): "
                         "pass kind='encoder' or kind='llm'")
