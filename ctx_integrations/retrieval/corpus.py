"""Which files of a corpus ingestion reads: a walk that leaves nothing out silently and stays inside the corpus.

Why it works this way:

- Every regular file is a candidate, whatever its name (LICENSE, README, notes.rst, data.csv): whether it is
  text is decided by its content when it is read (:mod:`ctx_integrations.retrieval.reading`), not here.
- Nothing is left out silently. Each entry the walk does not read is listed with its reason: hidden (a
  name starting with ``.``: ``.git``, ``.venv``; named on its own it is read), a folder that cannot be listed,
  an entry whose type cannot be read, a device / socket / pipe (reading a pipe would block), and
  symbolic links that are not followed. Ingestion keeps the stored passages of every listed entry: a folder
  that cannot be listed is not a folder that was emptied.
- Symbolic links stay inside the corpus unless asked. A link to a file inside the folder being walked is read
  under its own path; a link whose target lies outside that folder (a link to ``/etc/passwd`` in a shared
  folder) is not followed, because its content would become passages any reader of the store, or a server
  answering from it, can retrieve. ``follow_symlinks=True`` (``ctx-experts ingest --follow-symlinks``)
  follows every link. A link to a folder inside the corpus is not walked (its files are read where they
  are, once) unless asked; a followed link never walks into a folder that contains it (no loop).
- File names are bytes on POSIX, and Python hands a name that is not UTF-8 over with its bad bytes as lone
  surrogates, which no JSON, Chroma metadata or terminal accepts. :func:`display_path` shows such a name with
  the bad bytes escaped (``caf\\xe9.txt``); passage ids hash the name's bytes (``ingest.passage_id``).

Written here rather than with ``os.walk`` / ``Path.rglob``: both drop an unreadable folder without a word
(``os.walk`` only through an ``onerror`` callback) and neither can tell a link leaving the corpus from one
staying inside it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ctx_integrations.errors import InvalidOptionError

HIDDEN = "hidden (its name starts with '.'): not read in a folder; name it on its own to read it"
FOLLOW_HINT = "follow_symlinks=True / --follow-symlinks follows it"


@dataclass
class FileListing:
    """The files a walk found to read, and every entry it did not read, with the reason (``(path, reason)``)."""

    files: list[Path] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def display_path(path: str | os.PathLike) -> str:
    """``path`` as text that any JSON, metadata store or terminal accepts: bytes that are not UTF-8 as ``\\xNN``.

    A UTF-8 name is returned as ``str(path)`` (the same ``source`` a store built before this function has).
    """
    return os.fsencode(path).decode("utf-8", errors="backslashreplace")


def check_paths(paths: Sequence[str | os.PathLike]) -> None:
    """Refuse a path that does not exist (cheap: nothing is walked), before any model is loaded."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise InvalidOptionError("paths must be a list of files or folders, not a single path: [path]")
    for given in paths:
        path = Path(given).expanduser()
        try:
            path.stat()
        except FileNotFoundError:
            raise InvalidOptionError(f"{display_path(given)} does not exist: give existing files or folders") from None
        except OSError:
            pass  # exists but cannot be read: find_files lists it as skipped


def find_files(paths: Sequence[str | os.PathLike], *, follow_symlinks: bool = False) -> FileListing:
    """The files named in ``paths`` or found under its folders (sorted), and every entry left out with its reason.

    A path given on its own is read whatever its name (hidden included) and wherever a link in it leads: the
    user named it. A path that does not exist is an :class:`InvalidOptionError`; one that cannot be read is
    listed as skipped.
    """
    check_paths(paths)
    files: set[Path] = set()
    skipped: dict[Path, str] = {}
    for given in paths:
        path = Path(given).expanduser().resolve()
        try:
            mode = path.stat().st_mode
        except OSError as error:
            skipped[path] = _cannot_read(error)
            continue
        if stat.S_ISDIR(mode):
            _walk(path, follow_symlinks, files, skipped)
        elif stat.S_ISREG(mode):
            files.add(path)
        else:
            raise InvalidOptionError(f"{display_path(given)} is not a regular file or a folder (a device, socket or "
                                     "pipe): give files or folders")
    return FileListing(sorted(files), sorted((path, why) for path, why in skipped.items() if path not in files))


def _walk(root: Path, follow: bool, files: set[Path], skipped: dict[Path, str]) -> None:
    """Add the files under the folder ``root`` (a real path) to ``files``, and what is not read to ``skipped``.

    Iterative, so a deep tree cannot exhaust Python's recursion limit. Each folder waits on the stack with its
    real path and the real paths of the folders above it: a followed link must not walk into one of them.
    """
    stack = [(root, root, frozenset({root}))]
    while stack:
        folder, real_folder, ancestors = stack.pop()
        try:
            with os.scandir(folder) as scan:
                entries = sorted(scan, key=lambda entry: entry.name)
        except OSError as error:
            skipped[folder] = _cannot_read(error)
            continue
        for entry in entries:
            path = folder / entry.name
            if entry.name.startswith("."):
                skipped[path] = HIDDEN
                continue
            link = False
            try:
                link = entry.is_symlink()
                mode = os.stat(path).st_mode if link else entry.stat(follow_symlinks=False).st_mode
            except OSError as error:
                skipped[path] = _broken_link(path, error) if link else _cannot_read(error)
                continue
            real = Path(os.path.realpath(path)) if link else real_folder / entry.name
            if link and not follow:
                if not real.is_relative_to(root):
                    skipped[path] = (f"a symbolic link to {display_path(real)}, outside {display_path(root)}: not "
                                     f"followed ({FOLLOW_HINT})")
                    continue
                if stat.S_ISDIR(mode):
                    skipped[path] = (f"a symbolic link to the folder {display_path(real)}, inside the corpus: its "
                                     f"files are read there, not again through the link ({FOLLOW_HINT})")
                    continue
            if stat.S_ISDIR(mode):
                if real in ancestors:
                    skipped[path] = (f"a symbolic link to {display_path(real)}, a folder that contains it: not walked "
                                     "again")
                else:
                    stack.append((path, real, ancestors | {real}))
            elif stat.S_ISREG(mode):
                files.add(path)
            else:
                skipped[path] = "not a regular file (a device, socket or pipe): not read"


def _cannot_read(error: OSError) -> str:
    return f"cannot be read ({type(error).__name__}: {error.strerror or error}); its stored passages are kept"


def _broken_link(path: Path, error: OSError) -> str:
    try:
        target = display_path(os.readlink(path))
    except OSError:
        target = "?"
    return f"a symbolic link to {target}, which cannot be reached ({type(error).__name__}: {error.strerror or error})"
