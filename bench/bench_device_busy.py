"""Busy share of the simulated device (``models/sim.py``), served by ``visenc serve --model sim:...``,
under prefill-like clients; images a forward; host bytes the device thread copies an image.

python bench/bench_device_busy.py [--before /tmp/visenc-before] [--rounds 3] [--clients 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "service"), str(Path(__file__).resolve().parent)]

import _common as c

from visenc.models.sim import Span, stats
from visenc_client import AsyncClient

SPEC = "sim:launch_ms={launch_ms:g},token_us={token_us:g},patch=16,hidden={hidden},sync={sync}"


async def prefill_pass(url: str, images: list[bytes], clients: int, namespace: str) -> tuple[float, float, float]:
    """(images/s, monotonic start, when the last image was sent: until then every client was sending)."""
    todo = list(reversed(images))
    last_sent = [0.0]

    async def client() -> None:
        async with AsyncClient(url, namespace=namespace) as vc:
            while todo:
                image = todo.pop()
                last_sent[0] = time.monotonic()
                (handle,) = await vc.encode([image], wait=True)
                rows = await vc.fetch(handle, 0, handle.num_tokens)
                assert rows.shape[0] == handle.num_tokens, rows.shape

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    return len(images) / (time.monotonic() - t0), t0, last_sent[0]


def read_spans(path: Path, start: float, end: float) -> list[Span]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line]
    spans = [Span(**x) for x in lines if "images" in x]  # the rest: the device thread's waits
    return [s for s in spans if s.start >= start and s.end <= end]


def one_pass(
    env: dict[str, str], args: argparse.Namespace, case: tuple[int, float, int], images: list[bytes], tag: str
) -> dict[str, float]:
    clients, hog_ms, sync = case
    with tempfile.TemporaryDirectory(prefix="visenc-busy-") as tmp:
        timeline, port = Path(tmp) / "timeline.jsonl", c.free_port()
        spec = (
            SPEC.format(launch_ms=args.launch_ms, token_us=args.token_us, hidden=args.hidden, sync=sync)
            + f",timeline={timeline}"
        )
        cmd = [c.PYTHON, str(Path(__file__).with_name("_sim_serve.py")), "--hog-ms", str(hog_ms), "--"]
        cmd += ["--model", spec, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        url = f"http://127.0.0.1:{port}"
        with c.server(cmd, f"{url}/readyz", env, Path(tmp) / "serve.log"):
            warm = [c.jpeg(10**6 + i, args.size, args.size) for i in range(clients)]
            asyncio.run(prefill_pass(url, warm, clients, "warm"))
            rate, t0, first_end = asyncio.run(prefill_pass(url, images, clients, tag))
            found = stats(read_spans(timeline, t0, first_end))
    return {**found, "img_s": rate}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, default=None, help="another source tree, side by side")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    p.add_argument("--images", type=int, default=192, help="distinct images a pass (3 times the clients)")
    p.add_argument("--hog-ms", type=float, default=20.0)
    p.add_argument("--size", type=int, default=512, help="side of the square JPEGs (16 pixels a token)")
    p.add_argument("--token-us", type=float, default=100.0, help="device time a token")
    p.add_argument("--launch-ms", type=float, default=1.0, help="host time of a launch (Python, the GIL held)")
    p.add_argument("--hidden", type=int, default=64, help="row width (3584: a 7B model's, rows of real size)")
    p.add_argument("--sync", type=int, nargs="+", default=[0], help="0: async launch, 1: forward with a host sync")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    host_bytes()
    trees = {"now": c.service_env()}
    if args.before is not None:
        trees["before"] = c.service_env(args.before)
    results: dict[str, list[dict[str, float]]] = {}
    seed = 0
    cases = [(n, hog, sync) for sync in args.sync for n in args.clients for hog in (0.0, args.hog_ms)]
    for r in range(args.rounds):
        for case in cases:
            for tree, env in trees.items():
                images = [c.jpeg(seed + i, args.size, args.size) for i in range(args.images)]
                seed += args.images
                found = one_pass(env, args, case, images, f"r{r}-{tree}-{seed}")
                forward = "sync forward" if case[2] else "async launch"
                label = f"{tree}, {forward}, {case[0]} clients, loop busy {case[1]:g}/40 ms"
                results.setdefault(label, []).append(found)
                print(f"round {r}: {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in found.items()), flush=True)
    spec = SPEC.format(launch_ms=args.launch_ms, token_us=args.token_us, hidden=args.hidden, sync="0|1")
    print(f"\nsimulated device {spec}, {args.size}x{args.size} JPEGs, {args.images} distinct images a pass")
    summary: dict[str, dict[str, float]] = {}
    for label, runs in results.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        summary[label] = med
        busy = c.spread([run["busy_share"] for run in runs], "")
        print(
            f"  {label:<56} busy {busy}; idle: late {med['late_share']:.3f}, launch "
            f"{med['launch_share']:.3f}; {med['images_per_forward']:.2f} images a forward"
        )
    if args.json:
        print(json.dumps({"busy": summary}))
    return 0


def host_bytes() -> None:
    """Host bytes copied an image at launch, by the former path (``np.concatenate`` of the batch's float32
    inputs, then ``pin_memory``) and now (staged once by preprocessing in the input dtype: the device reads it)."""
    import numpy as np
    import torch

    from visenc.imaging.decode import decode
    from visenc.models.loading import load_tower

    tower = load_tower("tiny-qwen2-vl", dtype="bfloat16")
    images = [decode(c.jpeg(7 + i, 1920, 1080), max_pixels=10**9) for i in range(4)]
    prepared = [tower.preprocess(im) for im in images]
    for n in (1, 4):
        arrays = [p.pixels for p in prepared[:n]]
        packed = np.concatenate(arrays) if n > 1 else arrays[0]
        before = (packed.nbytes if n > 1 else 0) + packed.nbytes  # the concatenation, then the pinned copy
        staged = [tower.stage(p) for p in prepared[:n]]
        copied = tower.runtime.host_bytes_copied
        with torch.inference_mode():
            tower.forward(staged)
        now = tower.runtime.host_bytes_copied - copied
        written = sum(s.pixels.nbytes for s in staged)
        print(
            f"host bytes an image at launch, 1080p x{n} ({tower.name}, bfloat16): before {before / n / 1e6:.1f} MB, "
            f"now {now / n / 1e6:.1f} MB; written once by preprocessing now {written / n / 1e6:.1f} MB",
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())
