"""``EngineConfig``: every engine setting checked in one place, given to ``Engine`` as a config or keywords, and
written on the command line as flags generated from its fields (issue 39, item 7).

No test here loads a model but ``tiny_loaded`` (a random two-layer model built in memory); the CLI's path to the
engine is followed with ``Engine.from_pretrained`` replaced by a recorder, as tests/test_engine_options.py does.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from ctx_integrations.engine.core.config import GROUPS, EngineConfig
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]


def engine_flags_table() -> str:
    """The markdown table of the engine flags, from :class:`EngineConfig`'s fields (docs/cli.md holds it)."""
    rows = ["| flag | setting | what it sets |", "|---|---|---|"]
    for item in dataclasses.fields(EngineConfig):
        cli = item.metadata["flag"]
        if cli is None:
            continue
        option = "--" + item.name.replace("_", "-")
        if item.type == "bool":
            shape = f"{option}`, `--no-{option[2:]}"
        elif cli.choices and not cli.metavar:
            shape = f"{option} {{{','.join(cli.choices)}}}"
        else:
            shape = f"{option} {cli.metavar or item.name.upper()}"
        rows.append(f"| `{shape}` | {item.metadata['group']}: `{item.name}` | {item.metadata['help']} |")
    return "\n".join(rows) + "\n"


def test_every_field_is_a_documented_flag_or_explicitly_not_a_flag():
    """A new setting cannot be forgotten: it is built with ``setting(...)``, which must say its flag (or ``None``),
    and docs/cli.md holds the table of the flags exactly as the fields describe them."""
    for item in dataclasses.fields(EngineConfig):
        assert set(item.metadata) == {"group", "check", "help", "flag"}, item.name
        assert item.metadata["group"] in GROUPS and item.metadata["help"], item.name
    table = engine_flags_table()
    assert table in (ROOT / "docs" / "cli.md").read_text(encoding="utf-8"), \
        f"docs/cli.md must hold the engine flags table as the fields describe it:\n{table}"
    flagged = {f.name for f in dataclasses.fields(EngineConfig) if f.metadata["flag"] is not None}
    documented = set(re.findall(r"\| [a-z]+: `(\w+)` \|", table))
    assert documented == flagged
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser, suppress_defaults=False)
    assert {action.dest for action in parser._actions} - {"help"} == flagged


# -- the command line: every flag reaches the engine, before or after the command ----------------------------------
FLAGS = {  # field: (the flag and its text, the setting's value); a field with a flag and no row fails the test below
    "disk_format": (["--disk-format", "int8"], "int8"),
    "memory_bytes": (["--memory-bytes", "1MiB"], 2**20),
    "disk_bytes": (["--disk-bytes", "0"], 0),
    "host_bytes": (["--host-bytes", "2GiB"], 2 * 2**30),
    "host_format": (["--host-format", "fp16"], "fp16"),
    "remote_cache_url": (["--remote-cache-url", "redis://10.0.0.7:6379/1"], "redis://10.0.0.7:6379/1"),
    "max_request_bytes": (["--max-request-bytes", "1MiB"], 2**20),
    "max_batch_bytes": (["--max-batch-bytes", "2MiB"], 2 * 2**20),
    "max_queued_requests": (["--max-queued-requests", "7"], 7),
    "request_timeout_s": (["--request-timeout-s", "2.5"], 2.5),
    "max_format_bytes": (["--max-format-bytes", "256KiB"], 256 * 2**10),
    "format_compile_timeout_s": (["--format-compile-timeout-s", "30"], 30.0),
    "attention_kernel": (["--attention-kernel", "eager"], "eager"),
    "threads": (["--threads", "2"], 2),
    "compile_mode": (["--compile-mode", "auto"], "auto"),
    "batch_invariant": (["--batch-invariant"], True),
    "system_prompt": (["--system-prompt", "Answer in French."], "Answer in French."),
    "question_template": (["--question-template", "Q: {question}"], "Q: {question}"),
    "context_template": (["--context-template", "Doc: {context}"], "Doc: {context}"),
}
EXPECTED = EngineConfig(**{name: value for name, (_, value) in FLAGS.items()})


def _flags(names=FLAGS) -> list[str]:
    return [text for name in names for text in FLAGS[name][0]]


def test_the_table_gives_every_flag_a_value_other_than_its_default():
    flagged = {f.name for f in dataclasses.fields(EngineConfig) if f.metadata["flag"] is not None}
    assert set(FLAGS) == flagged
    defaults = EngineConfig()
    assert all(getattr(EXPECTED, name) != getattr(defaults, name) for name in FLAGS)


@pytest.fixture
def from_pretrained(monkeypatch):
    """``Engine.from_pretrained`` replaced: it records the config its keywords resolve to, then stops the command."""
    from ctx_integrations.engine.core.engine import Engine

    seen: list[dict] = []

    def record(cls, name=None, *, device=None, dtype=None, config=None, cache_dir=None, **settings):
        seen.append({"config": EngineConfig.resolve(config, settings), "dtype": dtype, "cache_dir": cache_dir})
        raise InvalidOptionError("stopped before the model loads")

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(record))
    monkeypatch.delenv("CTX_API_KEY", raising=False)
    return seen


@pytest.mark.parametrize("place", ["before", "after", "both"])
def test_every_engine_flag_reaches_the_engine_before_or_after_the_command(from_pretrained, capsys, place):
    """``serve`` (no store: it builds its engine at once) with every engine flag; "both": each flag given before the
    command with another value is overridden by the one after it."""
    if place == "before":
        argv = [*_flags(), "serve"]
    elif place == "after":
        argv = ["serve", *_flags()]
    else:
        argv = ["--disk-format", "fp16", "--threads", "1", "--max-queued-requests", "3", "--no-batch-invariant",
                "--compile-mode", "auto", "serve", *_flags()]
    assert run_cli(*argv) == 2
    assert "stopped before the model loads" in capsys.readouterr().err
    assert from_pretrained == [{"config": EXPECTED, "dtype": None, "cache_dir": None}]


def test_the_namespace_readers_keep_only_the_flags_given():
    from ctx_integrations.cli import build_parser

    parse = build_parser().parse_args
    assert EngineConfig.options_from_namespace(parse(["ask", "q", "--store", "s"])) == {}
    args = parse(["--no-batch-invariant", "ask", "q", "--store", "s", "--system-prompt", "", "--compile-mode", "none"])
    assert EngineConfig.options_from_namespace(args) == {"batch_invariant": False, "system_prompt": "",
                                                         "compile_mode": None}  # falsy values are values
    assert EngineConfig.from_namespace(args) == EngineConfig(system_prompt="", compile_mode=None)
    assert EngineConfig.from_namespace(parse(["ask", "q", "--store", "s", *_flags()])) == EXPECTED


BAD_FLAGS = [
    ("--max-queued-requests", "0", "max_queued_requests must be an integer in [1, inf], got 0"),
    ("--max-queued-requests", "many", "invalid int value: 'many'"),
    ("--request-timeout-s", "0", "request_timeout_s must be in (0, inf], got 0.0"),
    ("--request-timeout-s", "nan", "request_timeout_s must be a number, got NaN"),
    ("--memory-bytes", "-1", "'-1': a size must be at least 0 bytes (0: none)"),
    ("--host-bytes", "lots", "'lots' is not a size"),
    ("--max-request-bytes", "0", "'0': a size must be at least one byte"),
    ("--host-format", "int4", "invalid choice: 'int4'"),
    ("--attention-kernel", "fast", "invalid choice: 'fast'"),
    ("--compile-mode", "None", "invalid choice: 'None'"),
    ("--question-template", "no field", "question_template must contain '{question}'"),
    ("--context-template", "{context}{context}", "context_template must contain '{context}' exactly once"),
    ("--threads", "two", "'two' is not a whole number of threads"),
]


@pytest.mark.parametrize("place", ["before", "after"])
@pytest.mark.parametrize(("flag", "text", "says"), BAD_FLAGS, ids=[f"{f}={t}" for f, t, _ in BAD_FLAGS])
def test_a_bad_value_is_an_argparse_error_naming_the_flag(capsys, place, flag, text, says):
    from ctx_integrations.cli import build_parser

    given, command = [f"{flag}={text}"], ["ask", "q", "--store", "s"]  # one token: "-1" is not read as a flag
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*given, *command] if place == "before" else [*command, *given])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and says in err, err


def test_serve_still_takes_max_queued_the_older_name_of_max_queued_requests(capsys):
    from ctx_integrations.cli import build_parser, engine_options

    parse = build_parser().parse_args
    assert engine_options(parse(["serve", "--max-queued", "5"])) == {"max_queued_requests": 5}
    assert engine_options(parse(["serve", "--max-queued-requests", "6"])) == {"max_queued_requests": 6}
    with pytest.raises(SystemExit):
        parse(["serve", "--max-queued", "0"])
    assert "argument --max-queued: max_queued_requests must be an integer in [1, inf], got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "named"), [(["--memory-bytes", "1GiB"], "--memory-bytes"),
                                              (["--system-prompt", "Be brief."], "--system-prompt")])
def test_ingest_no_cache_refuses_every_engine_flag_it_would_ignore(tmp_path, flags, named):
    from ctx_integrations.cli import build_parser, check_ingest

    args = build_parser().parse_args(["ingest", "README.md", "--store", str(tmp_path / "s"), "--no-cache", *flags])
    with pytest.raises(InvalidOptionError, match=f"--no-cache computes no KV cache, so {named} would do nothing"):
        check_ingest(args)


# -- Python: Engine(loaded, config, **settings) ------------------------------------------------------------------
def test_an_unknown_engine_keyword_is_a_typed_error_naming_it_and_the_valid_ones():
    """It was Python's ``TypeError: unexpected keyword argument`` (and from ``from_pretrained``, after the model
    had loaded)."""
    from ctx_integrations import Engine
    from tests.helpers import tiny_loaded

    with pytest.raises(InvalidOptionError) as refused:
        Engine(tiny_loaded("llama", seed=31), thread=2)
    message = str(refused.value)
    assert "unknown engine setting(s) 'thread' (did you mean 'threads'?)" in message
    assert all(name in message for name in ("cache_dir", *EngineConfig.names(), "half_on_disk"))
    with pytest.raises(InvalidOptionError, match="'no_such_setting': the settings are cache_dir, disk_format"):
        Engine.from_pretrained("/no/such/model", no_such_setting=1)  # refused before the (missing) model loads


def test_the_settings_reach_the_store_the_layout_and_the_scheduler():
    from ctx_integrations import Engine
    from tests.helpers import tiny_loaded

    config = EngineConfig(disk_format="int8", memory_bytes=2**20, disk_bytes=2**30, host_bytes=0, host_format="fp16",
                          max_request_bytes=3 * 2**20, max_batch_bytes=5 * 2**20, max_queued_requests=7,
                          request_timeout_s=2.5, attention_kernel="eager", threads=1, compile_mode=None,
                          batch_invariant=True, system_prompt="Answer in French.", question_template="Q: {question}",
                          context_template="Doc: {context}")
    engine = Engine(tiny_loaded("llama", seed=32), config)
    assert engine.config is config
    store, layout, scheduler = engine.store, engine.layout, engine.scheduler
    assert (store.disk_format, store.memory_bytes, store.disk_bytes, store.host_bytes, store.host_format) == \
        ("int8", 2**20, 2**30, 0, "fp16")
    assert (layout.system_prompt, layout.question_template, layout.context_template) == \
        ("Answer in French.", "Q: {question}", "Doc: {context}")
    assert (engine.max_request_bytes, engine.max_queued_requests, engine.request_timeout_s) == (3 * 2**20, 7, 2.5)
    assert (scheduler.max_batch_bytes, scheduler.threads, scheduler.attention_kernel) == (5 * 2**20, 1, "eager")
    assert (scheduler.runner.compile_mode, scheduler.runner.batch_invariant) == (None, True)
    engine.close()


def test_keywords_apply_over_a_config():
    from ctx_integrations import Engine
    from tests.helpers import tiny_loaded

    config = EngineConfig(threads=1, max_queued_requests=5, system_prompt="Be brief.")
    engine = Engine(tiny_loaded("llama", seed=33), config, max_queued_requests=9)
    assert engine.config == EngineConfig(threads=1, max_queued_requests=9, system_prompt="Be brief.")
    assert engine.max_queued_requests == 9 and engine.layout.system_prompt == "Be brief."
    assert config.max_queued_requests == 5  # the caller's config is not changed
    with pytest.raises(InvalidOptionError, match="max_queued_requests must be an integer in \\[1, inf\\], got 0"):
        Engine(tiny_loaded("llama", seed=34), config, max_queued_requests=0)
    with pytest.raises(InvalidOptionError, match="config must be an EngineConfig"):
        Engine(tiny_loaded("llama", seed=35), {"threads": 1})


def test_half_on_disk_is_still_disk_format_fp16_and_a_contradiction_is_refused():
    from ctx_integrations import Engine
    from tests.helpers import tiny_loaded

    loaded = tiny_loaded("llama", seed=36)
    assert Engine(loaded, half_on_disk=True).config.disk_format == "fp16"
    assert Engine(loaded, EngineConfig(disk_format="fp16"), half_on_disk=True).config.disk_format == "fp16"
    assert Engine(loaded, half_on_disk=False, disk_format="int8").config.disk_format == "int8"
    for given in ({"disk_format": "int8"}, {"config": EngineConfig(disk_format="bf16")}):
        with pytest.raises(InvalidOptionError, match="half_on_disk=True is disk_format='fp16', which contradicts"):
            Engine(loaded, half_on_disk=True, **given)
    assert "half_on_disk" not in EngineConfig.names()


BAD_SETTINGS = [("disk_format", "int4"), ("memory_bytes", -1), ("disk_bytes", 1.5), ("host_bytes", "1"),
                ("host_format", None), ("remote_cache_url", "http://127.0.0.1:6379"), ("max_request_bytes", 0),
                ("max_batch_bytes", True),
                ("max_queued_requests", 0), ("request_timeout_s", 0), ("request_timeout_s", float("nan")),
                ("max_format_bytes", 0), ("format_compile_timeout_s", float("inf")),
                ("attention_kernel", "fast"), ("threads", 0), ("compile_mode", "none"), ("batch_invariant", 1),
                ("system_prompt", None), ("question_template", "no field"), ("context_template", "no field")]


@pytest.mark.parametrize(("name", "value"), BAD_SETTINGS, ids=[f"{n}={v!r}" for n, v in BAD_SETTINGS])
def test_every_setting_is_checked_when_the_config_is_built(name, value):
    with pytest.raises(InvalidOptionError, match=name):
        EngineConfig(**{name: value})


def test_every_field_has_a_bad_value_above_and_the_config_is_frozen():
    assert {name for name, _ in BAD_SETTINGS} == set(EngineConfig.names())
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().threads = 2  # type: ignore[misc]
    assert EngineConfig(memory_bytes=2.0**20).memory_bytes == 2**20  # an integral float is the int it equals
    assert isinstance(EngineConfig(memory_bytes=2.0**20).memory_bytes, int)


def test_the_package_exports_engine_config_lazily():
    import ctx_integrations
    from ctx_integrations.engine.core import config

    assert ctx_integrations.EngineConfig is config.EngineConfig
    assert "EngineConfig" in ctx_integrations.__all__ and "EngineConfig" in dir(ctx_integrations)
