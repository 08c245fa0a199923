"""The image parts of a chat request: read, hashed, and tagged with their visenc hash as ``uuid``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from visenc.media import MediaError, base64_bytes, data_url_bytes, fetch, is_allowed_url
from visenc.proxy.affinity import Memo
from visenc.proxy.errors import ProxyError
from visenc.proxy.settings import ProxySettings
from visenc_client import Video
from visenc_client.format import image_hash, video_hash

#: a video vLLM takes as frames already sampled: JPEG frames, base64, joined by commas
JPEG_FRAMES = "data:video/jpeg;base64,"


@dataclass(slots=True)
class Image:
    """One image part: its visenc hash, and its bytes or its data: URL (decoded only if it is handed over)."""

    hash: str
    source: bytes | str | Video


class Images:
    def __init__(self, settings: ProxySettings, memo: Memo, http: httpx.AsyncClient) -> None:
        self.settings, self.memo, self.http = settings, memo, http

    def data_url_bytes(self, url: str) -> bytes | None:
        try:
            return data_url_bytes(url, self.settings.max_image_bytes)
        except MediaError as e:
            raise ProxyError(str(e)) from e

    def payload(self, image: Image) -> bytes | Video | None:
        """What visenc is given for ``image``: its bytes, or a video's frames."""
        return image.source if isinstance(image.source, bytes | Video) else self.data_url_bytes(image.source)

    async def tag(self, body: dict[str, Any]) -> list[Image]:
        """Give every image part its visenc hash as ``uuid``; the images, in order."""
        parts = _parts(body)
        if not parts:
            return []
        images = await asyncio.gather(*(self._media(p["type"], p.pop("_url")) for p in parts))
        for part, image in zip(parts, images):
            part["uuid"] = image.hash
        return list(images)

    async def _media(self, kind: str, url: str) -> Image:
        return self._video(url) if kind == "video_url" else await self._image(url)

    async def _image(self, url: str) -> Image:
        """A data: URL seen before by its remembered hash alone; others read and hashed."""
        known = self.memo.hash_of(url)
        if known is not None:
            return Image(known, url)
        data = self.data_url_bytes(url)
        if data is not None:
            image = Image(image_hash(data), data)
            self.memo.remember(url, image.hash)
            return image
        if url.startswith(("http://", "https://")):
            if not is_allowed_url(url, self.settings.allow_url_prefix):
                raise ProxyError("image URLs are not allowed here (only data: URLs, or URLs under an allowed prefix)")
            try:  # never remembered: what a URL serves may change
                s = self.settings
                data = await fetch(self.http, url, max_bytes=s.max_image_bytes, timeout_s=s.fetch_timeout_s)
            except MediaError as e:
                raise ProxyError(str(e)) from e
            return Image(image_hash(data), data)
        raise ProxyError("an image_url must be a data: URL or an allowed http(s) URL")

    def _video(self, url: str) -> Image:
        """A ``data:video/jpeg`` part: the frames vLLM takes of it (the first ``video_num_frames``)."""
        n = self.settings.video_num_frames
        texts = url[len(JPEG_FRAMES) :].split(",", n)[:n] if n > 0 else url[len(JPEG_FRAMES) :].split(",")
        try:
            frames = [
                base64_bytes(t, self.settings.max_image_bytes, "a video frame is not valid base64") for t in texts
            ]
        except MediaError as e:
            raise ProxyError(str(e)) from e
        return Image(video_hash([image_hash(f) for f in frames]), Video(frames))


def _parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The image and pre-sampled video parts of the messages, each with its URL under ``_url``."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ProxyError("'messages' must be a list")
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts += [p for p in content if isinstance(p, dict) and p.get("type") in ("image_url", "video_url")]
    tagged = []
    for part in parts:
        kind = part["type"]
        media = part.get(kind)
        url = media.get("url") if isinstance(media, dict) else media
        if not isinstance(url, str):
            raise ProxyError(f"an {kind} part has no url")
        if kind == "video_url" and not url.startswith(JPEG_FRAMES):
            continue  # a video file: vLLM decodes and encodes it itself
        part["_url"] = url
        tagged.append(part)
    return tagged
