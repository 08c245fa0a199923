"""One memory budget per process: its default on a GPU host and in a container, and its split.

The host is faked only where it is read: NVML (a fake ``pynvml`` module, or the one function that
asks it) and the cgroup tree (fake files). The arithmetic is the service's own."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from tests.support.api import running_app

from visenc import process_memory
from visenc.bootstrap import staged
from visenc.config import Settings
from visenc.engine.budget import STAGED_LINE_FACTOR, STAGING_SHARE
from visenc.engine.host import host_memory_bytes

GiB = 1 << 30


def no_cgroup(tmp_path: Path) -> tuple[Path, Path]:
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/\n")
    (tmp_path / "cgroup").mkdir()
    (tmp_path / "cgroup" / "memory.max").write_text("max\n")
    return tmp_path / "cgroup", proc


def cgroup_of(tmp_path: Path, limit: int) -> tuple[Path, Path]:
    root, proc = no_cgroup(tmp_path)
    (root / "memory.max").write_text(f"{limit}\n")
    return root, proc


def fake_nvml(monkeypatch: pytest.MonkeyPatch, count: int | None) -> None:
    """A ``pynvml`` that sees ``count`` GPUs (``None``: no driver, nvmlInit fails)."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def init() -> None:
        if count is None:
            raise NVMLError("NVML Shared Library Not Found")

    nvml.NVMLError = NVMLError  # type: ignore[attr-defined]
    nvml.nvmlInit = init  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: count  # type: ignore[attr-defined]
    nvml.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)


def test_nvml_counts_every_gpu_of_the_host_whatever_cuda_visible_devices_says(monkeypatch):
    fake_nvml(monkeypatch, 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert process_memory.host_gpu_count() == 8
    fake_nvml(monkeypatch, None)
    assert process_memory.host_gpu_count() == 1  # no driver: one
    fake_nvml(monkeypatch, 0)
    assert process_memory.host_gpu_count() == 1  # no GPU: one


def test_an_8_gpu_host_without_a_cgroup_limit_gives_each_process_an_eighth(tmp_path, monkeypatch):
    fake_nvml(monkeypatch, 8)
    root, proc = no_cgroup(tmp_path)
    split = process_memory.plan(Settings(), root, proc)
    assert split.total == int(process_memory.PROCESS_SHARE * host_memory_bytes() / 8)
    assert "8 GPU" in split.source
    done = process_memory.with_staged(split, Settings(), staged=64 << 20)
    assert done.l1 + done.overflow + done.shm + done.staged + done.joined == done.total
    assert done.shm == int(process_memory.SHM_SHARE * done.total)
    assert done.joined == int(process_memory.JOIN_SHARE * done.total)
    assert done.overflow == int(process_memory.OVERFLOW_SHARE * done.total)
    # eight processes, one per GPU, together stay within the host's memory
    assert 8 * done.total <= host_memory_bytes()


def test_a_container_limit_sizes_the_budget_whatever_the_gpus(tmp_path, monkeypatch):
    fake_nvml(monkeypatch, 8)
    limit = min(16 * GiB, host_memory_bytes() // 2)
    root, proc = cgroup_of(tmp_path, limit)
    split = process_memory.plan(Settings(), root, proc)
    assert split.total == int(process_memory.PROCESS_SHARE * limit)
    assert "container" in split.source


def test_the_setting_overrides_and_parts_set_must_fit(tmp_path, monkeypatch):
    fake_nvml(monkeypatch, 8)
    root, proc = no_cgroup(tmp_path)
    settings = Settings(process_memory_bytes=4 * GiB, cache_bytes=GiB)
    split = process_memory.with_staged(process_memory.plan(settings, root, proc), settings, staged=GiB // 4)
    assert (split.total, split.l1, split.shm, split.overflow) == (4 * GiB, GiB, GiB, GiB // 2)
    too_big = Settings(process_memory_bytes=2 * GiB, cache_bytes=2 * GiB)
    with pytest.raises(ValueError, match="process_memory_bytes"):
        process_memory.with_staged(process_memory.plan(too_big, root, proc), too_big, staged=0)
    # without a budget set, parts set beyond the default raise it to their sum
    big = Settings(cache_bytes=host_memory_bytes())
    grown = process_memory.with_staged(process_memory.plan(big, root, proc), big, staged=0)
    assert grown.total == grown.l1 + grown.shm + grown.overflow + grown.staged + grown.joined


def test_shared_memory_off_leaves_its_part_to_l1(tmp_path, monkeypatch):
    fake_nvml(monkeypatch, 1)
    root, proc = no_cgroup(tmp_path)
    settings = Settings(process_memory_bytes=GiB, shm_enabled=False)
    split = process_memory.with_staged(process_memory.plan(settings, root, proc), settings, staged=0)
    assert split.shm == 0 and split.l1 == GiB - split.overflow - split.joined


def test_staged_inputs_are_the_schedulers_bound(tiny_tower):
    settings = Settings(max_batch_tokens=1024, prefetch_tokens=512, memory_budget_bytes=GiB)
    assert staged(tiny_tower, settings, GiB) == (512, (512 + 1024) * tiny_tower.input_bytes_per_token())


def test_on_cuda_the_staging_bound_fits_the_process_budget_not_the_host(tiny_tower, monkeypatch):
    """One batch per preprocessing worker, within an eighth of this process's budget: eight processes
    on a host never stage more than the host holds, whatever each one's pool."""
    monkeypatch.setattr(tiny_tower, "device", torch.device("cuda"))
    settings = Settings(max_batch_tokens=16384, memory_budget_bytes=GiB, preprocess_workers=64)
    line = STAGED_LINE_FACTOR * tiny_tower.input_bytes_per_token()
    roomy, _ = staged(tiny_tower, settings, 1 << 40)
    small_budget = 256 * (1 << 20)
    tight, tight_bytes = staged(tiny_tower, settings, small_budget)
    assert tight == max(2 * 16384, int(STAGING_SHARE * small_budget) // line) < roomy == (2 + 64) * 16384
    assert tight_bytes == (tight + 16384) * tiny_tower.input_bytes_per_token()


async def test_the_engine_stages_within_the_bound_the_split_counts(tiny_tower):
    """The bound is planned once, where the split is made, and handed to the engine as a setting."""
    async with running_app(tiny_tower, process_memory_bytes=GiB, preprocess_workers=3) as client:
        engine = client.app.state.engine  # type: ignore[attr-defined]
        planned, _ = staged(tiny_tower, Settings(process_memory_bytes=GiB, preprocess_workers=3), GiB)
        assert engine.settings.prefetch_tokens == engine.budget.prefetch_tokens == planned


def test_parts_set_beyond_a_budget_set_are_refused_before_the_model_loads(capsys):
    """``visenc serve`` says so and exits 2 at once, as for any invalid setting (the staged inputs,
    known once the tower is loaded, are checked then)."""
    from visenc.cli import main

    flags = ["--process-memory-bytes", str(GiB), "--cache-bytes", str(GiB), "--pin-overflow-bytes", str(GiB // 2)]
    assert main(["serve", *flags, "--shm-enabled", "false"]) == 2
    assert "process_memory_bytes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="process_memory_bytes"):
        Settings(process_memory_bytes=GiB, shm_max_bytes=GiB // 2, cache_bytes=GiB // 2 + 1)
    Settings(process_memory_bytes=GiB, shm_max_bytes=GiB // 2, cache_bytes=GiB // 2)  # the control: they fit
    Settings(process_memory_bytes=GiB, shm_max_bytes=2 * GiB, shm_enabled=False, cache_bytes=GiB)  # shm off
