"""Garbage-collection pauses of ``visenc serve``, with the heap it starts with frozen (as it runs) and without.

A full collection holds the GIL: every thread of the service, the event loop and the device loop included,
waits it out. Two parts, side by side in one run:
- one full collection of a started service's heap, in this process;
- every full collection while a served visenc answers ``--requests`` (8 callers: a quarter encode new
  images, the rest ``include_rows`` look-ups), each server recording its own pauses.

python bench/bench_gc.py [--requests 24000]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "service"), str(ROOT / "clients"), str(ROOT / "bench")]

import _common as c

from visenc.bootstrap import create_app, load_tower
from visenc.cli import freeze_heap
from visenc.config import Settings
from visenc_client import Client

#: the server: its full collections' pauses, one a line, in PAUSES; FROZEN=0 serves without the freeze
CHILD = """
import gc, os, sys, time
import visenc.cli as cli
started, out = [], open(os.environ["PAUSES"], "a", buffering=1)
def timed(phase, info):
    if info["generation"] == 2 and phase == "start":
        started.append(time.perf_counter())
    elif info["generation"] == 2:
        out.write(f"{time.perf_counter() - started.pop()}\\n")
gc.callbacks.append(timed)
if os.environ["FROZEN"] == "0":
    cli.freeze_heap = lambda: None
sys.exit(cli.main(sys.argv[1:]))
"""


def one_collection(rounds: int = 5) -> tuple[int, float, float]:
    """Objects a started service tracks, and one full collection's seconds before and after the freeze."""
    settings = Settings()
    create_app(settings, tower=load_tower(settings))
    tracked = len(gc.get_objects())
    seconds = []
    for i in range(2 * rounds):
        if i == rounds:
            freeze_heap()
        t0 = time.perf_counter()
        gc.collect()
        seconds.append(time.perf_counter() - t0)
    gc.unfreeze()
    return tracked, statistics.median(seconds[:rounds]), statistics.median(seconds[rounds:])


def served_pauses(folder: Path, frozen: bool, requests: int) -> tuple[list[float], list[float]]:
    """The full collections' seconds of a served visenc: up to its first answer, then under load."""
    pauses = folder / f"pauses-{int(frozen)}.txt"
    port = c.free_port()
    cmd = [c.PYTHON, "-c", CHILD, "serve", "--port", str(port), "--log-level", "warning"]
    env = {**c.service_env(), "PAUSES": str(pauses), "FROZEN": str(int(frozen))}
    with c.server(cmd, f"http://127.0.0.1:{port}/readyz", env), Client(f"http://127.0.0.1:{port}") as client:
        handles = client.encode([c.jpeg(i, 320, 240) for i in range(64)])
        before = len(pauses.read_text().split()) if pauses.exists() else 0

        def one(i: int) -> None:
            if i % 4 == 0:
                client.encode([c.jpeg(10_000 + i, 64, 64)], wait=True)
            else:
                client.lookup([handles[i % 64].hash], wait=True, include_rows=True)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(requests)))
        seconds = [float(s) for s in pauses.read_text().split()]
    return seconds[:before], seconds[before:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=24_000)
    args = p.parse_args()
    tracked, unfrozen, frozen = one_collection()
    print(f"the embedded default, started: {tracked} objects tracked; one full collection takes")
    print(f"  {unfrozen * 1e3:.1f} ms with the heap not frozen, {frozen * 1e6:.0f} us with it frozen")
    with tempfile.TemporaryDirectory(prefix="visenc-gc-") as folder:
        for is_frozen in (False, True):
            start, load = served_pauses(Path(folder), is_frozen, args.requests)
            ms = ", ".join(f"{s * 1e3:.0f}" for s in load) or "none"
            print(f"served, heap {'frozen' if is_frozen else 'not frozen'}: {len(start)} full collections while "
                  f"starting; under {args.requests} requests: {len(load)} [{ms}] ms, longest "
                  f"{max(load, default=0) * 1e3:.0f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
