"""One image's trip through the engine, and who moves it along.

A ``Job`` is a distinct image being encoded (single-flight: one job per index
key). Each state transition is made by exactly one module::

    intake     ──▶ QUEUED  (handed to the scheduler)   or  WATCHING (another replica encodes it)
    remote     WATCHING ──▶ QUEUED (owner gone: encode here)
    scheduler  QUEUED ──▶ PREPARING ──▶ READY ──▶ RUNNING (taken into a batch)
    outputs    any ──▶ DONE | FAILED  (the only place a job's future is resolved)

``order`` is (request arrival, position in the request): jobs run in arrival
order and, within a request, in prompt order, so the first chunk's images are
ready first. ``urgent`` (set by a fetch that waits on it) moves a job ahead of
every non-urgent one.

``interest`` counts who still wants the result: each waiting request or fetch,
plus one for a ``wait=false`` encode (the caller will fetch later). A job whose
interest drops to zero before its forward is dropped.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from visenc_client.format import Entry

if TYPE_CHECKING:
    from visenc.models.base import Prepared, TokenLayout

_arrivals = itertools.count()


class JobState(enum.Enum):
    NEW = "new"
    WATCHING = "watching"
    QUEUED = "queued"
    PREPARING = "preparing"
    READY = "ready"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (JobState.DONE, JobState.FAILED)


@dataclass(eq=False)
class Job:
    key: str
    image_hash: str
    #: ``None`` while only the hash is known (a fetch waiting for another replica's encode)
    layout: TokenLayout | None
    cost: int
    order: tuple[int, int]
    future: asyncio.Future[Entry]
    admitted_at: float
    state: JobState = JobState.NEW
    data: bytes | None = None
    #: extra staging charge (input-token units) while the image is decoded and
    #: preprocessed: its decoded pixels, which can dwarf the tower input
    decode_cost: int = 0
    prepared: Prepared | None = None
    urgent: bool = False
    #: encode here whoever holds the claim (waited ``claim_wait_s`` for another replica already)
    unclaimed: bool = False
    interest: int = 0
    #: set by the worker: monotonic start of the forward that ran this job, and its duration (s)
    started_at: float | None = None
    forward_s: float | None = None
    seq: int = field(default_factory=lambda: next(_arrivals))

    @property
    def priority(self) -> tuple[bool, tuple[int, int], int]:
        return (not self.urgent, self.order, self.seq)

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def shape(self) -> TokenLayout:
        """The layout of a job that has its bytes (every job the scheduler holds)."""
        assert self.layout is not None, "a job without bytes reached the scheduler"
        return self.layout
