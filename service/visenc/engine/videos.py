"""Videos in a request: inspected whole, then taken as their tubes, then folded back into one handle.

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
key, so a later look-up by that hash alone finds its tubes (``video_rows``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass

from visenc.engine.interface import Handle
from visenc.engine.items import Failed, Item
from visenc.engine.prepare import ImagePrep, Video
from visenc.errors import NotFound, VisencError
from visenc_client.format import (
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


async def inspect_videos(items: list[Item], prep: ImagePrep, pool: Executor) -> None:
    """Inspect every video item in the pool (one task each); a failure is that item's error."""
    loop = asyncio.get_running_loop()
    videos = [it for it in items if it.frames is not None and it.open]
    results = await asyncio.gather(
        *(loop.run_in_executor(pool, prep.inspect_video, it.frames or [], it.hash or None) for it in videos),
        return_exceptions=True,
    )
    for it, res in zip(videos, results):
        if isinstance(res, BaseException):
            raise res  # a bug, not the video's fault
        it.hash, outcome = res
        if isinstance(outcome, VisencError):
            it.outcome = Failed(outcome)
        else:
            it.video = outcome


def expand(items: list[Item]) -> tuple[list[Item], list[Span]]:
    """The flat list intake takes (images as they are, each good video as its tubes) and the spans."""
    flat: list[Item] = []
    spans: list[Span] = []
    for it in items:
        lo = len(flat)
        if it.video is None:
            flat.append(it)
        else:
            flat.extend(Item(t.inspected.hash, t, inspected=t.inspected) for t in it.video.tubes)
        spans.append(Span(it, lo, len(flat), it.video))
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


async def video_rows(manifest: Entry, video: str, lookup: Callable[[str], Awaitable[Entry]]) -> Entry:
    """A video's rows from its manifest: every tube looked up (``lookup`` waits for a pending one and
    raises ``NotFound`` for an evicted one), joined in order, copied once."""
    try:
        tubes = manifest_tubes(manifest)
    except CorruptEntry as e:
        raise NotFound(f"no embedding for video {video} (its manifest is unreadable: {e})") from e
    entries = await asyncio.gather(*(lookup(t) for t in tubes))
    first = entries[0]
    rows = [e.array() for e in entries]  # views of the stored values: joined in one copy
    return pack_entry(rows, dtype=first.dtype, grid_thw=manifest.grid_thw, fingerprint=first.fingerprint, hash=video)
