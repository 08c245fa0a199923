"""``visenc proxy``'s settings: every field is a ``visenc proxy --flag`` and a ``VISENC_PROXY_*`` variable."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from visenc.config import Bytes


class ProxySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VISENC_PROXY_", extra="forbid", validate_default=True)

    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8080, ge=0, le=65535, description="Port to bind.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    upstream: list[str] = Field(..., min_length=1, description="A vLLM OpenAI server (repeat for several).")
    visenc: str = Field("http://127.0.0.1:8000", description="The visenc service.")
    visenc_api_key: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("visenc_api_key", "VISENC_PROXY_VISENC_API_KEY", "VISENC_API_KEY"),
        description="Bearer key for visenc (prefer the variable: flags show in the process list).",
    )
    allow_url_prefix: list[str] = Field(
        default_factory=list, description="Fetch http(s) image URLs under this prefix (repeat); none: data: URLs only."
    )
    max_image_bytes: Bytes = Field(32 << 20, gt=0, description="Largest image, bytes.")
    fetch_timeout_s: float = Field(10.0, gt=0, description="Bound of one image URL fetch.")
    upstream_timeout_s: float = Field(600.0, gt=0, description="Bound of one request to an upstream.")
    health_interval_s: float = Field(2.0, gt=0, description="How often the upstreams are health-checked.")
    affinity_size: int = Field(
        100_000, gt=0, description="Images remembered for cache affinity (hash -> the upstream that saw it last)."
    )
    max_background_encodes: int = Field(
        64, ge=0, description="Hand-overs to visenc in flight at once; past it a request's images are skipped."
    )
    memo_chars: int = Field(
        128 << 20,
        ge=0,
        description="data: URLs remembered with their image's hash, in characters: an image resent turn after "
        "turn is neither decoded nor hashed again, nor handed to visenc again once accepted.",
    )
    encode_first: bool = Field(
        False,
        description="Forward a request only once visenc has its images (default: at once; visenc gets them after "
        "the answer). With wait_for_encoding on the connector, every image then comes from visenc.",
    )
    video_num_frames: int = Field(
        32, description="Frames vLLM takes of a data:video/jpeg URL (its video num_frames media option; -1: all)."
    )
    absent_timeout_s: float = Field(
        0.05,
        ge=0,
        description="Longest wait, once a body is out, for visenc to say which new images it lacks (0: not asked).",
    )

    @field_validator("upstream")
    @classmethod
    def _no_trailing_slash(cls, v: list[str]) -> list[str]:
        return [u.rstrip("/") for u in v]

    @field_validator("video_num_frames")
    @classmethod
    def _frames(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("video_num_frames must be positive, or -1 (all frames)")
        return v
