"""Issue 18, items 9 and 10: GGUF conversions keyed by content, and no model folder's own code run by default."""

from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace

import pytest
import transformers

from ctx_integrations import file_hashes
from ctx_integrations.engine.core import model as model_module
from ctx_integrations.errors import CtxIntegrationsError, InvalidOptionError, ModelLoadError, TrustRemoteCodeError
from ctx_integrations.file_hashes import sha256_of_file
from tests.helpers import embedded_tokenizer, move_ctime


# -- item 9 ---------------------------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_two_ggufs_of_one_name_and_size_convert_to_different_folders(tmp_path, cache):
    """The bug: the folder was keyed by name and size, so the second file loaded the first one's weights."""
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for file, byte in ((first, b"\x01"), (second, b"\x02")):
        file.parent.mkdir()
        file.write_bytes(b"GGUF" + byte * 1000)
    assert first.stat().st_size == second.stat().st_size
    assert model_module._converted_dir(first) != model_module._converted_dir(second)
    copy = tmp_path / "c" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(first.read_bytes())
    tag = model_module._converted_dir(first).name.split("-")[-1]
    assert model_module._converted_dir(copy).name.split("-")[-1] == tag  # same bytes, same conversion


def test_content_hash_is_remembered_by_path_and_stamp(tmp_path, cache, monkeypatch):
    """Remembered while the file's stamp is unchanged; a byte changed with the mtime restored is hashed again
    (this test asserted the opposite until the reliability issue: the stamp was only size and mtime)."""
    monkeypatch.setattr(file_hashes, "SETTLE_NS", -10**18)  # as if the file had been written long ago
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF" + b"\x01" * 1000)
    first = model_module.file_content_hash(file)
    index = json.loads((cache / "models" / "gguf-hashes.json").read_text())
    assert index[str(file.resolve())]["sha256"] == first
    assert model_module.file_content_hash(file) == first
    stat = file.stat()
    file.write_bytes(b"GGUF" + b"\x02" * 1000)  # same size; restore the mtime: the ctime still moves
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    move_ctime(file)
    assert model_module.file_content_hash(file) == sha256_of_file(file) != first


# -- item 10 --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def remote_code_folder(tmp_path_factory):
    """A model folder whose config points at its own Python code, which would abort the test if it ran."""
    folder = tmp_path_factory.mktemp("remote-code")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "ctx-custom-arch", "architectures": ["CustomForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                     "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}))
    for name in ("configuration_custom.py", "modeling_custom.py"):
        (folder / name).write_text("raise SystemExit('the folder's own code ran')\n")
    embedded_tokenizer().save_pretrained(folder)
    return folder


def test_folder_that_needs_custom_code_is_a_typed_error_naming_the_option(remote_code_folder):
    with pytest.raises(TrustRemoteCodeError, match=r"trust_remote_code=True") as caught:
        model_module.load_model(remote_code_folder)
    assert isinstance(caught.value, ModelLoadError) and isinstance(caught.value, CtxIntegrationsError)


class _Stop(OSError):
    pass


def _spy(calls):
    def from_pretrained(*args, **kwargs):
        calls.append(kwargs)
        raise _Stop("stop here")

    return classmethod(lambda cls, *a, **k: from_pretrained(*a, **k))


@pytest.mark.parametrize("opt_in", [False, True])
def test_load_model_and_tokenizer_pass_trust_remote_code_explicitly(tmp_path, monkeypatch, opt_in):
    calls: list[dict] = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", _spy(calls))
    with pytest.raises(ModelLoadError):
        model_module.load_model(tmp_path, trust_remote_code=opt_in)
    with pytest.raises(ModelLoadError):
        model_module.load_tokenizer(tmp_path, trust_remote_code=opt_in)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(lambda cls, *a, **k: object()))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _spy(calls))
    with pytest.raises(ModelLoadError):
        model_module.load_model(tmp_path, trust_remote_code=opt_in)
    assert len(calls) == 3 and all(call["trust_remote_code"] is opt_in for call in calls)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_trust_remote_code_must_be_a_bool(tmp_path, value):
    with pytest.raises(InvalidOptionError, match="trust_remote_code"):
        model_module.load_model(tmp_path, trust_remote_code=value)


def test_embedder_passes_trust_remote_code_false(tmp_path, monkeypatch):
    from ctx_integrations.retrieval.embedders import TransformerEmbedder

    calls: list[dict] = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", _spy(calls))
    with pytest.raises(ModelLoadError):
        TransformerEmbedder(tmp_path)._load()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(lambda cls, *a, **k: object()))
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", _spy(calls))
    with pytest.raises(ModelLoadError):
        TransformerEmbedder(tmp_path)._load()
    assert len(calls) == 2 and all(call["trust_remote_code"] is False for call in calls)


@pytest.mark.parametrize(("cls_name", "flag_class", "extra"), [
    ("BGEM3Embedder", "BGEM3FlagModel", {}),
    ("FlagRerankerModel", "FlagReranker", {"kind": "encoder", "model_ref": "r"}),
    ("FlagRerankerModel", "FlagLLMReranker", {"kind": "llm", "model_ref": "r"}),
])
def test_flag_models_pass_trust_remote_code_false(tmp_path, cls_name, flag_class, extra):
    from ctx_integrations.retrieval import flag

    calls: list[dict] = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        raise ValueError("Loading this model requires you to execute custom code; set trust_remote_code=True")

    model = object.__new__(getattr(flag, cls_name))
    vars(model).update(folder=tmp_path, device="cpu", use_fp16=False, batch_size=2, max_length=8,
                       _model=None, _lock=threading.Lock(), _flag=SimpleNamespace(**{flag_class: spy}), **extra)
    with pytest.raises(TrustRemoteCodeError):
        model._load()
    assert calls[0]["trust_remote_code"] is False
