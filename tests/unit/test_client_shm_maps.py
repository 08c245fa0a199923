"""The client's cache of shared-memory maps (``visenc_client._shm``) against a real ``visenc serve`` and its
real tmpfs segments: a segment the service reaps leaves tmpfs though this process had mapped it, and two
threads mapping one segment at once keep one map, counted once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness.images import png_bytes
from harness.processes import serve_process
from harness.waits import wait_until

from visenc_client import Client, RowRange
from visenc_client import _shm as shm

LEASE_S = 1.0


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A visenc whose segments live in a folder of their own on /dev/shm, leased for ``LEASE_S``."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    directory = Path("/dev/shm") / f"visenc-test-{os.getpid()}-{tmp_path_factory.getbasetemp().name}"
    directory.mkdir()
    try:
        with serve_process("--shm-dir", str(directory), "--shm-lease-s", str(LEASE_S), "--max-wait-ms", "1") as url:
            yield {"url": url, "dir": directory}
    finally:
        for f in directory.iterdir():
            f.unlink()
        directory.rmdir()


def segments(directory: Path) -> list[str]:
    return [f.name for f in directory.iterdir() if ".probe-" not in f.name and not f.name.startswith("visenc-life-")]


def deleted_mapped_bytes(directory: Path) -> int:
    """Bytes this process still maps of files unlinked from ``directory`` (tmpfs pages nobody can free)."""
    total = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        if str(directory) in line and line.endswith("(deleted)"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            total += hi - lo
    return total


def tmpfs_used(directory: Path) -> int:
    st = os.statvfs(directory)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_reaped_segment_leaves_tmpfs_though_this_process_mapped_it(service: dict[str, Any]) -> None:
    directory = service["dir"]
    images = [png_bytes(900 + i, 896, 896) for i in range(2)]
    with Client(service["url"], shared_memory=True) as vc:
        handles = vc.encode(images)
        before = tmpfs_used(directory)
        rows = [np.array(vc.fetch(h)) for h in handles]  # copied: no view of a segment is kept
        during = tmpfs_used(directory)
    nbytes = sum(r.nbytes for r in rows)
    assert segments(directory) and nbytes >= 2 << 20
    wait_until(lambda: not segments(directory), 30, "the service reaps the segments (their lease lapsed)")
    wait_until(lambda: deleted_mapped_bytes(directory) == 0, 10, "this process unmaps the reaped segments")
    assert shm._CACHE.mapped_bytes == 0
    assert tmpfs_used(directory) < during - nbytes // 2 and during > before  # the pages went back to tmpfs


def test_two_threads_mapping_one_segment_keep_one_map(service: dict[str, Any], monkeypatch) -> None:
    """Both threads miss the cache before either maps: one map is kept and counted once, so the cache
    still keeps what is put later (before, the bytes were counted twice and never given back: the cache
    evicted every later map as it was put)."""
    with Client(service["url"], shared_memory=True) as vc:
        handles = vc.encode([png_bytes(950 + i, 224, 224) for i in range(3)])
        for h in handles:
            vc.fetch(h)
        names = sorted(segments(service["dir"]))
    size = os.path.getsize(service["dir"] / names[0])
    cache = shm._MapCache(3 * size, 0.0)
    monkeypatch.setattr(shm, "_CACHE", cache)
    both_missed = threading.Barrier(2)
    real_open = os.open

    def open_after_both_missed(path: Any, *args: Any) -> int:
        if str(path).startswith(str(service["dir"])):
            both_missed.wait(10)
        return real_open(path, *args)

    monkeypatch.setattr(shm.os, "open", open_after_both_missed)
    maps = shm.SegmentMaps(str(service["dir"]))
    threads = [threading.Thread(target=maps.nbytes, args=(names[0],)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    monkeypatch.setattr(shm.os, "open", real_open)
    assert cache.mapped_bytes == size and len(cache._maps) == 1
    for name in names[1:]:
        maps.nbytes(name)
    assert len(cache._maps) == len(names) and cache.mapped_bytes == sum(
        os.path.getsize(service["dir"] / n) for n in names
    )


def test_a_segment_swept_right_after_its_check_is_asked_for_again(tmp_path, monkeypatch) -> None:
    """The service's segment goes between the check that it is there and its open (a restarted life sweeps
    the killed one's): the known handle is not used, and the rows are asked for again."""
    monkeypatch.setattr(shm, "_CACHE", shm._MapCache(1 << 30, 0))  # no sweeper thread drops the map early
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    (tmp_path / "visenc-seg").write_bytes(rows.tobytes())
    known = shm.SegmentHandles()
    item = {"hash": "h", "segment": "visenc-seg", "offset": 0, "start": 0, "shape": [2, 4]}
    known.learn(str(tmp_path), 60.0, item, np.dtype(np.float32))
    assert np.array_equal(known.views([RowRange("h")])[0], rows)
    checked = os.path.exists

    def swept_after_check(path: Any) -> bool:
        there = checked(path)
        if str(path).endswith("visenc-seg"):
            os.unlink(path)
        return there

    monkeypatch.setattr(shm.os.path, "exists", swept_after_check)
    assert known.views([RowRange("h")]) is None
