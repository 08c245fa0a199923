"""How rows reach this client: ``HttpRows`` (rows frames) or ``ShmRows`` (the service's segments, same
host); ``AutoRows`` asks the service at the first read. The client holds one and never asks which."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from visenc_client import _protocol as p
from visenc_client._rows import http_chunk_flow, shm_chunk_flow, shm_fetch_flow
from visenc_client._shm import SegmentHandles, same_host
from visenc_client._steps import AnyFlow
from visenc_client._types import Handle, RowRange
from visenc_client.chunks import ChunkPlan

log = logging.getLogger("visenc_client")

Headers = dict[str, str]


class RowsTransport(ABC):
    """The three reads of rows, as flows the client's driver runs."""

    shared_memory = False
    #: a look-up asks for the rows with the handles (one round trip) rather than reading them after
    rows_with_lookup = True
    segments: SegmentHandles | None = None

    @property
    def http_fallbacks(self) -> int:
        """Ranges read over HTTP because the service's shared-memory budget was full."""
        return 0

    def reads_unpinned(self, image_hash: str) -> bool:
        """Whether this client reads ``image_hash`` with no request (so no read would unpin it)."""
        return False

    @abstractmethod
    def fetch(
        self, image: str | Handle, start: int | None, end: int | None, headers: Headers
    ) -> AnyFlow[np.ndarray]: ...

    @abstractmethod
    def fetch_many(self, ranges: Sequence[RowRange], wait: bool, headers: Headers) -> AnyFlow[list[np.ndarray]]: ...

    @abstractmethod
    def fetch_chunk(self, plan: ChunkPlan, out: Any, wait: bool, headers: Headers) -> AnyFlow[Any]: ...


class HttpRows(RowsTransport):
    def fetch(self, image: str | Handle, start: int | None, end: int | None, headers: Headers) -> AnyFlow[np.ndarray]:
        return p.fetch_flow(image, start, end, headers)

    def fetch_many(self, ranges: Sequence[RowRange], wait: bool, headers: Headers) -> AnyFlow[list[np.ndarray]]:
        return p.fetch_many_flow(ranges, wait=wait, headers=headers)

    def fetch_chunk(self, plan: ChunkPlan, out: Any, wait: bool, headers: Headers) -> AnyFlow[Any]:
        return http_chunk_flow(plan, out, wait=wait, headers=headers)


class ShmRows(RowsTransport):
    """Read-only views of the service's segments; what its budget cannot hold, over HTTP."""

    shared_memory = True
    rows_with_lookup = False

    def __init__(self) -> None:
        self.segments = SegmentHandles()

    @property
    def http_fallbacks(self) -> int:
        return self.segments.http_fallbacks if self.segments is not None else 0

    def reads_unpinned(self, image_hash: str) -> bool:
        return self.segments is not None and self.segments.knows(image_hash)

    def fetch(self, image: str | Handle, start: int | None, end: int | None, headers: Headers) -> AnyFlow[np.ndarray]:
        return (yield from self.fetch_many([RowRange.of(image, start, end)], True, headers))[0]

    def fetch_many(self, ranges: Sequence[RowRange], wait: bool, headers: Headers) -> AnyFlow[list[np.ndarray]]:
        assert self.segments is not None
        return shm_fetch_flow(ranges, wait=wait, headers=headers, known=self.segments)

    def fetch_chunk(self, plan: ChunkPlan, out: Any, wait: bool, headers: Headers) -> AnyFlow[Any]:
        assert self.segments is not None
        return shm_chunk_flow(plan, out, wait=wait, headers=headers, known=self.segments)


def rows_for(model_info: dict[str, Any], base_url: str) -> RowsTransport:
    """Shared memory where the service that answered ``model_info`` shares this host's, else HTTP."""
    chosen: RowsTransport = ShmRows() if same_host(model_info) else HttpRows()
    log.info("visenc at %s: rows over %s", base_url, "shared memory" if chosen.shared_memory else "HTTP")
    return chosen


class AutoRows(RowsTransport):
    """Shared memory or HTTP, as ``GET /v1/model`` shows at the first read (``shared_memory="auto"``)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.chosen: RowsTransport | None = None

    @property
    def shared_memory(self) -> bool:  # type: ignore[override]
        return self.chosen is not None and self.chosen.shared_memory

    @property
    def rows_with_lookup(self) -> bool:  # type: ignore[override]
        return self.chosen is None or self.chosen.rows_with_lookup

    @property
    def segments(self) -> SegmentHandles | None:  # type: ignore[override]
        return None if self.chosen is None else self.chosen.segments

    @property
    def http_fallbacks(self) -> int:
        return 0 if self.chosen is None else self.chosen.http_fallbacks

    def reads_unpinned(self, image_hash: str) -> bool:
        return self.chosen is not None and self.chosen.reads_unpinned(image_hash)

    def _settled(self, headers: Headers) -> AnyFlow[RowsTransport]:
        if self.chosen is None:
            info = yield from p.simple_flow("GET", "/v1/model", headers)
            self.chosen = rows_for(info, self.base_url)
        return self.chosen

    def fetch(self, image: str | Handle, start: int | None, end: int | None, headers: Headers) -> AnyFlow[np.ndarray]:
        return (yield from (yield from self._settled(headers)).fetch(image, start, end, headers))

    def fetch_many(self, ranges: Sequence[RowRange], wait: bool, headers: Headers) -> AnyFlow[list[np.ndarray]]:
        return (yield from (yield from self._settled(headers)).fetch_many(ranges, wait, headers))

    def fetch_chunk(self, plan: ChunkPlan, out: Any, wait: bool, headers: Headers) -> AnyFlow[Any]:
        return (yield from (yield from self._settled(headers)).fetch_chunk(plan, out, wait, headers))


def rows_transport(shared_memory: bool | str, base_url: str) -> RowsTransport:
    """The transport ``shared_memory`` names: ``True``, ``False`` or ``"auto"``."""
    if shared_memory == "auto":
        return AutoRows(base_url)
    return ShmRows() if shared_memory is True else HttpRows()
