"""BGE-M3 and FlagReranker through the real FlagEmbedding classes, on tiny random weights built here (offline).

The BGE-M3-shaped folder is a 2-layer XLM-RoBERTa (BGE-M3's architecture) saved as
``pytorch_model.bin`` (the format BAAI/bge-m3 ships), the embedded MiniLM tokenizer (its ``[SEP]``
declared as the end token, as ``</s>`` is in BGE-M3's tokenizer) and random ``colbert_linear.pt`` /
``sparse_linear.pt`` heads. Expected scores are computed by hand from the same weights with the
closed forms of FlagEmbedding's M3 model (``_sparse_embedding``, ``_colbert_embedding``,
``compute_lexical_matching_score``, ``colbert_score``).
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    XLMRobertaConfig,
    XLMRobertaModel,
)

from ctx_integrations.errors import InvalidOptionError, MissingDependencyError, ModelLoadError
from ctx_integrations.retrieval import BGEM3Embedder, FlagRerankerModel
from ctx_integrations.retrieval.embedders import Embedder, minilm_dir
from ctx_integrations.retrieval.retriever import Reranker, ScoredRetriever, Scorer
from ctx_integrations.retrieval.scores import fuse_scores, normalize, normalize_reranker
from ctx_integrations.retrieval.specs import embedder_from_spec
from ctx_integrations.retrieval.store import DocumentStore, StoreMismatchError
from tests.helpers import tiny_loaded

HIDDEN = 32
QUERY = "where is the old tower"
TEXTS = {
    "tower": "The old tower is in Paris, near the river.",
    "fuji": "Mount Fuji is the highest mountain in Japan.",
    "vault": "The secret code of the vault is 4721.",
    "market": "Where the river bends, the old market sells fish.",
    "zebra": "Zebras graze quietly.",
}
FLAG_PROMPT = ("Given a query A and a passage B, determine whether the passage contains an answer to the query by "
               "providing a prediction of either 'Yes' or 'No'.")


@pytest.fixture(scope="module")
def m3_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-bge-m3")
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()), eos_token="[SEP]")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    # initializer_range 0.1: with the usual 0.02 a random encoder gives nearly the same CLS vector for every text
    config = XLMRobertaConfig(vocab_size=tokenizer.vocab_size, hidden_size=HIDDEN, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=64, max_position_embeddings=8194,
                              pad_token_id=tokenizer.pad_token_id, initializer_range=0.1,
                              architectures=["XLMRobertaModel"])
    config.save_pretrained(folder)
    torch.save(XLMRobertaModel(config).state_dict(), folder / "pytorch_model.bin")
    colbert, sparse = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, 1)
    with torch.no_grad():
        sparse.bias.fill_(1.2)  # most token weights positive, some cut by the relu
    torch.save(colbert.state_dict(), folder / "colbert_linear.pt")
    torch.save(sparse.state_dict(), folder / "sparse_linear.pt")
    return folder


@pytest.fixture(scope="module")
def m3(m3_folder) -> BGEM3Embedder:
    return BGEM3Embedder(m3_folder)


@pytest.fixture(scope="module")
def reranker_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-reranker")
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    tokenizer.save_pretrained(folder)
    torch.manual_seed(1)
    # a wide initialisation so that the logits of different pairs differ visibly
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=1, initializer_range=0.5)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llm_reranker_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llm-reranker")
    loaded = tiny_loaded("llama", seed=3)
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


# -- hand computations ---------------------------------------------------------------------------------
class HandM3:
    """BGE-M3's three representations from the folder's weights, without FlagEmbedding."""

    def __init__(self, folder: Path):
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModel.from_pretrained(str(folder)).eval()
        self.colbert, self.sparse = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, 1)
        self.colbert.load_state_dict(torch.load(folder / "colbert_linear.pt"))
        self.sparse.load_state_dict(torch.load(folder / "sparse_linear.pt"))
        t = self.tokenizer
        self.unused = {t.cls_token_id, t.eos_token_id, t.pad_token_id, t.unk_token_id}

    @torch.no_grad()
    def encode(self, text: str) -> tuple[np.ndarray, dict[int, float], np.ndarray]:
        ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        hidden = self.model(input_ids=ids).last_hidden_state[0]
        dense = torch.nn.functional.normalize(hidden[0], dim=-1).numpy()  # CLS pooling
        weights: dict[int, float] = {}
        for token, weight in zip(ids[0].tolist(), torch.relu(self.sparse(hidden)).squeeze(-1).tolist()):
            if token not in self.unused and weight > 0:
                weights[token] = max(weights.get(token, 0.0), weight)  # max-pooled per token id
        colbert = torch.nn.functional.normalize(self.colbert(hidden[1:]), dim=-1).numpy()  # every token but CLS
        return dense, weights, colbert

    def scores(self, query: str, text: str) -> dict[str, float]:
        q_dense, q_weights, q_colbert = self.encode(query)
        d_dense, d_weights, d_colbert = self.encode(text)
        return {"dense": float(q_dense @ d_dense),
                "sparse": sum(w * d_weights[t] for t, w in q_weights.items() if t in d_weights),
                "colbert": float((q_colbert @ d_colbert.T).max(axis=1).mean())}


@pytest.fixture(scope="module")
def hand(m3_folder) -> HandM3:
    return HandM3(m3_folder)


# -- BGE-M3 ------------------------------------------------------------------------------------------------
def test_bge_m3_satisfies_both_protocols_and_rebuilds_from_its_spec(m3, m3_folder):
    assert isinstance(m3, Embedder) and isinstance(m3, Scorer) and m3.kinds == ("sparse", "colbert")
    assert m3.dimension == HIDDEN and m3.folder == m3_folder.resolve()
    assert m3.spec == f"bge-m3:{m3_folder.resolve()}"
    rebuilt = embedder_from_spec(m3.spec)
    assert isinstance(rebuilt, BGEM3Embedder) and rebuilt.identity == m3.identity
    assert BGEM3Embedder(m3_folder, max_length=64).identity != m3.identity  # truncation changes vectors


def test_dense_vectors_are_unit_float32_cls_embeddings(m3, hand):
    texts = list(TEXTS.values())
    vectors = m3.embed_documents(texts)
    assert vectors.shape == (len(texts), HIDDEN) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    for text, vector in zip(texts, vectors):  # FlagEmbedding sorts by length: the order must be restored
        np.testing.assert_allclose(vector, hand.encode(text)[0], atol=1e-5)
    query = m3.embed_query(QUERY)
    assert query.shape == (HIDDEN,) and query.dtype == np.float32
    np.testing.assert_allclose(query, hand.encode(QUERY)[0], atol=1e-5)
    assert m3.embed_documents([]).shape == (0, HIDDEN)
    with pytest.raises(InvalidOptionError, match="list of texts"):
        m3.embed_documents("one text")


def test_sparse_and_colbert_scores_equal_the_closed_forms(m3, hand):
    texts = list(TEXTS.values())
    scores = m3.score(QUERY, texts)
    assert set(scores) == {"sparse", "colbert"} and all(len(v) == len(texts) for v in scores.values())
    for k, text in enumerate(texts):
        expected = hand.scores(QUERY, text)
        assert scores["sparse"][k] == pytest.approx(expected["sparse"], rel=1e-4, abs=1e-6)
        assert scores["colbert"][k] == pytest.approx(expected["colbert"], rel=1e-4, abs=1e-6)
        assert -1.0 <= scores["colbert"][k] <= 1.0
    assert scores["sparse"][0] > 0.0  # "old tower" shared with the query
    assert scores["sparse"][list(TEXTS).index("zebra")] == 0.0  # no token shared with the query
    assert m3.score(QUERY, []) == {"sparse": [], "colbert": []}


@pytest.mark.parametrize("head", ["colbert_linear.pt", "sparse_linear.pt"])
def test_a_folder_missing_a_head_is_refused(m3_folder, tmp_path, head):
    incomplete = tmp_path / "incomplete"
    shutil.copytree(m3_folder, incomplete)
    (incomplete / head).unlink()
    with pytest.raises(ModelLoadError, match=f"no {head}.*random weights"):
        BGEM3Embedder(incomplete)


def test_a_missing_folder_is_refused_without_asking_the_hub(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        BGEM3Embedder(tmp_path / "absent")
    with pytest.raises(ModelLoadError, match="config.json"):
        FlagRerankerModel(tmp_path)  # an existing folder that is not a model


def test_a_hub_id_resolves_from_the_hugging_face_cache_offline(m3_folder, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "models--tiny-org--bge-m3"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(m3_folder, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    embedder = BGEM3Embedder("tiny-org/bge-m3", cache_dir=tmp_path)
    assert embedder.folder == snapshot and embedder.spec == "bge-m3:tiny-org/bge-m3" and embedder.name == "bge-m3"
    (snapshot / "sparse_linear.pt").unlink()
    with pytest.raises(ModelLoadError, match="sparse_linear.pt"):  # the head check covers hub snapshots too
        BGEM3Embedder("tiny-org/bge-m3", cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        BGEM3Embedder("tiny-org/absent", cache_dir=tmp_path)


def test_missing_flag_embedding_names_the_extra(m3_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "FlagEmbedding", None)  # what an uninstalled package looks like to import
    with pytest.raises(MissingDependencyError, match=r"ctx-integrations\[flag\]"):
        BGEM3Embedder(m3_folder)
    with pytest.raises(MissingDependencyError, match=r"ctx-integrations\[flag\]"):
        FlagRerankerModel(m3_folder)


def test_max_length_defaults_to_the_model_positions_and_bad_sizes_are_refused(m3, m3_folder):
    assert m3.max_length == 8194 - 0 - 1  # XLM-R positions start after the pad id (0 here, 1 in BGE-M3)
    with pytest.raises(InvalidOptionError, match="8193 positions"):
        BGEM3Embedder(m3_folder, max_length=8194)
    with pytest.raises(InvalidOptionError, match="batch_size"):
        BGEM3Embedder(m3_folder, batch_size=0)
    with pytest.raises(InvalidOptionError, match="kind"):
        FlagRerankerModel(m3_folder, kind="colbert")


# -- rerankers ---------------------------------------------------------------------------------------------
def test_encoder_reranker_returns_the_cross_encoder_logits(reranker_folder):
    reranker = FlagRerankerModel(reranker_folder)
    assert isinstance(reranker, Reranker) and reranker.kind == "encoder"
    texts = list(TEXTS.values())
    logits = reranker.rerank(QUERY, texts)
    tokenizer = AutoTokenizer.from_pretrained(str(reranker_folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(reranker_folder)).eval()
    with torch.no_grad():
        expected = [model(**tokenizer(QUERY, text, return_tensors="pt")).logits.item() for text in texts]
    assert logits == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert max(expected) - min(expected) > 0.1  # the pairs are told apart, so order errors would show
    assert reranker.rerank(QUERY, []) == []


def test_our_sigmoid_equals_flag_reranker_normalize_true(reranker_folder):
    from FlagEmbedding import FlagReranker

    texts = list(TEXTS.values())
    logits = FlagRerankerModel(reranker_folder).rerank(QUERY, texts)
    flag = FlagReranker(str(reranker_folder), devices="cpu", use_fp16=False)
    normalised = flag.compute_score([(QUERY, t) for t in texts], normalize=True)
    assert [normalize_reranker(z) for z in logits] == pytest.approx(normalised, abs=1e-7)
    assert [1 / (1 + math.exp(-z)) for z in logits] == pytest.approx(normalised, abs=1e-7)


def test_llm_reranker_returns_the_yes_logit(llm_reranker_folder):
    reranker = FlagRerankerModel(llm_reranker_folder)
    assert reranker.kind == "llm"
    texts = list(TEXTS.values())[:3]
    logits = reranker.rerank(QUERY, texts)
    tokenizer = AutoTokenizer.from_pretrained(str(llm_reranker_folder))
    model = AutoModelForCausalLM.from_pretrained(str(llm_reranker_folder)).eval()

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    yes = ids("Yes")[0]
    expected = []
    with torch.no_grad():
        for text in texts:
            prompt = [tokenizer.bos_token_id] + ids(f"A: {QUERY}") + ids("\n") + ids(f"B: {text}") + ids("\n") + ids(
                FLAG_PROMPT)
            expected.append(model(torch.tensor([prompt])).logits[0, -1, yes].item())
    assert logits == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_reranker_kind_comes_from_the_config(reranker_folder, tmp_path):
    folder = tmp_path / "remote-code"
    shutil.copytree(reranker_folder, folder)
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text(config.replace('"architectures"', '"auto_map": {"AutoModel": "x.Y"}, '
                                                                          '"architectures"', 1))
    with pytest.raises(ModelLoadError, match="layer-wise"):
        FlagRerankerModel(folder)
    assert FlagRerankerModel(folder, kind="encoder").kind == "encoder"  # an explicit kind is trusted
    (folder / "config.json").write_text(config.replace("BertForSequenceClassification", "BertModel"))
    with pytest.raises(ModelLoadError, match="kind='encoder'"):
        FlagRerankerModel(folder)


# -- ScoredRetriever over a BGE-M3 store ------------------------------------------------------------------
@pytest.fixture(scope="module")
def m3_store(m3, tmp_path_factory) -> DocumentStore:
    store = DocumentStore(tmp_path_factory.mktemp("m3-store"), embedder=m3)
    store.add([{"id": key, "text": text} for key, text in TEXTS.items()])
    return store


@pytest.fixture(scope="module")
def hand_scores(hand) -> dict[str, dict[str, float]]:
    return {key: hand.scores(QUERY, text) for key, text in TEXTS.items()}


@pytest.mark.parametrize("score", ["dense", "sparse", "colbert"])
def test_retriever_ranks_by_the_chosen_bge_m3_score(m3_store, hand_scores, score):
    docs = ScoredRetriever(m3_store, score=score).retrieve(QUERY, top_k=3)
    ranked = sorted(TEXTS, key=lambda k: (-normalize(score, hand_scores[k][score]), k))
    assert [d.id for d in docs] == ranked[:3]
    for doc in docs:
        assert set(doc.scores) == {"dense", "dense_norm", "sparse", "sparse_norm", "colbert", "colbert_norm",
                                   "retrieval", "fused"}
        for kind in ("dense", "sparse", "colbert"):
            assert doc.scores[kind] == pytest.approx(hand_scores[doc.id][kind], rel=1e-4, abs=1e-5)
            assert doc.scores[f"{kind}_norm"] == normalize(kind, doc.scores[kind])
        assert doc.score == doc.scores["fused"] == doc.scores["retrieval"] == doc.scores[f"{score}_norm"]
        assert doc.text == TEXTS[doc.id]


def test_reranked_retrieval_fuses_by_harmonic_mean(m3_store, hand_scores, reranker_folder):
    reranker = FlagRerankerModel(reranker_folder)
    docs = ScoredRetriever(m3_store, score="colbert", reranker=reranker).retrieve(QUERY, top_k=2, rerank_top_n=4)
    pool = sorted(TEXTS, key=lambda k: (-normalize("colbert", hand_scores[k]["colbert"]), k))[:4]
    logits = dict(zip(pool, reranker.rerank(QUERY, [TEXTS[k] for k in pool])))
    fused = {k: fuse_scores(normalize("colbert", hand_scores[k]["colbert"]), normalize_reranker(logits[k]))
             for k in pool}
    assert [d.id for d in docs] == sorted(pool, key=lambda k: (-fused[k], k))[:2]
    for doc in docs:
        r_ret, r_rer = doc.scores["retrieval"], doc.scores["reranker_norm"]
        assert doc.scores["reranker"] == pytest.approx(logits[doc.id], abs=1e-6)
        assert r_rer == normalize_reranker(doc.scores["reranker"])
        assert doc.score == doc.scores["fused"] == pytest.approx(2 * r_ret * r_rer / (r_ret + r_rer + 1e-8))
        assert {"dense_norm", "sparse_norm", "colbert_norm"} <= set(doc.scores)


def test_a_bge_m3_store_reopens_with_its_embedder_and_refuses_another(m3_store):
    reopened = DocumentStore(m3_store.location)  # no embedder: rebuilt from the spec the store recorded
    assert isinstance(reopened.embedder, BGEM3Embedder) and reopened.embedder.identity == m3_store.embedder.identity
    assert ScoredRetriever(reopened, score="colbert").retrieve(QUERY, top_k=1)[0].id == ScoredRetriever(
        m3_store, score="colbert").retrieve(QUERY, top_k=1)[0].id
    with pytest.raises(StoreMismatchError, match="not comparable"):
        DocumentStore(m3_store.location, embedder=embedder_from_spec("minilm"))
