"""Wire schemas, shared by the JSON and msgpack encodings of every endpoint.

Bytes travel as raw ``bin`` in msgpack and as base64 strings in JSON.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

HASH_PATTERN = r"^[0-9a-f]{64}$"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", val_json_bytes="base64", ser_json_bytes="base64")


class EncodeItemIn(_Wire):
    hash: str | None = Field(None, description="SHA-256 of the image bytes, 64 lowercase hex digits.")
    data: bytes | None = Field(None, description="The encoded image (JPEG, PNG, WebP, ...).")


class EncodeRequest(_Wire):
    items: list[EncodeItemIn] = Field(..., min_length=1, description="Images, in prompt order.")
    wait: bool = Field(True, description="Wait until every image is encoded (false: answer at once).")
    include_rows: bool = Field(
        False, description="Also return each ready image's rows inline (``rows``: raw little-endian bytes, "
        "base64 in JSON), saving a fetch. For small embeddings (CLIP-style); requires wait=true.",
    )


class HandleOut(_Wire):
    hash: str
    status: Literal["ready", "pending", "missing", "error"]
    num_tokens: int | None = Field(None, description="Token rows the image becomes (known while pending).")
    hidden_size: int | None = None
    dtype: str | None = None
    grid_thw: list[int] | None = None
    error: str | None = None
    rows: bytes | None = Field(None, description="The rows, when include_rows was asked (ready images only).")


class EncodeResponse(_Wire):
    model: str = Field(..., description="Model fingerprint the handles belong to.")
    items: list[HandleOut]


class FetchRange(_Wire):
    hash: str = Field(..., description="Image hash.")
    start: int | None = Field(None, ge=0, description="First token row (default 0).")
    end: int | None = Field(None, ge=0, description="One past the last token row (default: all rows).")


class FetchRequest(_Wire):
    ranges: list[FetchRange] = Field(..., min_length=1)
    wait: bool = Field(True, description="Wait for pending images (up to fetch_timeout_s).")


class ErrorOut(_Wire):
    kind: str
    message: str


class ErrorResponse(_Wire):
    error: ErrorOut
