"""The handle of one image (its status, and enough to lay out its prompt) and the per-item error reasons."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

#: ``ready``: fetch now; ``pending``: being encoded (a fetch waits); ``missing``: not in the
#: index and no bytes were sent; ``error``: this item failed (see ``reason``)
Status = Literal["ready", "pending", "missing", "error"]
STATUSES: tuple[str, ...] = get_args(Status)

#: the stable reason code of an item whose ``status`` is ``error`` (the table is in docs/api.md)
Reason = Literal[
    "invalid_hash",  # 'hash' is not 64 lowercase hex digits
    "hash_mismatch",  # the uploaded bytes hash to another value than the given 'hash'
    "invalid_image",  # the bytes are not a decodable image (empty, unknown format, corrupt, truncated)
    "invalid_video",  # a video the tower does not take (no video processor, frames of two sizes, no frames)
    "image_too_large",  # over max_image_bytes, or over max_image_pixels (decided from the header)
    "encode_failed",  # the image decoded but the model could not encode it
    "out_of_memory",  # the image alone does not fit in the device's memory (batches are split and retried first)
]
REASONS: tuple[str, ...] = get_args(Reason)

#: the encode request header that says how its answers are kept for the caller (ready images, and
#: pending ones it waits for or uploaded): ``id``, under a lease id each such handle carries and the
#: caller's reads name; ``none``, not at all (a caller that will not read the rows from this service);
#: absent, under pins the first read of an image's last row that names no lease releases (callers from
#: before leases)
LEASE_HEADER = "X-Visenc-Lease"


@dataclass(frozen=True, slots=True)
class Handle:
    """One image's embedding handle: what a caller learns about one image, enough to lay out its prompt.

    ``status`` is ``ready`` (fetch now), ``pending`` (being encoded; a fetch
    waits), ``missing`` (not in the index and no bytes were sent) or ``error``
    (``reason`` says why: ``Reason``). ``num_tokens`` / ``grid_thw`` are known
    even while pending, so a prompt can be laid out before the embeddings exist.
    ``rows`` (client side) holds the embedding itself (a read-only ``[num_tokens,
    hidden]`` array) when the encode asked for ``include_rows`` and the image was
    ready; it travels beside the wire fields, not among them. ``lease``: the id of the pin that keeps a
    ready (or pending) image in the service's memory until this caller reads it; a read that names it
    releases the pin (``docs/api.md``)."""

    hash: str
    status: Status
    num_tokens: int | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    grid_thw: tuple[int, int, int] | None = None
    error: str | None = None
    reason: Reason | None = None
    rows: np.ndarray | None = field(default=None, compare=False, repr=False)
    #: a video's tubes' hashes, in order (``grid_thw[0]`` of them, ``num_tokens / grid_thw[0]`` rows
    #: each); ``None`` for an image
    tubes: tuple[str, ...] | None = None
    lease: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The handle's wire fields (``error`` and ``reason`` only on an error; ``tubes`` null for an image)."""
        out: dict[str, Any] = {
            "hash": self.hash,
            "status": self.status,
            "num_tokens": self.num_tokens,
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "grid_thw": list(self.grid_thw) if self.grid_thw else None,
        }
        if self.error is not None:
            out["error"] = self.error
            out["reason"] = self.reason
        out["tubes"] = list(self.tubes) if self.tubes is not None else None
        out["lease"] = self.lease
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any], rows: np.ndarray | None = None) -> Handle:
        """A handle from its wire fields (``KeyError`` / ``ValueError`` / ``TypeError`` if malformed)."""
        if d["status"] not in STATUSES:
            raise ValueError(f"unknown handle status {d['status']!r}")
        grid = d.get("grid_thw")
        return cls(
            str(d["hash"]),
            d["status"],
            d.get("num_tokens"),
            d.get("hidden_size"),
            d.get("dtype"),
            (int(grid[0]), int(grid[1]), int(grid[2])) if grid else None,
            d.get("error"),
            d.get("reason"),
            rows,
            tuple(str(t) for t in d["tubes"]) if d.get("tubes") is not None else None,
            str(d["lease"]) if d.get("lease") is not None else None,
        )


#: the wire fields of a handle (``Handle.to_wire``), in order; the rows travel beside them
HANDLE_FIELDS: tuple[str, ...] = (
    "hash",
    "status",
    "num_tokens",
    "hidden_size",
    "dtype",
    "grid_thw",
    "error",
    "reason",
    "tubes",
    "lease",
)
