"""Videos: inspected whole, taken as their tubes, folded back into one handle; their manifests stored,
pinned, and placed by the Locator (``docs/internals.md``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace

from visenc.engine.interface import Handle
from visenc.engine.items import MISSING, Encodable, Failed, Found, Item, Missing, Tubes, VideoPending, inspect
from visenc.engine.locator import READ, Absent, Locator, Stored
from visenc.engine.prepare import ImagePrep, Video
from visenc.errors import NotFound, PayloadTooLarge
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
    item: Item
    lo: int
    hi: int
    video: Video | None


class Videos:
    """Every video path: a request with videos (``request``), its manifests, and reads by a video's hash.
    Event loop only, no lock; no state of its own (manifests live in L1, joined rows in ``Joins``)."""

    def __init__(
        self, prep: ImagePrep, pool: Executor, index: Index, metrics: Metrics, joins: Joins, locator: Locator
    ) -> None:
        self.prep, self.pool, self.index, self.metrics, self.joins = prep, pool, index, metrics, joins
        self.locator = locator
        self.fingerprint = prep.tower.fingerprint

    async def request(self, items: list[Item], namespace: str) -> VideoRequest:
        await inspect(items, self.prep, self.pool, videos=True)
        work, spans = expand(items)
        return VideoRequest(work, spans, self, namespace)

    def store_manifests(self, spans: list[Span], work: list[Item], namespace: str, lease: Lease | None) -> None:
        for key, manifest in manifests(spans, work, namespace, self.fingerprint):
            self.index.store_local(key, manifest, leases=() if lease is None else (lease,))
            spawn(self.index.write_through(key, manifest), "manifest-write", self.metrics)

    def keys(self, video: str, namespace: str) -> list[str]:
        """What a pin of ``video`` covers: its tubes' keys, then its own, where L1 holds its manifest."""
        key = entry_key(namespace, self.fingerprint, video)
        manifest = self.index.peek(key)
        if manifest is None or manifest.kind != "video":
            return []
        try:
            return [entry_key(namespace, self.fingerprint, t) for t in tube_hashes(manifest, video)] + [key]
        except NotFound:
            return []

    def tubes(self, manifest: Entry, video: str) -> list[str]:
        """The hashes of a video's tubes; ``NotFound`` (unreadable manifest), ``PayloadTooLarge`` (its rows
        would exceed ``joined_rows_bytes``: refused before its tubes are read for nothing)."""
        tubes = tube_hashes(manifest, video)
        self.joins.check(manifest, video)
        return tubes

    def joined(self, video: str, grid_thw: tuple[int, int, int], namespace: str, tubes: Sequence[Entry]) -> Entry:
        """A video's rows: its tubes' entries joined in order."""
        return self.joins.rows(entry_key(namespace, self.fingerprint, video), grid_thw, video, tubes)

    async def outcome(
        self, manifest: Entry, video: str, namespace: str, *, rows: bool
    ) -> Found | VideoPending | Missing | Failed:
        """Where a video asked by its hash stands, without waiting: ready (``rows``: with its rows, else its
        fields alone, the rows staying within ``joins``), pending or missing."""
        try:
            tubes = self.tubes(manifest, video)
        except NotFound:
            return MISSING
        except PayloadTooLarge as e:
            return Failed(e)
        found = await self.locator.locate_many(tubes, namespace, READ)
        stored = [f.entry for f in found if isinstance(f, Stored)]
        if len(stored) == len(found):
            try:
                joined = self.joined(video, manifest.grid_thw, namespace, stored)
                return Found(joined if rows else replace(joined, blob=b""))
            except PayloadTooLarge as e:
                return Failed(e)
        return MISSING if any(isinstance(f, Absent) for f in found) else VideoPending(manifest)


class VideoRequest:
    """A request with videos: intake takes its images and tubes (``work``); the answer folds them.
    Lives for one request, on the event loop."""

    def __init__(self, work: list[Item], spans: list[Span], videos: Videos, namespace: str) -> None:
        self.work, self._spans, self._videos, self._namespace = work, spans, videos, namespace

    @property
    def held(self) -> list[Item]:
        return self.work + [s.item for s in self._spans if s.video is not None]

    def started(self, lease: Lease | None) -> None:
        """Every image and tube is taken: the manifests are stored, pinned for ``lease``."""
        self._videos.store_manifests(self._spans, self.work, self._namespace, lease)

    def answer(self, handles: list[Handle], *, rows: bool) -> list[Handle]:
        """One handle per item asked; ``rows``: a ready video carries its tubes' rows joined."""
        folded = fold(handles, self._spans)
        for i, span in enumerate(self._spans):
            if rows and span.video is not None and folded[i].status == "ready":
                tubes = [it.state.entry for it in self.work[span.lo : span.hi] if isinstance(it.state, Found)]
                joined = self._videos.joined(span.video.hash, span.video.grid_thw, self._namespace, tubes)
                folded[i] = replace(folded[i], rows=joined.array())
        return folded


def expand(items: list[Item]) -> tuple[list[Item], list[Span]]:
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
    for span in spans:
        if span.video is not None:
            tubes = [it.hash for it in flat[span.lo : span.hi]]
            grid, video = span.video.grid_thw, span.video.hash
            yield (
                entry_key(namespace, fingerprint, video),
                pack_manifest(tubes, grid_thw=grid, fingerprint=fingerprint, video=video),
            )


def tube_hashes(manifest: Entry, video: str) -> list[str]:
    """The hashes of a video's tubes (``NotFound`` for a manifest that does not parse)."""
    try:
        return manifest_tubes(manifest)
    except CorruptEntry as e:
        raise NotFound(f"no embedding for video {video} (its manifest is unreadable: {e})") from e


def join_rows(grid_thw: tuple[int, int, int], video: str, tubes: Sequence[Entry]) -> Entry:
    first = tubes[0]
    rows = [e.array() for e in tubes]
    return pack_entry(rows, dtype=first.dtype, grid_thw=grid_thw, fingerprint=first.fingerprint, hash=video)


class Joins:
    """Videos' rows joined for reads by the video's hash, at most ``max_bytes`` of them, least recently read
    evicted first.
    Event loop only, no lock; what it holds stays within ``max_bytes``."""

    def __init__(
        self, max_bytes: int, metrics: Metrics, tube_rows: Callable[[tuple[int, int, int]], int], row_bytes: int
    ) -> None:
        self.max_bytes, self.bytes, self._metrics = max_bytes, 0, metrics
        self._tube_rows, self._row_bytes = tube_rows, row_bytes
        self._held: OrderedDict[str, tuple[tuple[int, ...], Entry]] = OrderedDict()

    def check(self, manifest: Entry, video: str) -> None:
        """``PayloadTooLarge`` where the video's rows, by its manifest's grid, exceed ``max_bytes``."""
        self._refuse(video, DATA_OFFSET + manifest.grid_thw[0] * self._tube_rows(manifest.grid_thw) * self._row_bytes)

    def _refuse(self, video: str, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            raise PayloadTooLarge(
                f"the rows of video {video} ({nbytes} bytes) exceed joined_rows_bytes={self.max_bytes}; read its tubes"
            )

    def rows(self, key: str, grid_thw: tuple[int, int, int], video: str, tubes: Sequence[Entry]) -> Entry:
        """The video's rows; ``PayloadTooLarge`` when they alone exceed ``max_bytes``."""
        source = tuple(id(t) for t in tubes)
        held = self._held.get(key)
        if held is not None and held[0] == source:
            self._held.move_to_end(key)
            return held[1]
        nbytes = DATA_OFFSET + sum(t.rows for t in tubes) * tubes[0].row_bytes
        self._refuse(video, nbytes)
        self._evict(key)
        while self.bytes + nbytes > self.max_bytes:
            self._evict(next(iter(self._held)))
        entry = join_rows(grid_thw, video, tubes)
        self._held[key] = (source, entry)
        self.bytes += entry.nbytes
        self._metrics.joined_bytes.set(self.bytes)
        return entry

    def _evict(self, key: str) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self.bytes -= held[1].nbytes
            self._metrics.joined_bytes.set(self.bytes)
