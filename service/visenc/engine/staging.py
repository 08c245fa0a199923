"""The staging budget: tower-input tokens held for the device, one ledger line per job.

A job opens its line when its preprocessing starts (``Job.start_preparing``): its input and its decode are
held. The decode share goes when its image is decoded (``Line.decoded``, at ``Job.prepared``); the rest when
the job leaves the states that hold staged input (``job.STAGED``: forwarded, failed, dropped, or handed to
another replica), which ``Job`` does itself on that transition. A line frees only what it still holds, so
no path can leak or double-free the budget, and nothing outside a job writes the total.
"""

from __future__ import annotations


class Staging:
    def __init__(self) -> None:
        self._tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens held now (what the prefetch gate compares with its bound)."""
        return self._tokens

    def open(self, tokens: int, decode_tokens: int) -> Line:
        """A new line holding a job's input (``tokens``) and its decode (``decode_tokens``)."""
        self._tokens += tokens + decode_tokens
        return Line(self, tokens, decode_tokens)

    def _refund(self, tokens: int) -> None:
        self._tokens -= tokens


class Line:
    """One job's hold on the budget; each call is safe to repeat, in any order."""

    __slots__ = ("_decode", "_input", "_ledger")

    def __init__(self, ledger: Staging, tokens: int, decode_tokens: int) -> None:
        self._ledger, self._input, self._decode = ledger, tokens, decode_tokens

    def decoded(self) -> None:
        """The image is decoded: the decode share goes, the input stays held."""
        self._ledger._refund(self._decode)
        self._decode = 0

    def refund(self) -> None:
        """The job needs no staging any more: whatever the line holds goes."""
        self._ledger._refund(self._input + self._decode)
        self._input = self._decode = 0
