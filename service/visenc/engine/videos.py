"""Videos in a request: inspected whole, then taken as their tubes, then folded back into one handle.

Nothing here runs for a request of images: intake takes a request with videos as a ``VideoRequest``
(``Videos.request``), and an image's fetch reaches video code only where the index holds a video's
manifest under the asked hash.

A video item (frames) is inspected in the CPU pool (``ImagePrep.inspect_video``: decoded and
resized as the tower's video processor does, cut into tubes keyed by their resized frames, grid
and settings). Each tube then goes through intake exactly as an image that came with bytes:
looked up, single-flight joined, placed (here or at the replica already encoding it), queued,
batched. Only the bytes differ: a tube's job carries its resized frames, which its preprocess
step normalises and patchifies.

``expand`` turns a request's items into that flat list of images and tubes (``Span`` says which
stretch is whose); ``fold`` turns the flat handles back into one handle per item, a video's from
its tubes' (ready when all are; the first failed tube's error otherwise). A video's manifest (its
tubes' hashes in order, ``visenc_client.format.pack_manifest``) is stored under the video's own
key once its tubes are taken, pinned for the request's lease with its tubes (``pins.py``), so a later
look-up by that hash alone finds its tubes (``tube_hashes``; ``Joins``: the fetch path, ``fetch.py``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from visenc.engine.interface import Handle
from visenc.engine.items import Encodable, Failed, Frames, Item, Tubes
from visenc.engine.prepare import ImagePrep, Video
from visenc.errors import NotFound, PayloadTooLarge, VisencError
from visenc.index.memory import Lease
from visenc.index.tiered import Index
from visenc.metrics import Metrics
from visenc.tasks import spawn
from visenc_client.format import (
    DATA_OFFSET,
    CorruptEntry,
    Entry,
    Status,
    entry_key,
    manifest_tubes,
    pack_entry,
    pack_manifest,
)


@dataclass(frozen=True, slots=True)
class Span:
    """Request item ``item`` became flat items ``[lo, hi)``; ``video`` when it is a video."""

    item: Item
    lo: int
    hi: int
    video: Video | None


class Videos:
    """The video side of intake: a request with videos becomes a ``VideoRequest``."""

    def __init__(self, prep: ImagePrep, pool: Executor, index: Index, metrics: Metrics) -> None:
        self.prep, self.pool, self.index, self.metrics = prep, pool, index, metrics

    async def request(self, items: list[Item], namespace: str) -> VideoRequest:
        """``items`` with each video inspected (in the pool) and taken apart into its tubes."""
        await inspect_videos(items, self.prep, self.pool)
        work, spans = expand(items)
        return VideoRequest(work, spans, lambda lease: self._store_manifests(spans, work, namespace, lease))

    def _store_manifests(self, spans: list[Span], work: list[Item], namespace: str, lease: Lease | None) -> None:
        """Each video's manifest under its own key, pinned for ``lease`` (its tubes' reader): found by the
        video's hash from now on, and kept in L1 while its tubes are kept for that reader."""
        for key, manifest in manifests(spans, work, namespace, self.prep.tower.fingerprint):
            self.index.store_local(key, manifest, leases=() if lease is None else (lease,))
            spawn(self.index.write_through(key, manifest), "manifest-write", self.metrics)


class VideoRequest:
    """A request with videos: intake takes its images and the videos' tubes (``work``); once they are
    taken the manifests are stored, and the answer folds each video's tubes into one handle."""

    def __init__(self, work: list[Item], spans: list[Span], store_manifests: Callable[[Lease | None], None]) -> None:
        self.work, self._spans, self._store_manifests = work, spans, store_manifests

    @property
    def held(self) -> list[Item]:
        """What the request's lease may pin: its images and tubes, and its videos (their manifests)."""
        return self.work + [s.item for s in self._spans if s.video is not None]

    def started(self, lease: Lease | None) -> None:
        """Every image and tube is taken: the videos' manifests are stored, pinned for ``lease``."""
        self._store_manifests(lease)

    def answer(self, handles: list[Handle]) -> list[Handle]:
        return fold(handles, self._spans)


async def inspect_videos(items: list[Item], prep: ImagePrep, pool: Executor) -> None:
    """Inspect every video item in the pool (one task each); a failure is that item's error."""
    loop = asyncio.get_running_loop()
    videos = [(it, it.state.frames) for it in items if isinstance(it.state, Frames)]
    results = await asyncio.gather(
        *(loop.run_in_executor(pool, prep.inspect_video, frames, it.hash or None) for it, frames in videos),
        return_exceptions=True,
    )
    for (it, _), res in zip(videos, results):
        if isinstance(res, BaseException):
            raise res  # a bug, not the video's fault
        it.hash, outcome = res
        it.state = Failed(outcome) if isinstance(outcome, VisencError) else Tubes(outcome)


def expand(items: list[Item]) -> tuple[list[Item], list[Span]]:
    """The flat list intake takes (images as they are, each good video as its tubes) and the spans."""
    flat: list[Item] = []
    spans: list[Span] = []
    for it in items:
        lo = len(flat)
        match it.state:
            case Tubes(video):
                flat.extend(Item(t.inspected.hash, Encodable(t, t.inspected)) for t in video.tubes)
                spans.append(Span(it, lo, len(flat), video))
            case _:
                flat.append(it)
                spans.append(Span(it, lo, len(flat), None))
    return flat, spans


def fold(handles: list[Handle], spans: list[Span]) -> list[Handle]:
    """One handle per request item, a video's from its tubes' handles."""
    out = []
    for span in spans:
        if span.video is None:
            out.append(handles[span.lo])
            continue
        tubes = handles[span.lo : span.hi]
        video = span.video
        failed = next((h for h in tubes if h.status == "error"), None)
        if failed is not None:
            out.append(Handle(video.hash, "error", error=f"tube {failed.hash}: {failed.error}", reason=failed.reason))
            continue
        status: Status = "ready" if all(h.status == "ready" for h in tubes) else "pending"
        first = tubes[0]
        out.append(
            Handle(
                video.hash,
                status,
                sum(h.num_tokens or 0 for h in tubes),
                first.hidden_size,
                first.dtype,
                video.grid_thw,
                tubes=tuple(h.hash for h in tubes),
                lease=first.lease if all(h.lease == first.lease for h in tubes) else None,
            )
        )
    return out


def manifests(spans: list[Span], flat: list[Item], namespace: str, fingerprint: str) -> Iterator[tuple[str, Entry]]:
    """``(key, manifest)`` of every video of a request: its tubes' hashes in order."""
    for span in spans:
        if span.video is not None:
            tubes = [it.hash for it in flat[span.lo : span.hi]]
            grid, video = span.video.grid_thw, span.video.hash
            yield (
                entry_key(namespace, fingerprint, video),
                pack_manifest(tubes, grid_thw=grid, fingerprint=fingerprint, video=video),
            )


def tube_hashes(manifest: Entry, video: str) -> list[str]:
    """The hashes of a video's tubes, in order (``NotFound`` for a manifest that does not parse)."""
    try:
        return manifest_tubes(manifest)
    except CorruptEntry as e:
        raise NotFound(f"no embedding for video {video} (its manifest is unreadable: {e})") from e


def join_rows(manifest: Entry, video: str, tubes: Sequence[Entry]) -> Entry:
    """A video's rows: its tubes' entries joined in order, copied once."""
    first = tubes[0]
    rows = [e.array() for e in tubes]  # views of the stored values: joined in one copy
    return pack_entry(rows, dtype=first.dtype, grid_thw=manifest.grid_thw, fingerprint=first.fingerprint, hash=video)


class Joins:
    """Videos' rows joined for reads by the video's hash, at most ``max_bytes`` of them: one copy a video,
    served to every read while its tubes are the same entries (so a shared-memory segment of it is
    reused), the least recently read dropped first."""

    def __init__(
        self, max_bytes: int, metrics: Metrics, tube_rows: Callable[[tuple[int, int, int]], int], row_bytes: int
    ) -> None:
        self.max_bytes, self.bytes, self._metrics = max_bytes, 0, metrics
        self._tube_rows, self._row_bytes = tube_rows, row_bytes
        self._held: OrderedDict[str, tuple[tuple[int, ...], Entry]] = OrderedDict()

    def check(self, manifest: Entry, video: str) -> None:
        """``PayloadTooLarge`` where the video's rows, as its manifest's grid says, exceed ``max_bytes``:
        said before any of its tubes is read."""
        self._refuse(video, DATA_OFFSET + manifest.grid_thw[0] * self._tube_rows(manifest.grid_thw) * self._row_bytes)

    def _refuse(self, video: str, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            raise PayloadTooLarge(
                f"the rows of video {video} ({nbytes} bytes) exceed joined_rows_bytes={self.max_bytes}; read its tubes"
            )

    def rows(self, key: str, manifest: Entry, video: str, tubes: Sequence[Entry]) -> Entry:
        """The video's rows; ``PayloadTooLarge`` when they alone exceed ``max_bytes`` (its tubes are read
        one by one instead)."""
        source = tuple(id(t) for t in tubes)
        held = self._held.get(key)
        if held is not None and held[0] == source:
            self._held.move_to_end(key)
            return held[1]
        nbytes = DATA_OFFSET + sum(t.rows for t in tubes) * tubes[0].row_bytes
        self._refuse(video, nbytes)
        self._drop(key)
        while self.bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._held)))
        entry = join_rows(manifest, video, tubes)
        self._held[key] = (source, entry)
        self.bytes += entry.nbytes
        self._metrics.joined_bytes.set(self.bytes)
        return entry

    def _drop(self, key: str) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self.bytes -= held[1].nbytes
            self._metrics.joined_bytes.set(self.bytes)
