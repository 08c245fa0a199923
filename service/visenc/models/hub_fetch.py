"""Byte ranges of a hub file, and a vision-only safetensors file built from them: ``fetch_tensors``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from visenc.errors import ModelUnavailable
from visenc.models.progress import Progress, size_text
from visenc.models.resume import INCOMPLETE, RECORD_EVERY_S, Partial, block_bytes

log = logging.getLogger("visenc")

#: largest ranged GET; bigger ranges are cut into parts of this size, fetched side by side
PART_BYTES = 64 << 20
PARALLEL_PARTS = 8
#: tries of one part (each resumes where the last one stopped), and the first pause between them
PART_TRIES = 5
RETRY_PAUSE_S = 1.0
#: tries in a row that receive nothing before the hub is taken as gone (a hang ends start-up within a minute)
STALLED_TRIES = 2
#: the vision file's metadata key for the sha256 of its data (every byte after the header)
DATA_SHA256 = "data_sha256"
CHECK_BYTES = 16 << 20


@dataclass(eq=False)
class RemoteFile:
    """A file of a hub repository at one commit: its GET location, headers (token only to the hub) and size."""

    name: str
    url: str
    headers: dict[str, str]
    size: int | None
    etag: str | None = None
    _header: tuple[dict[str, Any], int] | None = None

    @classmethod
    def open(cls, repo_id: str, filename: str, commit: str) -> RemoteFile:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        url = hf_hub_url(repo_id, filename, revision=commit)
        meta = get_hf_file_metadata(url)
        headers = build_hf_headers()
        if _origin(meta.location) != _origin(url):  # a signed CDN URL: no token leaves the hub
            headers.pop("authorization", None)
        headers["Accept-Encoding"] = "identity"
        return cls(filename, meta.location, headers, meta.size, meta.etag)

    def read(self, start: int, end: int) -> bytes:
        out = bytearray(end - start)

        def put(at: int, chunk: bytes) -> None:
            out[at - start : at - start + len(chunk)] = chunk

        self.copy(start, end, put)
        return bytes(out)

    def copy(
        self, start: int, end: int, write: Callable[[int, bytes], None], stop: threading.Event | None = None
    ) -> None:
        """Bytes ``[start, end)`` to ``write(offset, chunk)`` in ranged GETs, resumed where a transfer was cut short."""
        import httpx2

        at, pause, stalled = start, RETRY_PAUSE_S, 0
        for attempt in range(PART_TRIES):
            began = at
            try:
                for chunk in self.stream(at, end):
                    if stop is not None and stop.is_set():
                        return
                    write(at, chunk)
                    at += len(chunk)
                if at == end:
                    return
                raise httpx2.RemoteProtocolError(f"{end - at} bytes short")
            except httpx2.TransportError as e:
                stalled = 0 if at > began else stalled + 1
                if attempt == PART_TRIES - 1 or stalled == STALLED_TRIES:
                    raise
                log.warning("fetching %s: %s; resuming at byte %d in %.0f s", self.name, e, at, pause)
                time.sleep(pause)
                pause *= 2

    def stream(self, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``[start, end)`` as they arrive; ``RangesNotServed`` where the server ignores or encodes the range."""
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session, hf_raise_for_status

        headers = {**self.headers, "Range": f"bytes={start}-{end - 1}"}
        with get_session().stream("GET", self.url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
            hf_raise_for_status(r)
            got = r.headers.get("Content-Range", "")
            encoding = r.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
            if r.status_code != 206 or not got.startswith(f"bytes {start}-{end - 1}/") or encoding != "identity":
                encoded = f", {encoding}-encoded" if encoding != "identity" else ""
                raise RangesNotServed(
                    f"the hub answered a request for bytes {start}-{end - 1} of {self.name} with {r.status_code} "
                    f"{got or '(no Content-Range)'}{encoded}"
                )
            yield from r.iter_bytes()  # as received: a transfer cut short keeps every byte that arrived

    def header(self) -> tuple[dict[str, Any], int]:
        """The safetensors header and where the data starts (8 + its length): two ranged GETs, once."""
        if self._header is None:
            (length,) = struct.unpack("<Q", self.read(0, 8))
            if self.size is not None and 8 + length > self.size:
                raise ModelUnavailable(f"{self.name} is not a safetensors file (header of {length} bytes)")
            self._header = json.loads(self.read(8, 8 + length)), 8 + length
        return self._header


class RangesNotServed(ModelUnavailable):
    """The server does not answer ranged GETs with the bytes asked: the whole file has to be downloaded."""


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


@dataclass(frozen=True)
class Span:
    """Adjacent tensors of one shard: source bytes ``[start, end)``, written at ``dest`` onwards."""

    source: RemoteFile
    start: int
    end: int
    dest: int


@dataclass
class Fetched:
    tensor_bytes: int = 0
    kept_bytes: int = 0
    header_bytes: int = 0
    requests: int = 0
    shards: int = 0


def plan(wanted: dict[RemoteFile, list[str]]) -> tuple[dict[str, Any], list[Span]]:
    """The vision file's header entries and the spans to fetch (one per run of adjacent tensors in a shard)."""
    entries: dict[str, Any] = {}
    spans: list[Span] = []
    at = 0
    for remote in sorted(wanted, key=lambda r: r.name):
        head, data = remote.header()
        for name in sorted(wanted[remote], key=lambda n: head[n]["data_offsets"][0]):
            begin, stop = head[name]["data_offsets"]
            entries[name] = {**head[name], "data_offsets": [at, at + stop - begin]}
            last = spans[-1] if spans else None
            if last is not None and last.source is remote and last.end == data + begin:
                spans[-1] = Span(remote, last.start, data + stop, last.dest)
            else:
                spans.append(Span(remote, data + begin, data + stop, at))
            at += stop - begin
    return entries, spans


def parts(spans: list[Span], size: int = PART_BYTES) -> list[Span]:
    out = []
    for s in spans:
        for start in range(s.start, s.end, size):
            out.append(Span(s.source, start, min(s.end, start + size), s.dest + start - s.start))
    return out


def fetch_tensors(dest: Path, wanted: dict[RemoteFile, list[str]], metadata: dict[str, str], label: str) -> Fetched:
    """Write ``dest``: a safetensors file of the ``wanted`` tensors of each remote shard, with ``DATA_SHA256``."""
    entries, spans = plan(wanted)
    placeholder = {**metadata, DATA_SHA256: "0" * 64}  # filled in once every byte is there
    body = json.dumps({"__metadata__": placeholder, **entries}, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    head = struct.pack("<Q", len(body)) + body
    key = f'"{DATA_SHA256}":"'.encode()
    digest_at = 8 + body.index(key) + len(key)
    total = sum(s.end - s.start for s in spans)
    blocks = parts(spans, block_bytes(total))
    dest.parent.mkdir(parents=True, exist_ok=True)
    with Partial(dest, head, len(head) + total, identity(head, spans)) as partial:
        kept = partial.kept([(b.dest, b.dest + b.end - b.start) for b in blocks])
        missing = [b for b in blocks if (b.dest, b.dest + b.end - b.start) not in kept]
        pieces = runs(missing, PART_BYTES)
        done = Fetched(
            tensor_bytes=sum(s.end - s.start for s in missing),
            kept_bytes=sum(e - s for s, e in kept),
            header_bytes=sum(r.header()[1] for r in wanted),
            requests=2 * len(wanted) + len(pieces),
            shards=len(wanted),
        )
        if done.kept_bytes:
            log.info(
                "%s: %s kept from an earlier fetch (checked), %s to fetch",
                label,
                *map(size_text, (done.kept_bytes, done.tensor_bytes)),
            )
        if shutil.disk_usage(dest.parent).free < done.tensor_bytes:
            raise ModelUnavailable(f"{dest.parent} has no room for {size_text(done.tensor_bytes)} of vision weights")
        with Progress(done.tensor_bytes, label) as progress:
            _fetch_parts(partial, pieces, block_bytes(total), progress.update)
        checksum = data_sha256(partial.fd, len(head), len(head) + total).encode()
        partial.finish(dest, (digest_at, checksum))
    return done


def identity(head: bytes, spans: list[Span]) -> str:
    """What a partial file must have been written for to be resumed: the header and each span's source."""
    sources = [(s.source.name, s.source.etag, s.source.size, s.start, s.end, s.dest) for s in spans]
    return hashlib.sha256(head + json.dumps(sources).encode()).hexdigest()


def runs(blocks: list[Span], limit: int) -> list[Span]:
    out: list[Span] = []
    for b in blocks:
        last = out[-1] if out else None
        if (
            last is not None
            and last.source is b.source
            and last.end == b.start
            and last.dest + last.end - last.start == b.dest
            and b.end - last.start <= limit
        ):
            out[-1] = Span(b.source, last.start, b.end, last.dest)
        else:
            out.append(b)
    return out


def leftovers(dest: Path) -> list[Path]:
    """Temporary files of ``dest`` named as earlier versions named them (removed only under ``dest``'s lock)."""
    return sorted(dest.parent.glob(f"{dest.name}.*{INCOMPLETE}"))


def data_sha256(fd: int, start: int, end: int) -> str:
    digest = hashlib.sha256()
    for at in range(start, end, CHECK_BYTES):
        digest.update(os.pread(fd, min(CHECK_BYTES, end - at), at))
    return digest.hexdigest()


def _fetch_parts(partial: Partial, pieces: list[Span], block: int, progress: Callable[[int], None]) -> None:
    stop = threading.Event()
    pool = ThreadPoolExecutor(PARALLEL_PARTS, thread_name_prefix="visenc-fetch")
    try:
        pending = {pool.submit(_fetch_part, partial, p, block, progress, stop) for p in pieces}
        while pending:
            finished, pending = wait(pending, timeout=RECORD_EVERY_S, return_when=FIRST_EXCEPTION)
            partial.flush()
            for future in finished:
                future.result()
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)


def _fetch_part(
    partial: Partial, piece: Span, block: int, progress: Callable[[int], None], stop: threading.Event
) -> None:
    start, digest = piece.start, hashlib.sha256()

    def write(at: int, chunk: bytes) -> None:
        nonlocal start, digest
        partial.write(piece.dest + at - piece.start, chunk)
        progress(len(chunk))
        view = memoryview(chunk)
        while view:
            end = min(piece.end, start + block)
            take = min(len(view), end - at)
            digest.update(view[:take])
            view, at = view[take:], at + take
            if at == end:
                partial.record(piece.dest + start - piece.start, piece.dest + end - piece.start, digest.hexdigest())
                start, digest = end, hashlib.sha256()

    piece.source.copy(piece.start, piece.end, write, stop)
