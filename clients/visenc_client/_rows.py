"""Flows that move embedding rows: chunk fetches into one buffer, shared-memory fetches.

Copies, counted: over HTTP each row byte is copied once in this process, from
the network chunk it arrived in to its place in the destination buffer (the
body is streamed, never joined). Over shared memory ``fetch_many`` hands out
read-only views of the mapped segments (no copy) and ``fetch_chunk`` copies
each row once, from the mapping into the buffer.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import httpx
import msgpack
import numpy as np

from visenc_client._exceptions import ProtocolError, error_for
from visenc_client._protocol import (
    NUMPY_DTYPES,
    AnyFlow,
    Flow,
    msgpack_request,
    raise_for_status,
    read_all,
    read_chunk,
    send_streamed,
)
from visenc_client._shm import SegmentHandles, SegmentMaps
from visenc_client._types import RowRange
from visenc_client.chunks import ChunkPlan
from visenc_client.format import FRAME_PREFIX_BYTES, CorruptFrame, frame_header_length, frame_items, tensor_words

Client = httpx.Client | httpx.AsyncClient


class BodyReader:
    """Reads a streamed body in order, copying each byte once to where the caller wants it."""

    def __init__(self) -> None:
        self._pending = memoryview(b"")

    def read_into(self, dst: memoryview) -> Generator[Any, Any, None]:
        filled = 0
        while filled < len(dst):
            if not self._pending:
                chunk = yield from read_chunk()
                if not chunk:
                    raise ProtocolError("the response body ended early")
                self._pending = memoryview(chunk)
            n = min(len(self._pending), len(dst) - filled)
            dst[filled : filled + n] = self._pending[:n]
            self._pending = self._pending[n:]
            filled += n

    def read(self, n: int) -> Generator[Any, Any, bytes]:
        """``n`` bytes as a new object (small headers only)."""
        buf = bytearray(n)
        yield from self.read_into(memoryview(buf))
        return bytes(buf)

    def expect_end(self) -> Generator[Any, Any, None]:
        if self._pending or (yield from read_chunk()):
            raise ProtocolError("the response body is longer than its header says")


def _failed(item: dict[str, Any]) -> Exception:
    return error_for(int(item.get("status", 500)), "fetch_failed", f"{item.get('hash')}: {item.get('error')}")


def destination(out: Any, rows: int, hidden: int, dtype: str, dense: bool) -> tuple[np.ndarray, Any]:
    """(a writable C-contiguous array viewing the buffer in the wire dtype, the object to return).

    ``out`` may be a numpy array or a CPU torch tensor (written through its
    numpy view; bfloat16 through its 16-bit words); ``None`` allocates one
    (zeros for the dense layout, whose text rows are not written)."""
    wire = NUMPY_DTYPES.get(dtype)
    if wire is None:
        raise ProtocolError(f"unknown dtype {dtype!r}")
    if out is None:
        array = (np.zeros if dense else np.empty)((rows, hidden), wire)
        return array, array
    target = out
    if not isinstance(out, np.ndarray) and type(out).__module__.startswith("torch"):
        target = tensor_words(out)
    if not isinstance(target, np.ndarray):
        raise TypeError(f"out must be a numpy array or a CPU torch tensor, not {type(out).__name__}")
    if target.shape != (rows, hidden):
        raise ValueError(f"out has shape {target.shape}, the chunk needs ({rows}, {hidden})")
    same = target.dtype == wire or (dtype == "bfloat16" and target.dtype.kind in "iu" and target.itemsize == 2)
    if not same:
        raise ValueError(f"out has dtype {target.dtype}, the embeddings are {dtype}")
    if not (target.flags.c_contiguous and target.flags.writeable):
        raise ValueError("out must be writable and C-contiguous")
    return target.view(wire), out


def _check_item(item: dict[str, Any], piece_rows: int, hidden: int, dtype: str) -> int:
    if "offset" not in item:
        raise _failed(item)
    if item["dtype"] != dtype or list(item["shape"]) != [piece_rows, hidden]:
        raise ProtocolError(f"{item['hash']}: got {item['shape']} {item['dtype']}, asked for {piece_rows} rows")
    return int(item["nbytes"])


def fetch_chunk_flow(
    client: Client,
    plan: ChunkPlan,
    out: Any,
    *,
    wait: bool,
    shm: SegmentHandles | None,
    headers: dict[str, str] | None,
) -> AnyFlow[Any]:
    """Every row ``plan`` needs, in one round trip (none for known segments), written into one buffer;
    over shared memory when ``shm`` (the client's known segments) is given."""
    if not plan.pieces:
        if out is None and plan.hidden is None:
            raise ValueError("nothing to fetch and no hidden size known: pass out= or placements with handles")
        return destination(out, plan.rows, plan.hidden or 0, plan.dtype or "float32", plan.dense)[1]
    ranges = [RowRange(p.hash, p.start, p.end) for p in plan.pieces]
    if shm is not None:
        views = yield from shm_fetch_flow(client, ranges, wait=wait, headers=headers, known=shm)
        hidden = views[0].shape[1]
        dtype = next(k for k, v in NUMPY_DTYPES.items() if v == views[0].dtype)
        array, result = destination(out, plan.rows, hidden, dtype, plan.dense)
        for piece, view in zip(plan.pieces, views):
            array[piece.dest : piece.dest + piece.rows] = view
        return result
    payload = {"ranges": [{"hash": r.hash, "start": r.start, "end": r.end} for r in ranges], "wait": wait}
    resp = yield from send_streamed(msgpack_request(client, "/v1/embeddings/fetch", payload, headers))
    if resp.status_code >= 400:
        raise_for_status(resp, (yield from read_all()))
    reader = BodyReader()
    try:
        hlen = frame_header_length((yield from reader.read(FRAME_PREFIX_BYTES)))
        items = frame_items((yield from reader.read(hlen)))
    except CorruptFrame as e:
        raise ProtocolError(f"unreadable rows response: {e}") from e
    if len(items) != len(plan.pieces):
        raise ProtocolError(f"asked for {len(plan.pieces)} ranges, got {len(items)}")
    for item in items:
        if "offset" not in item:
            raise _failed(item)
    hidden, dtype = int(items[0]["shape"][1]), str(items[0]["dtype"])
    array, result = destination(out, plan.rows, hidden, dtype, plan.dense)
    dst = array.data.cast("B")  # array is C-contiguous (checked by destination)
    row_bytes = hidden * array.itemsize
    for piece, item in zip(plan.pieces, items):
        nbytes = _check_item(item, piece.rows, hidden, dtype)
        at = piece.dest * row_bytes
        yield from reader.read_into(dst[at : at + nbytes])
    yield from reader.expect_end()
    return result


def shm_fetch_flow(
    client: Client,
    ranges: Sequence[RowRange],
    *,
    wait: bool,
    headers: dict[str, str] | None,
    known: SegmentHandles | None = None,
) -> Flow[list[np.ndarray]]:
    """Several ranges as read-only views of the service's shared-memory segments (no copy); no
    request when ``known`` already knows every image's segment."""
    if known is not None and (views := known.views(ranges)) is not None:
        return views
    payload = {"ranges": [{"hash": r.hash, "start": r.start, "end": r.end} for r in ranges], "wait": wait}
    resp = yield msgpack_request(client, "/v1/embeddings/shm", payload, headers)
    raise_for_status(resp)
    try:
        body = msgpack.unpackb(resp.content)
        maps, items, lease_s = SegmentMaps(str(body["dir"])), body["items"], float(body["lease_s"])
    except Exception as e:
        raise ProtocolError(f"unreadable shared-memory response: {e}") from e
    arrays = []
    for item in items:
        if "segment" not in item:
            raise _failed(item)
        dtype = NUMPY_DTYPES.get(item["dtype"])
        if dtype is None:
            raise ProtocolError(f"unknown dtype {item['dtype']!r}")
        rows, hidden = (int(x) for x in item["shape"])
        arrays.append(maps.view(item["segment"], int(item["offset"]), int(item["nbytes"]), dtype, rows, hidden))
        if known is not None:
            known.learn(maps.directory, lease_s, item, dtype)
    return arrays
