"""Service throughput, side by side in one run: visenc vs the bare in-process forward,
vs a naive FastAPI handler, and (given its folder) vs the Infinity peer.

All systems get the SAME tower and the SAME JPEGs. Rates (images/s):

* bare       in-process loop: decode + preprocess + forward at the best batch size
             (1..32), one thread: the ceiling a caller reaches without a service;
* forward    the same without decode/preprocess (pure device time, for reference);
* visenc     ``visenc serve``, 8 concurrent clients, one image per request, cold
             (bytes sent, encoded, rows fetched); a fresh namespace per round;
* warm       the same images again: every request is an index hit;
* naive      ``bench/naive_server.py``: per-request preprocess + batch-1 forward;
* infinity   ``infinity_emb v2`` on the same CLIP folder, 8 concurrent single-image clients.

Each round measures every system once, in turn; the printed ratios are medians over rounds.

    python bench/bench_service.py                                  # tiny-clip, 2 rounds
    python bench/bench_service.py --model tiny-qwen2-vl --images 48
    python bench/bench_service.py --infinity /work/peer-infinity   # CLIP folder built by the peer's setup.sh
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "service"), str(Path(__file__).resolve().parent)]

import _common as c  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="registry name or folder (default: tiny-clip, or the "
                   "peer's tiny-clip folder with --infinity)")
    p.add_argument("--images", type=int, default=64, help="distinct images per measurement")
    p.add_argument("--size", default="640x480", help="image size WxH")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--infinity", type=Path, default=None, help="peer folder from shared/peers/infinity/setup.sh")
    p.add_argument("--no-naive", action="store_true")
    p.add_argument("--serve-args", default="", help="extra `visenc serve` flags, e.g. '--max-wait-ms 5'")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()

    import torch

    from visenc.models.loading import load_tower

    peer = args.infinity
    if peer is not None and not (peer / "venv" / "bin" / "infinity_emb").exists():
        print(f"note: no Infinity install under {peer} (run shared/peers/infinity/setup.sh {peer}); "
              "skipping the peer")
        peer = None
    model = args.model or (str(peer / "tiny-clip") if peer else "tiny-clip")
    w, h = (int(x) for x in args.size.split("x"))
    images = [c.jpeg(i, w, h) for i in range(args.images)]
    torch.set_num_threads(os.cpu_count() or 1)
    tower = load_tower(model)
    print(f"model {model} ({tower.describe()['name']}), {args.images} images {args.size}, "
          f"{args.concurrency} concurrent single-image clients, {args.rounds} rounds, {os.cpu_count()} cores")

    rows: dict[str, list[float]] = {}
    logs = Path(tempfile.mkdtemp(prefix="visenc-bench-"))
    vport, nport, iport = c.free_port(), c.free_port(), c.free_port()
    env = c.service_env()
    with c.server(c.visenc_cmd(model, vport, *args.serve_args.split()), f"http://127.0.0.1:{vport}/readyz",
                  env, logs / "visenc.log"):
        for r in range(args.rounds):
            best, bare, rates = c.bare_rate(tower, images)
            _, fwd, _ = c.bare_rate(tower, images, (best[1],), preprocess=False, threads=(best[0],))
            rows.setdefault("bare", []).append(bare)
            rows.setdefault("forward", []).append(fwd)
            print(f"round {r}: bare best (threads {best[0]}, batch {best[1]}): {bare:.1f} img/s "
                  f"({', '.join(f't{t}b{b} {v:.1f}' for (t, b), v in rates.items())}); forward only {fwd:.1f}")
            send = c.visenc_sender(f"http://127.0.0.1:{vport}", f"bench{r}")
            rows.setdefault("visenc", []).append(asyncio.run(c.clients_rate(images, send, args.concurrency)))
            rows.setdefault("warm", []).append(asyncio.run(c.clients_rate(images, send, args.concurrency)))
            print(f"round {r}: visenc cold {rows['visenc'][-1]:.1f}, warm {rows['warm'][-1]:.1f} img/s")
    if not args.no_naive:
        with c.server([c.PYTHON, str(c.ROOT / "bench" / "naive_server.py"), "--model", model, "--port",
                       str(nport)], f"http://127.0.0.1:{nport}/healthz", env, logs / "naive.log"):
            for _ in range(args.rounds):
                rows.setdefault("naive", []).append(asyncio.run(c.clients_rate(
                    images, c.raw_sender(f"http://127.0.0.1:{nport}/encode"), args.concurrency)))
            print(f"naive: {', '.join(f'{x:.1f}' for x in rows['naive'])} img/s")
    if peer is not None:
        infinity_env = {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
                        "INFINITY_HOME": str(peer / "infhome")}
        cmd = [str(peer / "venv" / "bin" / "infinity_emb"), "v2", "--model-id", model, "--device", "cpu",
               "--engine", "torch", "--host", "127.0.0.1", "--port", str(iport), "--batch-size", "32",
               "--no-vector-disk-cache", "--no-compile"]
        name = "/".join(Path(model).parts[-2:])
        with c.server(cmd, f"http://127.0.0.1:{iport}/health", infinity_env, logs / "infinity.log"):
            send = c.infinity_sender(f"http://127.0.0.1:{iport}", name)
            asyncio.run(c.clients_rate(images[:8], send, args.concurrency))  # first-request warm-up
            for _ in range(args.rounds):
                rows.setdefault("infinity", []).append(asyncio.run(c.clients_rate(images, send, args.concurrency)))
                rows.setdefault("infinity_repeat", []).append(
                    asyncio.run(c.clients_rate(images, send, args.concurrency)))
            print(f"infinity: {', '.join(f'{x:.1f}' for x in rows['infinity'])} img/s cold, "
                  f"{', '.join(f'{x:.1f}' for x in rows['infinity_repeat'])} repeated")

    med = {k: statistics.median(v) for k, v in rows.items()}
    print("\nmedian images/s: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    ratios = {
        "visenc / bare (goal >= 0.9)": med["visenc"] / med["bare"],
        "visenc / forward-only": med["visenc"] / med["forward"],
        "visenc warm / cold": med["warm"] / med["visenc"],
    }
    if "naive" in med:
        ratios["visenc / naive"] = med["visenc"] / med["naive"]
    if "infinity" in med:
        ratios["visenc / infinity cold (goal >= 1.2)"] = med["visenc"] / med["infinity"]
        ratios["infinity / bare"] = med["infinity"] / med["bare"]
        ratios["visenc warm / infinity repeated"] = med["warm"] / med["infinity_repeat"]
    for k, v in ratios.items():
        print(f"  {k:40s} {v:6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"model": model, "images_per_s": med, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
