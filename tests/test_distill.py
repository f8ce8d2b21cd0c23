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


def reference_kl(model: torch.nn.Module, window: torch.Tensor, config: DistillConfig) -> float:
    """The consistency KL written out from its definition in float64, one plain forward pass per sequence.

    Teacher: the model over the whole window C + Y (the context included), predicting Y[1:].
    Student: streams chunk_k + Y and the prior Y alone, fused as sum_k w_k ((1 + beta) L_k - beta L_prior)
    with w = softmax_k(-H_k / tau) (low entropy = more weight; no top-p filter in training).
    Loss: KL(teacher || student) = sum_v t(v) (log t(v) - log s(v)), averaged over Y[1:].
    """
    context_len = config.n_chunks * config.chunk_tokens
    target = window[context_len:]

    def logprobs(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=ids.unsqueeze(0)).logits[0].double(), -1)

    teacher = logprobs(window)[context_len:-1]
    chunks = [logprobs(torch.cat([window[k * config.chunk_tokens:(k + 1) * config.chunk_tokens], target]))
              [config.chunk_tokens:-1] for k in range(config.n_chunks)]
    prior = logprobs(target)[:-1]
    chunk_lp = torch.stack(chunks)
    entropy = -(chunk_lp.exp() * chunk_lp).sum(-1)
    weights = torch.softmax(-entropy / config.tau, dim=0).unsqueeze(-1)
    student = torch.log_softmax((weights * ((1 + config.beta) * chunk_lp - config.beta * prior)).sum(0), -1)
    return float((teacher.exp() * (teacher - student)).sum(-1).mean())


@pytest.mark.parametrize(("tau", "beta"), [(0.2, 0.25), (1.0, 0.0)])
def test_consistency_kl_equals_its_definition(tau, beta):
    """Fails if the KL is reversed (student || teacher), the teacher does not see the context, or the
    entropy weights are softmax(+H / tau)."""
    loaded = peaked_tiny_model()
    config = small_config(tau=tau, beta=beta)
    window = token_windows(loaded.tokenizer, [plain_text(3)], config)[0]
    with torch.no_grad():
        kl = float(consistency_kl(loaded.model, window, config))
    assert kl == pytest.approx(reference_kl(loaded.model, window, config), rel=1e-4)
    assert kl > 0.01  # the teacher and the student disagree, so each part of the formula shows


def one_window_text(loaded, config: DistillConfig) -> str:
    """Text of exactly one training window (so the first step trains on a known window)."""
    ids = token_windows(loaded.tokenizer, [plain_text(4, words=400)], config)[0]
    text = loaded.tokenizer.decode(ids)
    assert len(token_windows(loaded.tokenizer, [text], config)) == 1
    return text


def test_the_first_training_loss_is_the_kl_against_the_full_context_teacher(tmp_path):
    """At step 0 the LoRA update is zero, so the loss distill() reports is the base model's consistency KL:
    fails if distill's teacher drops the context, or the trained loss is not that KL."""
    loaded = peaked_tiny_model()
    config = small_config(steps=1, tau=0.2)
    text = one_window_text(loaded, config)
    window = token_windows(loaded.tokenizer, [text], config)[0]
    expected = reference_kl(loaded.model, window, config)
    report = distill(loaded, [text], None, config)
    assert report.losses[0] == pytest.approx(expected, rel=1e-4)


def test_the_adapter_is_lora_on_the_query_and_value_projections_only(tmp_path):
    """The paper's setting (LoRA on q/v): the saved adapter holds q_proj and v_proj weights of every layer,
    nothing else."""
    from safetensors.torch import load_file

    loaded = peaked_tiny_model()
    assert DistillConfig().target_modules == ("q_proj", "v_proj")
    distill(loaded, [plain_text(5)], tmp_path / "adapter", small_config(steps=1))
    names = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")).keys()
    projections = {(name.split(".layers.")[1].split(".")[0], name.split(".lora_")[0].rsplit(".", 1)[1])
                   for name in names}
    layers = range(loaded.model.config.num_hidden_layers)
    assert projections == {(str(i), p) for i in layers for p in ("q_proj", "v_proj")}
