"""Wire schemas, shared by the JSON and msgpack encodings of every endpoint."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from visenc_client.format import HASH_PATTERN, Priority, Reason, Status

#: bound of a token-row index (no image comes near it; keeps every integer a fixed-width msgpack int)
MAX_ROW = 2**31 - 1


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", val_json_bytes="base64", ser_json_bytes="base64", strict=True)


class EncodeItemIn(_Wire):
    # the hash is checked per item by the engine: a malformed one is that item's error (reason
    # invalid_hash), not a rejection of the whole request, so the schema states no pattern
    hash: str | None = Field(
        None,
        description=f"SHA-256 of the image bytes, 64 lowercase hex digits ({HASH_PATTERN}); a malformed "
        "one makes this item an error with reason invalid_hash.",
    )
    data: bytes | None = Field(None, description="The encoded image (JPEG, PNG, WebP, ...).")
    frames: list[bytes] | None = Field(
        None,
        description="A video, as the frames the caller sampled, in order: each an encoded image, all one size. "
        "The item's hash is then the video hash (visenc_client.format.video_hash of the frames' hashes); "
        "only towers with a video processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) take videos.",
    )


class EncodeRequest(_Wire):
    items: list[EncodeItemIn] = Field(..., min_length=1, description="Images, in prompt order.")
    wait: bool = Field(True, description="Wait until every image is encoded (false: answer at once).")
    include_rows: bool = Field(
        False,
        description="Also return each ready image's rows inline (``rows``: raw little-endian bytes, "
        "base64 in JSON), saving a fetch. For small embeddings (CLIP-style); requires wait=true.",
    )
    priority: Priority | None = Field(
        None,
        description="The request's class: interactive work goes to the device before batch work (batch work keeps "
        "a floor of it). Unset: the X-Visenc-Priority header, else interactive.",
    )


class HandleOut(_Wire):
    hash: str
    status: Status
    num_tokens: int | None = Field(None, description="Token rows the image becomes (known while pending).")
    hidden_size: int | None = None
    dtype: str | None = None
    grid_thw: list[int] | None = None
    error: str | None = Field(None, description="What went wrong with this item (status 'error').")
    reason: Reason | None = Field(None, description="Stable reason code of an 'error' item (docs/api.md).")
    tubes: list[str] | None = Field(
        None,
        description="A video's tubes' hashes, in order: grid_thw[0] tubes of num_tokens / grid_thw[0] rows each, "
        "each fetchable on its own (null for an image).",
    )
    lease: str | None = Field(
        None,
        description="With the request header X-Visenc-Lease: id, the lease that keeps this ready (or pending) "
        "image in the replica's memory until the caller reads it: name it in the reads (docs/api.md).",
    )
    rows: bytes | None = Field(None, description="The rows, when include_rows was asked (ready images only).")


class EncodeResponse(_Wire):
    model: str = Field(..., description="Model fingerprint the handles belong to.")
    items: list[HandleOut]


class FetchRange(_Wire):
    hash: str = Field(..., description="Image hash, 64 lowercase hex digits.", pattern=HASH_PATTERN)
    start: int | None = Field(None, ge=0, le=MAX_ROW, description="First token row (default 0).")
    end: int | None = Field(None, ge=0, le=MAX_ROW, description="One past the last token row (default: all rows).")
    lease: str | None = Field(
        None,
        max_length=64,
        description="The lease the image's handle carried: this read renews its pin, or unpins it when it "
        "reaches the last row (a shared-memory export unpins it at once). Unknown or spent: ignored.",
    )


class FetchRequest(_Wire):
    ranges: list[FetchRange] = Field(..., min_length=1)
    wait: bool = Field(True, description="Wait for pending images (up to fetch_timeout_s).")


class ErrorOut(_Wire):
    kind: str = Field(..., description="Failure kind (the label of visenc_errors_total).")
    message: str = Field(..., description="What went wrong; a limit is named with its value.")


class ErrorResponse(_Wire):
    error: ErrorOut


class ModelInfo(BaseModel):
    name: str
    served_model_name: str = Field(..., description="--served-model-name, else --model.")
    fingerprint: str = Field(..., description="Goes into every index key.")
    hidden_size: int
    dtype: str
    device: str
    packable: bool
    family: str | None = Field(None, description="VLM family of a checkpoint tower (models/families/).")
    row_layout: list[dict[str, Any]] = Field(
        ..., description="Columns of a row along the hidden axis: [{name, width}] (Qwen3-VL: main, then deepstack)."
    )


class LayoutOut(BaseModel):
    width: int
    height: int
    num_tokens: int = Field(..., description="Rows the image becomes.")
    grid_thw: list[int]
    hidden_size: int
    row_layout: list[dict[str, Any]]
    span: list[dict[str, Any]] = Field(
        ...,
        description="The image's placeholder span in the engine's prompt, in order: {rows: n} (embedding rows) "
        "and {text: s} (prompt text the engine's processor writes there, tokenised by the engine).",
    )


class ReadyOut(BaseModel):
    status: Literal["ready"]
    index: dict[str, Any] = Field(..., description="Health of the index tiers.")
    queue_depth: int
