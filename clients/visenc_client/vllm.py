"""``VisencConnector``: vLLM's encoder-cache connector (``ec_consumer``), backed by visenc
(docs/integration-vllm.md). Everything that can fail happens on the scheduler side, before an image counts present."""

from __future__ import annotations

import logging
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from visenc_client._extras import needs

with needs("vllm", "visenc_client.vllm"):
    import torch
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorBase,
        ECConnectorMetadata,
        ECConnectorRole,
    )

    from visenc_client._local_rows import LocalRows
    from visenc_client._vllm_config import ConnectorOptions, MiB, encoder_output_width
    from visenc_client._vllm_requests import encodable, item_grid, told_absent
    from visenc_client._vllm_stats import Reporter, VisencPromMetrics, VisencStats, counts
    from visenc_client._wants import Absent, Mismatch, Want
    from visenc_client.format import is_valid_hash

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: how long an image found absent (missing, failed, unreachable) answers "not cached" without asking again
ABSENT_TTL_S = 1.0
MAX_ABSENT = 10_000
IDLE_WAIT_S = 0.005
#: rows asked for in one look-up, at most (the service's bodies are capped, 256 MiB by default)
MAX_FETCH_BYTES = 64 * MiB


@dataclass
class VisencConnectorMetadata(ECConnectorMetadata):  # type: ignore[misc]
    items: list[tuple[str, torch.Tensor]] = field(default_factory=list)


@dataclass
class ConnectorStats:
    """Counters of one connector, in vLLM's ``/metrics`` as ``vllm:visenc_*`` (docs/integration-vllm.md)."""

    fetches: int = 0
    hits: int = 0
    misses: int = 0
    told_absent: int = 0
    failures: int = 0
    rejected: int = 0
    deferred: int = 0
    timed_out: int = 0
    unavailable: int = 0
    loaded: int = 0
    loaded_bytes: int = 0


class VisencConnector(ECConnectorBase):  # type: ignore[misc]
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        self.stats = ConnectorStats()
        self._reporter = Reporter()
        model = vllm_config.model_config
        self._hidden = encoder_output_width(model)
        self._dtype: torch.dtype = model.dtype
        self._device = torch.device(vllm_config.device_config.device)
        self._model = str(model.model)
        load = getattr(vllm_config, "load_config", None)
        self._checkpoint = (self._model, model.revision, getattr(load, "download_dir", None))
        if role == ECConnectorRole.SCHEDULER:
            self._start_scheduler_side(vllm_config.ec_transfer_config)

    def _start_scheduler_side(self, transfer_config: Any) -> None:
        options = ConnectorOptions.read(transfer_config)
        self.urls = options.urls
        self.defer_timeout_s = options.defer_timeout_s
        self.wait_for_encoding = options.wait_for_encoding
        self._sources = options.sources(self._hidden, self._model, self._checkpoint)
        self._local = LocalRows(options.local_cache_bytes)
        self._inflight: dict[str, Future[dict[str, torch.Tensor | Absent]]] = {}
        self._absent: dict[str, float] = {}
        self._waiting_since: dict[str, float] = {}
        self._unavailable: set[str] = set()
        self._to_load: dict[str, torch.Tensor] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="visenc-fetch")
        self._sources.check_at_start()

    def _obtain(self, wants: dict[str, Want], wait: bool) -> dict[str, torch.Tensor | Absent]:
        return self._sources.obtain(wants, wait)

    def _collect(self) -> None:
        if len(self._absent) > MAX_ABSENT:
            now = time.monotonic()
            self._absent = {i: t for i, t in self._absent.items() if now - t < ABSENT_TTL_S}
        for identifier in [i for i, f in self._inflight.items() if f.done()]:
            future = self._inflight.pop(identifier)
            try:
                rows = future.result()[identifier]
                if isinstance(rows, Absent):
                    raise rows
            except Absent as e:
                self.stats.rejected += isinstance(e, Mismatch)
                self.stats.failures += 1
                log.warning(
                    "VisencConnector: image %s is not available from visenc (%s): vLLM encodes it", identifier, e
                )
                self._absent[identifier] = time.monotonic()
                continue
            except Exception:  # a bug of the fetch path: still only "not cached"
                log.exception("VisencConnector: fetching image %s failed", identifier)
                self.stats.failures += 1
                self._absent[identifier] = time.monotonic()
                continue
            if not self._local.put(identifier, rows):
                log.warning("VisencConnector: image %s does not fit local_cache_bytes: vLLM encodes it", identifier)
                self._absent[identifier] = time.monotonic()

    def _is_absent(self, identifier: str, now: float) -> bool:
        since = self._absent.get(identifier)
        if since is None:
            return False
        if now - since < ABSENT_TTL_S:
            return True
        del self._absent[identifier]
        return False

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Fetch the rows the request still needs; defer it while any is in flight, at most ``defer_timeout_s``."""
        self._collect()
        now = time.monotonic()
        in_flight = False
        lacking: list[str] = []
        batches: dict[bool, dict[str, Want]] = {}
        absent, told = told_absent(request), 0
        for feature in request.mm_features:
            identifier = feature.identifier
            if feature.mm_position.offset + feature.mm_position.length <= num_computed_tokens:
                continue
            if identifier in self._local:
                continue
            if identifier in self._inflight:
                in_flight = True
            elif identifier in absent and encodable(feature.data):
                told += 1
            elif is_valid_hash(identifier) and not self._is_absent(identifier, now):
                want = Want(int(feature.mm_position.get_num_embeds()), item_grid(feature.data))
                wait = self.wait_for_encoding or not encodable(feature.data)
                batches.setdefault(wait, {})[identifier] = want
                in_flight = True
            if not encodable(feature.data):
                lacking.append(identifier)
        for wait, wants in batches.items():
            self._fetch(wants, wait)
        rid = request.request_id
        if in_flight and now - self._waiting_since.setdefault(rid, now) < self.defer_timeout_s:
            self.stats.deferred += 1
            return False
        if in_flight:
            self.stats.timed_out += 1
        if lacking:
            log.warning(
                "VisencConnector: request %s fails: images %s came without pixels and visenc could not give their rows",
                rid,
                ", ".join(lacking),
            )
            self._unavailable.add(rid)
            self._waiting_since.pop(rid, None)
            return False
        self._waiting_since.pop(rid, None)
        self.stats.told_absent += told
        return True

    def _fetch(self, wants: dict[str, Want], wait: bool) -> None:
        batch: dict[str, Want] = {}
        size = 0
        for identifier, want in [*wants.items(), ("", None)]:
            bytes_ = 0 if want is None else 4 * want.rows * self._hidden  # at most 4 bytes a value
            if batch and (want is None or size + bytes_ > MAX_FETCH_BYTES):
                future = self._pool.submit(self._obtain, batch, wait)
                self._inflight.update(dict.fromkeys(batch, future))
                self.stats.fetches += 1
                batch, size = {}, 0
            if want is not None:
                batch[identifier] = want
                size += bytes_

    def has_cache_item(self, identifier: str) -> bool:
        present = identifier in self._local
        if present:
            self._local.pinned.add(identifier)
            self.stats.hits += 1
        else:
            self.stats.misses += 1
        return present

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        rows = self._local.get(identifier)
        if rows is not None:
            self._to_load[identifier] = rows

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> VisencConnectorMetadata:
        if self._inflight and not getattr(scheduler_output, "total_num_scheduled_tokens", 1):
            # nothing runs this step: vLLM would spin a core beside the visenc that encodes the rows
            futures.wait(list(self._inflight.values()), timeout=IDLE_WAIT_S, return_when=futures.FIRST_COMPLETED)
        meta = VisencConnectorMetadata(items=list(self._to_load.items()))
        self._to_load.clear()
        self._local.pinned.clear()
        return meta

    def take_unavailable_requests(self) -> set[str]:
        taken, self._unavailable = self._unavailable, set()
        self.stats.unavailable += len(taken)
        return taken

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._waiting_since.pop(request.request_id, None)
        return False, None

    def get_ec_connector_stats(self) -> VisencStats | None:
        if self.role == ECConnectorRole.SCHEDULER:
            return self._reporter.report(counts(self.stats, self._sources.backoff.unreachable))
        return self._reporter.report({"loaded": self.stats.loaded, "loaded_bytes": self.stats.loaded_bytes})

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> VisencStats:
        return VisencStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, *args: Any) -> VisencPromMetrics:
        return VisencPromMetrics(*args)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, VisencConnectorMetadata):
            return
        for identifier, rows in meta.items:
            if identifier in encoder_cache:
                continue
            encoder_cache[identifier] = rows.to(device=self._device, dtype=self._dtype)
            self.stats.loaded += 1
            self.stats.loaded_bytes += rows.numel() * rows.element_size()

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return

    def shutdown(self) -> None:
        if self.role != ECConnectorRole.SCHEDULER:
            return
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._sources.close()
