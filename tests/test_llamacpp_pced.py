"""The llama.cpp PCED prototype (``benchmarks/llamacpp_pced.py``): its pure parts here, the real run with libllama.

What each test catches is named beside it. The end-to-end test needs a llama.cpp build (``$LLAMA_CPP_BIN``,
docs/peer-llamacpp.md) and is skipped without one; it checks that PCED through libllama gives the library's
answer on the embedded model, which a wrong position, a sequence restored into the wrong id or logits read
from the wrong batch index would break.
"""

from __future__ import annotations

import ctypes
import os

import pytest

from benchmarks import llamacpp_pced as proto


def test_the_mirrored_structs_have_llama_h_sizes():
    # a field added, dropped or retyped when mirroring llama.h shifts every later field: passed by value, the
    # struct would then corrupt memory without an error
    assert ctypes.sizeof(proto.ModelParams) == proto.MODEL_PARAMS_BYTES == 80
    assert ctypes.sizeof(proto.ContextParams) == proto.CONTEXT_PARAMS_BYTES == 160
    assert ctypes.sizeof(proto.Batch) == proto.BATCH_BYTES == 56
    assert proto.ContextParams.n_seq_max.offset == 12 and proto.ContextParams.n_threads.offset == 28
    assert proto.ContextParams.type_k.offset == 104 and proto.ContextParams.kv_unified.offset == 133
    assert proto.ModelParams.n_gpu_layers.offset == 16 and proto.ModelParams.vocab_only.offset == 72


@pytest.mark.parametrize(("a", "b", "expected"), [
    ([1, 2, 3], [1, 2, 3], 1.0),
    ([1, 2, 3], [1, 9, 3], 1 / 3),  # counted to the first difference, not position by position
    ([1, 2], [1, 2, 3, 4], 0.5),  # over the longer answer: a truncated answer does not agree fully
    ([], [], 0.0),
])
def test_agreement_counts_the_common_prefix_over_the_longer_answer(a, b, expected):
    assert proto.agreement(a, b) == pytest.approx(expected)


def test_answer_rate_excludes_the_first_token():
    # tokens after the first over the time after the first: counting the first token would credit the prefill
    assert proto.Answer([1, 2, 3, 4, 5], ttft_s=1.0, total_s=3.0).tokens_per_s == pytest.approx(2.0)
    assert proto.Answer([1], ttft_s=1.0, total_s=1.0).tokens_per_s == 0.0


def test_a_missing_library_is_named_with_the_way_to_build_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no libllama.so in .*docs/peer-llamacpp.md"):
        proto.load_library(tmp_path)


def test_the_command_needs_the_library_folder(monkeypatch, capsys):
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    with pytest.raises(SystemExit):
        proto.parse_args([])
    assert "--lib-dir" in capsys.readouterr().err


@pytest.mark.slow
def test_pced_through_libllama_answers_like_the_library(tmp_path):
    folder = os.environ.get("LLAMA_CPP_BIN")
    if not folder:
        pytest.skip("set LLAMA_CPP_BIN to a llama.cpp build/bin folder with libllama.so (docs/peer-llamacpp.md)")
    result = proto.run(proto.parse_args(["--lib-dir", folder, "--documents", "3", "--repeats", "1",
                                         "--max-new-tokens", "12", "--step-sequences", "1", "2"]))
    # Q4_1 weights and f16 caches in llama.cpp, the dequantised fp32 model in ours: the same greedy answer, or at
    # most a late difference
    assert result["token_agreement"] >= 0.5
    assert [row["sequences"] for row in result["step_ms"]] == [1, 2]
    assert all(row["runs"] == 1 for row in result["rows"])
