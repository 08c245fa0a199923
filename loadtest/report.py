"""Render a load-test run into PNG plots and a Markdown summary."""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import itertools

import matplotlib.pyplot as plt
from matplotlib.axes import Axes

PREFIX = "locust"
HTTP_TYPES = ("GET", "POST")
PLOTS = ("latency.png", "throughput.png", "ttfc.png", "hit_ratio.png", "overview.png")


def _num(value: str | None) -> float:
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
        stamps = [_num(r["Timestamp"]) for r in self.history]
        stamps += [_num(r["t_unix"]) for r in self.metrics]
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
                if active_only and not _num(r["Requests/s"]) > 0:
                    continue
                xs.append(_num(r["Timestamp"]) - self.t0)
                ys.append(_num(r[column]))
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
                xs.append(_num(r["t_unix"]) - self.t0)
                ys.append(_num(r["value"]))
        return xs, ys

    def scraped_tiers(self) -> list[str]:
        tiers = set()
        for r in self.metrics:
            if r["metric"] == "visenc_cache_lookups_total":
                tiers.update(kv.split("=", 1)[1] for kv in r["labels"].split(";") if kv.startswith("tier="))
        return sorted(tiers)


def _rate(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """Per-second rate of a counter between consecutive samples (at the later sample's time)."""
    out_x, out_y = [], []
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x1 > x0:
            out_x.append(x1)
            out_y.append(max(0.0, y1 - y0) / (x1 - x0))
    return out_x, out_y


def _smooth_ratio(
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


# --- the four plots -------------------------------------------------------------


def _legend(ax: Axes, **kwargs: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="grey")


def plot_latency(run: Run, ax: Axes) -> None:
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    steady = [e for e in run.entries(HTTP_TYPES) if "[warm pool]" not in e["Name"]]  # start-up only
    for i, entry in enumerate(steady):
        c = colors[i % len(colors)]
        for col, style in (("50%", "-"), ("95%", "--"), ("99%", ":")):
            xs, ys = run.series(entry["Type"], entry["Name"], col, active_only=True)
            ax.plot(xs, ys, style, color=c, label=f"{entry['Name']} p{col[:-1]}" if col != "99%" else None)
    ax.set(title="Latency percentiles over time (last-10 s window; dotted: p99)", xlabel="s since start", ylabel="ms")
    ax.set_yscale("symlog", linthresh=1)  # Locust rounds to whole ms; sub-ms answers show as 0
    ax.set_ylim(bottom=0)
    users_x, users = run.series("", "Aggregated", "User Count")
    if users:
        twin = ax.twinx()
        twin.step(users_x, users, where="post", color="grey", alpha=0.5, label="users")
        twin.set_ylabel("users")
        twin.set_ylim(0, max(users) * 1.3 + 1)
    _legend(ax, fontsize=6, loc="best")


def plot_throughput(run: Run, ax: Axes) -> None:
    hits, misses = run.counter_deltas("images", "hit"), run.counter_deltas("images", "miss")
    times = sorted(set(hits) | set(misses))
    if times:
        xs, ys = _smooth_window(times, [hits.get(t, 0) + misses.get(t, 0) for t in times])
        ax.plot(xs, ys, color="C0", label="images requested/s (5 s mean)")
    xs, ys = _rate(*run.scraped("visenc_encoded_images_total"))
    if xs:
        ax.plot(xs, ys, color="C1", label="images encoded/s (server)")
    xs, ys = _rate(*run.scraped("visenc_forwards_total"))
    if xs:
        ax.plot(xs, ys, color="C2", lw=0.8, label="forwards/s (server)")
    ax.set(title="Throughput", xlabel="s since start", ylabel="per second")
    _legend(ax, fontsize=7, loc="upper left")


def _smooth_window(xs: list[float], ys: list[float], window_s: float = 5.0) -> tuple[list[float], list[float]]:
    """Per-second counts -> mean rate over a trailing window (shorter at the start of the run)."""
    out = []
    for x in xs:
        vals = [y for xx, y in zip(xs, ys) if x - window_s < xx <= x]
        out.append(sum(vals) / min(window_s, max(1.0, x - xs[0] + 1)))
    return xs, out


def _by_images(run: Run, type_: str) -> tuple[list[int], list[float], list[float]]:
    rows = sorted(
        (int(r["Name"].split("=")[1]), _num(r["50%"]), _num(r["95%"]))
        for r in run.entries([type_])
        if r["Name"].startswith("n=")
    )
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def plot_ttfc(run: Run, ax: Axes) -> None:
    for type_, color in (("TTFC", "C0"), ("TTA", "C3")):
        n, p50, p95 = _by_images(run, type_)
        if n:
            ax.plot(n, p50, "o-", color=color, label=f"{type_} median")
            ax.plot(n, p95, "s--", color=color, alpha=0.6, label=f"{type_} p95")
    ax.set(title="Time to first chunk / to all rows vs images per request", xlabel="images in the request", ylabel="ms")
    ax.set_ylim(bottom=0)
    _legend(ax, fontsize=7)


def plot_hit_ratio(run: Run, ax: Axes) -> None:
    xs, ys = _smooth_ratio(run.counter_deltas("images", "hit"), run.counter_deltas("images", "miss"))
    if xs:
        ax.plot(xs, ys, color="C0", label="client: hash-first answered (5 s window)")
    for i, tier in enumerate(run.scraped_tiers()):
        hx, hv = run.scraped("visenc_cache_lookups_total", tier=tier, result="hit")
        mx, mv = run.scraped("visenc_cache_lookups_total", tier=tier, result="miss")
        hits = dict(zip(*_deltas(hx, hv)))
        misses = dict(zip(*_deltas(mx, mv)))
        x, y = _smooth_ratio(hits, misses)
        if x:
            ax.plot(x, y, color=f"C{i + 1}", label=f"server: {tier} tier lookups (5 s window)")
    ax.set(title="Hit ratio over the run", xlabel="s since start", ylabel="hits / lookups", ylim=(-0.02, 1.02))
    _legend(ax, fontsize=7, loc="lower right")


def _deltas(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    return xs[1:], [max(0.0, b - a) for a, b in itertools.pairwise(ys)]


PLOTTERS = {
    "latency.png": plot_latency,
    "throughput.png": plot_throughput,
    "ttfc.png": plot_ttfc,
    "hit_ratio.png": plot_hit_ratio,
}


def render_plots(run: Run) -> list[Path]:
    paths = []
    for name, plot in PLOTTERS.items():
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        plot(run, ax)
        fig.tight_layout()
        fig.savefig(run.out / name)
        plt.close(fig)
        paths.append(run.out / name)
    fig, axes = plt.subplots(2, 2, figsize=(14, 8), dpi=80)
    for ax, plot in zip(axes.flat, PLOTTERS.values()):
        plot(run, ax)
    title = run.info.get("title")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(run.out / "overview.png")
    plt.close(fig)
    paths.append(run.out / "overview.png")
    return paths


# --- the summary ----------------------------------------------------------------


def _ms(value: str) -> str:
    v = _num(value)
    return "–" if math.isnan(v) else f"{v:.0f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def summary(run: Run) -> str:
    info = run.info
    http = run.entries(HTTP_TYPES)
    total_req = sum(int(r["Request Count"]) for r in http)
    total_fail = sum(int(r["Failure Count"]) for r in run.stats if r["Name"] != "Aggregated")
    duration = float(info.get("duration_s") or 0.0)
    lines = [f"# Load test: {info.get('scenario', '?')}", ""]
    if info:
        lines += [
            f"- target: `{info.get('url')}` ({info.get('server')})",
            f"- command: `{info.get('locust_command')}`",
            f"- duration: {duration:.1f} s, Locust exit code {info.get('locust_rc')}",
            "",
        ]
    lines += [f"**{total_req} HTTP requests, {total_fail} failures.**", ""]
    lines += ["## HTTP requests (ms)", ""]
    lines += _table(
        ["request", "count", "failures", "median", "p95", "p99", "max", "req/s"],
        [
            [
                f"`{r['Type']} {r['Name']}`",
                r["Request Count"],
                r["Failure Count"],
                _ms(r["50%"]),
                _ms(r["95%"]),
                _ms(r["99%"]),
                _ms(r["Max Response Time"]),
                f"{_num(r['Requests/s']):.2f}",
            ]
            for r in http
        ],
    )
    ttfc = {r["Name"]: r for r in run.entries(["TTFC"])}
    tta = {r["Name"]: r for r in run.entries(["TTA"])}
    if ttfc:
        lines += ["", "## Time to first chunk / to all rows, by images per request (ms)", ""]
        lines += _table(
            ["images", "requests", "TTFC median", "TTFC p95", "TTA median", "TTA p95"],
            [
                [
                    n.split("=")[1].lstrip("0"),
                    r["Request Count"],
                    _ms(r["50%"]),
                    _ms(r["95%"]),
                    _ms(tta.get(n, {}).get("50%")),
                    _ms(tta.get(n, {}).get("95%")),
                ]
                for n, r in sorted(ttfc.items())
            ],
        )
    server = run.entries(["server"])
    lines += ["", "## Server timing headers (ms)", ""]
    if server:
        lines += _table(
            ["header", "count", "median", "p95", "p99"],
            [[r["Name"], r["Request Count"], _ms(r["50%"]), _ms(r["95%"]), _ms(r["99%"])] for r in server],
        )
    else:
        lines += ["The service sent no `X-Visenc-Queue-Time` / `X-Visenc-Encode-Time` headers."]
    images = {r["Name"]: int(r["Request Count"]) for r in run.entries(["images"])}
    hit, miss = images.get("hit", 0), images.get("miss", 0)
    lines += ["", "## Images", ""]
    if hit + miss:
        lines += [
            f"- hash-first: {hit} answered from the index, {miss} uploaded: client hit ratio {hit / (hit + miss):.1%}"
        ]
    if duration and hit + miss:
        lines += [f"- images requested: {(hit + miss) / duration:.2f}/s over the run"]
    for tier in run.scraped_tiers():
        h = _last_delta(run.scraped("visenc_cache_lookups_total", tier=tier, result="hit")[1])
        m = _last_delta(run.scraped("visenc_cache_lookups_total", tier=tier, result="miss")[1])
        if h + m:
            lines += [
                f"- server `{tier}` tier: {h:.0f} hits / {h + m:.0f} lookups = {h / (h + m):.1%} "
                "(hash-first counts a new image twice: the hash round and the upload)"
            ]
    enc_x, enc = run.scraped("visenc_encoded_images_total")
    if len(enc) > 1 and enc_x[-1] > enc_x[0]:
        lines += [
            f"- server encoded {enc[-1] - enc[0]:.0f} images, {(enc[-1] - enc[0]) / (enc_x[-1] - enc_x[0]):.2f}/s"
        ]
    mem_x, mem = run.scraped("process_resident_memory_bytes")
    if len(mem) > 4:
        warm = next(i for i, x in enumerate(mem_x) if x >= mem_x[-1] * 0.25)  # after the first quarter
        lines += [
            f"- server resident memory: {mem[warm] / 2**20:.0f} MiB after warm-up "
            f"({mem_x[warm]:.0f} s), {max(mem[warm:]) / 2**20:.0f} MiB peak after it, "
            f"{mem[-1] / 2**20:.0f} MiB at the end"
        ]
    if run.failures:
        lines += ["", "## Failures", ""]
        lines += _table(
            ["request", "error", "occurrences"],
            [
                [f"`{f['Method']} {f['Name']}`", f["Error"].replace("|", "\\|")[:200], f["Occurrences"]]
                for f in run.failures
            ],
        )
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in PLOTS if p != "overview.png"]
    return "\n".join(lines) + "\n"


def brief(run: Run) -> str:
    """The run in a few lines for the terminal: one row per HTTP request kind and one for the time to the
    first chunk, then the images and failures (``report.md`` has the rest)."""
    rows = [
        (f"{r['Type']} {r['Name']}", r["Request Count"], r["Failure Count"], r["50%"], r["95%"], r["Requests/s"])
        for r in [*run.entries(HTTP_TYPES), *run.entries(["TTFC"])]
    ]
    head = ("request", "count", "failures", "median ms", "p95 ms", "per s")
    cells = [
        head,
        *((name, n, fail, _ms(p50), _ms(p95), f"{_num(rate):.2f}") for name, n, fail, p50, p95, rate in rows),
    ]
    width = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c[i].ljust(width[i]) if i == 0 else c[i].rjust(width[i]) for i in range(len(c))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in width))
    images = {r["Name"]: int(r["Request Count"]) for r in run.entries(["images"])}
    hit, miss = images.get("hit", 0), images.get("miss", 0)
    failures = sum(int(r["Failure Count"]) for r in run.stats if r["Name"] != "Aggregated")
    tail = f"{failures} failures" + (
        f"; hash-first hit ratio {hit / (hit + miss):.1%} of {hit + miss} images" if hit + miss else ""
    )
    return "\n".join([*lines, tail])


def _last_delta(values: list[float]) -> float:
    return values[-1] - values[0] if len(values) > 1 else 0.0


def render(out: Path) -> list[Path]:
    """Write every plot and ``report.md`` into ``out``; returns their paths."""
    run = Run(out)
    if not run.stats:
        raise FileNotFoundError(f"no {PREFIX}_stats.csv in {out}: did Locust run?")
    paths = render_plots(run)
    (out / "report.md").write_text(summary(run))
    return [*paths, out / "report.md"]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    for path in render(Path(argv[0])):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
