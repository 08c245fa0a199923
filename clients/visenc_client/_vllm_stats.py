"""``VisencConnector``'s counters in vLLM's log and ``/metrics`` (``vllm:visenc_<counter>_total``): each side
reports what changed since it last did; vLLM adds them up."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats

#: every counter vLLM shows, and what it counts (``ConnectorStats``'s fields, and the sources' failures)
COUNTERS = {
    "fetches": "Background look-ups the visenc connector started.",
    "hits": "Images the visenc connector answered present: vLLM ran no encoder for them.",
    "misses": "Images the visenc connector answered absent: vLLM encoded them.",
    "told_absent": "Images not looked up: the request said visenc lacks them.",
    "failures": "Images whose rows the visenc connector could not have: vLLM encoded them.",
    "rejected": "Images whose rows visenc had in another shape or grid than vLLM reads.",
    "deferred": "Scheduler steps a request waited for rows in flight.",
    "timed_out": "Requests that stopped waiting for rows (defer_timeout_s).",
    "unavailable": "Requests failed: an image without pixels whose rows could not be had.",
    "unreachable": "Look-ups a visenc replica or Redis could not answer (refused, reset, no answer in time): "
    "the next source was asked.",
    "loaded": "Images loaded into the encoder cache by a worker.",
    "loaded_bytes": "Bytes of rows loaded into the encoder cache by a worker.",
}


class VisencStats(ECConnectorStats):  # type: ignore[misc]
    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: ECConnectorStats) -> VisencStats:
        for name, count in other.data.items():
            self.data[name] = self.data.get(name, 0) + count
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Reporter:
    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def report(self, now: dict[str, int]) -> VisencStats | None:
        delta = {k: v - self._last.get(k, 0) for k, v in now.items() if v != self._last.get(k, 0)}
        self._last = dict(now)
        return VisencStats(data=delta) if delta else None


def counts(stats: Any, unreachable: int) -> dict[str, int]:
    return {**asdict(stats), "unreachable": unreachable}


class VisencPromMetrics(ECConnectorPromMetrics):  # type: ignore[misc]
    """One Prometheus counter per ``COUNTERS`` entry, labelled like vLLM's own (model, engine)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:visenc_{name}", documentation=doc, labelnames=labelnames)
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, count in transfer_stats_data.items():
            if name in self._counters and count > 0:
                self._counters[name].labels(*labels).inc(count)
