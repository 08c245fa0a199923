"""Container-aware limits: the memory budget and thread counts follow the cgroup (v1 and v2),
read from fake cgroup trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from visenc import devices
from visenc.engine import budget, host, threads

GiB = 1 << 30


def tree(tmp_path: Path, files: dict[str, str], proc: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    proc_file = tmp_path / "proc-self-cgroup"
    proc_file.write_text(proc)
    return root, proc_file


def test_cgroup_v2_limits_at_the_process_own_cgroup(tmp_path):
    root, proc = tree(
        tmp_path,
        {"memory.max": "max", "cpu.max": "max 100000", "app/memory.max": str(4 * GiB), "app/cpu.max": "150000 100000"},
        "0::/app\n",
    )
    assert host.cgroup_memory_limit(root, proc) == 4 * GiB
    assert host.cgroup_cpu_limit(root, proc) == 1.5
    assert host.usable_memory_bytes(root, proc) == min(4 * GiB, host.host_memory_bytes())
    assert host.usable_cores(root, proc) == min(2, len(os.sched_getaffinity(0)))


def test_cgroup_v2_namespace_root_and_unlimited(tmp_path):
    root, proc = tree(tmp_path, {"memory.max": str(3 * GiB), "cpu.max": "max 100000"}, "0::/\n")
    assert host.cgroup_memory_limit(root, proc) == 3 * GiB
    assert host.cgroup_cpu_limit(root, proc) is None
    assert host.usable_cores(root, proc) == len(os.sched_getaffinity(0))


def test_cgroup_v1_limits(tmp_path):
    root, proc = tree(
        tmp_path,
        {
            "memory/memory.limit_in_bytes": str(2 * GiB),
            "cpu,cpuacct/cpu.cfs_quota_us": "50000",
            "cpu,cpuacct/cpu.cfs_period_us": "100000",
        },
        "12:memory:/\n4:cpu,cpuacct:/\n",
    )
    assert host.cgroup_memory_limit(root, proc) == 2 * GiB
    assert host.cgroup_cpu_limit(root, proc) == 0.5
    assert host.usable_cores(root, proc) == 1  # at least one


def test_cgroup_v1_unlimited_values(tmp_path):
    root, proc = tree(
        tmp_path,
        {
            "memory/memory.limit_in_bytes": str(9223372036854771712),
            "cpu/cpu.cfs_quota_us": "-1",
            "cpu/cpu.cfs_period_us": "100000",
        },
        "12:memory:/\n4:cpu:/\n",
    )
    assert host.cgroup_memory_limit(root, proc) is None
    assert host.cgroup_cpu_limit(root, proc) is None


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert host.cgroup_memory_limit(tmp_path / "none", tmp_path / "none-proc") is None
    assert host.cgroup_cpu_limit(tmp_path / "none", tmp_path / "none-proc") is None


def test_budget_and_threads_follow_the_container(tmp_path, monkeypatch: pytest.MonkeyPatch):
    root, proc = tree(tmp_path, {"memory.max": str(GiB), "cpu.max": "100000 100000"}, "0::/\n")
    monkeypatch.setattr(host, "CGROUP_ROOT", root)
    monkeypatch.setattr(host, "PROC_CGROUP", proc)
    monkeypatch.setattr(host.usable_memory_bytes, "__defaults__", (root, proc))
    monkeypatch.setattr(host.usable_cores, "__defaults__", (root, proc))
    assert budget.device_memory_budget(devices.for_device("cpu"), 0.5) == GiB // 2
    assert threads.default_torch_threads(torch.device("cpu")) == 1
    assert threads.default_preprocess_workers(torch.device("cpu")) == 1
