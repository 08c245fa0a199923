"""A request's items as intake works on them: one ``state`` each, a stage until it becomes an outcome."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from visenc.engine.interface import EncodeItem, Handle
from visenc.engine.job import IllegalTransition, Job
from visenc.engine.prepare import ImagePrep, Inspected, Source, Video
from visenc.errors import EncodeFailed, InvalidHash, InvalidVideo, NotReady, VisencError
from visenc.imaging.video import VideoPreprocess
from visenc.index.memory import Lease
from visenc_client.format import Entry, is_valid_hash

HASH_RULE = "'hash' must be 64 lowercase hex digits (SHA-256 of the bytes)"


@dataclass(frozen=True, slots=True)
class HashOnly: ...


@dataclass(frozen=True, slots=True)
class Upload:
    data: bytes


@dataclass(frozen=True, slots=True)
class Encodable:
    """Bytes (or a video's tube) and what inspecting them found."""

    source: Source
    inspected: Inspected


@dataclass(frozen=True, slots=True)
class Frames:
    frames: list[bytes]


@dataclass(frozen=True, slots=True)
class Tubes:
    video: Video


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
class Missing: ...


HASH_ONLY, MISSING = HashOnly(), Missing()
Stage = HashOnly | Upload | Encodable | Frames | Tubes
Outcome = Failed | Found | Pending | VideoPending | Missing
State = Stage | Outcome

#: state -> the states an item may move to from it (``Item.to`` raises on any other edge)
ITEM_EDGES: dict[type[State], frozenset[type[State]]] = {
    HashOnly: frozenset({Found, Pending, VideoPending, Missing, Failed}),
    Upload: frozenset({Encodable, Failed}),
    Frames: frozenset({Tubes, Failed}),
    Encodable: frozenset({Found, Pending}),
    Tubes: frozenset(),
    Pending: frozenset({Found, Failed}),
    VideoPending: frozenset({Found, Missing, Failed}),
    Found: frozenset({Found}),
    Failed: frozenset(),
    Missing: frozenset(),
}


@dataclass(slots=True)
class Item:
    """One request item (an image, a video, or one of a video's tubes) and its state.
    One request's, on the event loop; ``state`` moves only through ``to``, along ``ITEM_EDGES``."""

    hash: str
    state: State
    #: its index key, once looked up
    key: str | None = None

    @property
    def open(self) -> bool:
        return isinstance(self.state, Stage)

    def to(self, state: State) -> None:
        if type(state) not in ITEM_EDGES[type(self.state)]:
            raise IllegalTransition(f"item {self.hash}: {type(self.state).__name__} -> {type(state).__name__}")
        self.state = state

    @property
    def looked_up(self) -> str:
        """Its index key (``IllegalTransition`` before its look-up)."""
        if self.key is None:
            raise IllegalTransition(f"item {self.hash} has not been looked up")
        return self.key


def itemise(items: Sequence[EncodeItem]) -> list[Item]:
    """Each item's first stage, with the checks that need no work."""
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


async def inspect(items: list[Item], prep: ImagePrep, pool: Executor, *, videos: bool = False) -> None:
    """Hash and probe every upload (``videos``: every video) in the pool; a failure is that item's outcome."""
    loop = asyncio.get_running_loop()
    todo = [(it, it.state) for it in items if isinstance(it.state, Frames if videos else Upload)]
    results = await asyncio.gather(
        *(
            loop.run_in_executor(pool, prep.inspect_video, s.frames, it.hash or None)
            if isinstance(s, Frames)
            else loop.run_in_executor(pool, prep.inspect, s.data, it.hash or None)
            for it, s in todo
        ),
        return_exceptions=True,
    )
    for (it, s), res in zip(todo, results):
        if isinstance(res, BaseException):
            raise res  # a bug, not the item's fault
        digest, outcome = res
        if isinstance(outcome, VisencError):  # an image keeps the hash its caller gave
            it.hash = digest if videos else it.hash or digest
            it.to(Failed(outcome))
            continue
        it.hash = digest
        if isinstance(outcome, Video):
            it.to(Tubes(outcome))
        elif isinstance(s, Upload):
            it.to(Encodable(s.data, outcome))


def waves(work: list[Item]) -> Iterator[tuple[int, int]]:
    """``work`` cut into spans ending after 1, 2, 4, ... uploads: the first images start encoding early."""
    lo, uploads, size = 0, 0, 1
    for i, it in enumerate(work):
        if isinstance(it.state, Upload):
            uploads += 1
            if uploads == size:
                yield lo, i + 1
                lo, uploads, size = i + 1, 0, size * 2
    if lo < len(work):
        yield lo, len(work)


def handle_of(item: Item, hidden_size: int, dtype: str, video: VideoPreprocess | None, *, rows: bool) -> Handle:
    """The handle of ``item``'s outcome (``rows``: a ready one carries its rows)."""
    match item.state:
        case Failed(error):
            return Handle(item.hash, "error", error=error.message, reason=error.item_reason)
        case Found(e):
            return Handle(item.hash, "ready", e.rows, e.hidden, e.dtype, e.grid_thw, rows=e.array() if rows else None)
        case Pending(Job(layout=lay)) if lay is not None:
            return Handle(item.hash, "pending", lay.num_tokens, hidden_size, dtype, lay.grid_thw)
        case VideoPending(manifest) if video is not None:
            grid = manifest.grid_thw
            return Handle(item.hash, "pending", grid[0] * video.tube_tokens(grid), hidden_size, dtype, grid)
        case Pending() | VideoPending():
            return Handle(item.hash, "pending")
    return Handle(item.hash, "missing")


def joined(work: list[Item]) -> dict[int, Job]:
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
    """A request of images alone: its items are its work. Lives for one request, on the event loop."""

    def __init__(self, items: list[Item]) -> None:
        self.work = items

    @property
    def held(self) -> list[Item]:
        return self.work

    def started(self, lease: Lease | None) -> None: ...

    def answer(self, handles: list[Handle], *, rows: bool) -> list[Handle]:
        return handles
