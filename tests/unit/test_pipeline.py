"""The engine pipeline: memory-bounded batches, staging charges, and preprocessing of
batch N+1 overlapping the forward of batch N, off the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import torch
from harness.waits import until
from tests.support.stages import SlowTower, forwarded, job, make_scheduler, pipeline

from visenc.engine.policy import BatchPolicy, SchedulerConfig
from visenc.errors import InvalidHash
from visenc.models.base import Prepared


async def test_batches_stay_under_the_byte_budget():
    s = make_scheduler(packable=True, max_tokens=1000, max_images=64)

    def batch_bytes(layouts):  # linear + the largest image's quadratic share
        return sum(lay.num_tokens for lay in layouts) + max(lay.num_tokens for lay in layouts) ** 2 // 10

    s.policy = BatchPolicy(SchedulerConfig(1000, 64, True, max_batch_bytes=100), batch_bytes)
    jobs = [job(10, (0, 0)), job(30, (0, 1)), job(10, (0, 2)), job(10, (0, 3)), job(40, (0, 4))]
    for j in jobs:
        s.submit(j)
    await until(lambda: len(s._ready) == 5)
    first = s.take_batch()
    # the 30 would bring 40 + 90 > 100: the batch stops there (no smaller job overtakes it: token order)
    assert first == [jobs[0]]
    assert batch_bytes([j.layout for j in first]) <= 100
    assert s.take_batch() == [jobs[1]]  # 30 + 90 > 100 on its own: runs, alone
    third = s.take_batch()
    assert third == [jobs[2], jobs[3]] and batch_bytes([j.layout for j in third]) <= 100
    assert s.take_batch() == [jobs[4]]


async def test_decode_charge_is_held_only_while_preprocessing():
    s = make_scheduler(prefetch=30)
    a, b = job(5, (0, 0), "A"), job(5, (0, 1), "A")
    a.decode_cost = b.decode_cost = 20  # a large source image for a small tower input
    s.submit(a)
    s.submit(b)
    assert s.staged_tokens == 25 and len(s._waiting) == 1  # b's 25 would cross 30 while a decodes
    await until(
        lambda: len(s._ready) == 2, 1.0, "2 ready"
    )  # a's decode charge is released when it is ready: b may start
    assert s.staged_tokens == 10
    forwarded(s, s.take_batch())
    assert s.staged_tokens == 0 and s.idle


async def test_preprocessing_overlaps_the_forward_and_never_runs_on_the_loop():
    tower = SlowTower(forward_s=0.15, preprocess_s=0.03)
    pool, outputs, s, worker = pipeline(tower, batch=4, prefetch=8)
    peak_staged = 0
    await asyncio.wrap_future(worker._thread.submit(lambda: None))  # the device thread is up (dynamo imported)
    worker.start()
    try:
        jobs = [job(1, (0, i), "only") for i in range(16)]
        for j in jobs:
            s.submit(j)

        def all_encoded() -> bool:
            nonlocal peak_staged
            peak_staged = max(peak_staged, s.staged_tokens)
            return all(j.future.done() for j in jobs)

        await until(all_encoded, 60, "16 images encoded", interval_s=0.005)
    finally:
        await worker.stop(5.0)
        await outputs.stop(5.0)
        pool.shutdown()
    assert all(j.future.result().rows == 1 for j in jobs)
    assert peak_staged <= 8  # two batches of 4: the prefetch gate holds
    loop_thread = threading.current_thread().name
    assert all(name.startswith("visenc-pre") and name != loop_thread for *_, name in tower.preps)
    assert sum(n for *_, n in tower.forwards) == 16 and max(n for *_, n in tower.forwards) == 4
    # while each forward but the last ran, the pool was preprocessing images of a later batch
    overlapped = [any(p0 < f1 and p1 > f0 for p0, p1, _ in tower.preps) for f0, f1, _ in tower.forwards[:-1]]
    assert all(overlapped), overlapped


class GroupedTower(SlowTower):
    """Cuts every batch into one forward per image, as a CPU Qwen tower does with large images."""

    def forward_groups(self, batch: Sequence[Prepared]) -> list[list[int]]:
        return [[i] for i in range(len(batch))]


async def test_each_forward_gives_its_images_back_to_the_budget_before_the_batch_ends():
    """A batch of 3 forwarded image by image, bound 4: the 4th image is staged when the batch is
    taken; each forward's image leaves the staged budget when its own forward ends, so the 5th
    (over the bound until then) is preprocessed while the batch's later forwards still run,
    instead of after the whole batch."""
    tower = GroupedTower(forward_s=0.1, preprocess_s=0.01)
    pool, outputs, s, worker = pipeline(tower, batch=3, prefetch=4)
    staged_at_start: list[int] = []
    forward = tower.forward

    def recording_forward(batch: Sequence[Prepared]) -> list[torch.Tensor]:
        staged_at_start.append(s.staged_tokens)
        return forward(batch)

    tower.forward = recording_forward  # type: ignore[method-assign]
    jobs = [job(1, (0, i), "only") for i in range(5)]
    for j in jobs[:3]:
        s.submit(j)
    await until(lambda: len(s._ready) == 3)
    s.submit(jobs[3])  # 3 + 1 <= 4: staged at once
    s.submit(jobs[4])  # 5 > 4 with four images ahead of the device: it waits
    assert s._waiting == [jobs[4]]
    worker.start()
    try:
        await asyncio.wait_for(asyncio.gather(*(j.future for j in jobs)), 10)
    finally:
        await worker.stop(5.0)
        await outputs.stop(5.0)
        pool.shutdown()
    assert [n for *_, n in tower.forwards] == [1, 1, 1, 1, 1]
    # 3 + the 4th; 2 + the 4th and 5th; then never over the bound (the device thread may start a forward
    # before the loop has taken the one before it back: it never waits for the loop)
    assert staged_at_start[:2] == [4, 4] and max(staged_at_start) <= 4
    fifth_prep_start = tower.preps[4][0]
    first_forward_end, last_of_batch_end = tower.forwards[0][1], tower.forwards[2][1]
    assert first_forward_end <= fifth_prep_start < last_of_batch_end
    assert s.staged_tokens == 0 and s.idle


def test_intake_waves_end_after_1_2_4_uploads_and_hashes_ride_along():
    from visenc.engine.items import HASH_ONLY, Failed, Item, Upload, waves

    def spans(kinds: str) -> list[tuple[int, int]]:  # "d": an upload, "h": a hash only
        return list(waves([Item("", Upload(b"x") if k == "d" else HASH_ONLY) for k in kinds]))

    assert spans("h" * 8) == [(0, 8)]  # a request of hashes: one wave, one index round trip
    assert spans("d") == [(0, 1)]
    assert spans("d" * 8) == [(0, 1), (1, 3), (3, 7), (7, 8)]
    assert spans("hhdhdd" + "h") == [(0, 3), (3, 6), (6, 7)]  # the last wave is whatever remains
    assert spans("") == []
    bad = Item("", Failed(InvalidHash("bad")))  # an item already refused does not count
    assert list(waves([bad, Item("", Upload(b"x")), Item("", Upload(b"x"))])) == [(0, 2), (2, 3)]
