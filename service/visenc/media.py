"""Image references as engines' front ends send them: ``data:`` URLs (decoded here) and ``http(s)``
URLs (fetched only under an allow-list, with size and time limits). One place for ``visenc proxy``
and the SGLang encoder endpoint (``visenc.epd``)."""

from __future__ import annotations

import asyncio
import binascii
import re
from collections.abc import Sequence

import httpx
import pybase64

from visenc.streams import read_capped

_DATA_URL = re.compile(r"data:(?P<mime>[\w/+.-]*)(?P<params>(;[\w=.-]+)*?);base64,(?P<data>.*)", re.S)


class MediaError(Exception):
    """An image reference that cannot be used (the message says why, for the caller)."""


def data_url_bytes(url: str, max_bytes: int) -> bytes | None:
    """The bytes of a ``data:...;base64,`` URL (``None``: not a data: URL)."""
    m = _DATA_URL.fullmatch(url)
    if m is None:
        return None
    return base64_bytes(m.group("data"), max_bytes, "an image data: URL is not valid base64")


def base64_bytes(text: str, max_bytes: int, invalid: str = "an image is not valid base64") -> bytes:
    if len(text) > (max_bytes + 2) // 3 * 4 + 4:  # decoding would pass the limit
        raise MediaError(f"an image is over {max_bytes} bytes")
    try:
        data = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(invalid) from e
    if len(data) > max_bytes:
        raise MediaError(f"an image is over {max_bytes} bytes")
    return data


def is_allowed_url(url: str, allow_prefixes: Sequence[str]) -> bool:
    return url.startswith(("http://", "https://")) and any(url.startswith(p) for p in allow_prefixes)


async def fetch(http: httpx.AsyncClient, url: str, *, max_bytes: int, timeout_s: float) -> bytes:
    """GET ``url`` (the caller checked the allow-list): its body, at most ``max_bytes``, within ``timeout_s``."""

    async def read() -> bytes:
        async with http.stream("GET", url) as r:
            if r.status_code != 200:
                raise MediaError(f"fetching an image URL answered {r.status_code}")
            return await read_capped(
                r.aiter_bytes(), max_bytes, lambda: MediaError(f"an image is over {max_bytes} bytes")
            )

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError as e:
        raise MediaError(f"fetching an image URL took longer than {timeout_s} s") from e
    except httpx.HTTPError as e:
        raise MediaError(f"fetching an image URL failed: {type(e).__name__}") from e
