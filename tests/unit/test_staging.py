"""The staging budget is one ledger (``engine/staging.py``): whatever happens to a job, in whatever
order, it ends holding nothing, and the scheduler's budget comes back to zero.

- the ledger alone: random sequences of charge (a line opened), decoded and free (closed) over a few
  jobs, each call repeated at will, never leave the total off what the jobs hold, and freeing every
  job leaves zero;
- the scheduler: random interleavings of admit, decode (preprocessing runs), cancel, fail (the
  preprocessing raises), take a batch and finish it, stop (``cancel_all``: whatever is not on the
  device fails, preparations started or not yet run), then the queue drained: zero every time, and
  every job finished or forwarded.

Both are deterministic: the preprocessing pool runs inline (``InlinePool``), so preparations progress
only at the steps that await them, and a failing case replays from its seed
(``pytest --hypothesis-seed=N``, or the ``@reproduce_failure`` blob hypothesis prints).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.support.stages import InlinePool, RecordedFailures, forwarded, settle

from visenc.engine.coordination import LocalCoordination
from visenc.engine.job import Job, JobState
from visenc.engine.policy import SchedulerConfig
from visenc.engine.prepare import Inspected
from visenc.engine.scheduler import Scheduler
from visenc.engine.staging import Line, Staging
from visenc.metrics import Metrics
from visenc.models.base import Prepared, TokenLayout


def make_job(i: int, cost: int, decode: int, loop: asyncio.AbstractEventLoop | None = None) -> Job:
    future = (loop or asyncio.new_event_loop()).create_future()
    j = Job(key=f"k{i}", image_hash=f"h{i}", order=(0, i), future=future, admitted_at=0.0)
    j.give_bytes(
        i.to_bytes(2, "little") + b"x" * cost, Inspected(f"h{i}", TokenLayout(cost, (1, 1, cost), 0), cost, decode)
    )
    return j


@settings(max_examples=200, deadline=None, print_blob=True)
@given(
    st.lists(st.tuples(st.integers(1, 50), st.integers(0, 200)), min_size=1, max_size=5),
    st.lists(st.tuples(st.sampled_from(["charge", "decoded", "free"]), st.integers(0, 4)), max_size=40),
)
def test_the_ledger_never_leaks_nor_frees_twice(costs: list[tuple[int, int]], calls: list[tuple[str, int]]) -> None:
    loop = asyncio.new_event_loop()
    try:
        jobs = [make_job(i, c, d, loop) for i, (c, d) in enumerate(costs)]
        ledger = Staging()
        lines: dict[int, Line] = {}  # each job's latest line, open or closed (its calls are repeated at will)
        remaining: dict[int, int] = {}
        for op, i in calls:
            job = jobs[i % len(jobs)]
            k = i % len(jobs)
            if op == "charge" and k not in remaining:
                lines[k] = ledger.open(job.cost, job.decode_cost)
            elif op == "decoded" and k in lines:
                lines[k].decoded()
            elif op == "free" and k in lines:
                lines[k].refund()
            if op == "charge":
                remaining.setdefault(k, job.cost + job.decode_cost)
            elif op == "decoded" and k in remaining:
                remaining[k] = min(remaining[k], job.cost)
            elif op == "free":
                remaining.pop(k, None)
            assert ledger.tokens == sum(remaining.values()) >= 0
        for line in lines.values():
            line.refund()
        assert ledger.tokens == 0
    finally:
        loop.close()


class Flaky:
    """Preprocessing that fails for the jobs marked to fail."""

    def __init__(self) -> None:
        self.fail: set[bytes] = set()

    def __call__(self, data: bytes) -> Prepared:
        if data[:2] in self.fail:
            raise RuntimeError("the image could not be preprocessed")
        n = len(data) - 2
        return Prepared(np.zeros((n, 1), np.float32), TokenLayout(n, (1, 1, n), 0))


OPS = st.lists(
    st.tuples(st.sampled_from(["admit", "decode", "cancel", "fail", "take", "finish", "stop"]), st.integers(0, 7)),
    max_size=30,
)


@settings(max_examples=60, deadline=None, print_blob=True)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 60)), min_size=1, max_size=8), OPS)
def test_the_scheduler_budget_comes_back_to_zero(costs: list[tuple[int, int]], ops: list[tuple[str, int]]) -> None:
    asyncio.run(scenario(costs, ops))


async def scenario(costs: list[tuple[int, int]], ops: list[tuple[str, int]]) -> None:
    loop = asyncio.get_running_loop()
    preprocess = Flaky()
    failed: list = []
    s = Scheduler(
        SchedulerConfig(max_batch_tokens=40, max_batch_images=3, packable=True, prefetch_tokens=50),
        preprocess=preprocess,
        pool=InlinePool(),
        outputs=RecordedFailures(failed),  # type: ignore[arg-type]
        coordination=LocalCoordination(),
        metrics=Metrics(),
    )
    jobs = [make_job(i, c, d, loop) for i, (c, d) in enumerate(costs)]
    admitted: set[int] = set()
    batches: list[list[Job]] = []
    for op, i in ops:
        k = i % len(jobs)
        job = jobs[k]
        if op == "admit" and k not in admitted:
            admitted.add(k)
            job.join()
            s.submit(job)
        elif op == "decode":  # let the preparations in flight finish
            await settle(s)
        elif op == "cancel" and k in admitted and job.interest > 0 and job.leave():
            s.drop(job)
        elif op == "fail":
            preprocess.fail.add(k.to_bytes(2, "little"))
        elif op == "take":
            if batch := s.take_batch():
                batches.append(batch)
        elif op == "finish" and batches:
            forwarded(s, batches.pop(0))
        elif op == "stop":
            s.cancel_all(RuntimeError("stopped"))
    for batch in batches:  # the device finishes what it took
        forwarded(s, batch)
    for k in admitted:  # every waiter goes away
        if jobs[k].interest > 0 and jobs[k].leave():
            s.drop(jobs[k])
    await settle(s)
    while batch := s.take_batch():
        forwarded(s, batch)
    s.cancel_all(RuntimeError("stopped"))
    assert s.staged_tokens == 0
    assert all(jobs[k].finished or jobs[k].state is JobState.FORWARDED for k in admitted)


async def test_a_job_left_and_joined_again_while_it_is_preprocessed_still_runs() -> None:
    # its only waiter goes while the thread preprocesses it, a new request joins it before the loop hears
    # that the preparation ended: it is still handed to the device, and one nobody joins is dropped
    from tests.support.stages import job as make_one
    from tests.support.stages import make_scheduler

    scheduler = make_scheduler()
    scheduler._pool = InlinePool()
    kept, dropped = make_one(4, (0, 0)), make_one(5, (0, 1))
    real = scheduler._preprocess

    def preprocess(data: bytes) -> Prepared:
        for j in (kept, dropped):
            if j.interest:
                j.leave()
                scheduler.drop(j)
        return real(data)

    scheduler._preprocess = preprocess
    scheduler._on_prepared = lambda j, _s: j.join() if j is kept else None
    scheduler.submit(kept)
    scheduler.submit(dropped)
    await settle(scheduler)
    assert kept.state is JobState.READY and dropped.state is JobState.FAILED
    assert scheduler.take(0.0, 0.0) == [kept]
    forwarded(scheduler, [kept])
    assert scheduler.staged_tokens == 0


async def test_a_job_both_preparing_and_ready_is_failed_once_at_stop() -> None:
    # a preprocessing thread hands its job to the ready list while the job's task still runs: stopping
    # lists it twice (preparing and ready), and it is failed, and answered, once
    from tests.support.stages import job as make_one

    from visenc.devices import for_device
    from visenc.engine.outputs import Outputs
    from visenc.errors import NotReady
    from visenc.index.memory import MemoryCache
    from visenc.index.tiered import Index

    outputs = Outputs(
        index=Index(MemoryCache(1 << 20, Metrics())),
        metrics=Metrics(),
        fingerprint="f" * 32,
        hidden_size=4,
        runtime=for_device("cpu"),
        coordination=LocalCoordination(),
    )
    outputs.start()
    twice = make_one(4, (0, 0))
    outputs.fail([twice, twice], NotReady("the service is stopping"))
    assert twice.state is JobState.FAILED
    done, _ = await asyncio.wait({twice.future}, timeout=10)
    assert done and isinstance(twice.future.exception(), NotReady)
    await outputs.stop(5.0)


def _inline_scheduler() -> Scheduler:
    """A scheduler whose preparations run on the loop's thread (``InlinePool``); it fails jobs into a record."""
    return Scheduler(
        SchedulerConfig(100, 8, False),
        preprocess=lambda data: Prepared(np.zeros((len(data), 1), np.float32), TokenLayout(len(data), (1, 1, 1), 0)),
        pool=InlinePool(),
        outputs=RecordedFailures(),  # type: ignore[arg-type]
        coordination=LocalCoordination(),
        metrics=Metrics(),
    )


async def test_a_job_handed_over_while_its_task_runs_is_in_the_backlog_once() -> None:
    # the gauges and the tenants' queues read the backlog: a job its thread made ready, whose task has
    # not yet ended on the loop, is one job waiting for the device, not two
    loop = asyncio.get_running_loop()
    scheduler = _inline_scheduler()
    handed = make_job(0, 4, 0, loop)
    handed.join()
    scheduler.submit(handed)
    for _ in range(10):
        if handed.state is JobState.READY:
            break
        await asyncio.sleep(0)
    assert handed.state is JobState.READY and any(not t.done() for t in scheduler._preparing)
    assert scheduler.backlog() == [handed]
    await settle(scheduler)
    assert scheduler.backlog() == [handed]


def _handing_over(loop: asyncio.AbstractEventLoop, hand_first: bool) -> tuple[Scheduler, Job, threading.Thread]:
    """A scheduler whose one job is preparing; reading its preparing jobs lets the job's thread hand it
    over, before (``hand_first``) or after the job is read. That thread waits for the scheduler's lock."""
    scheduler = _inline_scheduler()
    job = make_job(0, 4, 0, loop)
    job.join()
    job.queue()
    job.start_preparing(scheduler.staging)
    handed = threading.Thread(target=scheduler._prepare_and_hand, args=(job, job.take_bytes()))

    class HandOverWhileRead(dict):  # type: ignore[type-arg]
        def items(self):  # type: ignore[no-untyped-def]
            if not hand_first:
                yield from super().items()
            if not handed.is_alive() and job.state is JobState.PREPARING:
                handed.start()
                handed.join(timeout=1)  # returns at once where the reader does not hold the lock
            if hand_first:
                yield from super().items()

    scheduler._preparing = HandOverWhileRead({loop.create_task(asyncio.sleep(60)): job})
    return scheduler, job, handed


async def test_the_depth_counts_a_job_once_while_its_thread_hands_it_over() -> None:
    # the depth gauge reads the preparing jobs, then the ready list: the job is counted once, not twice
    scheduler, job, handed = _handing_over(asyncio.get_running_loop(), hand_first=False)
    assert scheduler.depth == 1
    handed.join()
    assert job.state is JobState.READY and scheduler._ready == [job] and scheduler.depth == 1
    for task in scheduler._preparing:
        task.cancel()


async def test_a_job_handed_over_meanwhile_still_holds_the_prefetch_gate() -> None:
    # the gate reads the ready list, then the preparing jobs: a job staged in either is ahead, never in neither
    scheduler, job, handed = _handing_over(asyncio.get_running_loop(), hand_first=True)
    assert not scheduler._fits(make_job(1, 4, 0, job.future.get_loop()), 0)
    handed.join()
    assert job.state is JobState.READY and not scheduler._fits(make_job(1, 4, 0, job.future.get_loop()), 0)
    for task in scheduler._preparing:
        task.cancel()
