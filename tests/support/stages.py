"""Stand-ins for the stages around the one under test."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from visenc.engine.job import Job


class RecordedFailures:
    """An outputs stage that only records failures: ``failed`` holds ``(job, error)`` pairs."""

    def __init__(self, into: list[tuple[Job, BaseException]] | None = None) -> None:
        self.failed: list[Any] = into if into is not None else []

    def fail(self, jobs: Sequence[Job], error: BaseException) -> None:
        for job in jobs:
            if not job.finished:
                job.fail()
                self.failed.append((job, error))
