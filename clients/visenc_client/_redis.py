"""Direct reads of token rows from the shared Redis index, with no hop through the service
(docs/internals.md, "Direct reads from Redis"). Only ready images are there: ``NotFoundError`` otherwise."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import redis
import redis.asyncio
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from visenc_client._exceptions import BadRequestError, NotFoundError, ProtocolError, TransportError, describe
from visenc_client._types import Handle
from visenc_client.format import DATA_OFFSET, NUMPY_DTYPES, CorruptEntry, entry_key
from visenc_client.format import parse_header as format_header

#: a cluster none of whose nodes answers raises ``RedisClusterException``, no ``RedisError``
UNREACHABLE = (redis.RedisError, RedisClusterException, OSError)


@dataclass(frozen=True, slots=True)
class RowsInfo:
    rows: int
    hidden: int
    dtype: str
    grid_thw: tuple[int, int, int]
    fingerprint: str
    hash: str

    @property
    def row_bytes(self) -> int:
        return self.hidden * NUMPY_DTYPES[self.dtype].itemsize


def parse_header(prefix: bytes, *, fingerprint: str, image_hash: str) -> RowsInfo:
    if not prefix:
        raise NotFoundError(404, "not_found", f"no embedding for image {image_hash} in redis")
    try:
        h = format_header(prefix)
    except CorruptEntry as e:
        raise ProtocolError(f"unreadable stored value for image {image_hash}: {e}") from e
    rows, hidden = h["shape"]
    info = RowsInfo(rows, hidden, h["dtype"], tuple(h["grid_thw"]), str(h["fingerprint"]), str(h["hash"]))  # type: ignore[arg-type]
    if info.fingerprint != fingerprint or info.hash != image_hash:
        raise ProtocolError(f"stored value for image {image_hash} belongs to another model or image")
    if h.get("kind", "rows") != "rows":  # a video's manifest: its rows are its tubes' entries
        raise NotFoundError(404, "not_found", f"{image_hash} is a video: read its tubes (Handle.tubes)")
    return info


def _range(info: RowsInfo, start: int | None, end: int | None) -> tuple[int, int]:
    s = 0 if start is None else start
    e = info.rows if end is None else end
    if not 0 <= s <= e <= info.rows:
        raise BadRequestError(400, "bad_request", f"range [{s}, {e}) is outside the image's {info.rows} token rows")
    return s, e


Bounds = tuple[int, int]
ReadFlow = Generator[list[Bounds], list[bytes], tuple[RowsInfo, bytes]]
_HEADER: Bounds = (0, DATA_OFFSET - 1)


def _rows_bounds(row_bytes: int, s: int, e: int) -> Bounds:
    return DATA_OFFSET + s * row_bytes, DATA_OFFSET + e * row_bytes - 1


def read_flow(image: str | Handle, start: int | None, end: int | None, *, fingerprint: str) -> ReadFlow:
    """One read's ``GETRANGE`` rounds and replies, independent of I/O; ``RedisRows`` / ``AsyncRedisRows`` drive it."""
    h = image.hash if isinstance(image, Handle) else image
    batch = [_HEADER]
    if isinstance(image, Handle) and image.num_tokens and image.hidden_size and image.dtype in NUMPY_DTYPES:
        known = RowsInfo(image.num_tokens, image.hidden_size, str(image.dtype), (0, 0, 0), "", h)
        s, e = _range(known, start, end)
        if e > s:
            batch.append(_rows_bounds(known.row_bytes, s, e))
    replies = yield batch
    info = parse_header(replies[0], fingerprint=fingerprint, image_hash=h)
    s, e = _range(info, start, end)
    if e == s:
        return info, b""
    want = _rows_bounds(info.row_bytes, s, e)
    if len(batch) == 2 and batch[1] == want:
        data = replies[1]
    else:
        (data,) = yield [want]
    if len(data) != (e - s) * info.row_bytes:  # evicted between the reads
        raise NotFoundError(404, "not_found", f"embedding for image {h} left redis during the read")
    return info, data


def _array(info: RowsInfo, data: bytes) -> np.ndarray:
    out: np.ndarray = np.frombuffer(data, dtype=NUMPY_DTYPES[info.dtype])
    return out.reshape(len(data) // info.row_bytes, info.hidden)


def _public(url: str) -> str:
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname or ""
    return parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")).geturl()


def _address(client: Any) -> str:
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None) or {}
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    if "host" in kwargs:
        return f"redis://{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
    nodes = getattr(client, "startup_nodes", None) or getattr(
        getattr(client, "nodes_manager", None), "startup_nodes", {}
    )
    node = next(iter(nodes.values()), None) if isinstance(nodes, dict) else None
    return f"redis://{node.host}:{node.port}" if node is not None else "redis"


class _Rows:
    """``from_url`` connects nothing: the first read does, and what cannot be reached then is a ``TransportError``."""

    _kinds: tuple[Any, Any]  # (its Redis client class, its cluster client class)

    def __init__(self, client: Any, *, fingerprint: str, namespace: str = "default") -> None:
        self._client = client
        self._connect: Callable[[], Any] | None = None
        self._connecting = threading.Lock()  # threads that read first make one client, not one each
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.url = _address(client)

    @classmethod
    def _from_url(cls, url: str, fingerprint: str, namespace: str, cluster: bool, options: dict[str, Any]) -> Any:
        rows = cls.__new__(cls)
        _Rows.__init__(rows, None, fingerprint=fingerprint, namespace=namespace)
        rows._connect = lambda: cls._kinds[cluster].from_url(url, **options)
        rows.url = _public(url)
        return rows

    @property
    def redis(self) -> Any:
        if self._client is None and self._connect is not None:
            with self._connecting:
                if self._client is None:
                    self._client = self._connect()  # a cluster's client asks its nodes for the slots here
        return self._client

    def key(self, image: str | Handle) -> str:
        return entry_key(self.namespace, self.fingerprint, image.hash if isinstance(image, Handle) else image)


class RedisRows(_Rows):
    """Blocking reads of token rows straight from Redis (or a Redis Cluster)."""

    _kinds = (redis.Redis, RedisCluster)

    @classmethod
    def from_url(
        cls, url: str, *, fingerprint: str, namespace: str = "default", cluster: bool = False, **options: Any
    ) -> RedisRows:
        return cls._from_url(url, fingerprint, namespace, cluster, options)  # type: ignore[no-any-return]

    def _drive(self, image: str | Handle, flow: ReadFlow) -> tuple[RowsInfo, bytes]:
        key = self.key(image)
        try:
            batch = next(flow)
            while True:
                pipe = self.redis.pipeline(transaction=False)
                for lo, hi in batch:
                    pipe.getrange(key, lo, hi)
                batch = flow.send(list(pipe.execute()))
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except UNREACHABLE as e:
            raise TransportError(describe(e), self.url) from e

    def fetch_bytes(self, image: str | Handle, start: int | None = None, end: int | None = None) -> bytes:
        return self._drive(image, read_flow(image, start, end, fingerprint=self.fingerprint))[1]

    def fetch(self, image: str | Handle, start: int | None = None, end: int | None = None) -> np.ndarray:
        """Rows ``[start, end)`` as a read-only ``[rows, hidden]`` array (raw uint16 for bfloat16)."""
        return _array(*self._drive(image, read_flow(image, start, end, fingerprint=self.fingerprint)))

    def info(self, image: str | Handle) -> RowsInfo:
        return self._drive(image, read_flow(image, 0, 0, fingerprint=self.fingerprint))[0]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> RedisRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRedisRows(_Rows):
    _kinds = (redis.asyncio.Redis, AsyncRedisCluster)

    @classmethod
    def from_url(
        cls, url: str, *, fingerprint: str, namespace: str = "default", cluster: bool = False, **options: Any
    ) -> AsyncRedisRows:
        return cls._from_url(url, fingerprint, namespace, cluster, options)  # type: ignore[no-any-return]

    async def _drive(self, image: str | Handle, flow: ReadFlow) -> tuple[RowsInfo, bytes]:
        key = self.key(image)
        try:
            batch = next(flow)
            while True:
                pipe = self.redis.pipeline(transaction=False)
                for lo, hi in batch:
                    pipe.getrange(key, lo, hi)
                batch = flow.send(list(await pipe.execute()))
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except UNREACHABLE as e:
            raise TransportError(describe(e), self.url) from e

    async def fetch_bytes(self, image: str | Handle, start: int | None = None, end: int | None = None) -> bytes:
        return (await self._drive(image, read_flow(image, start, end, fingerprint=self.fingerprint)))[1]

    async def fetch(self, image: str | Handle, start: int | None = None, end: int | None = None) -> np.ndarray:
        return _array(*await self._drive(image, read_flow(image, start, end, fingerprint=self.fingerprint)))

    async def info(self, image: str | Handle) -> RowsInfo:
        return (await self._drive(image, read_flow(image, 0, 0, fingerprint=self.fingerprint)))[0]

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def __aenter__(self) -> AsyncRedisRows:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
