"""The staging budget: tower-input tokens held for the device, one ledger line per job.

A job is charged its input and its decode (``charge``) when its preprocessing starts; the decode share
goes when its image is decoded (``decoded``); the rest when it leaves the device's way: forwarded,
dropped, failed or cancelled (``free``). Each call is safe to repeat for a job, in any order: the ledger
frees only what it holds, so no path can leak or double-free the budget.
"""

from __future__ import annotations

from visenc.engine.job import Job


class Staging:
    def __init__(self) -> None:
        #: tokens held now (what the prefetch gate compares with its bound)
        self.tokens = 0
        self._held: dict[Job, tuple[int, int]] = {}  # job -> (input tokens, decode tokens)

    def charge(self, job: Job) -> None:
        """``job``'s preprocessing starts: its input and its decode are held (once)."""
        if job not in self._held:
            self._held[job] = (job.cost, job.decode_cost)
            self.tokens += job.cost + job.decode_cost

    def decoded(self, job: Job) -> None:
        """``job``'s image is decoded: the decode share goes, the input stays held."""
        held = self._held.get(job)
        if held is not None and held[1]:
            self._held[job] = (held[0], 0)
            self.tokens -= held[1]

    def free(self, job: Job) -> None:
        """``job`` needs no staging any more: whatever it holds goes."""
        held = self._held.pop(job, None)
        if held is not None:
            self.tokens -= sum(held)
