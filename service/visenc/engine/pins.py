"""Pins for readers: L1 keeps an entry answered ready (or pending) until its caller reads it."""

from __future__ import annotations

import dataclasses

from visenc.engine.interface import Handle, LeaseMode
from visenc.engine.items import Found, Item, Pending
from visenc.engine.videos import Videos
from visenc.index.memory import Lease
from visenc.index.tiered import Index
from visenc_client.format import Entry, entry_key


@dataclasses.dataclass(frozen=True, slots=True)
class Reader:
    """One request's lease (``None``: nothing is pinned for it), and how it reads what it is answered."""

    lease: Lease | None
    waits: bool = True

    @classmethod
    def new(cls, mode: LeaseMode, *, waits: bool) -> Reader:
        lease = None if mode == "none" else Lease.new(named=mode != "anonymous")
        return cls(lease, waits)

    def of_pending(self, uploaded: bool) -> Lease | None:
        """The lease a pending image is pinned for once stored (``None``: not pinned)."""
        return self.lease if self.waits or uploaded else None

    def handles(self, work: list[Item], handles: list[Handle]) -> list[Handle]:
        """``handles`` with the lease id where the item is pinned for this request."""
        lease = self.lease
        if lease is None or not lease.named:
            return handles
        return [dataclasses.replace(h, lease=lease.id) if self._holds(it) else h for it, h in zip(work, handles)]

    def _holds(self, item: Item) -> bool:
        match item.state:
            case Found():
                return True
            case Pending(job):
                return self.lease is not None and job.has_reader(self.lease)
        return False


class Pins:
    """Event loop only; no state of its own (L1 holds the pins)."""

    def __init__(self, index: Index, fingerprint: str, videos: Videos) -> None:
        self.index = index
        self.fingerprint = fingerprint
        self.videos = videos

    def hold(self, image_hash: str, namespace: str, entry: Entry, lease: Lease | None) -> None:
        """An item is answered ready with ``entry``: L1 keeps it (a video: its tubes) for ``lease``."""
        if lease is None:
            return
        key = entry_key(namespace, self.fingerprint, image_hash)
        if self.index.peek(key) is entry:
            self.index.pin(key, lease)
            return
        for k in self.videos.keys(image_hash, namespace):
            self.index.pin(k, lease)

    def read(self, image_hash: str, namespace: str, lease: str | None, *, last: bool) -> None:
        """A caller read rows of an image (``last``: to its last row) naming ``lease`` (or none)."""
        key = entry_key(namespace, self.fingerprint, image_hash)
        for k in self.videos.keys(image_hash, namespace) or [key]:
            self.index.read(k, lease, last=last)

    def unpin(self, work: list[Item], namespace: str, lease: Lease | None) -> None:
        """A request failed: its caller reads none of ``work``, so every pin it holds for ``lease`` goes."""
        if lease is None:
            return
        for it in work:
            key = entry_key(namespace, self.fingerprint, it.hash)
            for k in self.videos.keys(it.hash, namespace) or [key]:
                self.index.unpin(k, lease.id)
