"""Serving a part: hash-first look-up, the misses encoded by the engine, the rows delivered."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from visenc.engine.interface import EncodeItem, EngineAPI, Handle
from visenc.epd.delivery import Destinations, Pusher
from visenc.epd.wire import embedding_data_frame
from visenc.errors import VisencError
from visenc.imaging.decode import loads_alike
from visenc.media import MediaError, base64_bytes, data_url_bytes, fetch, is_allowed_url
from visenc.metrics import Metrics
from visenc_client.format import image_hash

log = logging.getLogger("visenc.epd")


class EPDError(Exception):
    """A part that cannot be served: answered ``{status: "error", message, req_id}`` with ``status``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class MediaItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    url: str
    content_hash: str | None = None


class EncodePart(BaseModel):
    """``POST /encode``: one part of an SGLang request (the items one encoder URL got)."""

    model_config = ConfigDict(extra="allow")

    req_id: str = Field(min_length=1)
    num_parts: int = Field(ge=1)
    part_idx: int = Field(ge=0)
    mm_items: list[str | MediaItem] = Field(min_length=1)
    modality: str = "IMAGE"
    prefill_host: str | None = None
    embedding_port: int | list[int] | None = None

    @model_validator(mode="after")
    def _part_in_range(self) -> EncodePart:
        if self.part_idx >= self.num_parts:
            raise ValueError(f"part_idx must be in [0, {self.num_parts})")
        return self


class ReceiveUrl(BaseModel):
    """``POST /scheduler_receive_url``: a scheduler rank's PULL address for one part."""

    model_config = ConfigDict(extra="allow")

    req_id: str = Field(min_length=1)
    receive_count: int = Field(ge=1)
    receive_url: str = Field(min_length=3)


CONTENT_HASH = re.compile(r"sha256:([0-9a-fA-F]{64})")


@dataclass(frozen=True, slots=True)
class EPDSettings:
    namespace: str
    max_items: int
    max_image_bytes: int
    #: with an ``--image-loader`` other than ``sglang``, an image SGLang would load otherwise is refused
    image_loader: str = "sglang"
    max_pixels: int = 64_000_000
    allow_url_prefixes: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0
    #: longest an /encode waits for its image rows (the service's request deadline)
    encode_timeout_s: float = 120.0
    #: longest a part waits for its receivers to register once its rows exist
    register_timeout_s: float = 60.0
    push_timeout_s: float = 30.0


class EPD:
    """Serves SGLang's encoder protocol from an engine."""

    def __init__(self, settings: EPDSettings, metrics: Metrics, *, http: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.destinations = Destinations(ttl_s=max(300.0, settings.register_timeout_s))
        self.pusher = Pusher(timeout_s=settings.push_timeout_s)
        self.http = http or httpx.AsyncClient(follow_redirects=False)

    async def close(self) -> None:
        self.pusher.close()
        await self.http.aclose()

    def register(self, body: ReceiveUrl) -> None:
        try:
            self.destinations.register(body.req_id, body.receive_count, body.receive_url)
        except ValueError as e:
            raise EPDError(str(e)) from e

    async def serve(self, engine: EngineAPI, part: EncodePart) -> None:
        """Encode the part's images and deliver their rows; ``EPDError`` (sent to known receivers too) if it cannot."""
        try:
            await self._serve(engine, part)
        except EPDError as e:
            self.metrics.sglang_parts.labels("refused" if e.status < 500 else "failed").inc()
            log.warning("SGLang part %s: %s (%d)", part.req_id, e, e.status)
            raise
        self.metrics.sglang_parts.labels("delivered").inc()

    async def _serve(self, engine: EngineAPI, part: EncodePart) -> None:
        try:
            frames = await self._rows(engine, part)
        except EPDError as e:
            await self._deliver_error(part, str(e), e.status)
            raise
        self.metrics.sglang_waiting.inc()
        try:
            targets = await self._targets(part)
        finally:
            self.metrics.sglang_waiting.dec()
        results = await asyncio.gather(*(self.pusher.push(t, frames) for t in targets), return_exceptions=True)
        failed = [t for t, r in zip(targets, results) if isinstance(r, BaseException)]
        if failed:
            raise EPDError(f"could not deliver the embedding to {', '.join(failed)}", 502)

    async def _targets(self, part: EncodePart, *, wait: bool = True) -> list[str]:
        ports = part.embedding_port if isinstance(part.embedding_port, list) else [part.embedding_port]
        ports = [p for p in ports if p is not None]
        if ports:  # zmq_to_tokenizer (one port) or the scheduler ranks' ports, named in the request
            if not part.prefill_host:
                raise EPDError("embedding_port without prefill_host")
            return [f"{part.prefill_host}:{p}" for p in ports]
        if not wait:
            return self.destinations.registered(part.req_id)
        # zmq_to_scheduler: the ranks register their URLs (/scheduler_receive_url)
        targets, complete = await self.destinations.take(part.req_id, self.settings.register_timeout_s)
        if not complete:
            message = f"{len(targets)} receiver(s) registered within {self.settings.register_timeout_s} s"
            await self._push_error(targets, part, message, 504)
            raise EPDError(message, 504)
        return targets

    async def _deliver_error(self, part: EncodePart, message: str, status: int) -> None:
        try:
            targets = await self._targets(part, wait=False)
        except EPDError:
            return
        await self._push_error(targets, part, message, status)

    async def _push_error(self, targets: list[str], part: EncodePart, message: str, status: int) -> None:
        frame = embedding_data_frame(
            part.req_id, part.num_parts, part.part_idx, modality=_modality(part), error_msg=message, error_code=status
        )
        results = await asyncio.gather(*(self.pusher.push(t, [frame]) for t in targets), return_exceptions=True)
        for target, result in zip(targets, results):
            if isinstance(result, BaseException):
                log.warning("SGLang part %s: the error could not reach %s: %r", part.req_id, target, result)

    async def _rows(self, engine: EngineAPI, part: EncodePart) -> list[bytes | memoryview]:
        """Frames 0 and 1 of the part: its images' rows, in item order, as one tensor."""
        if _modality(part) != "IMAGE":
            raise EPDError(f"visenc encodes images; this part is {part.modality}")
        if len(part.mm_items) > self.settings.max_items:
            raise EPDError(f"{len(part.mm_items)} items, over the limit max_items={self.settings.max_items}", 413)
        ns = self.settings.namespace
        refs = [_reference(item) for item in part.mm_items]
        known = [h for _, h in refs if h is not None]
        present: set[str] = set()
        if known:
            handles = await engine.encode([EncodeItem(hash=h) for h in known], ns, wait=False, lease="none")
            present = {h.hash for h in handles if h.status in ("ready", "pending")}
        items = await asyncio.gather(*(self._item(i, url, h, present) for i, (url, h) in enumerate(refs)))
        try:
            timeout_s = self.settings.encode_timeout_s
            # the rows come with the answer: nothing is pinned for a later read
            handles = await engine.encode(items, ns, wait=True, timeout_s=timeout_s, lease="none", rows=True)
        except VisencError as e:
            raise EPDError(str(e), e.status_code) from e
        return _frames(part, handles)

    async def _item(self, index: int, url: str, content_hash: str | None, present: set[str]) -> EncodeItem:
        """The engine's item for one image: its hash alone where visenc holds it, else its bytes."""
        sglang_loader = self.settings.image_loader == "sglang"
        if sglang_loader and content_hash is not None and content_hash in present:
            return EncodeItem(hash=content_hash)
        data = await self._bytes(url)
        if content_hash is not None and image_hash(data) != content_hash:
            raise EPDError(f"content hash mismatch: expected sha256:{content_hash}, got sha256:{image_hash(data)}")
        if not sglang_loader:
            try:
                alike = loads_alike(data, (self.settings.image_loader, "sglang"), max_pixels=self.settings.max_pixels)
            except VisencError as e:
                raise EPDError(f"image {index} of the part: {e}") from e
            if not alike:  # an EXIF orientation or transparency: its rows here would not be SGLang's
                raise EPDError(
                    f"image {index} of the part loads otherwise in SGLang than with visenc's --image-loader "
                    f"{self.settings.image_loader} (rotated or transparent): serve SGLang with --image-loader sglang"
                )
        if content_hash is not None and content_hash in present:
            return EncodeItem(hash=content_hash)
        return EncodeItem(hash=content_hash, data=data)

    async def _bytes(self, url: str) -> bytes:
        limit = self.settings.max_image_bytes
        try:
            data = data_url_bytes(url, limit)
            if data is not None:
                return data
            if url.startswith(("http://", "https://")):
                if not is_allowed_url(url, self.settings.allow_url_prefixes):
                    raise EPDError("image URLs are not allowed here (data: URLs, or URLs under --sglang-url-prefixes)")
                return await fetch(self.http, url, max_bytes=limit, timeout_s=self.settings.fetch_timeout_s)
            if url.startswith(("file:", "/")) or "://" in url:
                raise EPDError("an image must be a data: URL, base64, or an allowed http(s) URL")
            return base64_bytes(url, limit)  # SGLang takes any other string as base64
        except MediaError as e:
            raise EPDError(str(e)) from e


def _modality(part: EncodePart) -> str:
    return part.modality.upper()


def _reference(item: str | MediaItem) -> tuple[str, str | None]:
    if isinstance(item, str):
        return item, None
    if item.model_extra:  # per-image processor options (``detail``, ...): rows visenc does not make
        raise EPDError(f"per-image options are not supported: {', '.join(sorted(item.model_extra))}")
    if item.content_hash is None:
        return item.url, None
    m = CONTENT_HASH.fullmatch(item.content_hash)
    if m is None:
        raise EPDError("content_hash must use the form 'sha256:<64 hex digits>'")
    return item.url, m.group(1).lower()


def _frames(part: EncodePart, handles: list[Handle]) -> list[bytes | memoryview]:
    bad = [(i, h) for i, h in enumerate(handles) if h.status != "ready" or h.rows is None]
    if bad:
        i, h = bad[0]
        raise EPDError(f"image {i} of the part: {h.error or h.status}", 400 if h.status == "error" else 504)
    header = embedding_data_frame(
        part.req_id,
        part.num_parts,
        part.part_idx,
        grid=[list(h.grid_thw or ()) for h in handles],
        dtype=handles[0].dtype,
        shape=[sum(h.num_tokens or 0 for h in handles), handles[0].hidden_size or 0],
    )
    views = [h.rows.data.cast("B") for h in handles if h.rows is not None]
    return [header, views[0] if len(views) == 1 else b"".join(views)]
