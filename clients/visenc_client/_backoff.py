"""Which sources to skip for now: those whose last failures cost their callers time.

A costly failure (a connect or an answer past its timeout, or any failure that took ``COSTLY_S``) backs
its source off: it is skipped for ``first_s``, doubled with each such failure in a row up to ``max_s``,
then one caller asks it again (the probe) while the others still skip it; one answer puts it back. A
failure at once (refused, reset) backs nothing off: asking again costs nothing, and finds the source as
soon as it is back.
"""

from __future__ import annotations

import threading
import time

#: a source that could not be reached is skipped this long, doubled with each failure in a row ...
BACKOFF_FIRST_S = 1.0
#: ... up to this many times as long; then one caller asks it again, and one answer puts it back
BACKOFF_GROWTH = 30
#: a failure that took this long is costly, whatever it was (a name server that does not answer)
COSTLY_S = 1.0


class Backoff:
    """Which sources to skip now: thread-safe. ``usable(name)`` says whether to ask ``name`` (after a
    back-off, it lets one caller through, the probe); every ask that ``usable`` allowed ends with
    ``done(name, reached)``."""

    def __init__(self, first_s: float = BACKOFF_FIRST_S, *, max_s: float | None = None) -> None:
        self.first_s, self.max_s = first_s, BACKOFF_GROWTH * first_s if max_s is None else max_s
        self._failures: dict[str, int] = {}  # failures in a row, of the sources that failed last time
        self._until: dict[str, float] = {}  # monotonic: skipped before this
        self._probing: set[str] = set()
        self._lock = threading.Lock()
        #: asks that found their source unreachable, since start
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
        """An ask of ``name`` ended: it answered (``reached``), or not, at a cost (``costly``) or at once."""
        with self._lock:
            self._probing.discard(name)
            self.unreachable += not reached
            if reached or not costly:  # asking it again costs nothing
                self._failures.pop(name, None)
                self._until.pop(name, None)
                return
            failures = self._failures[name] = self._failures.get(name, 0) + 1
            self._until[name] = time.monotonic() + min(self.max_s, self.first_s * 2 ** (failures - 1))

    def skipped_for(self, name: str) -> float:
        """Seconds until ``name`` is asked again (0 when it is asked now)."""
        with self._lock:
            return max(0.0, self._until.get(name, 0.0) - time.monotonic())
