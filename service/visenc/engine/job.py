"""One image's trip through the engine."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from visenc.index.format import Entry
from visenc.models.base import Prepared, TokenLayout

_arrivals = itertools.count()


@dataclass(eq=False)
class Job:
    """A distinct image being encoded (single-flight: one Job per index key).

    ``order`` is (request arrival, position in the request): jobs run in
    arrival order and, within a request, in prompt order, so the first chunk's
    images are ready first. ``urgent`` (set by a fetch that waits on it) moves
    a job ahead of every non-urgent one.

    ``interest`` counts who still wants the result: each waiting request or
    fetch, plus one for a ``wait=false`` encode (the caller will fetch later).
    A job whose interest drops to zero before its forward is dropped.
    """

    key: str
    image_hash: str
    layout: TokenLayout
    cost: int
    order: tuple[int, int]
    future: asyncio.Future[Entry]
    admitted_at: float
    data: bytes | None = None
    #: extra staging charge (input-token units) while the image is decoded and
    #: preprocessed: its decoded pixels, which can dwarf the tower input
    decode_cost: int = 0
    prepared: Prepared | None = None
    urgent: bool = False
    interest: int = 0
    #: set by the worker: monotonic start of the forward that ran this job, and its duration (s)
    started_at: float | None = None
    forward_s: float | None = None
    seq: int = field(default_factory=lambda: next(_arrivals))

    @property
    def priority(self) -> tuple[bool, tuple[int, int], int]:
        return (not self.urgent, self.order, self.seq)


@dataclass(slots=True)
class Timing:
    """Where one encode request's time went (seconds), for the response's timing headers.

    ``queue_s``: from the request's admission to the start of the last forward it
    waited for (preprocessing included; 0 when it waited for none).
    ``encode_s``: total duration of the distinct forwards that encoded the images
    it waited for (a batch shared with other requests counts once).
    Both stay 0 for an all-hit request and for ``wait=false``.
    """

    queue_s: float = 0.0
    encode_s: float = 0.0

    @classmethod
    def of(cls, admitted_at: float, jobs: list[Job]) -> Timing:
        started = [j.started_at for j in jobs if j.started_at is not None]
        forwards = {j.started_at: j.forward_s for j in jobs if j.forward_s is not None}
        return cls(max((max(0.0, s - admitted_at) for s in started), default=0.0), sum(forwards.values()))
