"""One image's trip through the engine: a state machine that only its own methods move.

A ``Job`` is a distinct image being encoded (one per index key). Each edge checks the state it comes from
(``EDGES``) and raises ``IllegalTransition`` otherwise; ``outputs`` alone finishes a job. Who moves each
edge: ``docs/design.md``. Its interest (``join``/``leave``) and urgency (``bump``) are its own too: a job
nobody wants any more is dropped before its forward. So is its staging line (``staging.py``): opened when
its preprocessing starts, closed by the edge that leaves ``STAGED``, whichever edge that is.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from visenc.index.memory import Lease
from visenc_client.format import Entry

if TYPE_CHECKING:
    from visenc.engine.prepare import Inspected, Source
    from visenc.engine.staging import Line, Staging
    from visenc.models.base import Prepared, TokenLayout

_arrivals = itertools.count()


class JobState(enum.Enum):
    NEW = "new"
    #: a fetch (no bytes) waiting for another replica's encode
    FOLLOWING = "following"
    #: bytes in hand, another replica encodes it: its entry is waited for
    WATCHING = "watching"
    QUEUED = "queued"
    PREPARING = "preparing"
    READY = "ready"
    RUNNING = "running"
    #: the forward ended; its rows are being copied out and packed
    FORWARDED = "forwarded"
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (JobState.DONE, JobState.FAILED)


S = JobState
_UNFINISHED = frozenset(s for s in S if not s.finished)
#: state -> the states a job may move to from it (the drawing in ``docs/design.md``, as data)
EDGES: dict[JobState, frozenset[JobState]] = {
    S.NEW: frozenset({S.QUEUED, S.WATCHING, S.FOLLOWING, S.FAILED}),
    S.FOLLOWING: frozenset({S.WATCHING, S.DONE, S.FAILED}),
    S.WATCHING: frozenset({S.QUEUED, S.DONE, S.FAILED}),
    S.QUEUED: frozenset({S.PREPARING, S.FAILED}),
    S.PREPARING: frozenset({S.WATCHING, S.READY, S.FAILED}),
    S.READY: frozenset({S.RUNNING, S.FAILED}),
    S.RUNNING: frozenset({S.FORWARDED, S.FAILED}),
    S.FORWARDED: frozenset({S.DONE, S.FAILED}),
    S.DONE: frozenset(),
    S.FAILED: frozenset(),
}
assert all(S.FAILED in EDGES[s] for s in _UNFINISHED)
#: the states that hold staged input (the job's staging line is open): preprocessing, ready, on the device
STAGED = frozenset({S.PREPARING, S.READY, S.RUNNING})


class Place(enum.Enum):
    """Where an image's encode happens (``coordination.py`` decides)."""

    HERE = "here"
    #: another replica encodes it: wait for its entry
    ELSEWHERE = "elsewhere"


class IllegalTransition(RuntimeError):
    """A stage tried to move a job along an edge that does not exist: a bug in that stage."""


@dataclass(eq=False)
class Job:
    key: str
    image_hash: str
    order: tuple[int, int]
    future: asyncio.Future[Entry]
    admitted_at: float
    #: the image's layout, tower-input cost and extra staging charge (input-token units: its decoded
    #: pixels, which can dwarf the tower input); known once the bytes are given (``give_bytes``)
    layout: TokenLayout | None = None
    cost: int = 0
    decode_cost: int = 0
    #: monotonic start of the forward that ran it, and that forward's duration (s): the jobs of one
    #: forward share both
    started_at: float | None = None
    forward_s: float | None = None
    seq: int = field(default_factory=lambda: next(_arrivals))
    _state: JobState = field(default=JobState.NEW, init=False)
    _interest: int = field(default=0, init=False)
    _readers: dict[str, Lease] = field(default_factory=dict, init=False, repr=False)
    _urgent: bool = field(default=False, init=False)
    #: the image's bytes, or a video's tube (its frames, resized when the video was inspected)
    _data: Source | None = field(default=None, init=False, repr=False)
    _input: Prepared | None = field(default=None, init=False, repr=False)
    _line: Line | None = field(default=None, init=False, repr=False)

    @property
    def state(self) -> JobState:
        return self._state

    @property
    def finished(self) -> bool:
        return self._state.finished

    @property
    def interest(self) -> int:
        """Who still wants the result."""
        return self._interest

    @property
    def urgent(self) -> bool:
        """A fetch waits on it."""
        return self._urgent

    @property
    def readers(self) -> list[Lease]:
        """The leases of the waiters that will read the entry from L1 once it is stored (pinned for them)."""
        return list(self._readers.values())

    def has_reader(self, lease: Lease) -> bool:
        """Whether the entry is pinned for ``lease`` once stored."""
        return lease.id in self._readers

    def join(self, reader: Lease | None = None) -> None:
        """One more waiter (a request, a fetch, or a ``wait=false`` caller) wants the result; ``reader``:
        its lease, when it will read the entry from L1 after the job ends (a fetch reads the result)."""
        self._interest += 1
        if reader is not None:
            self._readers[reader.id] = reader

    def leave(self, reader: Lease | None = None) -> bool:
        """One waiter is done with it (before it ends, its ``reader`` lease will read nothing); whether
        nobody wants it any more (drop it, unless finished)."""
        self._interest -= 1
        if reader is not None and not self.finished:
            self._readers.pop(reader.id, None)
        return self._interest <= 0 and not self.finished

    def bump(self) -> bool:
        """A fetch waits on it: ahead of every non-urgent job. Whether it was not urgent before."""
        was, self._urgent = self._urgent, True
        return not was

    @property
    def priority(self) -> tuple[bool, tuple[int, int], int]:
        return (not self._urgent, self.order, self.seq)

    @property
    def shape(self) -> TokenLayout:
        """The layout of a job that has its bytes (every job the scheduler queues)."""
        assert self.layout is not None, "a job without bytes reached the scheduler"
        return self.layout

    @property
    def input(self) -> Prepared:
        """The tower input (``READY`` and ``RUNNING`` only)."""
        if self._input is None:
            raise IllegalTransition(f"job {self.key} has no tower input in state {self._state.name}")
        return self._input

    def _move(self, to: JobState) -> None:
        if to not in EDGES[self._state]:
            raise IllegalTransition(f"job {self.key}: no edge {self._state.name} -> {to.name}")
        self._state = to
        if to not in STAGED and self._line is not None:
            self._line.refund()
            self._line = None

    # --- the edges ----------------------------------------------------------------------
    def give_bytes(self, data: Source, inspected: Inspected) -> None:
        """The image's bytes and what inspecting them found: at admission (``NEW``), or when a local
        encode brings them to a fetch that follows another replica (``FOLLOWING`` -> ``WATCHING``)."""
        if self._state is S.FOLLOWING:
            self._move(S.WATCHING)
        elif self._state is not S.NEW or self.layout is not None:
            raise IllegalTransition(f"job {self.key}: bytes given in state {self._state.name}, or twice")
        self._data, self.layout = data, inspected.layout
        self.cost, self.decode_cost = inspected.cost, inspected.decode_cost

    def queue(self) -> None:
        """Wait here for preprocessing (``NEW`` or ``WATCHING`` -> ``QUEUED``)."""
        self._move(S.QUEUED)

    def watch(self) -> None:
        """Wait for another replica's encode (or take the entry it finished): ``WATCHING`` with bytes,
        ``FOLLOWING`` without."""
        self._move(S.FOLLOWING if self.layout is None else S.WATCHING)

    def start_preparing(self, staging: Staging) -> None:
        """Its preprocessing starts (``QUEUED`` -> ``PREPARING``): its input and decode are held on ``staging``."""
        self._move(S.PREPARING)
        self._line = staging.open(self.cost, self.decode_cost)

    def take_bytes(self) -> Source:
        """The bytes to preprocess (``PREPARING``); the job lets go of them."""
        if self._state is not S.PREPARING or self._data is None:
            raise IllegalTransition(f"job {self.key}: bytes taken in state {self._state.name}")
        data, self._data = self._data, None
        return data

    def prepared(self, tower_input: Prepared) -> None:
        """Its tower input is made (``PREPARING`` -> ``READY``): the decode share of its staging goes."""
        self._move(S.READY)
        self._input = tower_input
        if self._line is not None:
            self._line.decoded()

    def run(self) -> None:
        """Taken into a batch for the device."""
        self._move(S.RUNNING)

    def forwarded(self, started_at: float, forward_s: float) -> None:
        """Its forward ended: the tower input is freed now, not when the request ends."""
        self._move(S.FORWARDED)
        self.started_at, self.forward_s, self._input = started_at, forward_s, None

    def finish(self) -> None:
        self._move(S.DONE)

    def fail(self) -> None:
        self._move(S.FAILED)
        self._data = self._input = None
