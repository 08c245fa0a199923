"""A load-test run's PNG plots: latency, throughput, time to first chunk, hit ratio, and all four in one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from loadtest.runs import HTTP_TYPES, Run, deltas, num, rate, smooth_ratio, smooth_window
from matplotlib.axes import Axes

PLOTS = ("latency.png", "throughput.png", "ttfc.png", "hit_ratio.png", "overview.png")


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
        xs, ys = smooth_window(times, [hits.get(t, 0) + misses.get(t, 0) for t in times])
        ax.plot(xs, ys, color="C0", label="images requested/s (5 s mean)")
    xs, ys = rate(*run.scraped("visenc_encoded_images_total"))
    if xs:
        ax.plot(xs, ys, color="C1", label="images encoded/s (server)")
    xs, ys = rate(*run.scraped("visenc_forwards_total"))
    if xs:
        ax.plot(xs, ys, color="C2", lw=0.8, label="forwards/s (server)")
    ax.set(title="Throughput", xlabel="s since start", ylabel="per second")
    _legend(ax, fontsize=7, loc="upper left")


def _by_images(run: Run, type_: str) -> tuple[list[int], list[float], list[float]]:
    rows = sorted(
        (int(r["Name"].split("=")[1]), num(r["50%"]), num(r["95%"]))
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
    xs, ys = smooth_ratio(run.counter_deltas("images", "hit"), run.counter_deltas("images", "miss"))
    if xs:
        ax.plot(xs, ys, color="C0", label="client: hash-first answered (5 s window)")
    for i, tier in enumerate(run.scraped_tiers()):
        hx, hv = run.scraped("visenc_cache_lookups_total", tier=tier, result="hit")
        mx, mv = run.scraped("visenc_cache_lookups_total", tier=tier, result="miss")
        hits = dict(zip(*deltas(hx, hv)))
        misses = dict(zip(*deltas(mx, mv)))
        x, y = smooth_ratio(hits, misses)
        if x:
            ax.plot(x, y, color=f"C{i + 1}", label=f"server: {tier} tier lookups (5 s window)")
    ax.set(title="Hit ratio over the run", xlabel="s since start", ylabel="hits / lookups", ylim=(-0.02, 1.02))
    _legend(ax, fontsize=7, loc="lower right")


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
