"""A request's items as intake works on them: what each one is, and its one outcome.

An item starts ``OPEN`` and ends as exactly one of: ``Failed`` (its error), ``Found`` (its entry),
``Pending`` (the job it waits on), ``VideoPending`` (a video asked by hash whose tubes are being
encoded: its manifest) or ``MISSING`` (a hash alone the index does not hold). Intake decides it;
nothing reads an outcome from which fields happen to be set.

* ``itemise``: the checks that need no work (a hash's syntax, an item with neither hash nor bytes);
* ``inspect``: every upload hashed (and checked against its given hash) and probed in the CPU pool,
  off the event loop; a failure is that item's outcome, the other items proceed;
* ``waves``: the spans intake takes one after another, so the first images of a big request start
  encoding while the later ones are still being inspected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from visenc.engine.interface import EncodeItem, Handle
from visenc.engine.job import Job
from visenc.engine.prepare import ImagePrep, Inspected, Source, Video
from visenc.errors import InvalidHash, InvalidVideo, VisencError
from visenc.imaging.video import VideoPreprocess
from visenc_client.format import Entry, is_valid_hash

HASH_RULE = "'hash' must be 64 lowercase hex digits (SHA-256 of the bytes)"


@dataclass(frozen=True, slots=True)
class Open:
    """Not decided yet."""


@dataclass(frozen=True, slots=True)
class Failed:
    error: VisencError


@dataclass(frozen=True, slots=True)
class Found:
    entry: Entry


@dataclass(frozen=True, slots=True)
class Pending:
    job: Job


@dataclass(frozen=True, slots=True)
class VideoPending:
    manifest: Entry


@dataclass(frozen=True, slots=True)
class Missing:
    """A hash alone that the index does not hold: upload the bytes."""


OPEN, MISSING = Open(), Missing()
Outcome = Open | Failed | Found | Pending | VideoPending | Missing


@dataclass(slots=True)
class Item:
    """One request item (an image, a video, or one of a video's tubes) and its outcome."""

    hash: str
    #: what a job for it is given: its bytes, or a video's tube (its resized frames); ``None``: a hash alone
    source: Source | None = None
    #: a video item's frames, and the video they make once inspected (``videos.py``)
    frames: list[bytes] | None = None
    video: Video | None = None
    inspected: Inspected | None = None
    key: str = ""
    outcome: Outcome = OPEN

    @property
    def open(self) -> bool:
        return isinstance(self.outcome, Open)

    @property
    def upload(self) -> bytes | None:
        """The image bytes this item came with (``None``: a hash alone, a video, or a tube)."""
        return self.source if isinstance(self.source, bytes) else None


def itemise(items: Sequence[EncodeItem]) -> list[Item]:
    """Per-item checks that need no work: the hash's syntax (the bytes are checked in ``inspect``)."""
    out = []
    for item in items:
        it = Item(item.hash or "", item.data, frames=item.frames)
        if item.data is not None and item.frames is not None:
            it.outcome = Failed(InvalidVideo("an item is an image ('data') or a video ('frames'), not both"))
        elif (item.hash is None and item.data is None and item.frames is None) or (
            item.hash is not None and not is_valid_hash(item.hash)
        ):
            it.outcome = Failed(InvalidHash(HASH_RULE))
        out.append(it)
    return out


async def inspect(items: list[Item], prep: ImagePrep, pool: Executor) -> None:
    """Hash and probe every upload in the pool; a failure is that item's outcome."""
    loop = asyncio.get_running_loop()
    uploads = [(it, data) for it in items if it.open and (data := it.upload) is not None]
    results = await asyncio.gather(
        *(loop.run_in_executor(pool, prep.inspect, data, it.hash or None) for it, data in uploads),
        return_exceptions=True,
    )
    for (it, _), res in zip(uploads, results):
        if isinstance(res, BaseException):
            raise res  # a bug, not the image's fault
        digest, outcome = res
        if isinstance(outcome, VisencError):
            it.outcome, it.hash = Failed(outcome), it.hash or digest
        else:
            it.hash, it.inspected = digest, outcome


def waves(work: list[Item]) -> Iterator[tuple[int, int]]:
    """``work`` cut into spans ending after 1, 2, 4, ... uploads (hash-only items ride along), taken
    one after another: a big request's first image starts encoding after its own inspection, not
    after every image's, and a request of hashes is one span (one index round trip)."""
    lo, uploads, size = 0, 0, 1
    for i, it in enumerate(work):
        if it.upload is not None and it.open:
            uploads += 1
            if uploads == size:
                yield lo, i + 1
                lo, uploads, size = i + 1, 0, size * 2
    if lo < len(work):
        yield lo, len(work)


def handle_of(item: Item, hidden_size: int, dtype: str, video: VideoPreprocess | None) -> Handle:
    """The handle of ``item``'s outcome (a pending image's layout is its job's, known from its size)."""
    match item.outcome:
        case Failed(error):
            return Handle(item.hash, "error", error=error.message, reason=error.item_reason)
        case Found(e):
            return Handle(item.hash, "ready", e.rows, e.hidden, e.dtype, e.grid_thw)
        case Pending(Job(layout=lay)) if lay is not None:
            return Handle(item.hash, "pending", lay.num_tokens, hidden_size, dtype, lay.grid_thw)
        case VideoPending(manifest) if video is not None:
            grid = manifest.grid_thw
            return Handle(item.hash, "pending", grid[0] * video.tube_tokens(grid), hidden_size, dtype, grid)
        case Pending() | VideoPending():
            return Handle(item.hash, "pending")
    return Handle(item.hash, "missing")
