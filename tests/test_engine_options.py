"""The CLI's engine flags (``--threads``, ``--disk-format``, ``--dtype``, ``--max-request-bytes``,
``--max-batch-bytes``) reach every engine it builds, Ray's too, and the runtime line says whether the dtype was
asked for or chosen by the machine. No model is loaded."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from ctx_integrations.cli import build_parser, engine_options, runtime_line
from ctx_integrations.engine.core.config import byte_count
from ctx_integrations.engine.core.model import default_dtype
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import run_cli

CPU = torch.device("cpu")


def _parse(*argv: str):
    return build_parser().parse_args([*argv, "ask", "q", "--store", "s"])


def test_dtype_is_an_engine_option_only_when_asked_for():
    assert "dtype" not in engine_options(_parse())
    assert "dtype" not in engine_options(_parse("--dtype", "auto"))
    assert engine_options(_parse("--dtype", "float32")) == {"dtype": torch.float32}
    assert engine_options(_parse("--dtype", "bfloat16", "--threads", "2")) == {"dtype": torch.bfloat16, "threads": 2}


def test_a_dtype_that_is_not_a_float_type_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        _parse("--dtype", "int8")
    assert "invalid choice: 'int8'" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "size"), [
    ("1048576", 2**20), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000),
    ("4 kib", 4096), ("10kB", 10_000), ("3b", 3), ("1TiB", 2**40), (" 7MB ", 7_000_000), ("2.5", 2), ("1", 1),
    ("1.0", 1)])
def test_a_byte_count_reads_plain_bytes_and_si_or_binary_units(text, size):
    assert byte_count(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "12 iB", "5 PB", "two GB", "0", "0.5", "-1", "-1GiB", "nan", "inf",
                                  "1e400", "1,000"])
def test_what_is_not_a_size_of_at_least_one_byte_is_refused_by_the_parser(text, capsys):
    with pytest.raises(SystemExit):
        _parse(f"--max-batch-bytes={text}")  # one token, so argparse does not read "-1GiB" as a flag
    err = capsys.readouterr().err
    assert f"argument --max-batch-bytes: {text!r}" in err
    # what to give instead: units for what is not a number, a minimum for what is one
    assert "is not a size; give bytes (1048576) or a number with a unit: KB, MB, GB, KiB, MiB, GiB" in err or \
        "a size must be at least one byte" in err


def test_a_size_below_one_byte_is_refused_as_too_small_and_a_word_as_not_a_size():
    with pytest.raises(argparse.ArgumentTypeError, match="'0.5': a size must be at least one byte"):
        byte_count("0.5")
    with pytest.raises(argparse.ArgumentTypeError, match=r"'lots' is not a size; .* KiB, MiB, GiB$"):
        byte_count("lots")


def test_the_byte_budgets_are_engine_options_only_when_given():
    assert not {"max_request_bytes", "max_batch_bytes"} & set(engine_options(_parse()))
    assert engine_options(_parse("--max-request-bytes", "512MiB", "--max-batch-bytes", "4GiB")) == {
        "max_request_bytes": 512 * 2**20, "max_batch_bytes": 4 * 2**30}


ENGINE_FLAGS = ("--threads", "2", "--disk-format", "int8", "--dtype", "float32", "--max-request-bytes", "1MiB",
                "--max-batch-bytes", "2MiB")
ENGINE_OPTIONS = {"threads": 2, "disk_format": "int8", "dtype": torch.float32, "max_request_bytes": 2**20,
                  "max_batch_bytes": 2 * 2**20}
ENGINE_COMMANDS = [("demo",), ("ingest", "docs"), ("ask", "q", "--store", "s"), ("eval",), ("serve",)]


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: c[0])
def test_the_engine_flags_are_taken_after_the_command_as_before_it(command):
    """Bug caught: ``ctx-experts ask q --threads 2`` refused as "unrecognized arguments" (the flags were the
    main parser's only), or a command's own default resetting a flag given before the command."""
    parse = build_parser().parse_args
    assert engine_options(parse([*command, *ENGINE_FLAGS])) == ENGINE_OPTIONS
    assert engine_options(parse([*ENGINE_FLAGS, *command])) == ENGINE_OPTIONS
    assert engine_options(parse([*command])) == {}


def test_a_flag_given_before_and_after_the_command_takes_the_later_value():
    args = build_parser().parse_args(["--threads", "1", "--dtype", "bfloat16", "ask", "q", "--store", "s",
                                      "--threads", "2"])
    assert engine_options(args) == {"threads": 2, "dtype": torch.bfloat16}


@pytest.mark.parametrize("place", ["before", "after"])
def test_every_kv_format_and_float_dtype_the_engine_knows_is_a_choice_of_the_flags(place):
    """Bug caught: a format added to the codec (or a dtype name mistyped) that the CLI refuses or mislabels."""
    from ctx_integrations.engine.core.kv_codec import KV_FORMATS

    def parse(*flags: str):
        command = ["ask", "q", "--store", "s"]
        return build_parser().parse_args([*flags, *command] if place == "before" else [*command, *flags])

    for kv_format in KV_FORMATS:
        assert engine_options(parse("--disk-format", kv_format)) == {"disk_format": kv_format}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert engine_options(parse("--dtype", str(dtype).removeprefix("torch."))) == {"dtype": dtype}


def test_commands_without_an_engine_do_not_take_the_engine_flags_after_their_name(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["models", "list", "--threads", "2"])
    assert "unrecognized arguments: --threads 2" in capsys.readouterr().err


def _engine(dtype: torch.dtype, threads: int = 3) -> SimpleNamespace:
    return SimpleNamespace(loaded=SimpleNamespace(name="m", dtype=dtype, device=CPU),
                           scheduler=SimpleNamespace(threads=threads))


def test_the_runtime_line_says_when_the_dtype_was_asked_for_and_what_the_default_is():
    chosen = default_dtype(CPU)
    other = torch.float32 if chosen == torch.bfloat16 else torch.bfloat16
    line = runtime_line(_engine(other))
    default_name = str(chosen).removeprefix("torch.")
    assert f"dtype {str(other).removeprefix('torch.')} (asked for; this device's default is {default_name});" in line
    assert "this CPU" not in line


def test_the_runtime_line_gives_the_cpu_reason_for_the_default_dtype(monkeypatch):
    monkeypatch.delenv("CTX_DTYPE", raising=False)
    line = runtime_line(_engine(default_dtype(CPU), threads=1))
    assert "(this CPU " in line and "asked for" not in line
    assert "; 1 CPU thread (" in line


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_the_runtime_line_names_ctx_dtype_when_it_chose_the_dtype(monkeypatch, name):
    monkeypatch.setenv("CTX_DTYPE", name)
    line = runtime_line(_engine(getattr(torch, name)))
    assert f"dtype {name} ($CTX_DTYPE);" in line and "this CPU" not in line


def test_a_ray_replica_builds_its_engine_with_the_options_and_one_thread_by_default(monkeypatch):
    ray_app = pytest.importorskip("ctx_integrations.serve.ray_app")
    from ctx_integrations.engine.core.engine import Engine

    built: list[dict] = []
    monkeypatch.setattr(Engine, "from_pretrained",
                        classmethod(lambda cls, model, **options: built.append({"model": model, **options})))
    threads = torch.get_num_threads()
    try:
        ray_app.replica_engine("m", "/kv", None, {"disk_format": "int8", "dtype": torch.float32})
        assert torch.get_num_threads() == 1
        ray_app.replica_engine("m", "/kv", None, {"threads": 2})
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert built == [{"model": "m", "cache_dir": "/kv", "threads": 1, "disk_format": "int8", "dtype": torch.float32},
                     {"model": "m", "cache_dir": "/kv", "threads": 2}]


@pytest.mark.parametrize(("argv", "expected"), [
    # serve --ray building its replicas without --threads / --disk-format / --dtype
    (["--threads", "2", "--disk-format", "int8", "--dtype", "float32", "--max-batch-bytes", "1GiB", "serve", "--ray"],
     {"threads": 2, "disk_format": "int8", "dtype": torch.float32, "max_batch_bytes": 2**30}),
    # serve --ray --max-queued N: only the one-process server read the flag, by hand
    (["serve", "--ray", "--max-queued", "5", "--request-timeout-s", "9"],
     {"max_queued_requests": 5, "request_timeout_s": 9.0}),
    # serve --ray --device cuda:1 loaded every replica's model on its default device
    (["serve", "--ray", "--device", "cuda:1", "--threads", "2"], {"device": "cuda:1", "threads": 2}),
], ids=["engine-flags", "max-queued", "device"])
def test_serve_ray_hands_the_engine_flags_to_every_replica(monkeypatch, capsys, argv, expected):
    """Each flag the one-process server honours reaches the engine options every Ray replica is built with."""
    ray_app = pytest.importorskip("ctx_integrations.serve.ray_app")
    seen: dict = {}

    def build_app(**kwargs):
        seen.update(kwargs)
        raise InvalidOptionError("stopped before Ray starts")

    monkeypatch.setattr(ray_app, "build_app", build_app)
    monkeypatch.delenv("CTX_API_KEY", raising=False)
    # replicas that reserve no GPU (a CPU driver's default), where --device is passed as given: on a CUDA machine
    # cuda:1 would be refused (each replica sees its own GPU as cuda:0; tests/test_serve_ray_flags.py)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_cli(*argv) == 2
    assert "stopped before Ray starts" in capsys.readouterr().err
    assert seen["engine_options"] == expected
