"""Consistency Distillation: a few steps lower the KL on a tiny model; the saved adapter loads, changes
the model identity (a cache miss, never a wrong hit) and reproduces the trained model's logits."""

from __future__ import annotations

import random

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.model import load_model
from ctx_integrations.engine.distill import DistillConfig, consistency_kl, distill, main, token_windows
from ctx_integrations.errors import InvalidOptionError, ModelLoadError
from tests.helpers import tiny_loaded

pytest.importorskip("peft")

WORDS = ("river town market water city house school road field light tree hill stone wind rain bridge north "
         "south east west garden table window door street wall farm village").split()


def plain_text(seed: int = 0, words: int = 140) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def small_config(**overrides) -> DistillConfig:
    settings = dict(rank=8, alpha=16.0, lr=1e-2, steps=8, warmup_steps=0, chunk_tokens=16, n_chunks=2,
                    target_tokens=12, tau=1.0, seed=0)
    settings.update(overrides)
    return DistillConfig(**settings)


def peaked_tiny_model():
    """A tiny Llama whose outputs depend on context enough for teacher and student to disagree
    (at the default init range 0.02 its outputs are nearly uniform and the KL is ~1e-4)."""
    return tiny_loaded("llama", seed=1, initializer_range=0.1)


def test_a_few_steps_lower_the_kl(tmp_path):
    loaded = peaked_tiny_model()
    config = small_config()
    windows = token_windows(loaded.tokenizer, [plain_text(0)], config)
    with torch.no_grad():
        before = [float(consistency_kl(loaded.model, w, config)) for w in windows]
    weights_before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    report = distill(loaded, [plain_text(0)], tmp_path / "adapter", config)
    assert len(report.losses) == config.steps and report.windows == len(windows)
    assert sum(before) > 0.05  # the chunked student really disagrees with the full-context teacher
    # the base model is restored: same weights, no LoRA layers left behind
    assert all(torch.equal(weights_before[k], v) for k, v in loaded.model.state_dict().items())
    trained = load_model_from(loaded, tmp_path, tmp_path / "adapter")
    with torch.no_grad():
        after = [float(consistency_kl_with_teacher(trained, loaded, w, config)) for w in windows]
    assert sum(after) < 0.75 * sum(before), (before, after)


def save_base(loaded, folder):
    loaded.model.save_pretrained(folder / "base")
    loaded.tokenizer.save_pretrained(folder / "base")
    return folder / "base"


def load_model_from(loaded, tmp_path, adapter):
    return load_model(save_base(loaded, tmp_path), device="cpu", dtype=torch.float32, adapter=adapter)


def consistency_kl_with_teacher(student_loaded, teacher_loaded, window, config):
    """The KL of the adapted student against the *base* model's full-context teacher."""
    from ctx_integrations.engine.distill import _next_token_logprobs

    return consistency_kl(student_loaded.model, window, config,
                          teacher=lambda ids, first: _next_token_logprobs(teacher_loaded.model, ids, first))


def test_adapter_changes_identity_and_is_loaded_by_the_engine(tmp_path):
    loaded = peaked_tiny_model()
    distill(loaded, [plain_text(1)], tmp_path / "adapter", small_config(steps=2))
    base_dir = save_base(loaded, tmp_path)
    plain = load_model(base_dir, device="cpu", dtype=torch.float32)
    adapted = load_model(base_dir, device="cpu", dtype=torch.float32, adapter=tmp_path / "adapter")
    assert plain.identity != adapted.identity and "adapter" in adapted.name
    ids = torch.tensor([loaded.tokenizer("the river town market", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert not torch.allclose(plain.model(ids).logits, adapted.model(ids).logits)
    engine = Engine.from_pretrained(base_dir, device="cpu", dtype=torch.float32, adapter=tmp_path / "adapter")
    assert engine.loaded.identity == adapted.identity
    answer = engine.generate("Where is the market?", ["The market is in the river town."], mode="soft_nbce",
                             max_new_tokens=3)
    assert answer.cache_misses == 1


def test_bad_adapter_folder_is_a_model_load_error(tmp_path):
    base_dir = save_base(tiny_loaded("llama"), tmp_path)
    with pytest.raises(ModelLoadError, match="adapter"):
        load_model(base_dir, device="cpu", adapter=tmp_path / "missing")


def test_too_little_text_says_how_much_is_needed():
    loaded = tiny_loaded("llama")
    with pytest.raises(InvalidOptionError, match="one training window needs"):
        distill(loaded, ["a few words"], None, small_config())
    with pytest.raises(InvalidOptionError):
        DistillConfig(rank=0)


def test_cli_main_trains_and_saves(tmp_path, monkeypatch):
    import ctx_integrations.engine.distill as module

    loaded = peaked_tiny_model()
    monkeypatch.setattr("ctx_integrations.engine.core.model.load_model", lambda name: loaded)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(plain_text(2))
    code = main([str(corpus), "--output", str(tmp_path / "out"), "--rank", "4", "--steps", "2", "--chunk-tokens", "16",
                 "--n-chunks", "2", "--target-tokens", "8"])
    assert code == 0
    assert (tmp_path / "out" / "adapter_config.json").is_file() and (tmp_path / "out" / module.CONFIG_FILE).is_file()
