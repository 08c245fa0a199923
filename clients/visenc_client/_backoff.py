"""Which sources to skip for now: those whose last failures cost their callers time (docs/internals.md,
"The client library")."""

from __future__ import annotations

import threading
import time

BACKOFF_FIRST_S = 1.0
BACKOFF_GROWTH = 30
#: a failure that took this long is costly, whatever it was (a name server that does not answer)
COSTLY_S = 1.0


class Backoff:
    """Thread-safe. Every ask that ``usable(name)`` allowed ends with ``done(name, reached, costly)``."""

    def __init__(self, first_s: float = BACKOFF_FIRST_S, *, max_s: float | None = None) -> None:
        self.first_s, self.max_s = first_s, BACKOFF_GROWTH * first_s if max_s is None else max_s
        self._failures: dict[str, int] = {}
        self._until: dict[str, float] = {}
        self._probing: set[str] = set()
        self._lock = threading.Lock()
        self.unreachable = 0

    def usable(self, name: str) -> bool:
        with self._lock:
            if name not in self._failures:
                return True
            if name in self._probing or time.monotonic() < self._until[name]:
                return False
            self._probing.add(name)
            return True

    def done(self, name: str, reached: bool, costly: bool = True) -> None:
        with self._lock:
            self._probing.discard(name)
            self.unreachable += not reached
            if reached or not costly:
                self._failures.pop(name, None)
                self._until.pop(name, None)
                return
            failures = self._failures[name] = self._failures.get(name, 0) + 1
            self._until[name] = time.monotonic() + min(self.max_s, self.first_s * 2 ** (failures - 1))

    def skipped_for(self, name: str) -> float:
        """Seconds until ``name`` is asked again (0 when it is asked now)."""
        with self._lock:
            return max(0.0, self._until.get(name, 0.0) - time.monotonic())
