"""What the HTTP layer sees of the engine: plain data and one typed interface (no torch imports)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from visenc.errors import VisencError
from visenc_client.format import DEFAULT_PRIORITY, Entry, Handle, Priority

__all__ = ["EncodeItem", "EngineAPI", "Handle", "LeaseMode", "Timing"]

#: how a request's answers are kept for its caller to read (``docs/internals.md``, "Pins, leases")
LeaseMode = Literal["id", "none", "anonymous"]


@dataclass(slots=True)
class EncodeItem:
    hash: str | None = None
    data: bytes | None = None
    #: a video's frames (encoded images), in order
    frames: list[bytes] | None = None


@dataclass(slots=True)
class Timing:
    """Where one encode request's time went (seconds; both 0 for an all-hit request and ``wait=false``)."""

    #: the longest queue wait of its images: admission until the device took each one's batch
    queue_s: float = 0.0
    #: the distinct forwards waited for, each counted once
    encode_s: float = 0.0


class EngineAPI(Protocol):
    """The engine as the API uses it (``engine/core.py`` implements it)."""

    fingerprint: str

    async def encode(
        self,
        items: Sequence[EncodeItem],
        namespace: str,
        *,
        wait: bool,
        timing: Timing | None = None,
        timeout_s: float | None = None,
        lease: LeaseMode = "anonymous",
        rows: bool = False,
        priority: Priority = DEFAULT_PRIORITY,
    ) -> list[Handle]:
        """Handles for ``items`` in order (per-item errors inside); raises only for the whole request.
        ``rows``: each ready handle carries its rows (``Handle.rows``), nothing to look up again."""
        ...

    async def lookup(self, image_hash: str, namespace: str, *, timeout_s: float | None = None) -> Entry:
        """The entry of an image, waiting (and raising its priority) while it is being encoded."""
        ...

    async def lookup_many(
        self, hashes: Sequence[str], namespace: str, *, timeout_s: float | None = None
    ) -> list[Entry | VisencError]:
        """``lookup`` of every hash, located at once: each one's entry, or the error that is its answer."""
        ...

    def precheck(self, namespace: str) -> None:
        """Raise ``Overloaded`` at once where the tenant is already at one of its quotas."""
        ...

    def read(self, image_hash: str, namespace: str, lease: str | None, *, last: bool) -> None:
        """A caller read rows of an image naming its lease (or none): unpinned at the ``last`` row, else renewed."""
        ...

    def not_ready_reason(self) -> str | None:
        """Why the engine cannot take new work now (``None`` when it can)."""
        ...

    def describe(self) -> dict[str, Any]: ...

    def layout(self, width: int, height: int) -> dict[str, Any]:
        """What a ``width x height`` image becomes: row count, grid and placeholder span."""
        ...

    def health(self) -> dict[str, Any]: ...

    def export_gauges(self) -> None: ...
