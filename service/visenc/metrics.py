"""Prometheus metrics, named once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.metrics import MetricWrapperBase

from visenc.errors import all_kinds
from visenc_client.format import REASONS, Handle

#: 0.5 ms .. ~65 s, doubling
SECONDS_BUCKETS = tuple(0.0005 * 2**i for i in range(18))
#: 1 .. 1024 images
IMAGE_BUCKETS = tuple(float(2**i) for i in range(11))
#: 16 .. 1M tokens
TOKEN_BUCKETS = tuple(float(2**i) for i in range(4, 21))

#: label values known in advance
ENDPOINTS = (
    "/v1/encode",
    "/v1/embeddings/{image_hash}",
    "/v1/embeddings/fetch",
    "/v1/embeddings/shm",
    "/v1/model",
    "/healthz",
    "/readyz",
    "/metrics",
    "/encode",
    "/scheduler_receive_url",
    "/health",
)
TRANSPORTS = ("http", "shm", "inline")
#: why a tower runs eagerly (``models/compiled.py``'s ``CAUSES``), and every (state, cause) pair
COMPILE_CAUSES = ("setting", "toolchain", "backend", "warm_up_timeout", "warm_up_error")
COMPILE_STATES = (("warming", "none"), ("compiled", "none"), *(("eager", c) for c in COMPILE_CAUSES))
LOOKUP_RESULTS = ("hit", "miss", "corrupt", "error")
REDIS_OPS = ("get", "set", "queue", "claim", "look", "renew", "unclaim")
CLAIM_OUTCOMES = ("owned", "held", "ready", "takeover", "timeout", "unavailable", "fetch_wait")
#: the background tasks whose failures are counted (``visenc.tasks.spawn``)
BACKGROUND_TASKS = (
    "device-worker",
    "outputs",
    "index-write",
    "claims-flush",
    "claims-renew",
    "remote-waits",
    "prepare",
    "shm-reaper",
    "request",
)
#: what became of an SGLang /encode part: delivered; refused (the request was bad); failed (encode or delivery)
PART_OUTCOMES = ("delivered", "refused", "failed")
#: where an encode failed: the forward raised, the forward stalled, copying its outputs out failed
FAILURE_STAGES = ("forward", "stall", "output")
#: why an encode was refused: a tenant's quota, or the global queue limit (shedding the tenant using the most)
REFUSALS = ("tenant_images", "tenant_tokens", "queue_full")
PRIORITY_CLASSES = ("interactive", "batch")


def _preset(family: MetricWrapperBase, *values: Iterable[str]) -> None:
    """Create every combination of ``values`` as a child of ``family`` (value 0)."""
    combos: list[tuple[str, ...]] = [()]
    for axis in values:
        combos = [(*c, v) for c in combos for v in axis]
    for combo in combos:
        family.labels(*combo)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        self._http(r)
        self._engine(r)
        self._index(r)
        self._health(r)
        self._sglang(r)
        self._tasks(r)
        self._device(r)
        self._tenancy(r)

    def _http(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "visenc_requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "visenc_request_duration_seconds",
            "HTTP request duration.",
            ["endpoint"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.errors = Counter("visenc_errors", "Errors answered, by kind.", ["kind"], registry=r)
        self.bytes_served = Counter(
            "visenc_bytes_served", "Embedding bytes served, by transport.", ["transport"], registry=r
        )
        _preset(self.requests, ENDPOINTS, ["200"])
        _preset(self.request_seconds, ENDPOINTS)
        _preset(self.errors, all_kinds())
        _preset(self.bytes_served, TRANSPORTS)
        self.failed_items = Counter(
            "visenc_failed_items", "Items answered with status error, by reason.", ["reason"], registry=r
        )
        _preset(self.failed_items, REASONS)

    def count_failed_items(self, handles: list[Handle]) -> list[Handle]:
        """Every ``error`` handle of an answer counted by its reason (also in ``errors``, by that kind)."""
        for h in handles:
            if h.status == "error":
                reason = h.reason or "encode_failed"
                self.errors.labels(reason).inc()
                self.failed_items.labels(reason).inc()
        return handles

    def _engine(self, r: CollectorRegistry) -> None:
        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=SECONDS_BUCKETS, registry=r)

        self.queue_wait_seconds = seconds(
            "visenc_queue_wait_seconds", "Time an image waited from admission until the device took its batch."
        )
        self.preprocess_seconds = seconds("visenc_preprocess_seconds", "Decode + preprocess time of one image.")
        self.forward_seconds = seconds(
            "visenc_forward_seconds", "Device time of one batched forward (events on its stream)."
        )
        self.output_seconds = seconds(
            "visenc_output_seconds", "Device-to-host copy and packing of one forward's outputs (off the device thread)."
        )
        self.batch_images = Histogram(
            "visenc_batch_size_images", "Images per forward.", buckets=IMAGE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "visenc_batch_size_tokens", "Input patch tokens per forward.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.queue_depth = Gauge(
            "visenc_queue_depth", "Images admitted and not yet encoded (preprocessing or queued).", registry=r
        )
        self.queue_capacity = Gauge(
            "visenc_queue_capacity_images", "Admission bound (max_queue_images): past it, encodes get 429.", registry=r
        )
        self.inflight = Gauge(
            "visenc_inflight_images", "Distinct images being encoded (single-flight map size).", registry=r
        )
        self.singleflight_joins = Counter(
            "visenc_singleflight_joins", "Requests that joined an encode already in flight.", registry=r
        )
        self.singleflight_waits = Gauge(
            "visenc_singleflight_waiting", "Waiters currently blocked on an in-flight encode.", registry=r
        )
        self.encoded_images = Counter("visenc_encoded_images", "Images encoded by a forward.", registry=r)
        self.encoded_tokens = Counter("visenc_encoded_tokens", "Output token rows encoded.", registry=r)
        self.forwards = Counter("visenc_forwards", "Forward calls (batches) run.", registry=r)
        self.encode_failures = Counter(
            "visenc_encode_failures",
            "Images whose encode failed, by stage (forward, stall, output).",
            ["kind"],
            registry=r,
        )
        self.oom_splits = Counter(
            "visenc_oom_splits",
            "Forwards that ran out of memory and were split in two (or, for one image, failed it).",
            registry=r,
        )
        self.cancelled_images = Counter(
            "visenc_cancelled_images",
            "Images dropped before their forward because every request waiting for them went away.",
            registry=r,
        )
        _preset(self.encode_failures, FAILURE_STAGES)

    def _index(self, r: CollectorRegistry) -> None:
        self.cache_lookups = Counter(
            "visenc_cache_lookups", "Index lookups by tier and result.", ["tier", "result"], registry=r
        )
        self.cache_evictions = Counter("visenc_cache_evictions", "Entries evicted from a tier.", ["tier"], registry=r)
        self.index_up = Gauge(
            "visenc_index_up",
            "1 while a tier answers (its last health report), 0 while it is down.",
            ["tier"],
            registry=r,
        )
        self.cache_bytes = Gauge("visenc_cache_bytes", "Bytes held by a tier.", ["tier"], registry=r)
        self.cache_entries = Gauge("visenc_cache_entries", "Entries held by a tier.", ["tier"], registry=r)
        self.cache_pinned_bytes = Gauge(
            "visenc_cache_pinned_bytes",
            "Bytes of L1 entries answered ready and not yet read by every caller (kept past the budget).",
            registry=r,
        )
        self.cache_pins_cut = Counter(
            "visenc_cache_pins_cut",
            "Pins on L1 entries ended before their lease because pinned entries held twice the budget.",
            registry=r,
        )
        self.bytes_index = Counter(
            "visenc_index_bytes", "Bytes read from / written to a tier.", ["tier", "op"], registry=r
        )
        self.redis_errors = Counter(
            "visenc_redis_errors", "Redis operations that failed, by operation.", ["op"], registry=r
        )
        self.claims = Counter(
            "visenc_claims",
            "Cross-replica encode claims by outcome: owned (an encode starts here under our claim), held "
            "(another replica encodes it; wait), ready (its entry found at admission or encode start), "
            "takeover (the owner went away), timeout "
            "(waited claim_wait_s), unavailable (Redis down: encode here), fetch_wait (a fetch waits for "
            "another replica's encode).",
            ["outcome"],
            registry=r,
        )
        self.claim_waiting = Gauge(
            "visenc_claim_waiting_images", "Images this replica waits for another replica to encode.", registry=r
        )
        self.corrupt_entries = Counter(
            "visenc_corrupt_entries", "Index entries that failed their integrity check (treated as misses).", registry=r
        )
        _preset(self.redis_errors, REDIS_OPS)
        _preset(self.claims, CLAIM_OUTCOMES)
        self.preset_tiers(["memory"])

    def preset_tiers(self, tiers: Iterable[str]) -> None:
        """Create the per-tier children of the index families for the tiers in use."""
        tiers = list(tiers)
        _preset(self.cache_lookups, tiers, LOOKUP_RESULTS)
        for family in (self.cache_evictions, self.cache_bytes, self.cache_entries):
            _preset(family, tiers)
        _preset(self.bytes_index, ["redis"], ["read", "write"])  # the shared tier's I/O (zeros without one)

    def _health(self, r: CollectorRegistry) -> None:
        self.worker_stalls = Counter("visenc_worker_stalls", "Times a forward ran past stall_timeout_s.", registry=r)
        self.worker_restarts = Counter(
            "visenc_worker_restarts",
            "Restart attempts of the device worker after a failed or stalled forward.",
            registry=r,
        )
        self.worker_alive = Gauge(
            "visenc_worker_alive",
            "1 while the device worker is healthy, 0 when failed, restarting or stalled.",
            registry=r,
        )
        self.compiled_graphs = Gauge(
            "visenc_compiled_graphs",
            "Graphs torch.compile built for the tower (0 when it is not compiled); bounded, see models/compiled.py.",
            registry=r,
        )
        self.compile_state = Gauge(
            "visenc_compile_state",
            "How the tower's blocks run (value 1): state warming, compiled or eager, and the cause of eager "
            "(setting, toolchain, backend, warm_up_timeout, warm_up_error); see /readyz's compile detail.",
            ["state", "cause"],
            registry=r,
        )
        for labels in COMPILE_STATES:  # the valid pairs only, not every combination
            self.compile_state.labels(*labels)
        self.model_info = Gauge(
            "visenc_model_info",
            "The served tower (value 1).",
            ["name", "fingerprint", "dtype", "device", "hidden_size"],
            registry=r,
        )
        self.shm_segments = Gauge("visenc_shm_segments", "Shared-memory segments held (leased to clients).", registry=r)
        self.shm_bytes = Gauge("visenc_shm_bytes", "Bytes held in shared-memory segments.", registry=r)
        self.joined_bytes = Gauge(
            "visenc_joined_rows_bytes", "Bytes of video rows joined from their tubes, kept for reads.", registry=r
        )

    def _tasks(self, r: CollectorRegistry) -> None:
        self.background_failures = Counter(
            "visenc_background_failures",
            "Background tasks that ended with an exception (a bug: logged with its traceback).",
            ["task"],
            registry=r,
        )
        _preset(self.background_failures, BACKGROUND_TASKS)
        self.redis_script_errors = Counter(
            "visenc_redis_script_errors",
            "Redis answered a command or script with an error that is no outage (a bug: the request got 500).",
            ["op"],
            registry=r,
        )
        _preset(self.redis_script_errors, REDIS_OPS)

    def _sglang(self, r: CollectorRegistry) -> None:
        self.sglang_parts = Counter("visenc_sglang_parts", "SGLang /encode parts, by outcome.", ["outcome"], registry=r)
        _preset(self.sglang_parts, PART_OUTCOMES)
        self.sglang_waiting = Gauge(
            "visenc_sglang_parts_waiting",
            "SGLang parts whose rows are ready, waiting for their receivers to register.",
            registry=r,
        )

    def set_compile_state(self, state: str, cause: str | None) -> None:
        """``visenc_compile_state``: 1 for the tower's current state and cause, 0 for the others."""
        for labels in COMPILE_STATES:
            self.compile_state.labels(*labels).set(0)
        self.compile_state.labels(state, cause or "none").set(1)

    def export_index_health(self, health: Mapping[str, object]) -> None:
        """Set ``visenc_index_up`` from ``Index.health()``: every mapping in it (nested ones
        included, for tiered indexes) that has a ``tier`` and an ``ok`` reports one tier."""
        if "tier" in health and "ok" in health:
            self.index_up.labels(str(health["tier"])).set(1 if health["ok"] else 0)
        for value in health.values():
            for child in value if isinstance(value, list | tuple) else [value]:
                if isinstance(child, Mapping):
                    self.export_index_health(child)

    def _device(self, r: CollectorRegistry) -> None:
        self.forward_launch_seconds = Histogram(
            "visenc_forward_launch_seconds",
            "Host time of one forward's launch on the device thread (the forward call itself).",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.device_wait_seconds = Histogram(
            "visenc_device_wait_seconds",
            "Time the device thread waited before a launch, by reason (copy-out: rows not copied out at their bound).",
            ["reason"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        _preset(self.device_wait_seconds, ["copy-out"])

    def _tenancy(self, r: CollectorRegistry) -> None:
        self.tenant_device_tokens = Counter(
            "visenc_tenant_device_tokens",
            "Tower-input tokens forwarded for a tenant's images (the unit its device share is kept in); tenants "
            "past the labelled ones count as 'other'.",
            ["tenant"],
            registry=r,
        )
        self.refusals = Counter(
            "visenc_refusals",
            "Encodes refused with 429, by tenant and reason (tenant_images, tenant_tokens, queue_full).",
            ["tenant", "reason"],
            registry=r,
        )
        self.device_busy = Gauge(
            "visenc_device_busy_ratio",
            "Share of the last busy_window_s the device held work (a batch taken, launched or copied out).",
            registry=r,
        )
        self.queued_device_seconds = Gauge(
            "visenc_queued_device_seconds",
            "Device time the images waiting for the device would take (at the recent seconds per token), by class.",
            ["priority"],
            registry=r,
        )
        self.oldest_waiting = Gauge(
            "visenc_oldest_waiting_seconds",
            "Age of the oldest image waiting for the device (admitted, not yet forwarded), by class.",
            ["priority"],
            registry=r,
        )
        _preset(self.refusals, ["default"], REFUSALS)
        _preset(self.tenant_device_tokens, ["default"])
        for family in (self.queued_device_seconds, self.oldest_waiting):
            _preset(family, PRIORITY_CLASSES)
