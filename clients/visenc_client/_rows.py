"""Flows that move embedding rows: chunk fetches into one buffer, shared-memory fetches. Each row byte is
copied once at most (docs/internals.md, "The client library")."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from visenc_client._exceptions import ProtocolError
from visenc_client._protocol import fetch_many_flow, ranges_request
from visenc_client._shm import SegmentHandles, SegmentMaps
from visenc_client._steps import AnyFlow, byte_view, failed_range, raise_for_status, read_frame, send_streamed
from visenc_client._types import RowRange
from visenc_client.chunks import ChunkPlan
from visenc_client.format import NUMPY_DTYPES, tensor_words

log = logging.getLogger("visenc_client")


def destination(out: Any, rows: int, hidden: int, dtype: str, dense: bool) -> tuple[np.ndarray, Any]:
    """(a writable array viewing ``out`` in the wire dtype, the object to return); ``None`` allocates one."""
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


def empty_chunk(plan: ChunkPlan, out: Any) -> Any:
    """What a chunk that needs no rows returns (the same on every transport)."""
    if out is None and plan.hidden is None:
        raise ValueError("nothing to fetch and no hidden size known: pass out= or placements with handles")
    return destination(out, plan.rows, plan.hidden or 0, plan.dtype or "float32", plan.dense)[1]


def _chunk_ranges(plan: ChunkPlan) -> list[RowRange]:
    return [RowRange(p.hash, p.start, p.end, plan.leases.get(p.hash)) for p in plan.pieces]


def shm_chunk_flow(
    plan: ChunkPlan, out: Any, *, wait: bool, headers: dict[str, str] | None, known: SegmentHandles
) -> AnyFlow[Any]:
    """Every row ``plan`` needs from the service's segments (no request for known ones), copied into one buffer."""
    views = yield from shm_fetch_flow(_chunk_ranges(plan), wait=wait, headers=headers, known=known)
    hidden = views[0].shape[1]
    dtype = next(k for k, v in NUMPY_DTYPES.items() if v == views[0].dtype)
    array, result = destination(out, plan.rows, hidden, dtype, plan.dense)
    for piece, view in zip(plan.pieces, views):
        array[piece.dest : piece.dest + piece.rows] = view
    return result


def http_chunk_flow(plan: ChunkPlan, out: Any, *, wait: bool, headers: dict[str, str] | None) -> AnyFlow[Any]:
    """Every row ``plan`` needs, in one round trip, read straight into one buffer."""
    ranges = _chunk_ranges(plan)
    head = yield from send_streamed(ranges_request("/v1/embeddings/fetch", ranges, wait=wait, headers=headers))
    pieces = iter(plan.pieces)
    target: list[Any] = []

    def place(item: dict[str, Any]) -> memoryview:
        piece = next(pieces)
        rows, hidden = (int(x) for x in item["shape"])
        if not target:
            target.extend(destination(out, plan.rows, hidden, str(item["dtype"]), plan.dense))
        array = target[0]
        if rows != piece.rows or (hidden, NUMPY_DTYPES[str(item["dtype"])]) != (array.shape[1], array.dtype):
            raise ProtocolError(f"{item['hash']}: got {item['shape']} {item['dtype']}, asked for {piece.rows} rows")
        return byte_view(array[piece.dest : piece.dest + rows])

    items = yield from read_frame(head, place)
    for item in items:
        if "offset" not in item:
            raise failed_range(item)
    if len(items) != len(plan.pieces):
        raise ProtocolError(f"asked for {len(plan.pieces)} ranges, got {len(items)}")
    return target[1]


def shm_fetch_flow(
    ranges: Sequence[RowRange],
    *,
    wait: bool,
    headers: dict[str, str] | None,
    known: SegmentHandles,
) -> AnyFlow[list[np.ndarray]]:
    """Several ranges as read-only views of the service's segments; those its budget could not hold, over HTTP."""
    if (views := known.views(ranges)) is not None:
        return views
    resp = yield ranges_request("/v1/embeddings/shm", ranges, wait=wait, headers=headers)
    raise_for_status(resp)
    try:
        body = msgpack.unpackb(resp.content)
        maps, items, lease_s = SegmentMaps(str(body["dir"])), body["items"], float(body["lease_s"])
    except Exception as e:
        raise ProtocolError(f"unreadable shared-memory response: {e}") from e
    arrays: list[np.ndarray | None] = []
    full: list[int] = []
    for i, item in enumerate(items):
        if "segment" not in item:
            if item.get("status") != 429:
                raise failed_range(item)
            full.append(i)
            arrays.append(None)
            continue
        dtype = NUMPY_DTYPES.get(item["dtype"])
        if dtype is None:
            raise ProtocolError(f"unknown dtype {item['dtype']!r}")
        rows, hidden = (int(x) for x in item["shape"])
        arrays.append(maps.view(item["segment"], int(item["offset"]), int(item["nbytes"]), dtype, rows, hidden))
        known.learn(maps.directory, lease_s, item, dtype)
    if full:
        if not known.http_fallbacks:
            log.warning(
                "visenc's shared-memory budget is full (%s): rows it cannot place there are read over HTTP "
                "(counted in the client's shm_http_fallbacks; raise --shm-max-bytes to avoid it)",
                items[full[0]].get("error"),
            )
        known.http_fallbacks += len(full)
        over_http = yield from fetch_many_flow([ranges[i] for i in full], wait=wait, headers=headers)
        for i, array in zip(full, over_http):
            arrays[i] = array
    known.spend(ranges)
    return arrays  # type: ignore[return-value]
