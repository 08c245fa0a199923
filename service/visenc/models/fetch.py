"""Byte ranges of a hub file, and a vision-only safetensors file built from them: ``fetch_tensors``.

Each shard's header is read with two ranged GETs (its 8-byte length, then the JSON), then only the
wanted tensors' bytes, adjacent tensors in one range, large ranges cut into parts fetched side by side
and written in place (``os.pwrite``). The file is written under a temporary name and renamed when
complete: a reader sees a whole file or none. Reasoning: ``docs/internals.md``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from visenc.errors import ModelUnavailable

log = logging.getLogger("visenc")

#: largest ranged GET; bigger ranges are cut into parts of this size, fetched side by side
PART_BYTES = 64 << 20
#: ranged GETs in flight at once
PARALLEL_PARTS = 8
#: tries of one part (each resumes where the last one stopped), and the first pause between them
PART_TRIES = 5
RETRY_PAUSE_S = 1.0
#: tries in a row that receive nothing (each waits ``HF_HUB_DOWNLOAD_TIMEOUT``) before the hub is
#: taken as gone: a hub that hangs ends start-up within a minute, one that cuts transfers short is resumed
STALLED_TRIES = 2
#: how often progress lines are logged when stderr is not a terminal
PROGRESS_EVERY_S = 5.0
#: the vision file's metadata key for the sha256 of its data (every byte after the header)
DATA_SHA256 = "data_sha256"
#: bytes read at once when that checksum is computed
CHECK_BYTES = 16 << 20
#: the suffix of a vision file being written
INCOMPLETE = ".incomplete"


@dataclass(eq=False)
class RemoteFile:
    """A file of a hub repository at one commit: where to GET it (the CDN location the hub redirects
    to, if any), the headers to send (the token only to the hub's own origin), its size. Its
    safetensors header is read once (``header``)."""

    name: str
    url: str
    headers: dict[str, str]
    size: int | None
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
        return cls(filename, meta.location, headers, meta.size)

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` (``copy``)."""
        out = bytearray(end - start)

        def put(at: int, chunk: bytes) -> None:
            out[at - start : at - start + len(chunk)] = chunk

        self.copy(start, end, put)
        return bytes(out)

    def copy(
        self, start: int, end: int, write: Callable[[int, bytes], None], stop: threading.Event | None = None
    ) -> None:
        """Bytes ``[start, end)`` handed to ``write(offset, chunk)`` as they arrive, in ranged GETs: a
        transfer cut short resumes where it stopped (``PART_TRIES`` tries, pauses doubling from
        ``RETRY_PAUSE_S``; ``STALLED_TRIES`` in a row that receive nothing end it); ``stop`` set ends
        it early."""
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
        """Bytes ``[start, end)`` as they arrive; ``RangesNotServed`` where the server does not
        answer the range it was asked (it would send the whole file) or encodes it."""
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
    """What a fetch transferred: tensor bytes, header bytes, ranged requests, shards read."""

    tensor_bytes: int = 0
    header_bytes: int = 0
    requests: int = 0
    shards: int = 0


def plan(wanted: dict[RemoteFile, list[str]]) -> tuple[dict[str, Any], list[Span]]:
    """The vision file's header entries (tensors in their source order, packed) and the spans to
    fetch: each run of tensors adjacent in their shard is one span."""
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
    """Spans cut into pieces of at most ``size`` bytes."""
    out = []
    for s in spans:
        for start in range(s.start, s.end, size):
            out.append(Span(s.source, start, min(s.end, start + size), s.dest + start - s.start))
    return out


def fetch_tensors(dest: Path, wanted: dict[RemoteFile, list[str]], metadata: dict[str, str], label: str) -> Fetched:
    """Write ``dest``: a safetensors file of the ``wanted`` tensors of each remote shard (their
    names, dtypes and bytes as in the shard), with ``metadata`` and ``DATA_SHA256``, the checksum of
    its data (``data_sha256``), which tells a later start that the file is whole."""
    entries, spans = plan(wanted)
    placeholder = {**metadata, DATA_SHA256: "0" * 64}  # filled in once every byte is there
    body = json.dumps({"__metadata__": placeholder, **entries}, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    key = f'"{DATA_SHA256}":"'.encode()
    digest_at = 8 + body.index(key) + len(key)
    pieces = parts(spans)
    done = Fetched(
        tensor_bytes=sum(s.end - s.start for s in spans),
        header_bytes=sum(r.header()[1] for r in wanted),
        requests=2 * len(wanted) + len(pieces),
        shards=len(wanted),
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(dest.parent).free < done.tensor_bytes + len(body):
        raise ModelUnavailable(f"{dest.parent} has no room for {size_text(done.tensor_bytes)} of vision weights")
    tmp = dest.with_name(f"{dest.name}.{uuid.uuid4().hex[:8]}{INCOMPLETE}")
    try:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(body)) + body)
            f.truncate(8 + len(body) + done.tensor_bytes)
        fd = os.open(tmp, os.O_RDWR)
        try:
            with Progress(done.tensor_bytes, label) as progress:
                _fetch_parts(fd, 8 + len(body), pieces, progress.update)
            os.pwrite(fd, data_sha256(fd, 8 + len(body), 8 + len(body) + done.tensor_bytes).encode(), digest_at)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return done


def leftovers(dest: Path) -> list[Path]:
    """The temporary files of fetches of ``dest`` that never ended (a process killed midway): only
    the holder of ``dest``'s lock may remove them, no other fetch being under way then."""
    return sorted(dest.parent.glob(f"{dest.name}.*{INCOMPLETE}"))


def data_sha256(fd: int, start: int, end: int) -> str:
    """sha256 (hex) of bytes ``[start, end)`` of the open file ``fd``."""
    digest = hashlib.sha256()
    for at in range(start, end, CHECK_BYTES):
        digest.update(os.pread(fd, min(CHECK_BYTES, end - at), at))
    return digest.hexdigest()


def _fetch_parts(fd: int, base: int, pieces: list[Span], progress: Callable[[int], None]) -> None:
    """Every part, ``PARALLEL_PARTS`` at a time; the first failure (or an exit) stops the others."""
    stop = threading.Event()
    pool = ThreadPoolExecutor(PARALLEL_PARTS, thread_name_prefix="visenc-fetch")
    try:
        for future in [pool.submit(_fetch_part, fd, base, p, progress, stop) for p in pieces]:
            future.result()
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)


def _fetch_part(fd: int, base: int, part: Span, progress: Callable[[int], None], stop: threading.Event) -> None:
    """One part into the file at ``base + part.dest``."""

    def write(at: int, chunk: bytes) -> None:
        os.pwrite(fd, chunk, base + part.dest + at - part.start)
        progress(len(chunk))

    part.source.copy(part.start, part.end, write, stop)


class Progress:
    """Bytes fetched: a progress bar on a terminal (huggingface_hub's tqdm, which
    ``HF_HUB_DISABLE_PROGRESS_BARS`` turns off), a log line every ``PROGRESS_EVERY_S`` otherwise."""

    def __init__(self, total: int, label: str) -> None:
        from huggingface_hub.utils import are_progress_bars_disabled, tqdm

        self.total, self.label, self.done = total, label, 0
        self.lock = threading.Lock()
        self.bar = None
        if sys.stderr.isatty() and not are_progress_bars_disabled():
            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label)
        else:
            log.info("%s: fetching %s", label, size_text(total))
        self.logged = time.monotonic()

    def update(self, n: int) -> None:
        with self.lock:
            self.done += n
            if self.bar is not None:
                self.bar.update(n)
            elif time.monotonic() - self.logged >= PROGRESS_EVERY_S:
                self.logged = time.monotonic()
                log.info(
                    "%s: %s of %s (%.0f%%)",
                    self.label,
                    size_text(self.done),
                    size_text(self.total),
                    100 * self.done / max(1, self.total),
                )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def size_text(n: float) -> str:
    """``n`` bytes for a person: ``512 B``, ``1.3 GiB``."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"
