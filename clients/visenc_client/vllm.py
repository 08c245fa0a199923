"""``VisencConnector``: vLLM's encoder-cache (EC) connector, backed by a visenc service.

vLLM runs as an ``ec_consumer``: it asks the connector whether an image's encoder
output exists and, if so, loads it into its encoder cache instead of running the
vision tower. Configure it with::

    --ec-transfer-config '{"ec_connector": "VisencConnector",
                           "ec_connector_module_path": "visenc_client.vllm",
                           "ec_role": "ec_consumer",
                           "ec_connector_extra_config": {"url": "http://HOST:8000"}}'

``ec_connector_extra_config`` keys (all optional but ``url``):

=====================  ====================================================================
``url``                the visenc service
``api_key``            bearer key (its tenant is the namespace)
``namespace``          key namespace when the service runs without API keys
``transport``          ``http`` (default) or ``shm`` (same host, service run with ``--shm-enabled true``)
``timeout_s``          bound of every call to visenc (default 30: a fetch waits for a pending encode)
``lookup_timeout_s``   bound of the scheduler's status look-ups (default 2)
``defer_timeout_s``    longest a request is deferred while an image it needs is encoding (default 10)
``expected_fingerprint``  refuse to start unless visenc serves exactly this model fingerprint
=====================  ====================================================================

An image's identifier in vLLM is its visenc hash (SHA-256 of the image bytes, 64 hex
digits): pass it as the image's ``multi_modal_uuids`` entry offline, or as the
``uuid`` of the image content part over the OpenAI API (``visenc proxy`` does that).
Any other identifier is simply "not cached" and vLLM encodes the image itself.

**Scheduler side** (engine-core process). ``ensure_cache_available`` is called per
request before it is scheduled: every image of the request whose status is not yet
known is looked up in one hash-only round trip (never uploading). ``has_cache_item``
then answers from that status: ``ready`` and ``pending`` (being encoded, here or on
another replica) count as present; ``missing``, an error, or visenc unreachable
count as absent, and vLLM encodes the image itself (counted: ``misses``). While an
image the request still needs is ``pending``, ``ensure_cache_available`` defers the
request (vLLM schedules the others and asks again next step; ``deferred``), for at
most ``defer_timeout_s``; so a worker loads rows that exist instead of blocking the
whole step on an encode in progress.

**Worker side** (each worker process). ``start_load_caches`` loads every item the
step scheduled in one round trip (``/v1/embeddings/fetch``, or shared-memory
segments), waits for pending encodes up to ``timeout_s``, checks each tensor's shape
against what vLLM will read, and puts it in the encoder cache in the model's dtype
and on its device. vLLM's API hands the connector whole images, not prefill
chunks, so whole images are loaded (the encoder cache keeps them for later chunks).

**Faults.** Nothing hangs: every call is bounded. At start-up a visenc serving rows
of another width than the model's embeddings is refused with a clear error. An item
the worker cannot load after the scheduler counted it present fails loudly (a
``RuntimeError`` naming the image and the cause): vLLM's connector API has no way
for a worker to fall back to encoding an image the scheduler handed to it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from visenc_client._client import Client
from visenc_client._exceptions import VisencClientError
from visenc_client._types import RowRange
from visenc_client.format import is_valid_hash

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

PRESENT = ("ready", "pending")


@dataclass
class VisencConnectorMetadata(ECConnectorMetadata):  # type: ignore[misc]
    """What one step's worker loads: ``(identifier, rows vLLM reads)`` pairs (plain, picklable)."""

    items: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class ConnectorStats:
    """Counters of one connector (``VisencConnector.stats``)."""

    lookups: int = 0  # round trips of the scheduler's status look-ups
    hits: int = 0  # images answered present (vLLM runs no encoder for them)
    misses: int = 0  # images answered absent (vLLM encodes them itself)
    unreachable: int = 0  # look-ups that failed (visenc down or slow): answered absent
    deferred: int = 0  # scheduler steps a request waited because an image it needs next was still encoding
    loaded: int = 0  # images loaded into the encoder cache by a worker
    loaded_bytes: int = 0


def _torch_rows(rows: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bfloat16":  # carried as raw 16-bit words
        return torch.from_numpy(np.ascontiguousarray(rows).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(rows))


def encoder_output_width(model_config: Any) -> int:
    """Width of one row of vLLM's encoder cache for this model: the LLM's input-embedding size,
    times ``1 + levels`` for models that carry deepstack levels in each row (Qwen3-VL:
    ``[main | ds_1 | ... | ds_k]``)."""
    vision = getattr(model_config.hf_config, "vision_config", None)
    levels = len(getattr(vision, "deepstack_visual_indexes", None) or ())
    return int(model_config.get_inputs_embeds_size()) * (1 + levels)


class VisencConnector(ECConnectorBase):  # type: ignore[misc]
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        extra = vllm_config.ec_transfer_config
        self.url: str = extra.get_from_extra_config("url", "http://127.0.0.1:8000")
        self.timeout_s = float(extra.get_from_extra_config("timeout_s", 30.0))
        self.lookup_timeout_s = float(extra.get_from_extra_config("lookup_timeout_s", 2.0))
        self.defer_timeout_s = float(extra.get_from_extra_config("defer_timeout_s", 10.0))
        transport = extra.get_from_extra_config("transport", "http")
        if transport not in ("http", "shm"):
            raise ValueError(f"VisencConnector: transport must be 'http' or 'shm', not {transport!r}")
        options: dict[str, Any] = {
            "namespace": extra.get_from_extra_config("namespace", None),
            "api_key": extra.get_from_extra_config("api_key", None),
        }
        self._client = Client(self.url, timeout=self.timeout_s, shared_memory=transport == "shm", **options)
        self._lookup_client = Client(self.url, timeout=self.lookup_timeout_s, **options)
        self.stats = ConnectorStats()
        self._status: dict[str, str] = {}  # scheduler side: identifier -> last known status
        self._to_load: dict[str, int] = {}  # scheduler side: this step's loads
        self._pending_since: dict[str, float] = {}  # scheduler side: when a needed image was first seen pending
        model = vllm_config.model_config
        self._hidden = encoder_output_width(model)
        self._dtype: torch.dtype = model.dtype
        self._device = torch.device(vllm_config.device_config.device)
        self._check_model(extra.get_from_extra_config("expected_fingerprint", None))

    def _check_model(self, expected_fingerprint: str | None) -> None:
        """Refuse a visenc that serves another model; only warn when it cannot be reached yet."""
        try:
            served = self._lookup_client.model()
        except VisencClientError as e:
            log.warning(
                "VisencConnector: visenc at %s is not reachable yet (%s); images count as not cached until it is",
                self.url,
                e,
            )
            return
        hidden = int(served.get("hidden_size", -1))
        if hidden != self._hidden:
            raise ValueError(
                f"VisencConnector: visenc at {self.url} serves {served.get('name')!r} with rows of width {hidden}, "
                f"but this model's image embeddings are {self._hidden} wide: it serves another model"
            )
        if expected_fingerprint is not None and served.get("fingerprint") != expected_fingerprint:
            raise ValueError(
                f"VisencConnector: visenc at {self.url} serves fingerprint {served.get('fingerprint')}, "
                f"expected {expected_fingerprint}"
            )
        log.info(
            "VisencConnector: visenc at %s serves %s (fingerprint %s, %s, rows of %d)",
            self.url,
            served.get("name"),
            served.get("fingerprint"),
            served.get("dtype"),
            hidden,
        )

    # --- scheduler side -------------------------------------------------------------------
    def _refresh(self, identifiers: list[str]) -> None:
        """One hash-only look-up for every identifier whose status is not yet ``ready``."""
        todo = [i for i in dict.fromkeys(identifiers) if is_valid_hash(i) and self._status.get(i) != "ready"]
        if not todo:
            return
        self.stats.lookups += 1
        try:
            handles = self._lookup_client.lookup(todo)
        except VisencClientError as e:
            self.stats.unreachable += 1
            log.warning("VisencConnector: look-up of %d images failed (%s): vLLM encodes them", len(todo), e)
            for i in todo:
                self._status[i] = "unreachable"
            return
        for i, h in zip(todo, handles):
            self._status[i] = h.status

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Look up the request's images in one round trip. While an image the request still
        needs (past ``num_computed_tokens``) is being encoded, the request is deferred (vLLM
        schedules others and asks again next step), so no worker blocks on it; past
        ``defer_timeout_s`` it is scheduled anyway and its load waits for the rows."""
        needed = [
            f.identifier
            for f in request.mm_features
            if f.mm_position.offset + f.mm_position.length > num_computed_tokens
        ]
        self._refresh(needed)
        now = time.monotonic()
        pending = [i for i in needed if self._status.get(i) == "pending"]
        for i in [i for i in self._pending_since if self._status.get(i) != "pending"]:
            del self._pending_since[i]
        if any(now - self._pending_since.setdefault(i, now) < self.defer_timeout_s for i in pending):
            self.stats.deferred += 1
            return False
        return True

    def has_cache_item(self, identifier: str) -> bool:
        if identifier not in self._status:
            self._refresh([identifier])
        present = self._status.get(identifier) in PRESENT
        if present:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
        return present

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        if self._status.get(identifier) in PRESENT:
            self._to_load[identifier] = int(request.get_num_encoder_embeds(index))

    def update_state_after_free(self, request: Request, index: int) -> None:
        # vLLM dropped its copy: the next request with this image asks again (it may have been evicted)
        self._status.pop(request.mm_features[index].identifier, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> VisencConnectorMetadata:
        meta = VisencConnectorMetadata(items=list(self._to_load.items()))
        self._to_load.clear()
        return meta

    # --- worker side -----------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, VisencConnectorMetadata):
            return
        todo = [(i, n) for i, n in meta.items if i not in encoder_cache]
        if not todo:
            return
        try:
            arrays = self._client.fetch_many([RowRange(i) for i, _ in todo])
        except VisencClientError as e:
            raise RuntimeError(
                f"VisencConnector: could not load {len(todo)} image embeddings from {self.url}: {e}"
            ) from e
        for (identifier, rows), array in zip(todo, arrays):
            if array.shape != (rows, self._hidden):
                raise RuntimeError(
                    f"VisencConnector: image {identifier}: visenc has rows {tuple(array.shape)}, vLLM reads "
                    f"({rows}, {self._hidden}): the two preprocess this image differently"
                )
            wire = "bfloat16" if array.dtype == np.uint16 else str(array.dtype)
            encoder_cache[identifier] = _torch_rows(array, wire).to(device=self._device, dtype=self._dtype)
            self.stats.loaded += 1
            self.stats.loaded_bytes += array.nbytes

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return  # a consumer only loads

    def shutdown(self) -> None:
        self._client.close()
        self._lookup_client.close()
