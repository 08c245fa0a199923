"""One load-test run's CSVs, read once, and the series arithmetic the plots and the summary share."""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PREFIX = "locust"
HTTP_TYPES = ("GET", "POST")


def num(value: str | None) -> float:
    try:
        return float(value) if value not in (None, "", "N/A") else math.nan
    except ValueError:
        return math.nan


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


class Run:
    """The CSVs of one run, read once."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.stats = _rows(out / f"{PREFIX}_stats.csv")
        self.history = _rows(out / f"{PREFIX}_stats_history.csv")
        self.failures = _rows(out / f"{PREFIX}_failures.csv")
        self.metrics = _rows(out / "metrics.csv")
        info = out / "run.json"
        self.info: dict[str, Any] = json.loads(info.read_text()) if info.exists() else {}
        stamps = [num(r["Timestamp"]) for r in self.history]
        stamps += [num(r["t_unix"]) for r in self.metrics]
        self.t0 = min((t for t in stamps if not math.isnan(t)), default=0.0)

    def entries(self, types: Iterable[str]) -> list[dict[str, str]]:
        wanted = set(types)
        return [r for r in self.stats if r["Type"] in wanted and r["Name"] != "Aggregated"]

    def series(self, type_: str, name: str, column: str, active_only: bool = False) -> tuple[list[float], list[float]]:
        """(seconds since start, value) of one history column of one entry; ``active_only`` leaves out
        seconds with no request (Locust repeats stale percentiles there)."""
        xs, ys = [], []
        for r in self.history:
            if r["Type"] == type_ and r["Name"] == name:
                if active_only and not num(r["Requests/s"]) > 0:
                    continue
                xs.append(num(r["Timestamp"]) - self.t0)
                ys.append(num(r[column]))
        return xs, ys

    def counter_deltas(self, type_: str, name: str) -> dict[float, float]:
        """Per-second increments of an entry's total request count, keyed by seconds since start."""
        xs, totals = self.series(type_, name, "Total Request Count")
        out: dict[float, float] = {}
        prev = 0.0
        for x, total in zip(xs, totals):
            out[x] = out.get(x, 0.0) + max(0.0, total - prev)
            prev = total
        return out

    def scraped(self, metric: str, **labels: str) -> tuple[list[float], list[float]]:
        """(seconds since start, value) of one scraped series (labels must match those given)."""
        xs, ys = [], []
        for r in self.metrics:
            if r["metric"] != metric:
                continue
            have = dict(kv.split("=", 1) for kv in r["labels"].split(";") if kv)
            if all(have.get(k) == v for k, v in labels.items()):
                xs.append(num(r["t_unix"]) - self.t0)
                ys.append(num(r["value"]))
        return xs, ys

    def scraped_tiers(self) -> list[str]:
        tiers = set()
        for r in self.metrics:
            if r["metric"] == "visenc_cache_lookups_total":
                tiers.update(kv.split("=", 1)[1] for kv in r["labels"].split(";") if kv.startswith("tier="))
        return sorted(tiers)


def rate(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """Per-second rate of a counter between consecutive samples (at the later sample's time)."""
    out_x, out_y = [], []
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x1 > x0:
            out_x.append(x1)
            out_y.append(max(0.0, y1 - y0) / (x1 - x0))
    return out_x, out_y


def smooth_ratio(
    hits: dict[float, float], misses: dict[float, float], window_s: float = 5.0
) -> tuple[list[float], list[float]]:
    """hits / (hits + misses) over a trailing window, per second with any traffic in the window."""
    times = sorted(set(hits) | set(misses))
    xs, ys = [], []
    for t in times:
        h = sum(v for s, v in hits.items() if t - window_s < s <= t)
        m = sum(v for s, v in misses.items() if t - window_s < s <= t)
        if h + m > 0:
            xs.append(t)
            ys.append(h / (h + m))
    return xs, ys


def smooth_window(xs: list[float], ys: list[float], window_s: float = 5.0) -> tuple[list[float], list[float]]:
    """Per-second counts -> mean rate over a trailing window (shorter at the start of the run)."""
    out = []
    for x in xs:
        vals = [y for xx, y in zip(xs, ys) if x - window_s < xx <= x]
        out.append(sum(vals) / min(window_s, max(1.0, x - xs[0] + 1)))
    return xs, out


def deltas(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    return xs[1:], [max(0.0, b - a) for a, b in itertools.pairwise(ys)]


def last_delta(values: list[float]) -> float:
    return values[-1] - values[0] if len(values) > 1 else 0.0


def ms(value: str) -> str:
    v = num(value)
    return "–" if math.isnan(v) else f"{v:.0f}"
