"""What this machine offers a decode step: the CPU cores this process may use and whether the CPU computes bf16.

torch's own default thread count is the machine's physical cores, whatever the process may use: in a
container limited to 2 of 64 cores (a cgroup CPU quota or an affinity mask) it starts 64 OpenMP threads
that then wait on each other, and every matrix product gets slower. :func:`available_cores` counts
what the process may actually run on. bf16 halves the bytes a CPU decode step reads, but only CPUs
with bf16 arithmetic (AVX512-BF16, AMX) compute it faster than fp32; on others (AVX2, e.g. Zen 3)
torch converts every operand and a bf16 prefill measured 7x slower than fp32 in this project.
Linux reports both in ``/proc`` and ``/sys``; elsewhere the answers fall back to ``os.cpu_count()``
and "no bf16". ``$CTX_DTYPE`` overrides the choice of dtype (:func:`forced_dtype`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
DTYPE_ENV = "CTX_DTYPE"
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # what --dtype and $CTX_DTYPE accept besides "auto"


def _cgroup_quota_cores(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cgroup v2 (``cpu.max``) or v1 (``cpu.cfs_quota_us``) CPU quota in cores, ``None`` when unlimited."""
    try:
        quota, _, period = (root / "cpu.max").read_text().strip().partition(" ")
        if quota != "max" and period:
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def _physical_cores(cpus: set[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """How many distinct physical cores the logical ``cpus`` sit on (SMT siblings share one core's units)."""
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology: count the logical CPU as a core
    return len(cores)


def available_cores() -> int:
    """The physical cores this process may run on: its affinity mask's, capped by its cgroup's CPU quota."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)
    cores = _physical_cores(cpus)
    quota = _cgroup_quota_cores()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def default_threads() -> int:
    """torch's thread count in the calling thread, capped at :func:`available_cores`.

    A caller who lowered it (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``) keeps that count; torch's own
    default, which counts the machine's cores whatever the process may use, is cut to what the process may.
    """
    import torch

    return max(1, min(torch.get_num_threads(), available_cores()))


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no ``/proc/cpuinfo``)."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has bf16 arithmetic (AMX-BF16 or AVX512-BF16), where bf16 weights decode faster than fp32."""
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in _BF16_FLAGS)


def forced_dtype() -> str | None:
    """The dtype ``$CTX_DTYPE`` names (``float32``, ``bfloat16`` or ``float16``), ``None`` when unset or ``auto``.

    A value that names no dtype raises :class:`~ctx_integrations.errors.InvalidOptionError` instead of
    being ignored: a test leg meant to run in bf16 must not run in fp32 without a word.
    """
    value = os.environ.get(DTYPE_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in DTYPE_NAMES:
        from ctx_integrations.errors import InvalidOptionError

        raise InvalidOptionError(f"${DTYPE_ENV}={value!r} names no dtype: use one of auto, {', '.join(DTYPE_NAMES)}")
    return value


def cpu_dtype_name() -> str:
    """The dtype the library runs on this CPU: ``$CTX_DTYPE``'s when set, else ``bfloat16`` where the CPU computes
    bf16 and ``float32`` where it does not. Torch-free, so ``make test`` asks it which dtype its main run used."""
    return forced_dtype() or ("bfloat16" if native_bf16() else "float32")
