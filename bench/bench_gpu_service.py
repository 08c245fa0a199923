"""``visenc serve`` on a GPU with a Qwen2.5-VL-7B-sized checkpoint: cold images/s of 16 clients
sending distinct screenshots, against the bare compiled forward of the same images on the same
device, and the clients' latency percentiles.

The checkpoint (seeded random bf16 weights, Qwen2.5-VL-7B's vision config, ``bench_gpu.py``) is
written once to ``--checkpoint``. Screenshots are JPEGs from 720p to 1440p, all distinct. Each
round: the bare loop (the same images preprocessed beforehand, then forwarded in batches of up to
``max_batch_tokens`` patches, as the service's scheduler forms them, through a compiled and warmed
tower in this process), then the service under 16 clients (each one image per ``/v1/encode`` with
``wait``, in a fresh namespace: every image cold). The service runs with its defaults (compiled,
warmed before it is ready).

Prints "no CUDA device" and exits 0 where there is none, unless ``--device cpu`` (with ``--tower
tiny``: a smoke run of this script's own code).

    python bench/bench_gpu_service.py [--images 96] [--rounds 3] [--clients 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "service"), str(Path(__file__).resolve().parent)]

import _common as c  # noqa: E402
import bench_gpu  # noqa: E402

#: screenshot sizes the images cycle through
SCREENS = [(1280, 720), (1920, 1080), (2560, 1440), (1366, 768), (1440, 900), (1600, 900)]


def bare_rate(tower: Any, prepared: list[Any], max_batch_tokens: int) -> float:
    """images/s of the forward alone, in batches of up to ``max_batch_tokens`` patches, in order."""
    import torch

    batches: list[list[Any]] = [[]]
    for p in prepared:
        if (
            batches[-1]
            and sum(tower.input_tokens(x.layout) for x in batches[-1]) + tower.input_tokens(p.layout) > max_batch_tokens
        ):
            batches.append([])
        batches[-1].append(p)
    sync = torch.cuda.synchronize if tower.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for batch in batches:
        tower.forward(batch)
    sync()
    return len(prepared) / (time.perf_counter() - t0)


async def service_round(url: str, images: list[bytes], clients: int, namespace: str) -> tuple[float, list[float]]:
    """(images/s, each request's seconds) of ``clients`` concurrent single-image cold encodes."""
    send = c.visenc_sender(url, namespace, inline=False)
    latencies: list[float] = []

    async def timed(client: Any, data: bytes) -> None:
        t0 = time.perf_counter()
        await send(client, data)
        latencies.append(time.perf_counter() - t0)

    rate = await c.clients_rate(images, timed, clients)
    return rate, latencies


def measure(
    proc: Any,
    port: int,
    tower: Any,
    prepared: list[Any],
    images: list[bytes],
    args: Any,
    bare: list[float],
    served: list[float],
    latencies: list[float],
) -> Any:
    """Rounds of the served rate, each beside the bare forward with the server paused; the served
    tower's compile status."""
    url = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(f"{url}/readyz", timeout=10) as r:
        served_compile = json.loads(r.read())["compile"]
    print(f"served tower: {served_compile}")  # eager here would make the ratio below meaningless
    asyncio.run(service_round(url, images[: args.clients], args.clients, "warm"))
    for r in range(args.rounds):
        c.pause(proc)
        bare.append(bare_rate(tower, prepared, args.max_batch_tokens))
        c.resume(proc)
        rate, lat = asyncio.run(service_round(url, images, args.clients, f"round{r}"))
        served.append(rate)
        latencies += lat
    return served_compile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/visenc-bench-qwen2.5-vl-7b-vision"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--tower", choices=["7b", "tiny"], default="7b")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    from visenc.config import Settings
    from visenc.imaging.decode import decode
    from visenc.models import compiled
    from visenc.models.loading import load_tower

    vision = bench_gpu.QWEN2_5_VL_7B_VISION if args.tower == "7b" else bench_gpu.TINY_VISION
    path = c.write_qwen25_checkpoint(args.checkpoint.with_name(f"{args.checkpoint.name}-{args.tower}"), vision)
    images = [c.jpeg(i, *SCREENS[i % len(SCREENS)]) for i in range(args.images)]
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    tower = load_tower(str(path), device=args.device, dtype=dtype)
    tower.compile()
    with compiled.backend_failures() as failures:
        tower.warm_up()
    print(f"bare tower: {compiled.graphs()} graphs" + (f", compile failures: {failures[:1]}" if failures else ""))
    prepared = [tower.preprocess(decode(b, max_pixels=1 << 30)) for b in images]
    args.max_batch_tokens = Settings().max_batch_tokens
    bare_rate(tower, prepared, args.max_batch_tokens)  # every batch shape once
    port = c.free_port()
    flags = ["--device", args.device, "--dtype", dtype, "--compile", "on"]
    bare: list[float] = []
    served: list[float] = []
    latencies: list[float] = []
    log = path.with_name(f"{path.name}-serve.log")  # the server's own output, printed if it never answers
    try:
        with c.server(
            c.visenc_cmd(str(path), port, *flags), f"http://127.0.0.1:{port}/readyz", c.service_env(), log
        ) as proc:
            served_compile = measure(proc, port, tower, prepared, images, args, bare, served, latencies)
    except RuntimeError:
        print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:]), file=sys.stderr)
        raise
    ratios = [s / b for s, b in zip(served, bare)]
    latencies.sort()
    p50, p95 = (latencies[int(q * (len(latencies) - 1))] for q in (0.5, 0.95))
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}, {args.images} distinct screenshots 720p-1440p, {args.clients} clients, {args.rounds} rounds")
    print(f"  bare compiled forward: {statistics.median(bare):.2f} img/s")
    print(f"  visenc serve, cold:    {statistics.median(served):.2f} img/s  (p50 {p50:.3f} s, p95 {p95:.3f} s)")
    print(f"  service / bare forward: {c.spread(ratios)}")
    if args.json:
        report = {"bare_img_s": bare, "served_img_s": served, "ratio": statistics.median(ratios), "p50_s": p50}
        print(json.dumps({**report, "p95_s": p95, "device": name, "served_compile": served_compile}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
