"""Render a load-test run into PNG plots (``plots.py``) and a Markdown summary."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python loadtest/report.py`: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.plots import PLOTS, render_plots
from loadtest.runs import HTTP_TYPES, PREFIX, Run, last_delta, ms, num

__all__ = ["Run", "brief", "render", "summary"]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def summary(run: Run) -> str:
    sections = (_head, _http, _chunks, _server_timing, _images, _failures)
    lines = [line for section in sections for line in section(run)]
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in PLOTS if p != "overview.png"]
    return "\n".join(lines) + "\n"


def _head(run: Run) -> list[str]:
    info = run.info
    total_req = sum(int(r["Request Count"]) for r in run.entries(HTTP_TYPES))
    total_fail = sum(int(r["Failure Count"]) for r in run.stats if r["Name"] != "Aggregated")
    lines = [f"# Load test: {info.get('scenario', '?')}", ""]
    if info:
        lines += [
            f"- target: `{info.get('url')}` ({info.get('server')})",
            f"- command: `{info.get('locust_command')}`",
            f"- duration: {_duration(run):.1f} s, Locust exit code {info.get('locust_rc')}",
            "",
        ]
    return [*lines, f"**{total_req} HTTP requests, {total_fail} failures.**", ""]


def _duration(run: Run) -> float:
    return float(run.info.get("duration_s") or 0.0)


def _http(run: Run) -> list[str]:
    rows = [
        [
            f"`{r['Type']} {r['Name']}`",
            r["Request Count"],
            r["Failure Count"],
            ms(r["50%"]),
            ms(r["95%"]),
            ms(r["99%"]),
            ms(r["Max Response Time"]),
            f"{num(r['Requests/s']):.2f}",
        ]
        for r in run.entries(HTTP_TYPES)
    ]
    header = ["request", "count", "failures", "median", "p95", "p99", "max", "req/s"]
    return ["## HTTP requests (ms)", "", *_table(header, rows)]


def _chunks(run: Run) -> list[str]:
    ttfc = {r["Name"]: r for r in run.entries(["TTFC"])}
    tta = {r["Name"]: r for r in run.entries(["TTA"])}
    if not ttfc:
        return []
    rows = [
        [
            n.split("=")[1].lstrip("0"),
            r["Request Count"],
            ms(r["50%"]),
            ms(r["95%"]),
            ms(tta.get(n, {}).get("50%")),
            ms(tta.get(n, {}).get("95%")),
        ]
        for n, r in sorted(ttfc.items())
    ]
    header = ["images", "requests", "TTFC median", "TTFC p95", "TTA median", "TTA p95"]
    return ["", "## Time to first chunk / to all rows, by images per request (ms)", "", *_table(header, rows)]


def _server_timing(run: Run) -> list[str]:
    server = run.entries(["server"])
    lines = ["", "## Server timing headers (ms)", ""]
    if not server:
        return [*lines, "The service sent no `X-Visenc-Queue-Time` / `X-Visenc-Encode-Time` headers."]
    rows = [[r["Name"], r["Request Count"], ms(r["50%"]), ms(r["95%"]), ms(r["99%"])] for r in server]
    return [*lines, *_table(["header", "count", "median", "p95", "p99"], rows)]


def _images(run: Run) -> list[str]:
    images = {r["Name"]: int(r["Request Count"]) for r in run.entries(["images"])}
    hit, miss = images.get("hit", 0), images.get("miss", 0)
    lines = ["", "## Images", ""]
    if hit + miss:
        lines += [
            f"- hash-first: {hit} answered from the index, {miss} uploaded: client hit ratio {hit / (hit + miss):.1%}"
        ]
    if _duration(run) and hit + miss:
        lines += [f"- images requested: {(hit + miss) / _duration(run):.2f}/s over the run"]
    for tier in run.scraped_tiers():
        h = last_delta(run.scraped("visenc_cache_lookups_total", tier=tier, result="hit")[1])
        m = last_delta(run.scraped("visenc_cache_lookups_total", tier=tier, result="miss")[1])
        if h + m:
            lines += [
                f"- server `{tier}` tier: {h:.0f} hits / {h + m:.0f} lookups = {h / (h + m):.1%} "
                "(hash-first counts a new image twice: the hash round and the upload)"
            ]
    return lines + _server_work(run)


def _server_work(run: Run) -> list[str]:
    lines = []
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
    return lines


def _failures(run: Run) -> list[str]:
    if not run.failures:
        return []
    rows = [
        [f"`{f['Method']} {f['Name']}`", f["Error"].replace("|", "\\|")[:200], f["Occurrences"]] for f in run.failures
    ]
    return ["", "## Failures", "", *_table(["request", "error", "occurrences"], rows)]


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
        *((name, n, fail, ms(p50), ms(p95), f"{num(rate):.2f}") for name, n, fail, p50, p95, rate in rows),
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
