"""What this process may use: memory and CPU, as the container sees them."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
#: v1 reports "no limit" as a huge page-aligned number
_V1_UNLIMITED = 1 << 60


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_paths(root: Path, proc_cgroup: Path, controller: str) -> list[Path]:
    """Folders that may hold this process's limits for ``controller``: its own cgroup first, then the root."""
    text = _read(proc_cgroup) or ""
    found = []
    for line in text.splitlines():
        _, controllers, rel = [*line.split(":", 2), "", ""][:3]
        rel = rel.lstrip("/")
        if controllers == "":  # v2 unified hierarchy: "0::/path"
            found.append(root / rel)
        elif controller in controllers.split(","):  # v1: "4:cpu,cpuacct:/path", mounted as cpu,cpuacct/
            found += [root / controllers / rel, root / controller / rel, root / controllers, root / controller]
    return [*found, root]


def cgroup_memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """The smallest memory limit of this process's cgroup (bytes), or ``None`` when unlimited."""
    limits = []
    for folder in _own_paths(root, proc_cgroup, "memory"):
        for name in ("memory.max", "memory.limit_in_bytes"):
            value = _read(folder / name)
            if value and value != "max" and value.isdigit() and int(value) < _V1_UNLIMITED:
                limits.append(int(value))
    return min(limits) if limits else None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in cores (e.g. 1.5), or ``None`` when unlimited."""
    quotas = []
    for folder in _own_paths(root, proc_cgroup, "cpu"):
        v2 = _read(folder / "cpu.max")
        if v2:
            quota, _, period = v2.partition(" ")
            if quota != "max" and quota.isdigit() and period.isdigit() and int(period) > 0:
                quotas.append(int(quota) / int(period))
        quota_v1, period_v1 = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        if quota_v1 and period_v1 and quota_v1.isdigit() and period_v1.isdigit() and int(period_v1) > 0:
            quotas.append(int(quota_v1) / int(period_v1))  # "-1" (unlimited) is not all digits
    return min(quotas) if quotas else None


def host_memory_bytes() -> int:
    """Physical RAM of this host (Linux/macOS ``sysconf``)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def usable_memory_bytes(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """Host RAM, or the cgroup's memory limit when that is lower."""
    host = host_memory_bytes()
    limit = cgroup_memory_limit(root, proc_cgroup)
    return host if limit is None else min(host, limit)


def usable_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """Cores this process may run on: its CPU affinity, capped by the cgroup's CPU quota (rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit(root, proc_cgroup)
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))
