"""The pure parts of the llama.cpp peer benchmark (``benchmarks/peer_llamacpp.py``); no llama.cpp binary needed.

What each test would catch is named beside it: reading the wrong llama-bench test or field, counting a
stream's empty events as its first token, a ratio taken against another scenario's (or no) baseline,
an order that runs one system's repeats back to back, a prompt that is not the one ``concat`` builds,
a server left running after an error, and a missing binary found only after minutes of model loading.
The one end-to-end run needs the binaries (``$LLAMA_CPP_BIN``) and is skipped without them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import peer_llamacpp as peer
from benchmarks.peer_llamacpp import (
    Cell,
    LlamaCppNotFoundError,
    Measurement,
    alternation,
    concat_ids,
    concurrent_rows,
    parse_completion_stream,
    parse_llama_bench,
    rag_rows,
    raw_rows,
    resolve_binary,
)
from benchmarks.serving import Job


def bench_test(n_prompt: int, n_gen: int, avg_ts: float) -> dict:
    """One entry of ``llama-bench -o json`` as b11434 writes it (fields trimmed; values from a real run)."""
    return {"build_commit": "unknown", "build_number": 11434, "cpu_info": "AMD EPYC", "backends": "CPU",
            "model_type": "llama 256M Q4_1", "model_size": 96576768, "n_batch": 2048, "n_ubatch": 512,
            "n_threads": 1, "type_k": "f16", "flash_attn": -1, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": 0,
            "test_time": "2026-11-24T09:33:39Z", "avg_ns": 852897475, "stddev_ns": 0, "avg_ts": avg_ts,
            "stddev_ts": 0.0, "samples_ns": [852897475], "samples_ts": [round(avg_ts, 3)]}


# -- llama-bench -------------------------------------------------------------------------------------
def test_llama_bench_json_gives_prefill_and_decode_by_test_shape_not_by_position():
    # decode listed first: a parser taking tests[0] as prefill (or reading samples_ns) fails here
    text = json.dumps([bench_test(0, 32, 92.193016), bench_test(128, 0, 150.076655)], indent=2)
    result = parse_llama_bench(text)
    assert result.prefill_tok_s == pytest.approx(150.076655)
    assert result.decode_tok_s == pytest.approx(92.193016)
    assert result.build == "b11434 (unknown)" and result.threads == 1


def test_llama_bench_json_without_a_decode_test_is_refused():
    # a run with -n 0 (or a pp+tg "-pg" test) must not be reported as a decode speed
    with pytest.raises(ValueError, match="one prefill and one decode"):
        parse_llama_bench(json.dumps([bench_test(512, 0, 150.0), bench_test(512, 128, 80.0)]))


# -- llama-server's stream ---------------------------------------------------------------------------
def sse(payload: dict) -> str:
    return "data: " + json.dumps(payload)


def final_event(predicted: int, prompt_n: int, cache_n: int) -> dict:
    """The last /completion event as llama-server b11434 streams it (trimmed)."""
    return {"index": 0, "content": "", "tokens": [], "id_slot": 0, "stop": True, "tokens_predicted": predicted,
            "tokens_evaluated": prompt_n + cache_n, "stop_type": "limit", "tokens_cached": prompt_n + cache_n + 3,
            "timings": {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": 47.6, "predicted_n": predicted,
                        "predicted_ms": 31.2}}


def test_stream_times_the_first_token_not_the_first_event():
    # an event without a token (prompt progress) arrives first: counting it would halve TTFT
    events = [(1.2, sse({"index": 0, "content": "", "tokens": [], "stop": False, "prompt_progress": {}})), (1.2, ""),
              (1.5, sse({"index": 0, "content": " a", "tokens": [253], "stop": False})), (1.5, ""),
              (1.6, sse({"index": 0, "content": " French", "tokens": [3432], "stop": False})),
              (1.7, sse({"index": 0, "content": "-", "tokens": [29], "stop": False})),
              (1.8, sse({"index": 0, "content": "American", "tokens": [7441], "stop": False})),
              (2.0, sse(final_event(4, 6, 0)))]
    measured = parse_completion_stream(events, started=1.0)
    assert measured.ttft_s == pytest.approx(0.5) and measured.total_s == pytest.approx(1.0)
    assert (measured.new_tokens, measured.prompt_tokens, measured.cached_tokens) == (4, 6, 0)


def test_stream_reports_the_prefix_the_server_reused():
    # warm request: 6 of 7 prompt tokens came from the slot's cache; the prompt is prompt_n + cache_n
    events = [(0.1, sse({"content": " I", "tokens": [339], "stop": False})), (0.3, sse(final_event(3, 1, 6)))]
    measured = parse_completion_stream(events, started=0.0)
    assert (measured.prompt_tokens, measured.cached_tokens, measured.new_tokens) == (7, 6, 3)
    assert measured.ttft_s == pytest.approx(0.1)


def test_stream_without_its_final_event_or_with_an_error_is_an_error():
    # a server killed mid-answer must not turn into a fast answer
    with pytest.raises(RuntimeError, match="final"):
        parse_completion_stream([(0.1, sse({"content": "x", "tokens": [1], "stop": False}))], started=0.0)
    with pytest.raises(RuntimeError, match="context size"):
        parse_completion_stream([(0.1, sse({"error": {"code": 400, "message": "exceeds the context size"}}))],
                                started=0.0)


# -- summaries ---------------------------------------------------------------------------------------
def cell(system: str, mode: str, scenario: str, ttft: list[float], total: list[float], n: int = 3) -> Cell:
    return Cell(1, n, scenario, system, mode, [Measurement(a, b, 32) for a, b in zip(ttft, total)])


def test_rag_ratios_are_medians_against_llama_of_the_same_scenario_and_n():
    rows = rag_rows([cell(peer.LLAMA_SERVER, "concat prompt", "cold", [4.0, 2.0, 3.0], [5.0, 6.0, 4.0]),
                     cell(peer.LLAMA_SERVER, "concat prompt", "warm", [0.2], [0.4]),
                     cell(peer.OURS_ENGINE, "pced", "cold", [1.0, 9.0, 1.5], [2.0, 2.5, 30.0]),
                     cell(peer.OURS_ENGINE, "pced", "warm", [0.5], [1.0]),
                     cell(peer.OURS_ENGINE, "pced", "cold", [1.0], [2.0], n=8)])  # no llama row at N=8
    by = {(r["system"], r["scenario"], r["N"]): r for r in rows}
    cold = by[(peer.OURS_ENGINE, "cold", 3)]
    assert cold["ttft_s"] == 1.5 and cold["total_s"] == 2.5  # medians, not means (one outlier of 9 s / 30 s)
    assert cold["ttft_ours_over_llama"] == pytest.approx(1.5 / 3.0)
    assert cold["total_ours_over_llama"] == pytest.approx(2.5 / 5.0)
    assert by[(peer.OURS_ENGINE, "warm", 3)]["ttft_ours_over_llama"] == pytest.approx(0.5 / 0.2)
    assert by[(peer.LLAMA_SERVER, "cold", 3)]["ttft_ours_over_llama"] == 1.0
    assert by[(peer.OURS_ENGINE, "cold", 8)]["ttft_ours_over_llama"] is None


def test_raw_ratio_is_ours_over_llama_per_test_and_thread_count():
    rows = raw_rows({(1, "prefill pp512", peer.LLAMA_BENCH): [150.0, 100.0, 200.0],
                     (1, "prefill pp512", peer.OURS_MODEL): [300.0],
                     (2, "prefill pp512", peer.LLAMA_BENCH): [250.0],
                     (1, "decode tg128", peer.LLAMA_BENCH): [90.0],
                     (1, "decode tg128", peer.OURS_MODEL): [18.0]})
    by = {(r["threads"], r["test"], r["system"]): r for r in rows}
    assert by[(1, "prefill pp512", peer.OURS_MODEL)]["ours_over_llama"] == pytest.approx(2.0)  # 300 / median 150
    assert by[(1, "decode tg128", peer.OURS_MODEL)]["ours_over_llama"] == pytest.approx(0.2)
    assert by[(1, "prefill pp512", peer.LLAMA_BENCH)]["runs"] == 3


def test_concurrent_ratio_is_of_answers_per_second():
    run = {"requests": 16, "ttft_p50_s": 1.0, "latency_p50_s": 2.0, "tokens_per_s": 10.0}
    rows = concurrent_rows({(peer.LLAMA_SERVER, "concat prompt"): [{**run, "answers_per_s": 0.5}],
                            (peer.OURS_ENGINE, "pced"): [{**run, "answers_per_s": 1.0}, {**run, "answers_per_s": 6.0},
                                                         {**run, "answers_per_s": 2.0}]}, 2, 8, 8)
    ours = next(r for r in rows if r["system"] == peer.OURS_ENGINE)
    assert ours["answers_per_s"] == 2.0 and ours["ours_over_llama"] == pytest.approx(4.0)  # median, not mean (3.0)
    assert (ours["threads"], ours["clients"], ours["N"]) == (2, 8, 8)


def test_table_prints_every_column_the_rows_carry(capsys):
    rows = rag_rows([cell(peer.LLAMA_SERVER, "concat prompt", "cold", [2.0], [3.0]),
                     cell(peer.OURS_ENGINE, "ape", "cold", [1.0], [1.5])])
    peer.print_table(rows, peer.RAG_COLUMNS)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].count("|") == len(peer.RAG_COLUMNS) + 1 and len(lines) == 4
    assert "| 0.500 | 0.500 |" in lines[3]  # ttft and total ratios of the ape row


def test_alternation_interleaves_the_systems_every_repeat():
    # all of A then all of B would put a load spike on one system only
    assert alternation(("llama.cpp", "ours"), 3) == [(0, "llama.cpp"), (0, "ours"), (1, "llama.cpp"), (1, "ours"),
                                                     (2, "llama.cpp"), (2, "ours")]
    assert alternation(("a", "b"), 0) == []


# -- the prompt llama-server gets ----------------------------------------------------------------------
def test_llama_server_gets_the_prompt_concat_builds():
    from ctx_integrations.engine.core.layout import PromptLayout
    from ctx_integrations.engine.modes.baselines import concatenated_ids
    from tests.helpers import embedded_tokenizer

    tokenizer = embedded_tokenizer()
    layout = PromptLayout(tokenizer)
    documents = ["The vault code is 4721.", "Velmora has a copper bridge.", "Ilse Marrow designed it."]
    job = Job("Who designed the bridge?", documents, "concat")
    ids = concat_ids(layout, job)
    ctx = SimpleNamespace(engine=SimpleNamespace(layout=layout), suffix_ids=tuple(layout.suffix_ids(job.query)),
                          check_window=lambda *a: None)
    assert ids == concatenated_ids(ctx, [layout.context_ids(d) for d in documents])  # what concat prefills
    assert ids == tokenizer(layout.render(documents, job.query), add_special_tokens=False)["input_ids"]


# -- servers and binaries ------------------------------------------------------------------------------
def test_llama_server_listens_on_loopback_with_the_given_threads_and_a_context_per_slot(tmp_path):
    command = peer.llama_server_command(Path("/bin/llama-server"), Path("m.gguf"), 8123, 2, 8, 3000)
    flags = dict(zip(command[1::2], command[2::2]))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8123"
    assert flags["-t"] == flags["-tb"] == "2" and flags["--parallel"] == "8" and flags["-c"] == "24000"


def test_a_server_is_stopped_when_the_block_raises(tmp_path):
    # the benchmark fails mid-run: the server must not outlive it (a stray llama-server holds cores)
    port = peer.free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    with pytest.raises(KeyError):
        with peer.subprocess_server(command, f"http://127.0.0.1:{port}/", tmp_path / "log", timeout_s=30) as process:
            raise KeyError("benchmark failed")
    assert process.poll() is not None


def test_a_server_that_exits_at_start_fails_with_its_log(tmp_path):
    command = [sys.executable, "-c", "import sys; print('bad model file'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="bad model file"):
        with peer.subprocess_server(command, "http://127.0.0.1:9/health", tmp_path / "log", timeout_s=30):
            pass


def test_a_missing_binary_is_a_typed_error_that_says_what_to_do(tmp_path):
    with pytest.raises(LlamaCppNotFoundError, match="--llama-server PATH or set LLAMA_CPP_BIN"):
        resolve_binary("llama-server", None, None)
    with pytest.raises(LlamaCppNotFoundError, match=r"llama-bench not found at .*nowhere.*cmake --build"):
        resolve_binary("llama-bench", None, str(tmp_path / "nowhere"))
    plain = tmp_path / "llama-server"
    plain.write_text("")
    with pytest.raises(LlamaCppNotFoundError, match="not executable"):
        resolve_binary("llama-server", plain, None)
    assert issubclass(LlamaCppNotFoundError, FileNotFoundError)
    plain.chmod(0o755)
    assert resolve_binary("llama-server", None, str(tmp_path)) == plain  # found through $LLAMA_CPP_BIN


def test_main_refuses_a_missing_binary_before_loading_any_model(monkeypatch, tmp_path):
    # the error must come in a second, not after the model load and the raw table
    monkeypatch.setattr(peer, "load_engine", lambda *a: pytest.fail("loaded a model before checking the binaries"))
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    started = time.perf_counter()
    with pytest.raises(LlamaCppNotFoundError, match="llama-bench"):
        peer.main(["--llama-server", sys.executable, "--llama-bench", str(tmp_path / "missing")])
    assert time.perf_counter() - started < 5


# -- end to end (needs the binaries) -------------------------------------------------------------------
def llama_cpp_bin() -> Path:
    folder = os.environ.get("LLAMA_CPP_BIN")
    if not folder or not all((Path(folder) / name).is_file() for name in ("llama-server", "llama-bench")):
        pytest.skip("set LLAMA_CPP_BIN to a folder with llama-server and llama-bench (see benchmarks/peer_llamacpp.py)")
    return Path(folder)


@pytest.mark.slow
def test_a_tiny_run_against_llama_cpp_writes_every_table(tmp_path):
    llama_cpp_bin()
    output = tmp_path / "peer.json"
    peer.main(["--threads", "1", "--repeats", "1", "--documents", "2", "--doc-tokens", "32", "--max-new-tokens", "2",
               "--modes", "pced", "--serve-modes", "", "--clients", "2", "--concurrent-documents", "2",
               "--concurrent-requests", "2", "--prompt-tokens", "32", "--gen-tokens", "4",
               "--log-dir", str(tmp_path / "logs"), "--output", str(output)])
    rows = json.loads(output.read_text())["rows"]
    assert {r["table"] for r in rows} == {"raw", "rag", "concurrent"}
    rag = [r for r in rows if r["table"] == "rag"]
    assert {(r["system"], r["scenario"]) for r in rag} == {(s, c) for s in (peer.LLAMA_SERVER, peer.OURS_ENGINE)
                                                           for c in peer.SCENARIOS}
    llama_warm = next(r for r in rag if r["system"] == peer.LLAMA_SERVER and r["scenario"] == "warm")
    assert llama_warm["cached_tokens"] > 0  # the prefix cache did its part
    assert all(r["ttft_ours_over_llama"] > 0 for r in rag)
    assert all(r["ours_over_llama"] > 0 for r in rows if r["table"] in ("raw", "concurrent"))
