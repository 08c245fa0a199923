"""A request's items as intake works on them: syntax checks, inspection, and the waves they are taken in.

* ``itemise``: the checks that need no work (a hash's syntax, an item with neither hash nor bytes);
* ``inspect``: every upload hashed (and checked against its given hash) and probed in the CPU pool,
  off the event loop; a failure is that item's error, the other items proceed;
* ``waves``: the spans intake takes one after another, so the first images of a big request start
  encoding while the later ones are still being inspected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from visenc.engine.interface import EncodeItem
from visenc.engine.prepare import ImagePrep, Inspected, Source, Tube, Video
from visenc.errors import InvalidHash, InvalidVideo, VisencError
from visenc_client.format import Entry, is_valid_hash

HASH_RULE = "'hash' must be 64 lowercase hex digits (SHA-256 of the bytes)"


@dataclass(slots=True)
class Item:
    """One request item as intake works on it."""

    hash: str
    data: bytes | None = None
    inspected: Inspected | None = None
    error: VisencError | None = None
    key: str = ""
    entry: Entry | None = None
    #: a video item's frames, and the video they make once inspected (``videos.py``)
    frames: list[bytes] | None = None
    video: Video | None = None
    #: a video's tube (an item of its own, with no bytes)
    tube: Tube | None = None
    #: a video asked by hash whose tubes are still being encoded: its manifest
    manifest: Entry | None = None

    @property
    def source(self) -> Source | None:
        """What a job for this item is given: its bytes, or a video's tube (its resized frames)."""
        return self.data if self.data is not None else self.tube


def itemise(items: Sequence[EncodeItem]) -> list[Item]:
    """Per-item checks that need no work: the hash's syntax (the bytes are checked in ``inspect``)."""
    out = []
    for item in items:
        it = Item(item.hash or "", item.data, frames=item.frames)
        if item.data is not None and item.frames is not None:
            it.error = InvalidVideo("an item is an image ('data') or a video ('frames'), not both")
        elif (item.hash is None and item.data is None and item.frames is None) or (
            item.hash is not None and not is_valid_hash(item.hash)
        ):
            it.error = InvalidHash(HASH_RULE)
        out.append(it)
    return out


async def inspect(items: list[Item], prep: ImagePrep, pool: Executor) -> None:
    """Hash and probe every upload in the pool; a failure is that item's error."""
    loop = asyncio.get_running_loop()
    uploads = [(it, it.data) for it in items if it.data is not None and it.error is None]
    results = await asyncio.gather(
        *(loop.run_in_executor(pool, prep.inspect, data, it.hash or None) for it, data in uploads),
        return_exceptions=True,
    )
    for (it, _), res in zip(uploads, results):
        if isinstance(res, BaseException):
            raise res  # a bug, not the image's fault
        digest, outcome = res
        if isinstance(outcome, VisencError):
            it.error, it.hash = outcome, it.hash or digest
        else:
            it.hash, it.inspected = digest, outcome


def waves(work: list[Item]) -> Iterator[tuple[int, int]]:
    """``work`` cut into spans ending after 1, 2, 4, ... uploads (hash-only items ride along), taken
    one after another: a big request's first image starts encoding after its own inspection, not
    after every image's, and a request of hashes is one span (one index round trip)."""
    lo, uploads, size = 0, 0, 1
    for i, it in enumerate(work):
        if it.data is not None and it.error is None:
            uploads += 1
            if uploads == size:
                yield lo, i + 1
                lo, uploads, size = i + 1, 0, size * 2
    if lo < len(work):
        yield lo, len(work)
