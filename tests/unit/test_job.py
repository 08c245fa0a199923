"""The job state machine: every edge of ``JOB_EDGES`` can be walked through ``Job``'s methods, every other
move is refused, and what a state holds (bytes, tower input) exists only in the states that own it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np
import pytest

from visenc.engine.coordination import LocalCoordination, Place
from visenc.engine.job import JOB_EDGES, STAGED, IllegalTransition, Job, JobState
from visenc.engine.prepare import Inspected
from visenc.engine.staging import Staging
from visenc.engine.tenants import Account
from visenc.models.base import Prepared, TokenLayout
from visenc.tenancy import TenantPolicy

S = JobState
LAYOUT = TokenLayout(4, (1, 2, 2), 4)


def fresh(*, with_bytes: bool = True) -> Job:
    job = Job(key="k", image_hash="h", order=(0, 0), future=asyncio.get_running_loop().create_future(), admitted_at=0)
    if with_bytes:
        job.give_bytes(b"png", Inspected("h", LAYOUT, 4, 1))
    return job


def tower_input() -> Prepared:
    return Prepared(np.zeros((4, 1), np.float32), LAYOUT)


#: how a job reaches each state through legal moves only
PATHS: dict[JobState, Callable[[], Job]] = {}


def _path(state: JobState, before: JobState | None, step: Callable[[Job], object], *, with_bytes: bool = True):
    def reach() -> Job:
        job = fresh(with_bytes=with_bytes) if before is None else PATHS[before]()
        step(job)
        return job

    PATHS[state] = reach


_path(S.NEW, None, lambda j: None)
_path(S.FOLLOWING, None, Job.watch, with_bytes=False)
_path(S.WATCHING, S.NEW, Job.watch)
_path(S.QUEUED, S.NEW, Job.queue)
_path(S.PREPARING, S.QUEUED, lambda j: j.start_preparing(Staging()))
_path(S.READY, S.PREPARING, lambda j: (j.take_bytes(), j.prepared(tower_input())))
_path(S.RUNNING, S.READY, Job.run)
_path(S.FORWARDED, S.RUNNING, lambda j: j.forwarded(1.0, 0.5))
_path(S.DONE, S.FORWARDED, Job.finish)
_path(S.FAILED, S.NEW, Job.fail)

#: the method that moves a job to each state (``WATCHING`` from ``FOLLOWING``: the bytes arrive)
MOVES: dict[JobState, Callable[[Job], object]] = {
    S.FOLLOWING: Job.watch,
    S.WATCHING: lambda j: j.give_bytes(b"png", Inspected("h", LAYOUT, 4, 1)) if j.state is S.FOLLOWING else j.watch(),
    S.QUEUED: Job.queue,
    S.PREPARING: lambda j: j.start_preparing(Staging()),
    S.READY: lambda j: j.prepared(tower_input()),
    S.RUNNING: Job.run,
    S.FORWARDED: lambda j: j.forwarded(1.0, 0.5),
    S.DONE: Job.finish,
    S.FAILED: Job.fail,
}


def test_every_state_is_reached_and_has_a_move():
    assert set(PATHS) == set(S)
    assert set(MOVES) == set(S) - {S.NEW}  # nothing moves a job back to NEW
    assert not any(S.NEW in targets for targets in JOB_EDGES.values())


#: every (source, target) pair; FOLLOWING (waiting without bytes) is a target only for a job without
#: bytes: for any other job ``watch`` is the move to WATCHING
PAIRS = [(a, b) for a in S for b in S if b is not S.NEW and (b is not S.FOLLOWING or a in (S.NEW, S.FOLLOWING))]


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=lambda s: s.name)
async def test_each_edge_is_walked_and_every_other_move_refused(source: JobState, target: JobState):
    job = fresh(with_bytes=False) if (source, target) == (S.NEW, S.FOLLOWING) else PATHS[source]()
    assert job.state is source
    if target in JOB_EDGES[source]:
        MOVES[target](job)
        assert job.state is target
        assert job.finished is target.finished
    else:
        with pytest.raises(IllegalTransition):
            MOVES[target](job)
        assert job.state is source  # a refused move changes nothing


async def test_a_finished_job_never_moves_again():
    for state in (S.DONE, S.FAILED):
        assert JOB_EDGES[state] == frozenset()
        job = PATHS[state]()
        for move in MOVES.values():
            with pytest.raises(IllegalTransition):
                move(job)


async def test_every_unfinished_state_can_fail():
    for state in S:
        if not state.finished:
            job = PATHS[state]()
            job.fail()
            assert job.state is S.FAILED


async def test_bytes_and_tower_input_live_only_in_their_states():
    job = PATHS[S.QUEUED]()
    with pytest.raises(IllegalTransition):
        job.take_bytes()  # only once its encode started
    with pytest.raises(IllegalTransition):
        _ = job.input
    job.start_preparing(Staging())
    assert job.take_bytes() == b"png"
    with pytest.raises(IllegalTransition):
        job.take_bytes()  # taken once
    job.prepared(tower_input())
    assert job.input.layout == LAYOUT
    job.run()
    job.forwarded(3.0, 0.25)
    assert (job.started_at, job.forward_s) == (3.0, 0.25)
    with pytest.raises(IllegalTransition):
        _ = job.input  # freed with the forward


async def test_bytes_are_given_once_unless_a_fetch_adopts_them():
    job = fresh()
    with pytest.raises(IllegalTransition):
        job.give_bytes(b"again", Inspected("h", LAYOUT, 4, 1))
    follower = fresh(with_bytes=False)
    follower.watch()
    assert follower.state is S.FOLLOWING and follower.layout is None
    follower.give_bytes(b"png", Inspected("h", LAYOUT, 4, 1))
    assert follower.state is S.WATCHING and follower.cost == 4 and follower.decode_cost == 1


async def test_the_local_coordination_encodes_everything_here():
    local = LocalCoordination()
    assert await local.admit(["a", "b"]) == {"a": Place.HERE, "b": Place.HERE}
    assert not await local.elsewhere("a")
    job = PATHS[S.NEW]()
    assert await local.begin(job) is Place.HERE
    ended: list[object] = []
    local.watch(job, lambda j, outcome: ended.append((j, outcome)))
    assert ended == [(job, None)]  # nobody else can encode it: encode it here
    assert local.watching == 0


async def test_staging_is_held_only_in_the_staged_states_and_every_exit_gives_it_back():
    exits = {
        S.PREPARING: [Job.watch, Job.fail],
        S.READY: [Job.fail],
        S.RUNNING: [lambda j: j.forwarded(1.0, 0.5), Job.fail],
    }
    assert set(exits) == STAGED and all(
        set(JOB_EDGES[s]) - STAGED <= {S.WATCHING, S.FORWARDED, S.FAILED} for s in exits
    )
    for state, moves in exits.items():
        for move in moves:
            staging = Staging()
            job = PATHS[S.QUEUED]()
            job.start_preparing(staging)
            assert staging.tokens == 5  # its input (4) and its decode (1)
            if state is not S.PREPARING:
                job.take_bytes()
                job.prepared(tower_input())
                assert staging.tokens == 4  # decoded: its input alone
            if state is S.RUNNING:
                job.run()
            move(job)
            assert job.state not in STAGED and staging.tokens == 0


async def test_a_waiter_leaving_while_a_thread_moves_the_job_is_uncharged_once():
    # the loop's leave and a preprocessing thread's move both recount the job: neither may use a stale count
    mover: list[threading.Thread] = []

    class Interleaved(Account):
        def change(self, now, before):  # the thread moves the job between the leave's count and its store
            super().change(now, before)
            if not mover and now == (0, 0, 0):
                mover.append(threading.Thread(target=job.prepared, args=(tower_input(),)))
                mover[0].start()
                mover[0].join(0.5)

    account = Interleaved("a", TenantPolicy())
    job = Job(key="k", image_hash="h", order=(0, 0), future=asyncio.get_running_loop().create_future(),
              admitted_at=0, account=account)  # fmt: skip
    job.join()
    job.give_bytes(b"png", Inspected("h", LAYOUT, 4, 1))
    job.queue()
    job.start_preparing(Staging())
    assert (account.images, account.queued, account.tokens) == (1, 1, 4)
    assert job.leave()
    mover[0].join()
    assert job.state is S.READY
    assert (account.images, account.queued, account.tokens) == (0, 0, 0)
