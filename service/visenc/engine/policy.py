"""The batching policy: which waiting image is prepared next, and which ready images run together.

Order: interactive before batch (batch work keeps ``batch_floor`` of the device tokens while both wait), then
the tenants with work waiting share the device by weight (start-time fair queuing over tower-input tokens),
then, within a tenant, fetch-bumped first and prompt order (``docs/operations.md``, "Tenants")."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from visenc.engine.job import Job
from visenc.models.base import TokenLayout

#: least share of the device tokens batch work gets while interactive work waits too
BATCH_FLOOR = 0.05
#: the account name of a job charged to no tenant
NO_TENANT = ""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What the scheduler is told: the batch limits (``budget.BatchBudget`` applied), the prefetch gate, the
    class floor. One image over the limits still runs, alone."""

    max_batch_tokens: int
    max_batch_images: int
    packable: bool
    #: most tower-input tokens staged (preprocessing, ready or on the device); default two batches
    prefetch_tokens: int | None = None
    max_batch_bytes: int | None = None
    batch_floor: float = BATCH_FLOOR

    @property
    def prefetch(self) -> int:
        return self.prefetch_tokens or 2 * self.max_batch_tokens


class BatchPolicy:
    """Fair order and batch forming. ``pick``/``charge``/``refund`` run on the event loop; ``form_batch``
    reads only the jobs (their ``turn``, set before they are ready) and runs under the scheduler's lock."""

    def __init__(self, config: SchedulerConfig, batch_bytes: Callable[[Sequence[TokenLayout]], int] | None = None):
        self.config = config
        self._batch_bytes = batch_bytes
        #: each tenant's virtual time: device tokens it was handed, over its weight
        self._vtime: dict[str, float] = {}
        self._clock = 0.0
        self._active: set[str] = set()
        #: device tokens owed to batch work by interactive work that went ahead of it
        self._owed = 0.0
        self._contended = False
        self._turns = itertools.count(1)

    @staticmethod
    def _tenant(job: Job) -> tuple[str, float]:
        return (NO_TENANT, 1.0) if job.account is None else (job.account.tenant, job.account.weight)

    def pick(self, waiting: Sequence[Job]) -> Job | None:
        """The waiting job to prepare next (not taken: ``charge`` it when it is)."""
        if not waiting:
            return None
        by_class: dict[str, list[Job]] = {"interactive": [], "batch": []}
        for job in waiting:
            by_class[job.priority].append(job)
        self._activate({self._tenant(j)[0] for j in waiting})
        interactive, batch = by_class["interactive"], by_class["batch"]
        self._contended = bool(interactive and batch)
        if not batch:
            return self._fair_head(interactive)
        head = self._fair_head(batch)
        return self._fair_head(interactive) if interactive and self._owed < head.cost else head

    def _fair_head(self, jobs: Sequence[Job]) -> Job:
        """The tenant that was handed the least for its weight; its first job in its own order."""
        tenant = min({self._tenant(j)[0] for j in jobs}, key=lambda t: (self._vtime[t], t))
        return min((j for j in jobs if self._tenant(j)[0] == tenant), key=lambda j: j.queue_order)

    def _activate(self, tenants: set[str]) -> None:
        """A tenant that starts waiting again starts at the clock: time it left unused is not banked."""
        for t in tenants - self._active:
            self._vtime[t] = max(self._vtime.get(t, 0.0), self._clock)
        for t in self._active - tenants:
            if self._vtime[t] <= self._clock:
                del self._vtime[t]
        self._active = tenants

    def charge(self, job: Job) -> None:
        """``job`` leaves the queue for preparation: its tokens go to its tenant's virtual time."""
        tenant, weight = self._tenant(job)
        self._vtime.setdefault(tenant, self._clock)
        self._clock = max(self._clock, self._vtime[tenant])
        self._vtime[tenant] += job.cost / weight
        job.turn = next(self._turns)
        if job.priority == "batch":
            self._owed = max(0.0, self._owed - job.cost)
        elif self._contended:
            self._owed += job.cost * self.config.batch_floor / (1 - self.config.batch_floor)

    def refund(self, job: Job) -> None:
        """``job`` was charged and dropped before the device: its tenant did not get that time."""
        tenant, weight = self._tenant(job)
        if tenant in self._vtime:
            self._vtime[tenant] = max(self._clock, self._vtime[tenant] - job.cost / weight)

    def form_batch(self, ready: Sequence[Job]) -> list[Job]:
        """The next batch from ``ready`` (wanted jobs only): the first in order, then the others that fit, in
        order; a job that does not fit ends the batch (nothing smaller behind it overtakes it)."""
        order = sorted(ready, key=lambda j: (j.priority != "interactive", not j.urgent, j.turn, j.seq))
        if not order:
            return []
        head, config = order[0], self.config
        batch, tokens, layouts = [head], head.cost, [head.shape]
        for job in order[1:]:
            if len(batch) >= config.max_batch_images or (head.urgent and not job.urgent):
                break
            if not config.packable and job.shape.bucket != head.shape.bucket:
                continue
            if tokens + job.cost > config.max_batch_tokens or (
                self._batch_bytes is not None
                and config.max_batch_bytes is not None
                and self._batch_bytes([*layouts, job.shape]) > config.max_batch_bytes
            ):
                break
            batch.append(job)
            layouts.append(job.shape)
            tokens += job.cost
        return batch

    def prefetch_bound(self, job: Job, batch_staged: Callable[[], bool]) -> int:
        """The staged tokens ``job`` may be prepared within: the prefetch gate, one batch more for a fetch-bumped
        job, or for an interactive one while batch work holds staged input (it runs in the next batch taken,
        not behind the batch work staged ahead of it)."""
        ahead = job.urgent or (job.priority == "interactive" and batch_staged())
        return self.config.prefetch + (self.config.max_batch_tokens if ahead else 0)

    def fits(self, job: Job, staged_tokens: int, bound: int, nothing_ahead: bool) -> bool:
        """Whether staging ``job`` keeps the staged tokens within ``bound`` (always, with nothing staged)."""
        return staged_tokens + job.cost + job.decode_cost <= bound or nothing_ahead
