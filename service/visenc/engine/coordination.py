"""What the stages need to know of other replicas sharing the index: one interface, built once."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Protocol, TypeAlias

from visenc.engine.claims import Claims
from visenc.engine.job import Job, Place
from visenc.engine.remote import RemoteWaits
from visenc.index.redis_claims import ClaimState
from visenc.metrics import Metrics
from visenc_client.format import Entry

#: how a wait for another replica ended: its entry; ``None``: encode it here (the other replica went away
#: or took too long); an error: fail the job with it (nobody wants it any more, or shutting down)
WaitOutcome: TypeAlias = Entry | BaseException | None
WaitEnded: TypeAlias = Callable[[Job, WaitOutcome], None]
__all__ = ["Coordination", "LocalCoordination", "Place", "SharedCoordination", "WaitEnded", "WaitOutcome"]


class Coordination(Protocol):
    async def admit(self, keys: Sequence[str]) -> dict[str, Entry | Place]:
        """Per new image at admission (one round trip): its entry if another replica wrote it meanwhile,
        else where to encode it. An image to encode here is marked queued across replicas."""
        ...

    async def elsewhere(self, key: str) -> bool:
        """Whether another replica is encoding ``key`` or has it queued (a fetch waits for it)."""
        ...

    def queued(self, job: Job) -> None:
        """``job`` waits in this replica's queue."""
        ...

    async def begin(self, job: Job) -> Entry | Place:
        """``job``'s encode starts: ``HERE`` (go on), ``ELSEWHERE`` (another replica started it) or
        the entry another replica finished."""
        ...

    def watch(self, job: Job, then: WaitEnded) -> None:
        """Wait for another replica's encode of ``job``; ``then(job, outcome)`` is called once."""
        ...

    async def unclaim(self, key: str) -> None:
        """``key``'s entry is written, or its encode failed: let the claim go."""
        ...

    @property
    def watching(self) -> int:
        """Jobs waiting for another replica."""
        ...

    def start(self) -> None: ...

    async def stop_waits(self) -> None:
        """Answer every wait for another replica (the service is shutting down)."""
        ...

    async def stop(self) -> None:
        """Let go of everything held across replicas (after the last entry is written)."""
        ...


class LocalCoordination:
    """No other replica: every image is encoded here, nothing is claimed or waited for.
    Stateless."""

    watching = 0

    async def admit(self, keys: Sequence[str]) -> dict[str, Entry | Place]:
        return dict.fromkeys(keys, Place.HERE)

    async def elsewhere(self, key: str) -> bool:
        return False

    def queued(self, job: Job) -> None:
        pass

    async def begin(self, job: Job) -> Entry | Place:
        return Place.HERE

    def watch(self, job: Job, then: WaitEnded) -> None:
        then(job, None)  # nobody else can encode it

    async def unclaim(self, key: str) -> None:
        pass

    def start(self) -> None:
        pass

    async def stop_waits(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class SharedCoordination:
    """Replicas sharing a Redis index: claims at encode start, waits for each other's encodes.
    Event loop only, no lock; owns its claims and waits: ``start``, ``stop_waits``, ``stop``."""

    def __init__(self, claims: Claims, *, poll_max_s: float, wait_s: float, metrics: Metrics) -> None:
        self.claims = claims
        self.waits = RemoteWaits(claims, poll_max_s=poll_max_s, wait_s=wait_s, metrics=metrics)
        #: jobs whose wait for another replica timed out: encoded here without a claim
        self._unclaimed: weakref.WeakSet[Job] = weakref.WeakSet()

    async def admit(self, keys: Sequence[str]) -> dict[str, Entry | Place]:
        return await self.claims.admit(keys)

    async def elsewhere(self, key: str) -> bool:
        (state,) = await self.claims.look([key]) or [ClaimState.FREE]
        return state not in (ClaimState.FREE, ClaimState.OURS)  # encoding, queued, or just written

    def queued(self, job: Job) -> None:
        self.claims.queued(job)

    async def begin(self, job: Job) -> Entry | Place:
        if job in self._unclaimed:  # waited claim_wait_s for another replica already
            self._unclaimed.discard(job)
            return Place.HERE
        return await self.claims.begin(job)

    def watch(self, job: Job, then: WaitEnded) -> None:
        def ended(job: Job, outcome: WaitOutcome, timed_out: bool) -> None:
            if timed_out:
                self._unclaimed.add(job)
            then(job, outcome)

        self.waits.watch(job, ended)

    async def unclaim(self, key: str) -> None:
        await self.claims.unclaim(key)

    @property
    def watching(self) -> int:
        return self.waits.watching

    def start(self) -> None:
        self.claims.start()
        self.waits.start()

    async def stop_waits(self) -> None:
        await self.waits.stop()

    async def stop(self) -> None:
        await self.claims.stop()
