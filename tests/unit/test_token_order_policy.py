"""Scheduler policy for token order: no overtaking on a full batch, bump past the prefetch gate."""

from __future__ import annotations

from harness.waits import until
from tests.support.stages import forwarded, job, make_scheduler


async def test_a_smaller_later_image_does_not_overtake_one_that_did_not_fit():
    s = make_scheduler(packable=True, max_tokens=35)
    first, big, small = job(10, (0, 0), "a"), job(30, (0, 1), "b"), job(5, (0, 2), "c")
    for j in (first, big, small):
        s.submit(j)
    await until(lambda: len(s._ready) == 3)
    assert s.take_batch() == [first]
    assert s.take_batch() == [big, small]


async def test_bump_starts_preprocessing_past_the_prefetch_gate():
    s = make_scheduler(prefetch=20, max_images=1)
    jobs = [job(10, (0, i), "A") for i in range(5)]
    for j in jobs:
        s.submit(j)
    await until(lambda: len(s._ready) == 2)
    assert jobs[4] in s._waiting
    s.bump(jobs[4])
    await until(lambda: len(s._ready) == 3)  # preprocessed although the budget (20) is already spent
    assert s.staged_tokens == 30
    assert s.take_batch() == [jobs[4]]
    assert s.take_batch() == [jobs[0]]


async def test_an_urgent_batch_is_not_padded_with_work_nobody_waits_for():
    s = make_scheduler(packable=True, max_tokens=1000)
    jobs = [job(10, (0, i), f"b{i}") for i in range(6)]
    for j in jobs:
        s.submit(j)
    await until(lambda: len(s._ready) == 6)
    s.bump(jobs[3])
    s.bump(jobs[1])
    assert s.take_batch() == [jobs[1], jobs[3]]
    assert s.take_batch() == [jobs[0], jobs[2], jobs[4], jobs[5]]


async def test_bumps_stage_at_most_one_batch_past_the_prefetch_gate():
    """Fetches bumping every queued image (300 of them) never stage more than prefetch_tokens plus one
    batch: the rest wait, urgent and first in line, for the device to free staged work."""
    prefetch, batch = 40, 20
    s = make_scheduler(prefetch=prefetch, max_tokens=batch, max_images=2)
    jobs = [job(10, (0, i), "A") for i in range(300)]
    for j in jobs:
        s.submit(j)
    peak = s.staged_tokens
    for j in reversed(jobs):
        s.bump(j)
        peak = max(peak, s.staged_tokens)
    assert peak <= prefetch + batch
    done = 0

    def device_drains() -> bool:  # the device drains it all, the bound holds throughout
        nonlocal done, peak
        got = s.take_batch()
        if got:
            assert all(j.urgent for j in got)
            forwarded(s, got)
            done += len(got)
        peak = max(peak, s.staged_tokens)
        return done >= len(jobs)

    await until(device_drains, 60, "every job forwarded", interval_s=0)
    assert peak <= prefetch + batch and s.staged_tokens == 0
