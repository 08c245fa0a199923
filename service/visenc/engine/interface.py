"""What the HTTP layer sees of the engine: plain data and one typed interface.

Nothing here imports torch: ``visenc.api`` depends on this module only, so the
API can be imported, tested and documented without the model stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from visenc_client.format import Entry, Handle

__all__ = ["EncodeItem", "EngineAPI", "Handle", "LeaseMode", "Timing"]

#: how a request's answers are kept for its caller to read (``engine/pins.py``): ``id``, under a lease
#: whose id the handles carry and the reads name; ``anonymous``, under one the reads name no id of
#: (callers from before leases); ``inline``, until the answer itself has read the ready rows; ``none``,
#: not at all (a caller that reads the rows elsewhere)
LeaseMode = Literal["id", "none", "anonymous", "inline"]


@dataclass(slots=True)
class EncodeItem:
    """One item of an encode request: a hash, bytes, or both."""

    hash: str | None = None
    data: bytes | None = None
    #: a video's frames (encoded images), in order
    frames: list[bytes] | None = None


@dataclass(slots=True)
class Timing:
    """Where one encode request's time went (seconds), for the response's timing headers.

    ``queue_s``: from the request's admission to the start of the last forward it
    waited for (preprocessing included; 0 when it waited for none).
    ``encode_s``: total duration of the distinct forwards that encoded the images
    it waited for (a batch shared with other requests counts once).
    Both stay 0 for an all-hit request and for ``wait=false``.
    """

    queue_s: float = 0.0
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
    ) -> list[Handle]:
        """Handles for ``items`` in order (per-item errors inside); raises only for the whole request.
        ``lease``: how each ready or pending image is kept for the caller to read (``engine/pins.py``);
        with ``id`` those handles carry the lease id its reads name."""
        ...

    async def lookup(self, image_hash: str, namespace: str, *, timeout_s: float | None = None) -> Entry:
        """The entry of an image, waiting (and raising its priority) while it is being encoded."""
        ...

    def read(self, image_hash: str, namespace: str, lease: str | None, *, last: bool) -> None:
        """A caller has read rows of an image (``last``: to its last row), naming the lease its handle
        carried (or none): that pin is unpinned (``last``) or renewed."""
        ...

    def not_ready_reason(self) -> str | None:
        """Why the engine cannot take new work now (``None`` when it can)."""
        ...

    def describe(self) -> dict[str, Any]:
        """The served model: name, fingerprint, hidden size, dtype, device, packable, row layout."""
        ...

    def layout(self, width: int, height: int) -> dict[str, Any]:
        """What a ``width x height`` image becomes, before it exists: row count, grid and its
        placeholder span (``InvalidImage`` for a size the model's processor refuses)."""
        ...

    def health(self) -> dict[str, Any]:
        """Index tiers and queue: what ``/readyz`` reports."""
        ...

    def export_gauges(self) -> None:
        """Refresh the gauges that are read, not pushed (queue depth, worker health, index health)."""
        ...
