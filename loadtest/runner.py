"""Run one bounded, headless Locust scenario against visenc and render its report."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python loadtest/runner.py`: make `loadtest.*` importable
    sys.path.insert(0, str(ROOT))

from harness.waits import free_port, wait_ready
from loadtest.payloads import DEFAULT_STAGES, parse_stages, parse_timespan
from loadtest.report import Run, brief, render

SCRAPED = (
    "visenc_cache_lookups_total",
    "visenc_encoded_images_total",
    "visenc_forwards_total",
    "visenc_singleflight_joins_total",
    "visenc_queue_depth",
    "process_resident_memory_bytes",
)
#: the embedded default, kept light: the load generator shares the machine's cores
DEFAULT_SERVE_ARGS = ("--torch-threads", "1", "--log-level", "warning")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--url", help="Service to load (default: start `visenc serve` on a free loopback port).")
    p.add_argument(
        "--scenario",
        choices=("agent", "probe", "cold", "hot", "mixed", "tenants"),
        help="Scenario to run (default: agent, unless Locust's --tags picks the users).",
    )
    p.add_argument("-u", "--users", type=int, default=2, help="Concurrent users.")
    p.add_argument("-r", "--spawn-rate", type=float, default=1.0, help="Users started per second.")
    p.add_argument("-t", "--run-time", default="30s", help="How long Locust runs (Locust syntax: 30s, 2m).")
    p.add_argument("--stop-timeout", type=float, default=15.0, help="Seconds users get to finish at the end.")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "out", help="Output folder.")
    p.add_argument("--ramp", action="store_true", help="Use the staged shape (--stages) instead of -u/-r/-t.")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="Extra argument of `visenc serve` (repeatable; e.g. --serve-arg=--max-wait-ms=5).",
    )
    p.add_argument("--scrape-interval", type=float, default=1.0, help="Seconds between /metrics scrapes.")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="Seconds to wait for the server.")
    return p.parse_known_args(argv)


def _env() -> dict[str, str]:
    paths = [str(ROOT / "service"), str(ROOT / "clients"), str(ROOT)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


@contextlib.contextmanager
def served(args: argparse.Namespace) -> Iterator[tuple[str, str, int | None]]:
    """(url, description, pid or None) of the service to load: the given one, or a `visenc serve` we
    start and stop."""
    if args.url:
        wait_ready(args.url.rstrip("/"), None, args.ready_timeout)
        yield args.url.rstrip("/"), "given URL", None
        return
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "visenc",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *DEFAULT_SERVE_ARGS,
        *args.serve_arg,
    ]
    with (args.out / "serve.log").open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc, args.ready_timeout)
            yield url, f"started here: {shlex.join(cmd[1:])}", proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Scraper(threading.Thread):
    """Scrapes ``/metrics`` every ``interval_s`` into ``metrics.csv`` until stopped (one last scrape then)."""

    def __init__(self, url: str, path: Path, interval_s: float) -> None:
        super().__init__(daemon=True, name="metrics-scraper")
        self.url, self.path, self.interval_s = url, path, interval_s
        self.stopping = threading.Event()
        self.errors = 0

    def scrape(self, f: TextIO, client: httpx.Client) -> None:
        try:
            text = client.get(f"{self.url}/metrics", timeout=5.0).text
        except httpx.HTTPError:
            self.errors += 1
            return
        now = time.time()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in SCRAPED:
                    labels = ";".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    print(f"{now:.3f},{s.name},{labels},{s.value}", file=f)

    def run(self) -> None:
        with self.path.open("w") as f, httpx.Client() as client:
            print("t_unix,metric,labels,value", file=f)
            while not self.stopping.wait(self.interval_s):
                self.scrape(f, client)
            self.scrape(f, client)


def locust_command(args: argparse.Namespace, url: str, extra: list[str]) -> list[str]:
    files = "loadtest/locustfile.py" + (",loadtest/shapes.py" if args.ramp else "")
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        files,
        "--headless",
        "--host",
        url,
        "--csv",
        str(args.out / "locust"),
        "--csv-full-history",
        "--stop-timeout",
        f"{args.stop_timeout:g}s",
        "--only-summary",
        "--loglevel",
        "WARNING",
    ]
    if args.scenario:
        cmd += ["--scenario", args.scenario]
    if not args.ramp:
        cmd += ["-u", str(args.users), "-r", str(args.spawn_rate), "--run-time", args.run_time]
    return cmd + extra


def locust_deadline_s(args: argparse.Namespace, extra: list[str]) -> float:
    """How long Locust may take in all: its run time (or the last ramp stage), the stop timeout, start-up."""
    if args.ramp:
        stages = argparse.ArgumentParser(add_help=False)
        stages.add_argument("--stages", default=DEFAULT_STAGES)
        run_s = parse_stages(stages.parse_known_args(extra)[0].stages)[-1][0]
    else:
        run_s = parse_timespan(args.run_time)
    return run_s + args.stop_timeout + 60.0


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv)
    if args.scenario is None and not {"-T", "--tags"} & {e.split("=")[0] for e in extra}:
        args.scenario = "agent"
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("locust_*.csv"):
        old.unlink()
    with served(args) as (url, server, server_pid):
        cmd = locust_command(args, url, extra)
        scraper = Scraper(url, args.out / "metrics.csv", args.scrape_interval)
        scraper.start()
        started = time.time()
        with (args.out / "locust.log").open("wb") as log:
            try:
                rc = subprocess.run(
                    cmd,
                    cwd=ROOT,
                    env=_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=locust_deadline_s(args, extra),
                ).returncode
            except subprocess.TimeoutExpired:  # subprocess.run has killed it
                rc = 124
        duration = time.time() - started
        scraper.stopping.set()
        scraper.join(timeout=10)
    info = {
        "scenario": args.scenario or "by tags",
        "url": url,
        "server": server,
        "server_pid": server_pid,
        "locust_rc": rc,
        "duration_s": duration,
        "locust_command": shlex.join(["locust", *cmd[3:]]),
        "scrape_errors": scraper.errors,
        "title": f"visenc load test: {args.scenario or 'by tags'}, "
        + ("staged ramp" if args.ramp else f"{args.users} users, {args.run_time}")
        + (f" ({' '.join(extra)})" if extra else ""),
    }
    (args.out / "run.json").write_text(json.dumps(info, indent=2))
    if not (args.out / "locust_stats.csv").exists():
        print((args.out / "locust.log").read_text()[-3000:], file=sys.stderr)
        print(f"Locust wrote no stats (exit code {rc})", file=sys.stderr)
        return 1
    paths = render(args.out)
    print(f"{args.out}: report.md, {len(paths) - 1} plots, Locust's CSVs, metrics.csv, run.json\n")
    print(brief(Run(args.out)))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
