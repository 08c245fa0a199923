"""``visenc proxy``'s settings and its OpenAI-style errors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastapi.responses import JSONResponse


@dataclass
class ProxySettings:
    upstreams: Sequence[str]
    visenc_url: str
    visenc_api_key: str | None = None
    #: http(s) image URLs are fetched only under one of these prefixes (none: only data: URLs)
    allow_url_prefixes: Sequence[str] = ()
    max_image_bytes: int = 32 << 20
    fetch_timeout_s: float = 10.0
    upstream_timeout_s: float = 600.0
    health_interval_s: float = 2.0
    #: images remembered for cache affinity (hash -> the upstream that saw it last)
    affinity_size: int = 100_000
    #: background encodes (one per request) in flight at once; more are skipped, never queued
    max_background_encodes: int = 64
    #: data: URLs remembered with their image's hash, in characters (an image resent turn after turn
    #: is neither decoded nor hashed again; its hand-over to visenc, once accepted, is not repeated)
    memo_chars: int = 128 << 20
    #: hand a request's images to visenc before forwarding it (default: after its answer is through;
    #: with ``wait_for_encoding`` on the connector, every image of it then comes from visenc)
    encode_first: bool = False
    #: frames vLLM takes of a ``data:video/jpeg`` URL (its ``num_frames`` video media option; -1: all)
    video_num_frames: int = 32
    #: the longest visenc is waited for, once the body is out, to say which images new to the proxy
    #: it lacks (then they count as lacking); 0: it is not asked, the connector looks them up itself
    absent_timeout_s: float = 0.05

    def __post_init__(self) -> None:
        if self.video_num_frames == 0 or self.video_num_frames < -1:
            raise ValueError("video_num_frames must be positive, or -1 (all frames)")


class ProxyError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status, self.kind = message, status, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}
        return JSONResponse(body, self.status)
