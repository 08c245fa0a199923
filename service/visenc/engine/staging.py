"""The staging budget: tower-input tokens held for the device, one line per job, refunded by the job's own
transitions (``job.STAGED``)."""

from __future__ import annotations

import threading


class Staging:
    """Written on the loop and, through ``Job.run``, on the device thread under the scheduler's lock."""

    def __init__(self) -> None:
        self._tokens = 0
        self._lock = threading.Lock()  # lines are refunded on preprocessing and device threads too

    @property
    def tokens(self) -> int:
        """Tokens held now (what the prefetch gate compares with its bound)."""
        return self._tokens

    def open(self, tokens: int, decode_tokens: int) -> Line:
        with self._lock:
            self._tokens += tokens + decode_tokens
        return Line(self, tokens, decode_tokens)

    def _refund(self, tokens: int) -> None:
        with self._lock:
            self._tokens -= tokens


class Line:
    """One job's hold on the budget; each call is safe to repeat, in any order."""

    __slots__ = ("_decode", "_input", "_ledger")

    def __init__(self, ledger: Staging, tokens: int, decode_tokens: int) -> None:
        self._ledger, self._input, self._decode = ledger, tokens, decode_tokens

    def decoded(self) -> None:
        """The image is decoded: the decode share is refunded."""
        self._ledger._refund(self._decode)
        self._decode = 0

    def refund(self) -> None:
        """The job needs no staging any more: whatever the line holds is refunded."""
        self._ledger._refund(self._input + self._decode)
        self._input = self._decode = 0
