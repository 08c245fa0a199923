"""visenc_client: talk to a visenc service from a prefill worker.

Example::

    from visenc_client import Client, ImagePlacement, RowRange

    with Client("http://127.0.0.1:8000") as vc:
        h = vc.encode([png_bytes], wait=False)[0]   # pending handle, num_tokens known
        first = vc.fetch(h, 0, 16)                    # waits until encoded
        rows = vc.fetch_chunk([ImagePlacement.of(h, offset=7)], 0, 512)  # one prefill chunk's rows

``RedisRows`` needs ``visenc-client[redis]``, ``visenc_client.vllm`` needs ``visenc-client[vllm]``.
"""

from typing import TYPE_CHECKING, Any

from visenc_client._client import AsyncClient, Client
from visenc_client._exceptions import (
    APIError,
    BadRequestError,
    DeadlineError,
    ImageEncodeError,
    NotFoundError,
    OverloadedError,
    ProtocolError,
    ServerError,
    TransportError,
    UnavailableError,
    VisencClientError,
)
from visenc_client._extras import needs
from visenc_client._types import Handle, RowRange, Video, image_hash, video_hash
from visenc_client.chunks import ChunkPiece, ChunkPlan, ImagePlacement, plan_chunk
from visenc_client.prefill import PromptLayout, VisencPrefill, expand_placeholders

if TYPE_CHECKING:
    from visenc_client._redis import AsyncRedisRows, RedisRows, RowsInfo

_EXTRAS = {"AsyncRedisRows": "redis", "RedisRows": "redis", "RowsInfo": "redis"}


def __getattr__(name: str) -> Any:
    if name not in _EXTRAS:
        raise AttributeError(f"module 'visenc_client' has no attribute {name!r}")
    with needs(_EXTRAS[name], f"visenc_client.{name}"):
        from visenc_client import _redis
    return getattr(_redis, name)


__all__ = [
    "APIError",
    "AsyncClient",
    "AsyncRedisRows",
    "BadRequestError",
    "ChunkPiece",
    "ChunkPlan",
    "Client",
    "DeadlineError",
    "Handle",
    "ImageEncodeError",
    "ImagePlacement",
    "NotFoundError",
    "OverloadedError",
    "PromptLayout",
    "ProtocolError",
    "RedisRows",
    "RowRange",
    "RowsInfo",
    "ServerError",
    "TransportError",
    "UnavailableError",
    "Video",
    "VisencClientError",
    "VisencPrefill",
    "expand_placeholders",
    "image_hash",
    "plan_chunk",
    "video_hash",
]
