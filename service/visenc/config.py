"""Settings: one typed place for every option."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from visenc.tenancy import TenantSettings
from visenc_client.format import NAMESPACE_PATTERN

MiB = 1 << 20
_UNITS = {u + i: 1 << 10 * n if i else 1000**n for n, u in enumerate(["", *"kmgt"]) for i in ("", "i")}
_SIZE = re.compile(r"(-?\d+(?:\.\d+)?)\s*([kmgt]i?)?b?", re.I)


def parse_bytes(value: object) -> object:
    """A byte size: an integer, or a number with a unit: KB, MB, GB, TB (powers of 1000) or KiB, MiB,
    GiB, TiB (powers of 1024); 'k', 'M', 'Gi', ... alone too. Anything else is left to fail as an int."""
    if not isinstance(value, str):
        return value
    m = _SIZE.fullmatch(value.strip())
    if m is None:
        raise ValueError(f"{value!r} is not a byte size (e.g. 2GiB, 512MB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


#: bytes: an int, or '2GiB', '512MB', ...
Bytes = Annotated[int, BeforeValidator(parse_bytes)]


def octal(value: object) -> object:
    """A file mode in octal ('0660', '660', '0o660'); anything else is left to fail as an int."""
    return int(value, 8) if isinstance(value, str) and re.fullmatch(r"(0o)?[0-7]{1,4}", value.strip()) else value


Mode = Annotated[int, BeforeValidator(octal), Field(ge=0, le=0o777)]


class Settings(TenantSettings):
    model_config = SettingsConfigDict(env_prefix="VISENC_", extra="forbid", validate_default=True)

    # --- server -------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0: any free port).")
    uds: Path | None = Field(None, description="Unix domain socket to listen on instead of host:port.")
    uds_mode: Mode = Field(0o600, description="Mode of the --uds socket, in octal (0600: owner only; 0660: group too).")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")

    # --- model --------------------------------------------------------------
    model: str = Field(
        "tiny-qwen2-vl",
        description="Registry name (tiny-qwen2-vl, tiny-qwen2.5-vl, tiny-clip, tiny-siglip), a local checkpoint "
        "folder, or a hub id ORG/NAME[@REVISION] (through huggingface_hub: HF_HOME, HF_HUB_CACHE, HF_TOKEN, "
        "HF_ENDPOINT, HF_HUB_OFFLINE); only its vision weights are read, and from a hub only they are fetched.",
    )
    revision: str | None = Field(
        None,
        description="Hub revision (branch, tag or commit) of a hub --model; unset: the repository's default "
        "branch (main). Same as @REVISION. Start-up logs the commit it resolved to.",
    )
    served_model_name: str | None = Field(
        None, description="Name /v1/model and the start-up log give the model (default: --model)."
    )
    download_dir: Path | None = Field(
        None,
        description="Hub cache folder the vision weights are fetched into (default: HF_HUB_CACHE, or HF_HOME/hub).",
    )
    hf_token: SecretStr | None = Field(None, description="Hub token for gated or private models (default: HF_TOKEN).")
    trust_remote_code: bool = Field(
        False, description="Accepted for vLLM/TEI command lines; changes nothing: visenc runs no repository code."
    )
    hub_wait_s: float = Field(
        300.0, ge=0, description="Seconds a start waits out a hub that says 'try later' (408, 429, 5xx, no answer)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype; auto = float32 on CPU, bfloat16 on CUDA."
    )
    device: str = Field("auto", description="torch device: cpu, cuda, cuda:N; auto = cuda if available.")
    max_pixels: int | None = Field(
        None, gt=0, description="Override the tower's max pixels after resize (variable-resolution towers)."
    )
    image_backend: Literal["torchvision", "pil"] = Field(
        "torchvision",
        description="Whose image-processor backend the pixels equal: torchvision (transformers' fast processors, "
        "what vLLM and SGLang run) or pil. They differ wherever an image is resized. Part of the fingerprint.",
    )
    image_loader: Literal["vllm", "sglang", "transformers"] = Field(
        "vllm",
        description="Whose image loader the rows must match (formats, EXIF orientation, how transparency "
        "becomes RGB): vllm (vLLM 0.32: EXIF orientation applied, any transparency onto white), sglang (0.5.23: "
        "alpha dropped), transformers (transparency onto white). Part of the model fingerprint, with the version.",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Compile the tower's blocks with torch.compile (dynamic shapes) at start-up; readiness waits "
        "for it, so no request pays for it. auto: on for CUDA, off on a CPU.",
    )
    torch_threads: int | None = Field(None, gt=0, description="torch intra-op threads (default: CPU: all; CUDA: 1).")

    # --- index --------------------------------------------------------------
    namespace: str = Field("default", pattern=NAMESPACE_PATTERN, description="Default key namespace (tenant).")
    process_memory_bytes: Bytes | None = Field(
        None,
        gt=0,
        description="One memory budget for what this process keeps for the rows it serves: the in-process index "
        "(L1), the pinned entries beyond it, the shared-memory segments and the staged tower inputs. Default: half "
        "of the container's memory limit; without one, half of the host's memory over its GPU count (NVML, every "
        "GPU of the host). Start-up logs the split.",
    )
    cache_bytes: Bytes | None = Field(
        None,
        ge=0,
        description="Byte budget of the in-process index (L1); default: what process_memory_bytes leaves after the "
        "other parts. Start-up logs how many screenshots of the served model it holds.",
    )
    pin_overflow_bytes: Bytes | None = Field(
        None,
        ge=0,
        description="Bytes that entries pinned for their readers may hold beyond cache_bytes; past it the oldest "
        "pins are cut (visenc_cache_pins_cut_total). Default: an eighth of process_memory_bytes, within it.",
    )
    joined_rows_bytes: Bytes | None = Field(
        None,
        ge=0,
        description="Bytes of video rows joined from their tubes for reads by the video's hash, kept for the reads "
        "that follow (one copy a video, least recently read dropped first); a video whose rows exceed it is "
        "refused with 413 (read its tubes). Default: a sixteenth of process_memory_bytes, within it.",
    )
    ready_lease_s: float = Field(
        30.0,
        gt=0,
        description="How long an image answered ready stays in L1 for its caller to read, whatever the budget "
        "(unpinned earlier once read to its last row).",
    )
    redis_url: SecretStr | None = Field(
        None, description="redis:// or rediss:// URL of the shared index (L2); unset = in-process only."
    )
    cache_ttl_s: int = Field(7 * 86400, gt=0, description="TTL of Redis entries, seconds.")
    redis_batch_bytes: Bytes = Field(
        64 * MiB,
        gt=0,
        description="Most bytes of entries one Redis read brings in: the misses of a request are read in batches "
        "of as many keys as entries of the served model's largest image fit (at least one), each batch "
        "stored in L1 before the next is read.",
    )

    # --- shared index (Redis) ------------------------------------------------
    redis_mode: Literal["standalone", "cluster"] = Field(
        "standalone",
        description="How to reach redis_url: one server (standalone) or a Redis Cluster "
        "(cluster: the URL names any one node; the others are discovered).",
    )
    redis_timeout_s: float = Field(
        1.0, gt=0, description="Socket connect and read timeout of one Redis command, seconds."
    )
    redis_retry_s: float = Field(
        1.0,
        gt=0,
        description="After a Redis failure, how long Redis is skipped (lookups miss, writes are "
        "dropped) before it is tried again, seconds.",
    )
    claim_ttl_ms: int = Field(
        5000,
        gt=0,
        description="Lifetime of a cross-replica encode claim (taken when an encode starts) and of "
        "an image's queued mark; the owner renews them every third of it while the image is encoding "
        "or queued, so they only lapse when the owner dies.",
    )
    claim_poll_ms: float = Field(
        20.0,
        gt=0,
        description="Longest pause between checks of an image another replica is encoding "
        "(checks start at 1 ms and back off to this).",
    )
    claim_wait_s: float = Field(
        30.0, gt=0, description="Longest wait for another replica's encode before encoding here anyway."
    )

    # --- engine -------------------------------------------------------------
    max_batch_tokens: int = Field(
        16384,
        gt=0,
        description="Most input patch tokens in one forward (a cap: the memory budget may lower it; "
        "a single larger image still runs).",
    )
    max_batch_images: int = Field(64, gt=0, description="Most images in one forward.")
    max_wait_ms: float = Field(
        2.0, ge=0, description="How long an idle worker waits for a batch to fill before running it."
    )
    preprocess_workers: int | None = Field(
        None,
        gt=0,
        description="Threads that decode and preprocess images (default: every core; on a CPU host they "
        "share the cores with the forward, see docs/operations.md).",
    )
    max_queue_images: int = Field(
        4096, gt=0, description="Images waiting for the encoder before new work is refused with 429."
    )

    # --- limits and deadlines ----------------------------------------------
    request_timeout_s: float = Field(120.0, gt=0, description="Deadline of an encode request with wait.")
    fetch_timeout_s: float = Field(60.0, gt=0, description="How long a fetch waits for a pending image.")
    max_body_bytes: Bytes = Field(256 * MiB, gt=0, description="Largest request body.")
    max_items: int = Field(512, gt=0, description="Most items in one encode or fetch request.")
    max_image_bytes: Bytes = Field(64 * MiB, gt=0, description="Largest single encoded image.")
    max_image_pixels: int = Field(
        64_000_000, gt=0, description="Most pixels of a decoded image (decompression-bomb guard)."
    )
    max_video_frames: int = Field(768, gt=0, description="Most frames of one video item.")
    max_video_pixels: int = Field(
        128_000_000,
        gt=0,
        description="Most pixels of one video item, all its frames together, decoded or resized as the tower's "
        "input (whichever is more: its input, 12 bytes a pixel, is held until its tubes' forwards).",
    )

    # --- reliability and security -------------------------------------------
    stall_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A forward running longer than this counts as a stalled device: its images fail with "
        "503, readiness turns false and the device worker restarts (see worker_restart_attempts).",
    )
    warm_up_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Longest a compiled tower's warm-up (its graphs' compile, before readiness) may take; "
        "stall_timeout_s does not apply to it and the worker is not restarted while it warms. Past it the "
        "tower serves eagerly. Default: scaled to the tower, 300 s + 20 s per compiled block.",
    )
    api_key: SecretStr | None = Field(
        None,
        description="One API key (16 characters or more) for the default namespace, as vLLM's and TEI's --api-key: "
        "every /v1 request then needs 'Authorization: Bearer <key>'. Several keys and tenants: api_keys.",
    )
    api_keys: SecretStr | None = Field(
        None,
        description="API keys as 'key:tenant,key:tenant'. When set (or api_keys_file), every /v1 request "
        "needs 'Authorization: Bearer <key>' and its namespace is the key's tenant. Prefer the env var or "
        "the file to the flag (flags show in the process list).",
    )
    api_keys_file: Path | None = Field(
        None, description="File of 'key:tenant' lines ('#' starts a comment), merged with api_keys."
    )
    worker_restart_attempts: int = Field(
        2,
        ge=1,
        description="After a forward fails or stalls, how many probe forwards may try to bring the "
        "device back before the process exits non-zero (for its supervisor to restart it).",
    )
    shutdown_timeout_s: float = Field(
        30.0,
        gt=0,
        description="On shutdown, how long the forward in progress and the writes of its "
        "results may take before they are abandoned.",
    )
    # --- SGLang encoder endpoints (POST /encode, /scheduler_receive_url) ------
    sglang_namespace: str | None = Field(
        None,
        pattern=NAMESPACE_PATTERN,
        description="Namespace of the entries SGLang's /encode reads and writes (SGLang sends no key). Unset: "
        "the default namespace without API keys; with API keys the SGLang endpoints then refuse (403).",
    )
    sglang_url_prefixes: list[str] = Field(
        default_factory=list,
        description="http(s) image URLs in SGLang's /encode items are fetched only under one of these prefixes "
        "(none: data: URLs and base64 only).",
    )
    sglang_register_timeout_s: float = Field(
        60.0, gt=0, description="How long an encoded part waits for its SGLang receivers to register."
    )
    # --- shared memory (same-host transport) ---------------------------------
    shm_enabled: bool = Field(
        True,
        description="Serve POST /v1/embeddings/shm: rows handed out as shared-memory segments to clients on the "
        "same host, running as the same user (off by itself where shm_dir is not a writable directory).",
    )
    shm_dir: str = Field("/dev/shm", description="Directory of the shared-memory segments (a tmpfs).")
    shm_lease_s: float = Field(
        30.0, gt=0, description="A segment stays openable at least this long after the last handle naming it."
    )
    shm_max_bytes: Bytes | None = Field(
        None,
        gt=0,
        description="Most bytes held in segments (default: a quarter of process_memory_bytes, within shm_dir's free "
        "space); a range that "
        "does not fit (no lease expired) is answered 429 in its place and the client reads it over HTTP.",
    )

    # --- throughput -----------------------------------------------------------
    memory_budget_bytes: Bytes | None = Field(
        None,
        gt=0,
        description="Working memory of the batches: forward activations (estimated from the tower's config) "
        "and, on CPU, the staged preprocessed inputs. Unset: memory_fraction of the device's memory.",
    )
    memory_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Share of device memory the batches may use when memory_budget_bytes is unset "
        "(CUDA: of total memory, at most what is free after loading; CPU: of physical RAM).",
    )
    prefetch_tokens: int | None = Field(
        None,
        gt=0,
        description="Most tower-input tokens staged for the device: preprocessing, ready or in the forward "
        "(default on CUDA: two batches plus one per preprocessing worker, within an eighth of the process "
        "memory budget; on a CPU a quarter of a batch, where preprocessing shares the cores).",
    )
    heap_keep_bytes: Bytes = Field(
        1024 * MiB,
        ge=0,
        description="Freed C-heap memory (glibc) kept for the next forward's activations instead of going back "
        "to the kernel at once (a CPU forward refaults its pages otherwise); all of it goes back once the "
        "device has been idle heap_idle_s. 0: glibc's defaults.",
    )
    heap_idle_s: float = Field(
        2.0, gt=0, description="Device idle time after which the freed C-heap memory goes back to the kernel."
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError("the device is auto, cpu, cuda or cuda:N")
        return v

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        return v

    @model_validator(mode="after")
    def _check_memory_parts(self) -> Settings:
        """Parts of the process budget set explicitly fit a budget set explicitly (the staged inputs,
        known once the tower is loaded, are checked then: ``process_memory.py``)."""
        total = self.process_memory_bytes
        shm = self.shm_max_bytes if self.shm_enabled else None
        parts = {
            "cache_bytes": self.cache_bytes,
            "pin_overflow_bytes": self.pin_overflow_bytes,
            "shm_max_bytes": shm,
            "joined_rows_bytes": self.joined_rows_bytes,
        }
        given = {k: v for k, v in parts.items() if v is not None}
        if total is not None and sum(given.values()) > total:
            said = " + ".join(f"{k}={v}" for k, v in given.items())
            raise ValueError(f"{said} exceed process_memory_bytes={total}")
        return self

    def redacted(self) -> dict[str, object]:
        """Settings safe to log: secrets masked (SecretStr prints as '**********')."""
        return {k: (str(v) if isinstance(v, SecretStr) else v) for k, v in self.__dict__.items()}
