"""The handle of one image (its status, and enough to lay out its prompt) and the per-item error reasons."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

Status = Literal["ready", "pending", "missing", "error"]
STATUSES: tuple[str, ...] = get_args(Status)

#: the stable reason code of an item whose ``status`` is ``error`` (docs/api.md)
Reason = Literal[
    "invalid_hash",
    "hash_mismatch",
    "invalid_image",
    "invalid_video",
    "image_too_large",
    "encode_failed",
    "out_of_memory",
]
REASONS: tuple[str, ...] = get_args(Reason)

#: the encode request header saying how answers are pinned for the caller: ``id`` (a lease per handle),
#: ``none``; absent: the first read of an image's last row that names no lease unpins (docs/api.md)
LEASE_HEADER = "X-Visenc-Lease"

#: an encode's class (header ``X-Visenc-Priority`` or the body's ``priority``): interactive work goes before
#: batch work on the device; batch work keeps a floor of it (docs/operations.md, "Tenants")
Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[str, ...] = get_args(Priority)
DEFAULT_PRIORITY: Priority = "interactive"
PRIORITY_HEADER = "X-Visenc-Priority"


@dataclass(frozen=True, slots=True)
class Handle:
    """One image's embedding handle: its status, and enough to lay out its prompt even while pending.
    ``rows``: the embedding, where the encode asked ``include_rows``; ``lease``: the pin a read names to unpin."""

    hash: str
    status: Status
    num_tokens: int | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    grid_thw: tuple[int, int, int] | None = None
    error: str | None = None
    reason: Reason | None = None
    rows: np.ndarray | None = field(default=None, compare=False, repr=False)
    #: a video's tubes' hashes, in order (``num_tokens / grid_thw[0]`` rows each); ``None`` for an image
    tubes: tuple[str, ...] | None = None
    lease: str | None = None

    def to_wire(self) -> dict[str, Any]:
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
