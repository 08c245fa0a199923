"""A rows read by a caller whose process is busy running Python (a vLLM worker's is): each view read in one
system call against the same view read segment by segment, side by side in one run, idle and busy.

python bench/bench_rows_busy.py [--size 1080p] [--rounds 5] [--reads 16] [--spinners 1]

Read segment by segment, a thread takes the GIL back after every segment; beside a thread running Python it
waits up to the switch interval (5 ms) each time. The ratio is segments ÷ whole: above 1, whole reads win.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "service"), str(ROOT / "clients"), str(ROOT / "bench")]

import _common as c
import bench_rows

from visenc_client import Client, _http, _sockets

READS: dict[str, Callable[[Client, str], object]] = {
    "Client.fetch": lambda vc, h: vc.fetch(h),
    "include_rows look-up": lambda vc, h: vc.lookup([h], wait=True, include_rows=True),
}


@contextlib.contextmanager
def busy(spinners: int) -> Iterator[None]:
    """``spinners`` threads running Python until the block ends."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            for i in range(1000):
                n += i

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(spinners)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def timed(read: Callable[[Client, str], object], vc: Client, hashes: list[str], n: int, whole: bool) -> float:
    """Milliseconds a read, ``n`` reads in turn over ``hashes``, each view whole or segment by segment."""
    _http.WHOLE_READ_BYTES = 1 << 20 if whole else 1 << 62
    t0 = time.perf_counter()
    for i in range(n):
        read(vc, hashes[i % len(hashes)])
    return (time.perf_counter() - t0) / n * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1080p", choices=list(bench_rows.SIZES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reads", type=int, default=16, help="reads per path per round")
    p.add_argument("--spinners", type=int, default=1, help="threads running Python beside the reader when busy")
    args = p.parse_args()
    if not _sockets.KERNEL_TIMEOUTS:
        print("whole reads need kernel socket timeouts (Linux, macOS): nothing to compare here")
        return 0
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="visenc-busy-")))
        checkpoint = c.write_qwen25_checkpoint(folder / "wide", bench_rows.WIDE)
        vc = stack.enter_context(Client(c.serve_checkpoint(stack, checkpoint)))
        images = [c.jpeg(7000 + i, *bench_rows.SIZES[args.size]) for i in range(4)]
        handles = vc.encode(images)
        hashes = [h.hash for h in handles]
        mb = handles[0].num_tokens * handles[0].hidden_size * 2 / 1e6
        print(f"{args.size}: {mb:.1f} MB of rows an image, {args.reads} reads a round, {args.rounds} rounds")
        for state, spinners in (("idle", 0), (f"busy ({args.spinners} thread(s) running Python)", args.spinners)):
            with busy(spinners):
                for title, read in READS.items():
                    ms: dict[bool, list[float]] = {True: [], False: []}
                    for whole in (True, False):
                        timed(read, vc, hashes, 2, whole)  # warm-up
                    for r in range(args.rounds):
                        for whole in (True, False) if r % 2 == 0 else (False, True):
                            ms[whole].append(timed(read, vc, hashes, args.reads, whole))
                    ratios = [s / w for w, s in zip(ms[True], ms[False])]
                    print(
                        f"  {state:38s} {title:22s} whole {statistics.median(ms[True]):6.2f} ms, "
                        f"segments {statistics.median(ms[False]):6.2f} ms: {c.spread(ratios)}"
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
