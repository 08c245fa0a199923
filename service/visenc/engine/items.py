"""A request's items as intake works on them: each one's state, one object, moved stage by stage.

An item is at one stage until intake decides its outcome, and its ``state`` says which (intake matches on
it; nothing reads a stage from which fields happen to be set):

* stages: ``HashOnly`` (a hash alone: it can only hit), ``Upload`` (bytes not yet inspected),
  ``Encodable`` (bytes or a video's tube, inspected: what a new job is given), ``Frames`` (a video's
  frames, not yet inspected) and ``Tubes`` (a video, inspected: taken as its tubes, ``videos.py``);
* outcomes: ``Failed`` (its error), ``Found`` (its entry), ``Pending`` (the job it waits on),
  ``VideoPending`` (a video asked by hash whose tubes are being encoded: its manifest) or ``MISSING``
  (a hash alone the index does not hold).

* ``itemise``: each item's first stage, and the checks that need no work (a hash's syntax, an item
  with neither hash nor bytes);
* ``inspect``: every upload hashed (and checked against its given hash) and probed in the CPU pool,
  off the event loop; a failure is that item's outcome, the other items proceed;
* ``waves``: the spans intake takes one after another, so the first images of a big request start
  encoding while the later ones are still being inspected;
* ``ImageRequest``: what intake takes and answers for a request of images (``videos.VideoRequest``
  the same for a request with videos).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from visenc.engine.interface import EncodeItem, Handle
from visenc.engine.job import Job
from visenc.engine.prepare import ImagePrep, Inspected, Source, Video
from visenc.errors import EncodeFailed, InvalidHash, InvalidVideo, NotReady, VisencError
from visenc.imaging.video import VideoPreprocess
from visenc.index.memory import Lease
from visenc_client.format import Entry, is_valid_hash

HASH_RULE = "'hash' must be 64 lowercase hex digits (SHA-256 of the bytes)"


# --- stages ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HashOnly:
    """A hash alone: found, joined, or missing; never encoded from it."""


@dataclass(frozen=True, slots=True)
class Upload:
    """Image bytes, not yet inspected (``inspect``)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Encodable:
    """Bytes (or a video's tube) and what inspecting them found: what a new job is given."""

    source: Source
    inspected: Inspected


@dataclass(frozen=True, slots=True)
class Frames:
    """A video's frames, not yet inspected (``videos.inspect_videos``)."""

    frames: list[bytes]


@dataclass(frozen=True, slots=True)
class Tubes:
    """A video, inspected: intake takes it as its tubes (``videos.VideoRequest``)."""

    video: Video


# --- outcomes ----------------------------------------------------------------------------
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


HASH_ONLY, MISSING = HashOnly(), Missing()
Stage = HashOnly | Upload | Encodable | Frames | Tubes
Outcome = Failed | Found | Pending | VideoPending | Missing


@dataclass(slots=True)
class Item:
    """One request item (an image, a video, or one of a video's tubes) and its state."""

    hash: str
    state: Stage | Outcome
    key: str = ""

    @property
    def open(self) -> bool:
        """Still at a stage: no outcome yet."""
        return isinstance(self.state, Stage)


def itemise(items: Sequence[EncodeItem]) -> list[Item]:
    """Each item's first stage; the per-item checks that need no work (the bytes are checked in ``inspect``)."""
    return [Item(item.hash or "", _first_stage(item)) for item in items]


def _first_stage(item: EncodeItem) -> Stage | Failed:
    if item.data is not None and item.frames is not None:
        return Failed(InvalidVideo("an item is an image ('data') or a video ('frames'), not both"))
    if (item.hash is None and item.data is None and item.frames is None) or (
        item.hash is not None and not is_valid_hash(item.hash)
    ):
        return Failed(InvalidHash(HASH_RULE))
    if item.frames is not None:
        return Frames(item.frames)
    return HASH_ONLY if item.data is None else Upload(item.data)


async def inspect(items: list[Item], prep: ImagePrep, pool: Executor) -> None:
    """Hash and probe every upload in the pool; a failure is that item's outcome."""
    loop = asyncio.get_running_loop()
    uploads = [(it, it.state.data) for it in items if isinstance(it.state, Upload)]
    results = await asyncio.gather(
        *(loop.run_in_executor(pool, prep.inspect, data, it.hash or None) for it, data in uploads),
        return_exceptions=True,
    )
    for (it, data), res in zip(uploads, results):
        if isinstance(res, BaseException):
            raise res  # a bug, not the image's fault
        digest, outcome = res
        if isinstance(outcome, VisencError):
            it.state, it.hash = Failed(outcome), it.hash or digest
        else:
            it.state, it.hash = Encodable(data, outcome), digest


def waves(work: list[Item]) -> Iterator[tuple[int, int]]:
    """``work`` cut into spans ending after 1, 2, 4, ... uploads (hash-only items ride along), taken
    one after another: a big request's first image starts encoding after its own inspection, not
    after every image's, and a request of hashes is one span (one index round trip)."""
    lo, uploads, size = 0, 0, 1
    for i, it in enumerate(work):
        if isinstance(it.state, Upload):
            uploads += 1
            if uploads == size:
                yield lo, i + 1
                lo, uploads, size = i + 1, 0, size * 2
    if lo < len(work):
        yield lo, len(work)


def handle_of(item: Item, hidden_size: int, dtype: str, video: VideoPreprocess | None) -> Handle:
    """The handle of ``item``'s outcome (a pending image's layout is its job's, known from its size)."""
    match item.state:
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


def joined(work: list[Item]) -> dict[int, Job]:
    """The jobs a request's items joined (each pending item holds one interest in its job)."""
    return {i: it.state.job for i, it in enumerate(work) if isinstance(it.state, Pending)}


def outcome_of(job: Job) -> Found | Failed:
    """A finished job's outcome for an item that waited on it."""
    error = job.future.exception()
    if isinstance(error, NotReady):
        raise error  # device failed, stalled or shutting down: retry (503), not a per-image failure
    if isinstance(error, VisencError) and error.item_reason is None:
        error = EncodeFailed(error.message)
    if error is not None:
        return Failed(error if isinstance(error, VisencError) else EncodeFailed("encoding failed"))
    return Found(job.future.result())


class ImageRequest:
    """A request of images (and hashes): its items are what intake takes, their handles its answer."""

    def __init__(self, items: list[Item]) -> None:
        self.work = items

    @property
    def held(self) -> list[Item]:
        """What the request's lease may pin."""
        return self.work

    def started(self, lease: Lease | None) -> None:
        """Every item is taken (found, joined or started)."""

    def answer(self, handles: list[Handle]) -> list[Handle]:
        return handles
