"""``EngineConfig``: every setting of an :class:`~ctx_integrations.engine.core.engine.Engine`, checked, and its flags.

One frozen dataclass holds the engine's cache, scheduler and prompt settings (the cache folder stays an argument of
its own: each command and app has its own default for it). Each field carries, in its ``metadata``, the check its
value must pass, its help text and how it is written on the command line (:class:`Flag`); the CLI's engine flags
are generated from those fields (:meth:`EngineConfig.add_arguments`), so a new setting is a flag with its help and
its check the day it is added, and a value is refused with the same message in Python and as an argparse error
naming the flag. The valid names of the choice-valued settings live here too, so the command line can offer them
without importing torch: this module imports nothing heavy. Written by hand on argparse and dataclasses: no
package generates argparse flags from a dataclass with this library's checks and typed errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ctx_integrations.engine.core.compile_pool import DEFAULT_FORMAT_COMPILE_TIMEOUT_S, DEFAULT_MAX_FORMAT_BYTES
from ctx_integrations.engine.core.layout import DEFAULT_CONTEXT_TEMPLATE, PCED_QUESTION_TEMPLATE, PCED_SYSTEM_PROMPT
from ctx_integrations.engine.core.validation import (
    choice,
    context_template_text,
    flag,
    optional_whole_number,
    question_template_text,
    real_number,
    text,
    whole_number,
)
from ctx_integrations.errors import InvalidOptionError

KV_FORMATS = ("native", "fp16", "bf16", "int8")  # how a cache tier stores entries (kv_codec)
ATTENTION_KERNELS = ("auto", "eager", "flex")  # the row pool's attention (flex.resolve_kernel)
COMPILE_MODES = (None, "auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DEFAULT_MEMORY_BYTES = 4 << 30  # 4 GiB of KV in the memory tier (device memory on a GPU, host RAM on CPU)
DEFAULT_MAX_QUEUED_REQUESTS = 256
HALF_ON_DISK = "half_on_disk"  # the older keyword for disk_format="fp16", accepted by Engine(...) only

Check = Callable[[str, Any], Any]


def check_compile_mode(mode: object) -> None:
    """Refuse anything but ``None``, ``"auto"`` or a ``torch.compile`` mode, by name, before any work."""
    if mode not in COMPILE_MODES:
        raise InvalidOptionError(f"compile_mode must be one of {', '.join(map(repr, COMPILE_MODES))}, got {mode!r}")


def _compile_mode(name: str, value: Any) -> str | None:
    check_compile_mode(value)
    return value


REMOTE_SCHEMES = ("redis", "rediss", "unix")  # the URLs of a remote KV tier (a Redis/Valkey server)


def remote_url(name: str, value: Any) -> str | None:
    """``None`` or a ``redis://``, ``rediss://`` or ``unix://`` URL (the remote tier's server), refused by name
    before any connection is tried."""
    if value is None:
        return None
    scheme = value.partition("://")[0].lower() if isinstance(value, str) and "://" in value else None
    if scheme not in REMOTE_SCHEMES:
        raise InvalidOptionError(f"{name} must be a Redis/Valkey URL (redis://HOST:PORT/DB, rediss://... with TLS, "
                                 f"or unix:///path/to/redis.sock) or None, got {value!r}")
    return value


def _optional(check: Check) -> Check:
    """``check``, with ``None`` (the setting's "choose for me") let through."""
    return lambda name, value: None if value is None else check(name, value)


# -- sizes on the command line ------------------------------------------------------------------------------------
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _size(text: str, minimum: int) -> int:
    number = text.strip().rstrip("bBiIkKmMgGtT ")
    unit = text.strip()[len(number):].strip().lower()
    try:
        value = float(number) * _BYTE_UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give bytes (1048576) or a number with a unit: "
                                         "KB, MB, GB, KiB, MiB, GiB") from None
    if not value >= minimum or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least one byte" if minimum == 1
                                         else f"{text!r}: a size must be at least {minimum} bytes (0: none)")
    return int(value)


def byte_count(text: str) -> int:
    """A size in bytes from ``1048576``, ``512MiB``, ``2GiB`` or ``1.5GB`` (SI and binary units, any case): the
    argparse type of the byte-budget flags, so a typo is refused before a model loads."""
    return _size(text, 1)


def byte_budget(text: str) -> int:
    """:func:`byte_count`, ``0`` included: the type of a cache tier's budget, where 0 means no such tier."""
    return _size(text, 0)


def thread_count(text: str) -> int:
    """``--threads N``: a whole number of threads, at least 1, as ``EngineConfig(threads=...)`` takes it.

    A count below 1 is refused (an argparse error naming the flag, exit status 2): it was once read as 1, so
    ``--threads -2`` ran on one thread with status 0 where the engine refuses the same value."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of threads") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the thread count must be at least 1")
    return count


# -- fields ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """How one :class:`EngineConfig` field is written on the command line: ``--field-name``.

    ``parse``: the argparse type (the text to a value; the field's check then runs on it, so a bad value is an
    argparse error naming the flag). ``choices``: the words it takes (argparse refuses others). ``value``: the
    parsed word as the setting's value (``--compile-mode none`` is ``compile_mode=None``). A ``bool`` field is
    ``--name`` / ``--no-name``."""

    parse: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    value: Callable[[Any], Any] = lambda parsed: parsed


GROUPS = ("cache", "scheduler", "prompt")


def setting(default: Any, group: str, check: Check, help: str, cli: Flag | None) -> Any:
    """One :class:`EngineConfig` field: its default, its group (:data:`GROUPS`), the check its value must pass
    (``check(name, value) -> value``), its help text and its flag (``None``: a setting with no flag)."""
    return field(default=default, metadata={"group": group, "check": check, "help": help, "flag": cli})


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of an :class:`~ctx_integrations.engine.core.engine.Engine` but its cache folder, checked.

    **Cache** (:class:`~ctx_integrations.engine.core.cache.KVCacheStore`). ``disk_format``: how document caches are
    stored in the disk tier: ``"native"`` (the model's dtype, exact), ``"fp16"`` / ``"bf16"`` (half an fp32 entry)
    or ``"int8"`` (KIVI-quantised: about a quarter); see :mod:`~ctx_integrations.engine.core.kv_codec`.
    ``memory_bytes``: the memory tier's budget (device memory on a GPU, host RAM on CPU; least recently used entries
    are evicted; 0: no memory tier). ``disk_bytes``: the disk tier's budget (``None``: unbounded; least recently used
    entries are evicted). ``host_bytes``: the pinned host tier behind a GPU's memory tier, which takes the entries
    the memory tier evicts and returns them by DMA (``None``: 16 GiB on CUDA, none on CPU), stored as
    ``host_format`` (the same formats as ``disk_format``: an int8 entry crosses PCIe at about a quarter of its fp32
    bytes and is widened on the GPU). ``remote_cache_url``: a Redis/Valkey server shared by every replica as the
    last tier (:mod:`~ctx_integrations.engine.core.remote`; ``None``: none). ``Engine(half_on_disk=True)`` is the
    older spelling of ``disk_format="fp16"`` (a keyword of ``Engine(...)`` only, not a field).

    **Scheduler** (:class:`~ctx_integrations.engine.core.scheduler.Scheduler`; engines built on one loaded model
    share it, so they must agree on the settings marked *shared*). ``max_request_bytes``: the most KV one request
    may allocate, checked before anything is allocated (``None``: 2 GiB on CPU, half the GPU's memory on CUDA).
    ``max_batch_bytes`` (*shared*): the KV bytes all running requests of the model may reserve together (prompt +
    ``max_new_tokens``, all their streams); a request that does not fit waits in the queue until running ones
    finish (``None``: half the host's RAM on CPU, half the GPU's memory on CUDA). ``max_queued_requests``: requests
    waiting for admission beyond this are refused with :class:`~ctx_integrations.errors.EngineOverloadedError`.
    ``request_timeout_s``: the default per-request timeout in seconds (``None``: none); ``timeout=`` on a call
    overrides it. ``attention_kernel`` (*shared*): the row pool's attention (every pooled mode): ``"auto"``
    (FlexAttention with a block mask on CUDA, the model's own attention with a boolean mask elsewhere), ``"flex"``
    or ``"eager"``. ``threads`` (*shared*): torch's CPU threads for the model's forwards, set on the engine's own
    step thread (``None``: torch's count in the thread that builds the engine, capped at the physical cores this
    process may use, affinity mask and cgroup quota included; see :mod:`~ctx_integrations.engine.core.machine`).
    ``compile_mode`` (*shared*): the row pool's decode step under ``torch.compile``
    (:mod:`~ctx_integrations.engine.core.compiled_step`): ``None`` (the eager step, the reference; the default:
    on an H200 it decoded PCED's 65 rows 2.7x faster than the compiled step), ``"auto"`` (``"reduce-overhead"``,
    CUDA graphs per bucket of rows and columns, on CUDA; the eager step elsewhere) or a ``torch.compile`` mode.
    ``max_format_bytes``: the most UTF-8 bytes of one structured-output format (a JSON schema, regex, grammar, the
    choices, a tool call's structural tag), checked before it is compiled
    (:class:`~ctx_integrations.errors.FormatTooLargeError`); ``format_compile_timeout_s``: the seconds its compile
    may take, after which it is stopped (:class:`~ctx_integrations.errors.FormatCompileTimeoutError`;
    :mod:`~ctx_integrations.engine.core.compile_pool`). ``batch_invariant`` (*shared*): on the CPU, run the pool's
    forwards with kernels whose
    rows round the same whatever the batch (:mod:`~ctx_integrations.engine.core.batch_invariant`: every GEMM
    in blocks of 16 rows, the math attention kernel, capacity in whole 512-column key blocks), so a
    request's logits are bit for bit those it gets alone in fp32 as in bf16, at 1.1-2.5x the time per token
    (docs/scheduler.md#batch-invariance); ``False`` (default): a row's logits may move with its neighbours (fp32:
    ~4e-5).

    **Prompt** (:class:`~ctx_integrations.engine.core.layout.PromptLayout`; part of every cache key, so caches
    computed under another prompt are not reused). ``system_prompt``: the system turn. ``question_template``: the
    text after the documents, holding ``{question}`` once. ``context_template``: wraps each document, holding
    ``{context}`` once (``"Example(s): {context}"`` for in-context examples).

    Every value is checked here, when the config is built (a typed
    :class:`~ctx_integrations.errors.InvalidOptionError` naming the setting), before any model or cache work.
    Build one with keywords, from another with :func:`dataclasses.replace`, or from parsed command-line flags
    with :meth:`from_namespace`.
    """

    # cache
    disk_format: str = setting("native", "cache", partial(choice, choices=KV_FORMATS),
                               "how KV caches are stored on disk: native (the model's dtype, exact; default), fp16 / "
                               "bf16 (half of fp32) or int8 (KIVI-quantised, about a quarter; its own folder)",
                               Flag(choices=KV_FORMATS))
    memory_bytes: int = setting(DEFAULT_MEMORY_BYTES, "cache", partial(whole_number, minimum=0,
                                                                        hint=" (0: no memory tier)"),
                                "the memory tier's KV budget (device memory on a GPU, host RAM on CPU; least recently "
                                "used entries are evicted; default 4GiB; 0: none)", Flag(byte_budget, metavar="SIZE"))
    disk_bytes: int | None = setting(None, "cache",
                                     partial(optional_whole_number, minimum=0, hint=" (None = no limit)"),
                                     "the disk tier's budget (least recently used entries are evicted; default: no "
                                     "limit)", Flag(byte_budget, metavar="SIZE"))
    host_bytes: int | None = setting(None, "cache", partial(optional_whole_number, minimum=0,
                                                            hint=" (0: no host tier; or None)"),
                                     "the pinned host tier behind a GPU's memory tier (default 16GiB on CUDA, none on "
                                     "CPU; 0: none)", Flag(byte_budget, metavar="SIZE"))
    host_format: str = setting("native", "cache", partial(choice, choices=KV_FORMATS),
                               "how the host tier stores entries (the formats of --disk-format; default native)",
                               Flag(choices=KV_FORMATS))
    remote_cache_url: str | None = setting(None, "cache", remote_url,
                                           "a Redis/Valkey server every replica shares as a KV tier "
                                           "(redis://HOST:PORT/DB, rediss:// or unix://; size it with the server's "
                                           "maxmemory and allkeys-lru; default: none)", Flag(metavar="URL"))
    # scheduler
    max_request_bytes: int | None = setting(None, "scheduler", partial(optional_whole_number, minimum=1),
                                            "the KV bytes one request may need (e.g. 512MiB, 2GiB; default 2 GiB on "
                                            "CPU, half the GPU's memory on CUDA); a bigger request is refused with the "
                                            "size it needs", Flag(byte_count, metavar="SIZE"))
    max_batch_bytes: int | None = setting(None, "scheduler", partial(optional_whole_number, minimum=1),
                                          "the KV bytes all running requests of the model may reserve together (e.g. "
                                          "4GiB; default half the host's RAM on CPU, half the GPU's memory on CUDA); "
                                          "requests beyond it wait", Flag(byte_count, metavar="SIZE"))
    max_queued_requests: int = setting(DEFAULT_MAX_QUEUED_REQUESTS, "scheduler", partial(whole_number, minimum=1),
                                       "requests the engine queues beyond those it runs; more are refused (503 from "
                                       f"the server; default {DEFAULT_MAX_QUEUED_REQUESTS})", Flag(int, metavar="N"))
    request_timeout_s: float | None = setting(None, "scheduler",
                                              _optional(partial(real_number, minimum=0, min_inclusive=False,
                                                                allow_inf=True)),
                                              "seconds a request may take before it fails with a timeout (default: "
                                              "none)", Flag(float, metavar="SECONDS"))
    attention_kernel: str = setting("auto", "scheduler", partial(choice, choices=ATTENTION_KERNELS),
                                    "the row pool's attention: auto (FlexAttention on CUDA, eager elsewhere; default), "
                                    "flex or eager", Flag(choices=ATTENTION_KERNELS))
    threads: int | None = setting(None, "scheduler", partial(optional_whole_number, minimum=1),
                                  "torch CPU threads (default: torch's, capped at the physical cores this process may "
                                  "use; at least 1; 1 is faster on a CPU other jobs are busy with)",
                                  Flag(thread_count, metavar="N"))
    compile_mode: str | None = setting(None, "scheduler", _compile_mode,
                                       "the decode step under torch.compile: none (eager; default), auto (CUDA "
                                       "graphs on CUDA, eager elsewhere), default, reduce-overhead, max-autotune or "
                                       "max-autotune-no-cudagraphs",
                                       Flag(choices=tuple("none" if m is None else m for m in COMPILE_MODES),
                                            metavar="MODE", value=lambda word: None if word == "none" else word))
    max_format_bytes: int = setting(DEFAULT_MAX_FORMAT_BYTES, "scheduler", partial(whole_number, minimum=1),
                                    "bytes of one structured-output format (JSON schema, regex, grammar, choices, "
                                    "tools), checked before it is compiled (e.g. 256KiB; default 64KiB); a bigger "
                                    "one is refused", Flag(byte_count, metavar="SIZE"))
    format_compile_timeout_s: float = setting(DEFAULT_FORMAT_COMPILE_TIMEOUT_S, "scheduler",
                                              partial(real_number, minimum=0, min_inclusive=False),
                                              "seconds one structured-output format may take to compile; then the "
                                              "compile is stopped and the request refused (default 10)",
                                              Flag(float, metavar="SECONDS"))
    batch_invariant: bool = setting(False, "scheduler", flag,
                                    "on the CPU, logits bit for bit those of the request alone, whatever the batch "
                                    "(1.1-2.5x the time per token; default off)", Flag())
    # prompt
    system_prompt: str = setting(PCED_SYSTEM_PROMPT, "prompt", text,
                                 "the system turn of every prompt (default: PCED's)", Flag(metavar="TEXT"))
    question_template: str = setting(PCED_QUESTION_TEMPLATE, "prompt",
                                     lambda name, value: question_template_text(value),
                                     "the text after the documents, with {question} once (default: PCED's)",
                                     Flag(metavar="TEXT"))
    context_template: str = setting(DEFAULT_CONTEXT_TEMPLATE, "prompt",
                                    lambda name, value: context_template_text(value),
                                    "wraps each document, with {context} once (default: {context})",
                                    Flag(metavar="TEXT"))

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            object.__setattr__(self, item.name, item.metadata["check"](item.name, getattr(self, item.name)))

    # -- Python ------------------------------------------------------------------------------------------------
    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(item.name for item in dataclasses.fields(cls))

    @classmethod
    def resolve(cls, config: EngineConfig | None, settings: Mapping[str, Any]) -> EngineConfig:
        """``config`` (default: all defaults) with ``settings`` (field names, or ``half_on_disk``) applied over it.

        An unknown name is refused with the valid ones, instead of Python's ``TypeError`` about an unexpected
        keyword argument."""
        if config is not None and not isinstance(config, EngineConfig):
            raise InvalidOptionError(f"config must be an EngineConfig (or None), got {type(config).__name__}: build "
                                     "one with EngineConfig(threads=2, ...) or pass the settings as keywords")
        settings = dict(settings)
        unknown = [name for name in settings if name not in cls.names() and name != HALF_ON_DISK]
        if unknown:
            valid = ("cache_dir", *cls.names(), HALF_ON_DISK)  # cache_dir: Engine's own keyword, named for a typo
            hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, valid, 1))
                     else repr(name) for name in unknown]
            raise InvalidOptionError(f"unknown engine setting(s) {', '.join(hints)}: the settings are "
                                     f"{', '.join(valid)}")
        if HALF_ON_DISK in settings:
            base = config.disk_format if config is not None else "native"
            settings["disk_format"] = half_on_disk_format(settings.get("disk_format", base),
                                                          settings.pop(HALF_ON_DISK))
        if config is None:
            return cls(**settings)
        return dataclasses.replace(config, **settings) if settings else config  # frozen: shared safely

    # -- the command line --------------------------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                      suppress_defaults: bool) -> None:
        """One flag per field that has a :class:`Flag` (``max_batch_bytes`` -> ``--max-batch-bytes``); a ``bool``
        field is ``--name`` / ``--no-name``.

        Every flag's default is ``None`` (not given: the engine's default holds, see :meth:`options_from_namespace`),
        or with ``suppress_defaults`` none at all (``argparse.SUPPRESS``): the flags of a subcommand's parser, which
        must not reset a value given before the subcommand."""
        default = argparse.SUPPRESS if suppress_defaults else None
        for item in dataclasses.fields(cls):
            cli: Flag | None = item.metadata["flag"]
            if cli is None:
                continue
            option = "--" + item.name.replace("_", "-")
            if item.type in ("bool", bool):
                parser.add_argument(option, dest=item.name, action=argparse.BooleanOptionalAction, default=default,
                                    help=_escape(item.metadata["help"]))
                continue
            parser.add_argument(option, dest=item.name, default=default, help=_escape(item.metadata["help"]),
                                choices=cli.choices, metavar=cli.metavar,
                                type=None if cli.choices else argument_type(item.name))

    @classmethod
    def options_from_namespace(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The settings whose flags were given (``None`` or absent: not given), as :class:`EngineConfig` keywords."""
        options: dict[str, Any] = {}
        for item in dataclasses.fields(cls):
            cli: Flag | None = item.metadata["flag"]
            value = getattr(args, item.name, None)
            if cli is not None and value is not None:
                options[item.name] = cli.value(value)
        return options

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> EngineConfig:
        """The config of the flags given, every other setting at its default."""
        return cls(**cls.options_from_namespace(args))


def argument_type(name: str) -> Callable[[str], Any]:
    """The argparse type of field ``name``'s flag: its :class:`Flag` ``parse``, then the field's check, whose
    refusal becomes an argparse error naming the flag (``argument --max-queued-requests: max_queued_requests must
    be ...``)."""
    item = {f.name: f for f in dataclasses.fields(EngineConfig)}[name]
    cli: Flag = item.metadata["flag"]

    def parse(text: str) -> Any:
        parsed = cli.parse(text)
        try:
            item.metadata["check"](name, cli.value(parsed))
        except InvalidOptionError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return parsed

    parse.__name__ = cli.parse.__name__  # argparse's "invalid int value: 'x'" names the type
    return parse


def check_setting(name: str, value: Any) -> Any:
    """``value`` checked as :class:`EngineConfig`'s field ``name`` (for the classes that take one setting directly,
    such as :class:`~ctx_integrations.engine.core.cache.KVCacheStore`)."""
    return EngineConfig.__dataclass_fields__[name].metadata["check"](name, value)


def half_on_disk_format(disk_format: Any, half_on_disk: Any) -> Any:
    """``disk_format`` with the older ``half_on_disk=True`` (``"fp16"``) applied; the two contradicting is refused."""
    if not flag(HALF_ON_DISK, half_on_disk):
        return disk_format
    if disk_format not in ("native", "fp16"):
        raise InvalidOptionError(f"half_on_disk=True is disk_format='fp16', which contradicts "
                                 f"disk_format={disk_format!r}: give disk_format alone")
    return "fp16"


def _escape(help_text: str) -> str:
    """argparse %-formats help text (``%(default)s``): a literal ``%`` must be doubled."""
    return help_text.replace("%", "%%")
