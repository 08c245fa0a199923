"""The C heap under the CPU forward: freed activations are kept for the next forward
instead of being faulted in again, and go back to the system when the device is idle."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness.waits import until
from tests.support.stages import SlowTower, job, pipeline

from visenc import heap

SERVICE = str(Path(__file__).resolve().parents[2] / "service")

# three 9 MiB blocks written and freed, ten times: a layer's activations, forward after forward
CYCLES = textwrap.dedent(
    """
    import ctypes, os, resource, sys
    sys.path.insert(0, SERVICE)
    from visenc import heap
    held = heap.hold_freed(KEEP)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def cycle():
        blocks = [libc.malloc(9 << 20) for _ in range(3)]
        for b in blocks:
            ctypes.memset(b, 1, 9 << 20)
        for b in reversed(blocks):
            libc.free(b)

    def resident():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    cycle()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        cycle()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    kept = resident()
    heap.trim()
    print(held, faults, (kept - resident()) >> 20)
    """
)


def cycles(keep: int, env: dict[str, str] | None = None) -> tuple[bool, int, int]:
    """(setting took effect, page faults over ten cycles, MiB given back after them)."""
    code = CYCLES.replace("SERVICE", repr(SERVICE)).replace("KEEP", str(keep))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    out = run.stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


needs_glibc = pytest.mark.skipif(heap._glibc() is None, reason="the heap settings are glibc's (mallopt)")


@needs_glibc
def test_freed_blocks_are_reused_without_faulting_and_given_back_when_asked():
    held, faults, _ = cycles(keep=256 << 20)
    assert held and faults < 100  # 27 MiB a cycle is 6912 pages: none of them faulted again
    default_held, default_faults, _ = cycles(keep=0)
    assert not default_held and default_faults > 6912  # glibc's dynamic trim refaults them, cycle after cycle
    _, _, given_back = cycles(keep=256 << 20)
    assert given_back >= 20  # the kept blocks left the process when given back


@needs_glibc
def test_the_environment_variables_start_another_process_as_hold_freed_sets_this_one():
    env = {**os.environ, **heap.environment(256 << 20)}
    held, faults, _ = cycles(keep=0, env=env)  # nothing set in-process: glibc reads the variables
    assert not held and faults < 100


async def test_the_idle_device_gives_the_heap_back_once_after_its_work(monkeypatch):
    calls: list[float] = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(0.0) or True)
    tower = SlowTower(forward_s=0.01, preprocess_s=0.0)
    pool, outputs, s, worker = pipeline(tower, batch=2, prefetch=4)
    worker.heap_idle_s = 0.5
    idle_polls = [0]
    take = worker.device.ready.take

    def counted_take(max_wait_s: float, timeout_s: float) -> list:
        batch = take(max_wait_s, timeout_s)
        idle_polls[0] += not batch
        return batch

    monkeypatch.setattr(worker.device.ready, "take", counted_take)

    async def polls_idle(times: int) -> None:
        start = idle_polls[0]
        await until(lambda: idle_polls[0] >= start + times, 10, f"{times} idle polls of the device")

    worker.start()
    try:
        await polls_idle(3)
        assert calls == []  # no work yet: nothing to give back
        first = job(1, (0, 0), "only")
        s.submit(first)
        await asyncio.wait_for(first.future, 5)
        assert calls == []  # not idle long enough yet
        await until(lambda: calls, 10, "the heap given back")
        await polls_idle(3)
        assert len(calls) == 1  # once, not at every idle poll after
        second = job(1, (0, 1), "only")
        s.submit(second)
        await asyncio.wait_for(second.future, 5)
        await until(lambda: len(calls) == 2, 10, "the heap given back after the second job")
    finally:
        await worker.stop(5.0)
        await outputs.stop(5.0)
        pool.shutdown()
