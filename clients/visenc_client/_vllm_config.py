"""``VisencConnector``'s options (docs/integration-vllm.md) and what it reads of vLLM's own config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from visenc_client._sources import RowSources
from visenc_client._weights import ACCEPT_OPTION, EngineWeights, Served, checkpoint_folder
from visenc_client.format import DEFAULT_PRIORITY, PRIORITIES, Priority

MiB = 1 << 20
TRANSPORTS = ("auto", "http", "shm")


def encoder_output_width(model_config: Any) -> int:
    """Width of one row of vLLM's encoder cache: the LLM's input-embedding size, times ``1 + levels`` for
    models that carry deepstack levels in each row (Qwen3-VL: ``[main | ds_1 | ... | ds_k]``)."""
    vision = getattr(model_config.hf_config, "vision_config", None)
    levels = len(getattr(vision, "deepstack_visual_indexes", None) or ())
    return int(model_config.get_inputs_embeds_size()) * (1 + levels)


def vllm_minor() -> str:
    """``major.minor`` of the vLLM running this connector (``0.32``)."""
    import vllm

    return ".".join(vllm.__version__.split(".")[:2])


@dataclass(frozen=True)
class ConnectorOptions:
    """The scheduler side's options, from vLLM's ``ec_connector_extra_config``."""

    urls: list[str]
    defer_timeout_s: float
    wait_for_encoding: bool
    transport: str
    expected_fingerprint: str | None
    accept_weights: bool
    timeout_s: float
    connect_timeout_s: float
    answer_timeout_s: float
    namespace: str | None
    api_key: str | None
    redis_url: str | None
    redis_mode: str
    backoff_s: float
    local_cache_bytes: int
    #: the class of the connector's encodes: interactive (default) or batch, for an offline vLLM
    priority: Priority = DEFAULT_PRIORITY

    @classmethod
    def read(cls, transfer_config: Any) -> ConnectorOptions:
        option = transfer_config.get_from_extra_config
        urls = option("url", "http://127.0.0.1:8000")
        transport = option("transport", "auto")
        if transport not in TRANSPORTS:
            raise ValueError(f"VisencConnector: transport must be 'auto', 'http' or 'shm', not {transport!r}")
        priority = option("priority", DEFAULT_PRIORITY)
        if priority not in PRIORITIES:
            raise ValueError(f"VisencConnector: priority must be 'interactive' or 'batch', not {priority!r}")
        return cls(
            urls=[urls] if isinstance(urls, str) else list(urls),
            defer_timeout_s=float(option("defer_timeout_s", 2.0)),
            wait_for_encoding=bool(option("wait_for_encoding", False)),
            transport=transport,
            expected_fingerprint=option("expected_fingerprint", None),
            accept_weights=bool(option(ACCEPT_OPTION, False)),
            timeout_s=float(option("timeout_s", 10.0)),
            connect_timeout_s=float(option("connect_timeout_s", 1.0)),
            answer_timeout_s=float(option("answer_timeout_s", 2.0)),
            namespace=option("namespace", None),
            api_key=option("api_key", None),
            redis_url=option("redis_url", None),
            redis_mode=option("redis_mode", "standalone"),
            backoff_s=float(option("backoff_s", 1.0)),
            local_cache_bytes=int(option("local_cache_bytes", 256 * MiB)),
            priority=priority,
        )

    def sources(self, hidden: int, model: str, checkpoint: tuple[Any, ...]) -> RowSources:
        weights = EngineWeights(model, checkpoint_folder(*checkpoint), self.accept_weights)
        return RowSources(
            self.urls,
            served=Served(hidden, f"vllm-{vllm_minor()}", self.expected_fingerprint, weights),
            timeout_s=self.timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            answer_timeout_s=self.answer_timeout_s,
            transport=self.transport,
            namespace=self.namespace,
            api_key=self.api_key,
            redis_url=self.redis_url,
            redis_mode=self.redis_mode,
            backoff_s=self.backoff_s,
            priority=self.priority,
        )
