"""Pins for readers: L1 keeps an entry answered ready (or pending) until the caller that will read it does.

A request's caller reads through a path that releases what it pinned (``interface.LeaseMode``): each
request takes one lease (``index.memory.Lease``), handed out as an id (``id``) or not (``anonymous``:
callers from before leases, whose reads name none), kept by the answer itself (``inline``: rows in the
answer), or takes none (``none``: the proxy's hand-over, a look-up whose rows are read elsewhere). An
image is pinned once per lease, however often the request names it. An image answered ``ready`` is
pinned at once; one answered ``pending`` is pinned when stored, and only for a request that waited
for it or gave its bytes to read them later (``Reader``): a look-up by hash that does not wait, or
one whose rows come inline, is told where the image stands and reads nothing of a pending one. A
handle carries the lease id only where its image is pinned (or will be) for it. A video is pinned,
and read, as its manifest and its tubes (the rows L1 holds): a video answered ready stays readable
by its hash while pinned. Every read names its lease (``read``): a read to the last
row releases the pin, a partial one renews it; the read itself moves nothing in L1's recency order
unless it names no lease and finds no pin to release (a look-up of its own). The reasoning:
``docs/internals.md``.
"""

from __future__ import annotations

import dataclasses

from visenc.engine.interface import Handle, LeaseMode
from visenc.engine.items import Found, Item, Pending
from visenc.engine.videos import tube_hashes
from visenc.errors import NotFound
from visenc.index.memory import Lease
from visenc.index.tiered import Index
from visenc_client.format import Entry, entry_key


@dataclasses.dataclass(frozen=True, slots=True)
class Reader:
    """One request's lease (``None``: nothing is pinned for it), and how it reads what it is answered."""

    lease: Lease | None
    waits: bool = True
    inline: bool = False

    @classmethod
    def new(cls, mode: LeaseMode, *, waits: bool) -> Reader:
        """The reader of one request taken with ``mode`` that ``waits`` (or not) for its images."""
        lease = None if mode == "none" else Lease.new(named=mode != "anonymous")
        return cls(lease, waits, mode == "inline")

    def of_pending(self, uploaded: bool) -> Lease | None:
        """The lease an image answered pending is pinned for once stored: where the request waits for
        it, or ``uploaded`` its bytes and reads the rows later (not inline)."""
        return self.lease if self.waits or (uploaded and not self.inline) else None

    def handles(self, work: list[Item], handles: list[Handle]) -> list[Handle]:
        """``handles`` (one per item of ``work``) with the lease id where the item is pinned, or will
        be once stored, for this request, and its caller is to name it."""
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
    def __init__(self, index: Index, fingerprint: str) -> None:
        self.index = index
        self.fingerprint = fingerprint

    def hold(self, image_hash: str, namespace: str, entry: Entry, lease: Lease | None) -> None:
        """An item is answered ready with ``entry``: L1 keeps it (a video: its tubes) for ``lease``."""
        if lease is None:
            return
        key = entry_key(namespace, self.fingerprint, image_hash)
        if self.index.peek(key) is entry:
            self.index.pin(key, lease)
            return
        for k in self._video(key, image_hash, namespace):
            self.index.pin(k, lease)

    def read(self, image_hash: str, namespace: str, lease: str | None, *, last: bool) -> None:
        """A caller read rows of an image (``last``: to its last row) naming ``lease`` (or none)."""
        key = entry_key(namespace, self.fingerprint, image_hash)
        for k in self._video(key, image_hash, namespace) or [key]:
            self.index.read(k, lease, last=last)

    def unpin(self, work: list[Item], namespace: str, lease: Lease | None) -> None:
        """A request failed (refused, past its deadline, its client gone): its caller reads none of
        ``work``, so every pin it holds for ``lease`` goes (a pending image is no longer pinned for it
        once its job is left, ``InFlight.leave``)."""
        if lease is None:
            return
        for it in work:
            key = entry_key(namespace, self.fingerprint, it.hash)
            for k in self._video(key, it.hash, namespace) or [key]:
                self.index.unpin(k, lease.id)

    def _video(self, key: str, image_hash: str, namespace: str) -> list[str]:
        """The keys of a video's tubes, then ``key`` itself, where L1 holds the video's manifest under
        ``key``; else none."""
        manifest = self.index.peek(key)
        if manifest is None or manifest.kind != "video":
            return []
        try:
            return [entry_key(namespace, self.fingerprint, t) for t in tube_hashes(manifest, image_hash)] + [key]
        except NotFound:
            return []
