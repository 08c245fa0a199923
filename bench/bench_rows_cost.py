"""What one rows request costs beside its bytes: wall time and CPU time per request, on each side, for the raw
socket floor, ``include_rows``, ``fetch``, and the same requests without rows (one caller, rounds alternated).

python bench/bench_rows_cost.py [--size 1080p] [--rounds 5] [--requests 100]

The last lines bound what any path with this fixed cost can reach: floor ÷ (floor + the fixed request's wall).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "service"), str(ROOT / "clients"), str(ROOT / "bench")]

import _common as c
import bench_rows
from _rows_floors import RawReceiver, RawSender

from visenc_client import Client

#: a server's pid and one request to it
Measure = tuple[int | None, Callable[[], object]]


def thread_cpu(pid: int | None) -> dict[int, float]:
    """CPU seconds (user and system) of each of ``pid``'s threads (none without a pid)."""
    return {} if pid is None else {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def measured(pid: int | None, call: Callable[[], object], n: int) -> tuple[float, float, float, float]:
    """Per request, in ms: wall, the caller's CPU, the server's event loop CPU, its other threads' CPU."""
    before, t0, c0 = thread_cpu(pid), time.perf_counter(), time.thread_time()
    for _ in range(n):
        call()
    wall, client = time.perf_counter() - t0, time.thread_time() - c0
    after = thread_cpu(pid)
    loop = after.get(pid, 0.0) - before.get(pid, 0.0)
    others = sum(v - before.get(t, 0.0) for t, v in after.items() if t != pid)
    return tuple(x / n * 1e3 for x in (wall, client, loop, others))  # type: ignore[return-value]


def served(stack: contextlib.ExitStack, tree: Path, checkpoint: Path, image: bytes) -> dict[str, Measure]:
    """The rows requests of a ``visenc serve`` run from ``tree``, each as (its server's pid, the call)."""
    port = c.free_port()
    cmd = c.visenc_cmd(str(checkpoint), port, "--dtype", "bfloat16")
    pid = stack.enter_context(c.server(cmd, f"http://127.0.0.1:{port}/readyz", c.service_env(tree))).pid
    client = stack.enter_context(Client(f"http://127.0.0.1:{port}"))
    h = client.encode([image])[0]
    return {
        "include_rows": (pid, lambda: client.lookup([h.hash], wait=True, include_rows=True)),
        "fetch": (pid, lambda: client.fetch(h)),
        "lookup, no rows": (pid, lambda: client.lookup([h.hash], wait=True)),
        "GET /v1/model": (pid, client.model),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1080p", choices=list(bench_rows.SIZES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=100, help="requests per path per round")
    p.add_argument("--before", type=Path, default=None, help="another source tree, served side by side")
    args = p.parse_args()
    trees = {"": ROOT, **({" (before)": args.before.resolve()} if args.before else {})}
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="visenc-cost-")))
        checkpoint = c.write_qwen25_checkpoint(folder / "wide", bench_rows.WIDE)
        image = c.jpeg(7, *bench_rows.SIZES[args.size])
        paths = {
            f"{name}{tag}": m
            for tag, tree in trees.items()
            for name, m in served(stack, tree, checkpoint, image).items()
        }
        nbytes = paths["include_rows"][1]()[0].rows.nbytes  # type: ignore[index]
        receiver = RawReceiver(RawSender([bytes(nbytes)]).port, nbytes)  # one buffer, as one image is served
        paths = {"raw socket": (None, lambda: receiver.get(nbytes)), **paths}  # its sender: a thread here
        for pid, call in paths.values():  # warm-up
            measured(pid, call, 10)
        runs: dict[str, list[tuple[float, ...]]] = {name: [] for name in paths}
        for r in range(args.rounds):
            for name in list(paths) if r % 2 == 0 else list(paths)[::-1]:
                runs[name].append(measured(*paths[name], args.requests))
    report(args, nbytes, runs, list(trees))
    return 0


def report(args: argparse.Namespace, nbytes: int, runs: dict[str, list[tuple[float, ...]]], tags: list[str]) -> None:
    print(f"{args.size}, {nbytes / 1e6:.1f} MB of rows, 1 caller; ms a request, median of {args.rounds} rounds:")
    print(f"  {'path':27s} {'wall':>7s} {'client':>7s} {'loop':>7s} {'threads':>7s}")
    med = {name: [statistics.median(col) for col in zip(*rows)] for name, rows in runs.items()}
    for name, (wall, client_cpu, loop, others) in med.items():
        print(f"  {name:27s} {wall:7.2f} {client_cpu:7.2f} {loop:7.2f} {others:7.2f}")
    floor = med["raw socket"][0]
    for tag in tags:
        fixed = med[f"lookup, no rows{tag}"][0]
        ratios = [f[0] / r[0] for f, r in zip(runs["raw socket"], runs[f"include_rows{tag}"])]
        print(f"include_rows{tag} ÷ raw socket: {c.spread(ratios)}; a request's fixed cost alone ({fixed:.2f} ms) "
              f"bounds a path whose bytes move as fast as the floor's at {floor / (floor + fixed):.2f}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
