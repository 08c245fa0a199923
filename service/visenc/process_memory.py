"""One memory budget per process: how large it is, and how it is split."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from visenc.config import Settings
from visenc.engine.host import CGROUP_ROOT, PROC_CGROUP, cgroup_memory_limit, host_memory_bytes
from visenc.errors import VisencError
from visenc_client.format import DATA_OFFSET

if TYPE_CHECKING:
    from visenc.models.base import VisionTower

log = logging.getLogger(__name__)

#: the budget's share of the memory the process may use (the model, the runtime and the forwards use the rest)
PROCESS_SHARE = 0.5
#: shares of the budget: shared-memory segments, and pinned entries beyond L1
SHM_SHARE = 0.25
OVERFLOW_SHARE = 0.125
JOIN_SHARE = 0.0625
#: width:height of the images ``largest_entry`` sizes: 4**-4 ... 4**4, 33 of them
ASPECTS = tuple(4 ** (i / 4 - 4) for i in range(33))
#: their areas: the most pixels a decoded image may have, halved 16 times
AREA_STEPS = 17
#: rows added to the largest layout found, for sizes between those tried (a resize's rounding): 1/64
ROWS_MARGIN = 64


class BudgetTooSmall(ValueError):
    """L1 cannot hold the rows of one image of the served model: ``visenc serve`` exits 2 with this line."""


def host_gpu_count() -> int:
    """GPUs on this host, as NVML counts them (all of them, whatever ``CUDA_VISIBLE_DEVICES`` hides);
    1 where there is no NVML or no GPU."""
    return max(1, host_gpus())


def host_gpus() -> int:
    """GPUs on this host as NVML counts them; 0 where there is no NVML or no GPU."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
        return 0
    finally:
        pynvml.nvmlShutdown()


def default_budget(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> tuple[int, str]:
    """The default budget in bytes, and how it was sized (for the log)."""
    host, limit = host_memory_bytes(), cgroup_memory_limit(root, proc_cgroup)
    if limit is not None and limit < host:
        return int(PROCESS_SHARE * limit), f"{PROCESS_SHARE:g} of the container's limit, {_gib(limit)}"
    gpus = host_gpus()
    over = f"over its {gpus} GPUs" if gpus > 1 else ("no GPU" if gpus == 0 else "1 GPU")
    return int(PROCESS_SHARE * host / max(1, gpus)), f"{PROCESS_SHARE:g} of the host's {_gib(host)}, {over}"


@dataclass(frozen=True, slots=True)
class MemorySplit:
    """The process budget and its parts (bytes); ``l1 + overflow + shm + staged <= total``."""

    total: int
    source: str
    shm: int
    overflow: int
    staged: int = 0
    l1: int = 0
    joined: int = 0

    def describe(self) -> str:
        parts = self.l1 + self.overflow + self.shm + self.staged + self.joined
        return (
            f"process memory budget {_gib(self.total)} ({self.source}): L1 {_gib(self.l1)} + pinned beyond L1 "
            f"{_gib(self.overflow)} + shared memory {_gib(self.shm)} + staged inputs {_gib(self.staged)} "
            f"+ joined video rows {_gib(self.joined)} = {_gib(parts)}"
        )


def plan(settings: Settings, root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> MemorySplit:
    """The budget and the parts known before the tower is loaded (shared memory, pinned overflow);
    ``with_staged`` fills in the rest. Raises ``ValueError`` where parts set explicitly exceed a budget
    set explicitly."""
    if settings.process_memory_bytes is not None:
        total, source = settings.process_memory_bytes, "set"
    else:
        total, source = default_budget(root, proc_cgroup)
    shm = 0 if not settings.shm_enabled else settings.shm_max_bytes or int(SHM_SHARE * total)
    overflow = settings.pin_overflow_bytes if settings.pin_overflow_bytes is not None else int(OVERFLOW_SHARE * total)
    joined = settings.joined_rows_bytes if settings.joined_rows_bytes is not None else int(JOIN_SHARE * total)
    return MemorySplit(total, source, shm, overflow, joined=joined)


def with_staged(split: MemorySplit, settings: Settings, staged: int) -> MemorySplit:
    """``split`` with the staged inputs' bound and L1: ``cache_bytes``, or what the other parts leave.
    A pinned overflow left unset takes at most what L1 leaves."""
    rest = split.total - split.shm - staged - split.joined
    l1 = settings.cache_bytes if settings.cache_bytes is not None else max(0, rest - split.overflow)
    overflow = split.overflow if settings.pin_overflow_bytes is not None else max(0, min(split.overflow, rest - l1))
    if l1 + overflow <= rest:
        return MemorySplit(split.total, split.source, split.shm, overflow, staged, l1, split.joined)
    parts = (
        f"L1 {_gib(l1)}, pinned beyond it {_gib(overflow)}, shared memory {_gib(split.shm)}, staged {_gib(staged)}, "
        f"joined video rows {_gib(split.joined)}"
    )
    if settings.process_memory_bytes is not None:
        raise ValueError(f"{parts}: more than process_memory_bytes, {_gib(split.total)}")
    log.warning("%s: more than the default memory budget %s; the budget is their sum", parts, _gib(split.total))
    total = split.shm + staged + l1 + overflow + split.joined
    return MemorySplit(total, "the parts set", split.shm, overflow, staged, l1, split.joined)


def largest_entry(tower: VisionTower, max_image_pixels: int) -> tuple[int, int]:
    """(rows, stored bytes) of the largest image entry ``tower`` makes: the most rows of its layouts at
    ``ASPECTS`` x ``AREA_STEPS`` sizes up to the most pixels a decoded image may have (a size the tower
    refuses is skipped), plus ``ROWS_MARGIN``."""
    rows = 0
    for aspect in ASPECTS:
        for step in range(AREA_STEPS):
            area = max_image_pixels / 2**step
            width = max(1, round(math.sqrt(area * aspect)))
            try:
                rows = max(rows, tower.layout(width, max(1, int(area // width))).num_tokens)
            except (ValueError, VisencError):
                continue
    rows += -(-rows // ROWS_MARGIN)
    return rows, DATA_OFFSET + rows * tower.hidden_size * tower.dtype.itemsize


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
