"""One image's trip through the engine: a state machine moved only by its own methods along ``JOB_EDGES``."""

from __future__ import annotations

import asyncio
import enum
import itertools
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from visenc.engine.tenants import Account
from visenc.index.memory import Lease
from visenc_client.format import DEFAULT_PRIORITY, Entry, Priority

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
    FORWARDED = "forwarded"
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (JobState.DONE, JobState.FAILED)


S = JobState
_UNFINISHED = frozenset(s for s in S if not s.finished)
#: state -> the states a job may move to from it (the drawing in ``docs/design.md``, as data)
JOB_EDGES: dict[JobState, frozenset[JobState]] = {
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
assert all(S.FAILED in JOB_EDGES[s] for s in _UNFINISHED)
#: the states that hold staged input (the job's staging line is open): preprocessing, ready, on the device
STAGED = frozenset({S.PREPARING, S.READY, S.RUNNING})
#: the states that count against a tenant's queue: admitted here, not yet on the device
QUEUED_HERE = frozenset({S.QUEUED, S.PREPARING, S.READY})
#: the states in which the device holds it: taken into a batch, launched, its rows being copied out
ON_DEVICE = frozenset({S.RUNNING, S.FORWARDED})


_MOVES = threading.Lock()


class Place(enum.Enum):
    HERE = "here"
    ELSEWHERE = "elsewhere"


class IllegalTransition(RuntimeError):
    """A move along an edge that does not exist: a bug in the caller."""


@dataclass(eq=False)
class Job:
    """Moved only by its methods along ``EDGES``: on the loop, and ``run`` on the device thread under a lock."""

    key: str
    image_hash: str
    order: tuple[int, int]
    future: asyncio.Future[Entry]
    admitted_at: float
    #: known once the bytes are given: layout, tower-input cost, decode charge (input-token units)
    layout: TokenLayout | None = None
    cost: int = 0
    decode_cost: int = 0
    #: when the device thread took its batch: its queue wait ends there (the header's and the histogram's)
    dequeued_at: float | None = None
    started_at: float | None = None
    forward_s: float | None = None
    seq: int = field(default_factory=lambda: next(_arrivals))
    #: the tenant it is charged to (its quotas, its device share); none: counted nowhere
    account: Account | None = None
    #: its class: interactive while any request that joined it is
    priority: Priority = DEFAULT_PRIORITY
    #: its place in the order the scheduler handed jobs to preprocessing (``policy.BatchPolicy``)
    turn: int = 0
    _state: JobState = field(default=JobState.NEW, init=False)
    _interest: int = field(default=0, init=False)
    _readers: dict[str, Lease] = field(default_factory=dict, init=False, repr=False)
    _urgent: bool = field(default=False, init=False)
    _data: Source | None = field(default=None, init=False, repr=False)
    _input: Prepared | None = field(default=None, init=False, repr=False)
    _line: Line | None = field(default=None, init=False, repr=False)
    _counted: tuple[int, int, int] = field(default=(0, 0, 0), init=False, repr=False)

    @property
    def state(self) -> JobState:
        return self._state

    @property
    def finished(self) -> bool:
        return self._state.finished

    @property
    def interest(self) -> int:
        return self._interest

    @property
    def urgent(self) -> bool:
        return self._urgent

    @property
    def readers(self) -> list[Lease]:
        return list(self._readers.values())

    def has_reader(self, lease: Lease) -> bool:
        return lease.id in self._readers

    def join(self, reader: Lease | None = None, priority: Priority | None = None) -> None:
        """One more waiter wants the result; ``reader``: its lease, where it reads the entry from L1; an
        interactive waiter makes the job interactive."""
        self._interest += 1
        if reader is not None:
            self._readers[reader.id] = reader
        if priority == "interactive":
            self.priority = priority
        self._recount_now()

    def leave(self, reader: Lease | None = None) -> bool:
        """One waiter is done with it; whether nobody wants it any more."""
        self._interest -= 1
        if reader is not None and not self.finished:
            self._readers.pop(reader.id, None)
        self._recount_now()
        return self._interest <= 0 and not self.finished

    def _recount_now(self) -> None:
        with _MOVES:  # a thread's move recounts too: each reads and writes ``_counted`` as one step
            self._recount()

    def _recount(self) -> None:
        """Its account holds it while a waiter wants it: an image until it finishes, its tokens until it runs."""
        if self.account is None:
            return
        wanted = self._interest > 0 and not self._state.finished
        queued = wanted and self._state in QUEUED_HERE
        now = (int(wanted), int(queued), self.cost if queued else 0)
        self.account.change(now, self._counted)
        self._counted = now

    def bump(self) -> bool:
        """A fetch waits on it; whether it was not urgent before."""
        was, self._urgent = self._urgent, True
        return not was

    @property
    def queue_order(self) -> tuple[bool, tuple[int, int], int]:
        """Its place within its tenant and class: fetch-bumped first, then prompt order."""
        return (not self._urgent, self.order, self.seq)

    @property
    def shape(self) -> TokenLayout:
        assert self.layout is not None, "a job without bytes reached the scheduler"
        return self.layout

    @property
    def input(self) -> Prepared:
        if self._input is None:
            raise IllegalTransition(f"job {self.key} has no tower input in state {self._state.name}")
        return self._input

    def _move(self, to: JobState) -> None:
        with _MOVES:  # preprocessing and device threads move jobs too: a check and its move are one step
            if to not in JOB_EDGES[self._state]:
                raise IllegalTransition(f"job {self.key}: no edge {self._state.name} -> {to.name}")
            if self.account is not None and (self._state in ON_DEVICE) != (to in ON_DEVICE):
                self.account.hold(1 if to in ON_DEVICE else -1)
            self._state = to
            self._recount()
        if to not in STAGED and self._line is not None:
            self._line.refund()
            self._line = None

    def give_bytes(self, data: Source, inspected: Inspected) -> None:
        """The image's bytes and what inspecting them found (``NEW``, or ``FOLLOWING`` -> ``WATCHING``)."""
        if self._state is S.FOLLOWING:
            self._move(S.WATCHING)
        elif self._state is not S.NEW or self.layout is not None:
            raise IllegalTransition(f"job {self.key}: bytes given in state {self._state.name}, or twice")
        self._data, self.layout = data, inspected.layout
        self.cost, self.decode_cost = inspected.cost, inspected.decode_cost
        self._recount_now()

    def queue(self) -> None:
        self._move(S.QUEUED)

    def watch(self) -> None:
        """Wait for another replica's encode: ``WATCHING`` with bytes, ``FOLLOWING`` without."""
        self._move(S.FOLLOWING if self.layout is None else S.WATCHING)

    def start_preparing(self, staging: Staging) -> None:
        """Its preprocessing starts (``QUEUED`` -> ``PREPARING``): its input and decode are held on ``staging``."""
        self._move(S.PREPARING)
        self._line = staging.open(self.cost, self.decode_cost)

    def take_bytes(self) -> Source:
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
        self._move(S.RUNNING)

    def forwarded(self, started_at: float, forward_s: float) -> None:
        """Its forward ended: the tower input is freed now, its tokens charged to its tenant's device work."""
        self._move(S.FORWARDED)
        self.started_at, self.forward_s, self._input = started_at, forward_s, None
        if self.account is not None:
            self.account.ran(self.cost)

    def finish(self) -> None:
        self._move(S.DONE)

    def fail(self) -> None:
        self._move(S.FAILED)
        self._data = self._input = None
