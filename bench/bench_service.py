"""Service throughput, side by side in one run: visenc vs the bare in-process forward,
vs a naive FastAPI handler, and (given its folder) vs the Infinity peer.

    python bench/bench_service.py                                  # tiny-clip, 2 rounds
    python bench/bench_service.py --model tiny-qwen2-vl --images 48
    python bench/bench_service.py --infinity /work/peer-infinity   # CLIP folder built by the peer's setup.sh
    python bench/bench_service.py --before /tmp/visenc-before      # this tree vs another (git worktree)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "service"), str(Path(__file__).resolve().parent)]

import _common as c


def source_env(tree: Path) -> dict[str, str]:
    """The environment that runs visenc from the source tree at ``tree``."""
    return {"PYTHONPATH": os.pathsep.join(str(tree / d) for d in ("service", "clients"))}


def infinity_env(peer: Path) -> dict[str, str]:
    return {
        "HF_HUB_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        "INFINITY_HOME": str(peer / "infhome"),
    }


def infinity_cmd(peer: Path, model: str, port: int) -> list[str]:
    flags = "--device cpu --engine torch --host 127.0.0.1 --batch-size 32 --no-vector-disk-cache --no-compile"
    exe = str(peer / "venv" / "bin" / "infinity_emb")
    return [exe, "v2", "--model-id", model, "--port", str(port), *flags.split()]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default=None,
        help="registry name or folder (default: tiny-clip, or the peer's tiny-clip folder with --infinity)",
    )
    p.add_argument("--images", type=int, default=64, help="distinct images per measurement")
    p.add_argument("--size", default="640x480", help="image size WxH")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--infinity", type=Path, default=None, help="peer folder from shared/peers/infinity/setup.sh")
    p.add_argument("--no-naive", action="store_true")
    p.add_argument("--infinity-heap", action="store_true", help="also run Infinity with visenc's C-heap setting")
    p.add_argument("--serve-args", default="", help="extra `visenc serve` flags, e.g. '--max-wait-ms 5'")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--before", type=Path, default=None, help="another source tree: its visenc, side by side")
    return p.parse_args()


def calibrate(tower: Any, images: list[bytes]) -> tuple[tuple[int, int], ...]:
    """The bare loop's best (threads, batch) per thread count: each config measured twice, median."""
    _, _, first = c.bare_rate(tower, images[:32], (1, 4, 8, 16))
    _, _, second = c.bare_rate(tower, images[:32], (1, 4, 8, 16))
    calib = {k: statistics.median([first[k], second[k]]) for k in first}
    configs = tuple(max((k for k in calib if k[0] == t), key=lambda k: calib[k]) for t in sorted({k[0] for k in calib}))
    print(
        f"bare loop calibration (img/s): {', '.join(f't{t}b{b} {v:.1f}' for (t, b), v in calib.items())}"
        f" -> per round, the better of {configs} (threads, batch)"
    )
    return configs


def start_servers(
    stack: contextlib.ExitStack, args: argparse.Namespace, model: str, peer: Path | None, keep: int
) -> tuple[dict[str, Callable[[int], c.Send]], dict[str, subprocess.Popen[bytes]]]:
    """Every server measured, started on ``stack``; a sender maker (round -> send) and the process of each."""
    from visenc import heap

    logs = Path(tempfile.mkdtemp(prefix="visenc-bench-"))
    env = c.service_env()
    nport = c.free_port()
    senders: dict[str, Callable[[int], c.Send]] = {}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    trees = {"visenc": env, **({"visenc_before": source_env(args.before)} if args.before else {})}
    for key, tree_env in trees.items():
        port = c.free_port()
        cmd = c.visenc_cmd(model, port, *args.serve_args.split())
        url = f"http://127.0.0.1:{port}"
        procs[key] = stack.enter_context(c.server(cmd, f"{url}/readyz", tree_env, logs / f"{key}.log"))
        senders[key] = lambda r, url=url: c.visenc_sender(url, f"bench{r}")
    if not args.no_naive:
        procs["naive"] = stack.enter_context(
            c.server(
                [c.PYTHON, str(c.ROOT / "bench" / "naive_server.py"), "--model", model, "--port", str(nport)],
                f"http://127.0.0.1:{nport}/healthz",
                env,
                logs / "naive.log",
            )
        )
        senders["naive"] = lambda r: c.raw_sender(f"http://127.0.0.1:{nport}/encode")
    if peer is not None:
        served = "/".join(Path(model).parts[-2:])
        runs = {"infinity": {}, **({"infinity_heap": heap.environment(keep)} if args.infinity_heap else {})}
        for key, extra in runs.items():
            port = c.free_port()
            procs[key] = stack.enter_context(
                c.server(
                    infinity_cmd(peer, model, port),
                    f"http://127.0.0.1:{port}/health",
                    {**infinity_env(peer), **extra},
                    logs / f"{key}.log",
                )
            )
            base = f"http://127.0.0.1:{port}"
            senders[key] = lambda r, base=base: c.infinity_sender(base, served)
    return senders, procs


def measure(
    args: argparse.Namespace,
    tower: Any,
    images: list[bytes],
    configs: tuple[tuple[int, int], ...],
    senders: dict[str, Callable[[int], c.Send]],
    procs: dict[str, subprocess.Popen[bytes]],
) -> dict[str, list[float]]:
    """Images/s of the bare loop, the forward alone and each server, round by round."""
    rows: dict[str, list[float]] = {}
    for proc in procs.values():  # only the system being measured runs (idle servers still poll)
        c.pause(proc)
    for r in range(args.rounds):
        bare = [c.bare_rate(tower, images, (b,), threads=(t,))[1] for t, b in configs]
        fwd = [c.bare_rate(tower, images, (b,), preprocess=False, threads=(t,))[1] for t, b in configs]
        rows.setdefault("bare", []).append(max(bare))
        rows.setdefault("forward", []).append(max(fwd))
        for key, make in senders.items():
            c.resume(procs[key])
            send = make(r)
            rows.setdefault(key, []).append(asyncio.run(c.clients_rate(images, send, args.concurrency)))
            if key in ("visenc", "visenc_before", "infinity"):  # the same images again
                rows.setdefault(f"{key}_repeat", []).append(asyncio.run(c.clients_rate(images, send, args.concurrency)))
            c.pause(procs[key])
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()) + " img/s")
    return rows


def report(args: argparse.Namespace, model: str, rows: dict[str, list[float]]) -> None:
    # ratios per round (both sides measured minutes apart at most), then the median over rounds
    def ratio(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(rows[a], rows[b])]

    med = {k: statistics.median(v) for k, v in rows.items()}
    print("\nmedian images/s: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    ratios = {
        "visenc / bare (goal >= 0.9)": ratio("visenc", "bare"),
        "visenc / forward-only": ratio("visenc", "forward"),
        "visenc repeated / cold": ratio("visenc_repeat", "visenc"),
    }
    if "naive" in rows:
        ratios["visenc / naive"] = ratio("visenc", "naive")
    if "visenc_before" in rows:
        ratios["visenc / visenc_before, cold"] = ratio("visenc", "visenc_before")
        ratios["visenc / visenc_before, repeated"] = ratio("visenc_repeat", "visenc_before_repeat")
    if "infinity" in rows:
        ratios["visenc / infinity cold (goal >= 1.2)"] = ratio("visenc", "infinity")
        ratios["infinity / bare"] = ratio("infinity", "bare")
        ratios["infinity repeated / cold"] = ratio("infinity_repeat", "infinity")
    if "infinity_heap" in rows:
        ratios["visenc / infinity with visenc's heap setting"] = ratio("visenc", "infinity_heap")
    for k, v in ratios.items():
        print(f"  {k:40s} {c.spread(v)}")
    if args.json:
        medians = {k: statistics.median(v) for k, v in ratios.items()}
        doc = {"model": model, "images_per_s": med, "ratios": medians, "rounds": ratios}
        args.json.write_text(json.dumps(doc, indent=2))


def main() -> int:
    args = parse_args()

    import torch

    from visenc import heap
    from visenc.config import Settings
    from visenc.models.loading import load_tower

    keep = Settings().heap_keep_bytes
    heap.hold_freed(keep)

    peer = args.infinity
    if peer is not None and not (peer / "venv" / "bin" / "infinity_emb").exists():
        print(f"note: no Infinity install under {peer} (run shared/peers/infinity/setup.sh {peer}); skipping the peer")
        peer = None
    model = args.model or (str(peer / "tiny-clip") if peer else "tiny-clip")
    w, h = (int(x) for x in args.size.split("x"))
    images = [c.jpeg(i, w, h) for i in range(args.images)]
    torch.set_num_threads(os.cpu_count() or 1)
    tower = load_tower(model)
    print(
        f"model {model} ({tower.describe()['name']}), {args.images} images {args.size}, "
        f"{args.concurrency} concurrent single-image clients, {args.rounds} rounds, {os.cpu_count()} cores"
    )
    configs = calibrate(tower, images)
    with contextlib.ExitStack() as stack:
        senders, procs = start_servers(stack, args, model, peer, keep)
        for make in senders.values():  # first requests (lazy init, thread pools) are not measured
            asyncio.run(c.clients_rate([c.jpeg(10_000 + i, w, h) for i in range(8)], make(-1), args.concurrency))
        rows = measure(args, tower, images, configs, senders, procs)
    report(args, model, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
