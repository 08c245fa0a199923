"""What ``Client`` and ``AsyncClient`` share: timeouts, headers, each operation's flow over the rows transport."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import httpx
import numpy as np

from visenc_client import _protocol as p
from visenc_client._exceptions import ImageEncodeError
from visenc_client._http import Connections
from visenc_client._rows import empty_chunk
from visenc_client._shm import SegmentHandles
from visenc_client._steps import AnyFlow, Ask
from visenc_client._transport import rows_for, rows_transport
from visenc_client._types import Handle, ImageInput, RowRange, Video
from visenc_client.chunks import ImagePlacement, plan_chunk
from visenc_client.format import LEASE_HEADER, PRIORITY_HEADER, Priority

#: a replica that does not accept costs this, not the read timeout
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_TIMEOUT = httpx.Timeout(connect=DEFAULT_CONNECT_TIMEOUT_S, read=300.0, write=60.0, pool=60.0)
SharedMemory = bool | Literal["auto"]


def timeouts(timeout: httpx.Timeout | float | None, connect_timeout: float | None) -> httpx.Timeout:
    """``timeout`` as a number bounds all but connecting (``DEFAULT_CONNECT_TIMEOUT_S``); ``connect_timeout`` wins."""
    if isinstance(timeout, httpx.Timeout):
        connect = timeout.connect if connect_timeout is None else connect_timeout
        return httpx.Timeout(connect=connect, read=timeout.read, write=timeout.write, pool=timeout.pool)
    return httpx.Timeout(timeout, connect=DEFAULT_CONNECT_TIMEOUT_S if connect_timeout is None else connect_timeout)


def connecting(e: httpx.TransportError) -> bool:
    return isinstance(e, httpx.ConnectError | httpx.ConnectTimeout)


def api_root(base_url: str) -> str:
    """``base_url`` without a trailing ``/v1`` (the client adds it to every path)."""
    stripped = base_url.rstrip("/")
    return stripped.removesuffix("/v1") if stripped.endswith("/v1") else base_url


def fetchable(image: str | Handle) -> None:
    """An ``error`` handle has no rows to fetch: its own failure, raised before any request."""
    if isinstance(image, Handle) and image.status == "error":
        raise ImageEncodeError(image.hash, image.error or "the service could not encode it", image.reason)


class ClientBase:
    """Each operation's flow, built from the client's settings; the twins drive them."""

    _http: httpx.Client | httpx.AsyncClient

    def __init__(
        self,
        base_url: str,
        namespace: str | None,
        api_key: str | None,
        shared_memory: SharedMemory,
        timeout: httpx.Timeout,
        custom_transport: bool,
        priority: Priority | None = None,
    ) -> None:
        base_url = api_root(base_url)
        self.rows = rows_transport(shared_memory, base_url)
        #: ask for lease ids, so reads by hash alone unpin no other caller's pin
        self.headers: dict[str, str] = {LEASE_HEADER: "id"}
        if namespace is not None:
            self.headers["x-visenc-namespace"] = namespace
        if api_key is not None:
            self.headers["authorization"] = f"Bearer {api_key}"
        if priority is not None:  # the class of this client's encodes (the service's default: interactive)
            self.headers[PRIORITY_HEADER] = priority
        self.base_url = base_url
        self.timeout = timeout
        self._conns = (
            None if custom_transport else Connections(base_url, connect_s=timeout.connect, read_s=timeout.read)
        )

    def _request(self, ask: Ask) -> httpx.Request:
        """``ask`` as httpx sends it (what ``Connections`` does not send)."""
        return self._http.build_request(ask.method, ask.path, content=ask.content or None, headers=ask.headers)

    def _choose(self, model_info: dict[str, Any]) -> None:
        """Settle the transport from ``/v1/model``."""
        self.rows = rows_for(model_info, self.base_url)

    @property
    def shared_memory(self) -> bool:
        """Whether rows are read from the service's segments (``"auto"``: once the first read settled it)."""
        return self.rows.shared_memory

    @property
    def _segments(self) -> SegmentHandles | None:
        return self.rows.segments

    @_segments.setter
    def _segments(self, segments: SegmentHandles) -> None:
        self.rows.segments = segments

    @property
    def shm_http_fallbacks(self) -> int:
        """Ranges read over HTTP because the service's shared-memory budget was full."""
        return self.rows.http_fallbacks

    def _encode_flow(
        self, images: Sequence[ImageInput | Video], wait: bool, hash_first: bool, include_rows: bool, pin: bool
    ) -> AnyFlow[list[Handle]]:
        headers = p.pinning(self.headers, pin)
        return p.encode_flow(images, wait=wait, hash_first=hash_first, headers=headers, include_rows=include_rows)

    def _lookup_flow(self, hashes: Sequence[str], wait: bool, include_rows: bool, pin: bool) -> AnyFlow[list[Handle]]:
        unpinned = self.rows.reads_unpinned
        return p.lookup_split_by_pin_flow(hashes, self.headers, unpinned, wait, include_rows, pin)

    def _unpin_flow(self, handles: Sequence[Handle]) -> AnyFlow[None]:
        return p.unpin_flow(handles, self.headers)

    def _fetch_flow(self, image: str | Handle, start: int | None, end: int | None) -> AnyFlow[np.ndarray]:
        fetchable(image)
        return (yield from self.rows.fetch(image, start, end, self.headers))

    def _fetch_many_flow(self, ranges: Sequence[RowRange], wait: bool) -> AnyFlow[list[np.ndarray]]:
        return self.rows.fetch_many(ranges, wait, self.headers)

    def _fetch_chunk_flow(
        self, placements: Sequence[ImagePlacement], start: int, end: int, out: Any, dense: bool, wait: bool
    ) -> AnyFlow[Any]:
        for placement in placements:
            fetchable(placement.image)
        plan = plan_chunk(placements, start, end, dense=dense)
        if not plan.pieces:
            return empty_chunk(plan, out)
        return (yield from self.rows.fetch_chunk(plan, out, wait, self.headers))

    def _model_flow(self) -> AnyFlow[dict[str, Any]]:
        return p.simple_flow("GET", "/v1/model", self.headers)
