"""What ``Client`` and ``AsyncClient`` share: timeouts, headers, the choice of HTTP or shared memory."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import httpx
import numpy as np

from visenc_client import _protocol as p
from visenc_client._http import Connections
from visenc_client._rows import fetch_chunk_flow, shm_fetch_flow
from visenc_client._shm import SegmentHandles, same_host
from visenc_client._steps import AnyFlow
from visenc_client._types import Handle, ImageInput, RowRange, Video
from visenc_client.chunks import ImagePlacement, plan_chunk
from visenc_client.format import LEASE_HEADER, PRIORITY_HEADER, Priority

log = logging.getLogger("visenc_client")

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
        self.shared_memory = shared_memory is True
        self._auto = shared_memory == "auto"
        self._segments = SegmentHandles() if self.shared_memory else None
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

    def _choose(self, model_info: dict[str, Any]) -> None:
        """Settle ``shared_memory="auto"`` from ``/v1/model``."""
        self._auto = False
        self.shared_memory = same_host(model_info)
        self._segments = SegmentHandles() if self.shared_memory else None
        log.info("visenc at %s: rows over %s", self.base_url, "shared memory" if self.shared_memory else "HTTP")

    @property
    def shm_http_fallbacks(self) -> int:
        """Ranges read over HTTP because the service's shared-memory budget was full."""
        return self._segments.http_fallbacks if self._segments is not None else 0

    def _encode_flow(
        self, images: Sequence[ImageInput | Video], wait: bool, hash_first: bool, include_rows: bool, pin: bool
    ) -> AnyFlow[list[Handle]]:
        headers = p.pinning(self.headers, pin)
        return p.encode_flow(
            self._http, images, wait=wait, hash_first=hash_first, headers=headers, include_rows=include_rows
        )

    def _lookup_flow(self, hashes: Sequence[str], wait: bool, include_rows: bool, pin: bool) -> AnyFlow[list[Handle]]:
        return p.lookup_split_by_pin_flow(self._http, hashes, self.headers, self._segments, wait, include_rows, pin)

    def _unpin_flow(self, handles: Sequence[Handle]) -> AnyFlow[None]:
        return p.unpin_flow(self._http, handles, self.headers)

    def _fetch_flow(self, image: str | Handle, start: int | None, end: int | None) -> AnyFlow[np.ndarray]:
        if self.shared_memory:
            return (yield from self._fetch_many_flow([RowRange.of(image, start, end)], wait=True))[0]
        return (yield from p.fetch_flow(self._http, image, start, end, self.headers))

    def _fetch_many_flow(self, ranges: Sequence[RowRange], wait: bool) -> AnyFlow[list[np.ndarray]]:
        if self._segments is not None:
            return shm_fetch_flow(self._http, ranges, wait=wait, headers=self.headers, known=self._segments)
        return p.fetch_many_flow(self._http, ranges, wait=wait, headers=self.headers)

    def _fetch_chunk_flow(
        self, placements: Sequence[ImagePlacement], start: int, end: int, out: Any, dense: bool, wait: bool
    ) -> AnyFlow[Any]:
        plan = plan_chunk(placements, start, end, dense=dense)
        return fetch_chunk_flow(self._http, plan, out, wait=wait, shm=self._segments, headers=self.headers)

    def _model_flow(self) -> AnyFlow[dict[str, Any]]:
        return p.simple_flow(self._http, "GET", "/v1/model", self.headers)
