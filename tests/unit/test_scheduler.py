"""Batching policy: priority, buckets, budgets, prefetch gating, dropping unwanted work."""

from __future__ import annotations

import asyncio
import time

from harness.waits import until
from tests.support.stages import forwarded, job, make_scheduler


async def test_same_bucket_batches_in_priority_order():
    s = make_scheduler()
    jobs = [job(10, (0, 0), "A"), job(20, (0, 1), "B"), job(10, (0, 2), "A"), job(10, (1, 0), "A")]
    for j in jobs:
        s.submit(j)
    await until(lambda: len(s._ready) == 4)
    assert s.take_batch() == [jobs[0], jobs[2], jobs[3]]
    assert s.take_batch() == [jobs[1]]
    assert s.take_batch() == []


async def test_packable_mixes_buckets_under_token_budget():
    s = make_scheduler(packable=True, max_tokens=35)
    jobs = [job(10, (0, i), f"b{i}") for i in range(5)]
    for j in jobs:
        s.submit(j)
    await until(lambda: len(s._ready) == 5)
    assert s.take_batch() == jobs[:3]
    assert s.take_batch() == jobs[3:]


async def test_oversized_image_runs_alone():
    s = make_scheduler(max_tokens=10)
    big = job(50, (0, 0))
    s.submit(big)
    await until(lambda: len(s._ready) == 1)
    assert s.take_batch() == [big]


async def test_urgent_job_jumps_the_queue():
    s = make_scheduler(max_images=1)
    jobs = [job(5, (0, i), "A") for i in range(3)]
    for j in jobs:
        s.submit(j)
    await until(lambda: len(s._ready) == 3)
    s.bump(jobs[2])
    assert s.take_batch() == [jobs[2]]
    assert s.take_batch() == [jobs[0]]


async def test_prefetch_budget_bounds_preprocessed_work():
    s = make_scheduler(prefetch=25)
    jobs = [job(10, (0, i), "A") for i in range(6)]
    for j in jobs:
        s.submit(j)
    await until(lambda: len(s._ready) == 2)  # a third 10 would cross 25: the rest wait with their bytes
    assert len(s._waiting) == 4 and s.staged_tokens == 20
    batch = s.take_batch()
    forwarded(s, batch)
    await until(lambda: len(s._ready) == 2)
    assert s.depth == 4 and len(s._waiting) == 2 and s.staged_tokens == 20


async def test_the_devices_next_input_is_prepared_whatever_the_bound_and_no_more():
    """A bound below two images' cost: once the device takes the one ready image, the next starts
    (nothing else is ahead of the device), and no third one while that one is ahead."""
    s = make_scheduler(prefetch=10)
    jobs = [job(8, (0, i), "A") for i in range(3)]
    for j in jobs:
        s.submit(j)
    await until(lambda: len(s._ready) == 1)
    assert len(s._waiting) == 2 and s.staged_tokens == 8  # 16 > 10, and the first is ahead
    assert s.take_batch() == [jobs[0]]
    await until(
        lambda: len(s._ready) == 1, 1.0, "1 ready"
    )  # started although 16 > 10: the device would else wait for it
    assert s._ready == [jobs[1]] and s._waiting == [jobs[2]] and s.staged_tokens == 16
    forwarded(s, [jobs[0]])
    assert s._waiting == [jobs[2]]  # 16 > 10 and jobs[1] is ahead of the device: the bound holds
    assert s.take_batch() == [jobs[1]]
    await until(lambda: len(s._ready) == 1)
    assert s._ready == [jobs[2]]


async def test_unwanted_jobs_are_dropped_before_preprocess_and_forward():
    failed: list = []
    s = make_scheduler(prefetch=10, failed=failed)
    a, b, c = job(10, (0, 0), "A"), job(10, (0, 1), "A"), job(10, (0, 2), "A")
    for j in (a, b, c):
        s.submit(j)
    await until(lambda: len(s._ready) == 1)
    a.leave()  # ready, about to be batched
    b.leave()  # still waiting for preprocessing
    assert s.take_batch() == []
    await until(lambda: len(s._ready) == 1)
    assert s.take_batch() == [c]
    assert {id(j) for j, _ in failed} == {id(a), id(b)}
    forwarded(s, [c])
    assert s.staged_tokens == 0 and s.idle


async def test_depth_counts_a_job_that_just_became_ready_once():
    """Woken by a job turning ready, before its preparation task has left the task set: the
    queue depth (what admission's 429 compares) must not count the job twice."""
    s = make_scheduler()
    s.submit(job(10, (0, 0)))
    while not s._ready:  # noqa: ASYNC110 (each loop turn: the first that sees it ready is the point)
        await asyncio.sleep(0)
    assert len(s._ready) == 1 and s.depth == 1


async def test_the_device_takes_work_that_piled_up_at_once_with_preparations_in_flight():
    """Ready work found on arrival (it piled up during the previous forward) is taken at once: the
    batch-filling wait is only for a device that was idle, never for stragglers behind a busy one."""
    s = make_scheduler()
    jobs = [job(10, (0, i), "A") for i in range(2)]
    for j in jobs:
        s.submit(j)
    await until(lambda: len(s._ready) == 2)
    s._preparations += 1  # another image is still being preprocessed
    t0 = time.monotonic()
    batch = await asyncio.to_thread(s.take, 5.0, 1.0)
    assert batch == jobs and time.monotonic() - t0 < 1.0, "the device waited for a straggler"
    s._preparations -= 1
