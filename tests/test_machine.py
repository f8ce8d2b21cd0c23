"""The machine's defaults: cores this process may use, bf16 by CPU feature, and threads set where forwards run."""

from __future__ import annotations

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core import machine
from ctx_integrations.engine.core.model import default_dtype
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import tiny_loaded


def _topology(root, cpu: int, package: int, core: int) -> None:
    folder = root / f"cpu{cpu}" / "topology"
    folder.mkdir(parents=True)
    (folder / "physical_package_id").write_text(f"{package}\n")
    (folder / "core_id").write_text(f"{core}\n")


def test_smt_siblings_count_as_one_core_and_packages_apart(tmp_path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 0), (0, 1), (1, 0)]):  # cpu0/cpu1 share a core
        _topology(tmp_path, cpu, package, core)
    assert machine._physical_cores({0, 1, 2, 3}, tmp_path) == 3
    assert machine._physical_cores({0, 1}, tmp_path) == 1
    assert machine._physical_cores({2, 7}, tmp_path) == 2  # cpu7 has no topology: counted alone
    assert machine._physical_cores({7, 8}, tmp_path) == 2  # ... and apart from every other such CPU


@pytest.mark.parametrize(("files", "cores"), [
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "0\n"}, None),  # no division by zero
    ({}, None),
])
def test_cgroup_quota_in_cores(tmp_path, files, cores):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert machine._cgroup_quota_cores(tmp_path) == cores


def test_available_cores_is_the_affinity_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: set(range(8)) if pid == 0 else set())
    monkeypatch.setattr(machine, "_physical_cores", lambda cpus: len(cpus))
    monkeypatch.setattr(machine, "_cgroup_quota_cores", lambda: 2.5)
    assert machine.available_cores() == 3  # a 2.5-core quota runs 3 threads part of the time
    monkeypatch.setattr(machine, "_cgroup_quota_cores", lambda: None)
    assert machine.available_cores() == 8
    monkeypatch.setattr(machine, "_cgroup_quota_cores", lambda: 0.2)
    assert machine.available_cores() == 1


def test_without_an_affinity_mask_the_cpu_count_is_used(monkeypatch):
    def no_affinity(pid):
        raise AttributeError("not Linux")

    monkeypatch.setattr(machine.os, "sched_getaffinity", no_affinity)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 6)
    assert machine.available_cores() == 6
    monkeypatch.setattr(machine.os, "cpu_count", lambda: None)  # unknown
    assert machine.available_cores() == 1


def test_cpu_flags_survive_bytes_that_are_not_utf8(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_bytes(b"model name\t: Caf\xe9 CPU\nflags\t\t: avx2 amx_bf16\n")
    assert machine.cpu_flags(cpuinfo) == frozenset({"avx2", "amx_bf16"})
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert machine.native_bf16()  # no flags given: this machine's


def test_cpu_flags_and_native_bf16(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    flags = machine.cpu_flags(cpuinfo)
    assert flags == frozenset({"fpu", "sse", "avx2", "avx512f"})
    assert not machine.native_bf16(flags)  # AVX-512 without its BF16 extension computes bf16 by conversion
    assert machine.native_bf16(flags | {"avx512_bf16"}) and machine.native_bf16(frozenset({"amx_bf16"}))
    assert machine.cpu_flags(tmp_path / "missing") == frozenset()


def test_default_dtype_follows_the_cpu_features(monkeypatch):
    monkeypatch.delenv("CTX_DTYPE", raising=False)
    monkeypatch.setattr(machine, "native_bf16", lambda: False)
    assert default_dtype(torch.device("cpu")) == torch.float32 and machine.cpu_dtype_name() == "float32"
    monkeypatch.setattr(machine, "native_bf16", lambda: True)
    assert default_dtype(torch.device("cpu")) == torch.bfloat16 and machine.cpu_dtype_name() == "bfloat16"
    assert default_dtype(torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("value, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                          (" BFloat16 ", torch.bfloat16), ("float16", torch.float16)])
def test_ctx_dtype_overrides_the_cpu_features_on_every_device(monkeypatch, value, dtype):
    """The dtype leg of ``make test`` sets it; a machine of either kind then runs the default path in both dtypes."""
    monkeypatch.setenv("CTX_DTYPE", value)
    for bf16 in (False, True):
        monkeypatch.setattr(machine, "native_bf16", lambda bf16=bf16: bf16)
        assert default_dtype(torch.device("cpu")) == dtype and default_dtype(torch.device("cuda")) == dtype


def test_ctx_dtype_auto_or_empty_leaves_the_choice_to_the_cpu(monkeypatch):
    monkeypatch.setattr(machine, "native_bf16", lambda: False)
    for value in ("auto", "", " AUTO"):
        monkeypatch.setenv("CTX_DTYPE", value)
        assert default_dtype(torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("value", ["bf16", "fp32", "int8", "float64"])
def test_a_ctx_dtype_that_names_no_dtype_is_refused_not_ignored(monkeypatch, value):
    monkeypatch.setenv("CTX_DTYPE", value)
    with pytest.raises(InvalidOptionError, match=r"\$CTX_DTYPE=.* names no dtype: use one of auto, float32"):
        default_dtype(torch.device("cpu"))


def test_threads_are_set_on_the_thread_that_runs_the_forwards():
    """torch's thread count belongs to the thread that sets it: the caller's setting must not decide the engine's."""
    before = torch.get_num_threads()
    seen: list[int] = []
    try:
        torch.set_num_threads(2)
        engine = Engine(tiny_loaded(), threads=1)
        answer = engine.generate("q?", ["a document"], max_new_tokens=3,
                                 on_token=lambda piece: seen.append(torch.get_num_threads()))
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2  # the caller's own count is left alone
        assert answer.timings["threads"] == 1.0 and answer.timings["dtype"] == "float32"
    finally:
        torch.set_num_threads(before)


def test_engines_on_one_model_share_its_threads():
    loaded = tiny_loaded()
    first = Engine(loaded, threads=1)
    assert Engine(loaded).scheduler is first.scheduler  # none given: the running value
    assert Engine(loaded, threads=1).scheduler.threads == 1
    with pytest.raises(InvalidOptionError, match="threads=1"):
        Engine(loaded, threads=2)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(InvalidOptionError, match="threads"):
            Engine(tiny_loaded(), threads=bad)


def test_default_threads_keep_a_lowered_torch_count_and_cap_torch_at_the_available_cores(monkeypatch):
    from ctx_integrations.engine.core import machine as machine_module

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(machine_module, "available_cores", lambda: 3)
        torch.set_num_threads(1)  # the caller lowered it: kept
        assert Engine(tiny_loaded()).scheduler.threads == 1
        torch.set_num_threads(8)  # torch's default counts the machine's cores: cut to what the process may use
        engine = Engine(tiny_loaded())
        assert engine.scheduler.threads == 3
        seen: list[int] = []
        torch.set_num_threads(1)
        engine.generate("q?", ["a document"], max_new_tokens=2,
                        on_token=lambda piece: seen.append(torch.get_num_threads()))
        assert seen and set(seen) == {3}  # set on the step thread, whatever the caller's count is now
    finally:
        torch.set_num_threads(before)
