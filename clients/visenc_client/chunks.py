"""Chunk planner: which token rows of which images a prefill chunk ``[start, end)`` needs (docs/internals.md)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from visenc_client._types import Handle


@dataclass(frozen=True, slots=True)
class ImagePlacement:
    """One image in a prompt: its rows at ``[offset, offset + num_tokens)``, or at ``runs`` ``(position, count)``."""

    image: str | Handle
    offset: int
    num_tokens: int
    runs: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.offset < 0 or self.num_tokens < 0:
            raise ValueError(f"offset ({self.offset}) and num_tokens ({self.num_tokens}) must be >= 0")
        if self.runs is not None:
            if sum(n for _, n in self.runs) != self.num_tokens or any(n < 0 for _, n in self.runs):
                raise ValueError(f"runs {self.runs} do not hold {self.num_tokens} rows")
            if any(a + n > b for (a, n), (b, _) in itertools.pairwise(self.runs)):
                raise ValueError(f"runs {self.runs} overlap or are out of order")

    @classmethod
    def from_span(
        cls, image: str | Handle, offset: int, span: Sequence[dict[str, object]], count_text: Callable[[str], int]
    ) -> ImagePlacement:
        """Place an image whose layout ``span`` starts at ``offset``; ``count_text(s)``: the tokens of ``s``."""
        runs, at = [], offset
        for piece in span:
            if "rows" in piece:
                n = int(piece["rows"])  # type: ignore[call-overload]
                runs.append((at, n))
                at += n
            else:
                at += count_text(str(piece["text"]))
        return cls(image, runs[0][0] if runs else offset, sum(n for _, n in runs), tuple(runs))

    def row_runs(self) -> tuple[tuple[int, int], ...]:
        return self.runs if self.runs is not None else ((self.offset, self.num_tokens),)

    @classmethod
    def of(cls, handle: Handle, offset: int) -> ImagePlacement:
        if handle.num_tokens is None:
            raise ValueError(f"handle {handle.hash} has no num_tokens (status {handle.status})")
        return cls(handle, offset, handle.num_tokens)

    @property
    def hash(self) -> str:
        return self.image.hash if isinstance(self.image, Handle) else self.image

    @property
    def end(self) -> int:
        last, count = self.row_runs()[-1]
        return last + count


@dataclass(frozen=True, slots=True)
class ChunkPiece:
    hash: str
    start: int
    end: int
    dest: int

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    start: int
    end: int
    dense: bool
    rows: int
    pieces: tuple[ChunkPiece, ...]
    hidden: int | None = None
    dtype: str | None = None
    leases: Mapping[str, str] = field(default_factory=dict, compare=False)


def _by_tube(piece: ChunkPiece, video: Handle | None) -> list[ChunkPiece]:
    if video is None or not video.tubes or not video.num_tokens:
        return [piece]
    per = video.num_tokens // len(video.tubes)
    out, row = [], piece.start
    while row < piece.end:
        i = row // per
        stop = min(piece.end, (i + 1) * per)
        out.append(ChunkPiece(video.tubes[i], row - i * per, stop - i * per, piece.dest + row - piece.start))
        row = stop
    return out


def plan_chunk(placements: Sequence[ImagePlacement], start: int, end: int, *, dense: bool = False) -> ChunkPlan:
    """The rows chunk ``[start, end)`` needs from ``placements`` (non-overlapping). Pieces are in prompt order and
    non-empty; packed, their ``dest`` ranges tile ``[0, rows)``; dense, rows land at ``position - start``."""
    if not 0 <= start <= end:
        raise ValueError(f"chunk [{start}, {end}) is not a range of prompt positions")
    ordered = sorted((p for p in placements if p.num_tokens > 0), key=lambda p: p.offset)
    for before, after in itertools.pairwise(ordered):
        if before.end > after.offset:
            raise ValueError(
                f"images overlap: {before.hash} covers [{before.offset}, {before.end}), "
                f"{after.hash} starts at {after.offset}"
            )
    pieces: list[ChunkPiece] = []
    packed = 0
    for p in ordered:
        row = 0
        for at, count in p.row_runs():
            lo, hi = max(start, at), min(end, at + count)
            if lo < hi:
                piece = ChunkPiece(p.hash, row + lo - at, row + hi - at, lo - start if dense else packed)
                last = pieces[-1] if pieces else None
                if last and last.hash == p.hash and last.end == piece.start and last.dest + last.rows == piece.dest:
                    piece = ChunkPiece(p.hash, last.start, piece.end, last.dest)
                    pieces.pop()
                pieces.append(piece)
                packed += hi - lo
            row += count
    videos = {p.hash: p.image for p in ordered if isinstance(p.image, Handle) and p.image.tubes}
    handles = [p.image for p in placements if isinstance(p.image, Handle) and p.image.hidden_size]
    leases = {
        h: p.image.lease for p in ordered if isinstance(p.image, Handle) and p.image.lease for h in _hashes(p.image)
    }
    return ChunkPlan(
        start,
        end,
        dense,
        end - start if dense else packed,
        tuple(q for piece in pieces for q in _by_tube(piece, videos.get(piece.hash))),
        handles[0].hidden_size if handles else None,
        handles[0].dtype if handles else None,
        leases,
    )


def _hashes(handle: Handle) -> tuple[str, ...]:
    return handle.tubes or (handle.hash,)
