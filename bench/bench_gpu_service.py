"""``visenc serve`` on a GPU with a Qwen2.5-VL-7B-sized checkpoint under prefill-like clients, against the
bare compiled forward of the same images on the same device: cold and hits, 16 and 64 clients.

    python bench/bench_gpu_service.py [--images 96] [--rounds 3] [--clients 16 64]
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

import _common as c
import bench_gpu

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


async def prefill_round(url: str, images: list[bytes], clients: int, namespace: str) -> tuple[float, list[float]]:
    """(images/s, each image's seconds) of ``clients`` prefill-like workers: encode with wait, then fetch
    the rows over HTTP, one image at a time each."""
    from visenc_client import AsyncClient

    todo = list(reversed(images))
    latencies: list[float] = []

    async def worker() -> None:
        async with AsyncClient(url, namespace=namespace, timeout=300) as vc:
            while todo:
                data, t0 = todo.pop(), time.perf_counter()
                (handle,) = await vc.encode([data], wait=True)
                await vc.fetch(handle, 0, handle.num_tokens)
                latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return len(images) / (time.perf_counter() - t0), latencies


def measure(proc: Any, port: int, tower: Any, prepared: list[Any], images: list[bytes], args: Any) -> dict[str, Any]:
    """Rounds of the bare forward (the server paused), then each client count's cold and hits passes."""
    url = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(f"{url}/readyz", timeout=10) as r:
        served_compile = json.loads(r.read())["compile"]
    print(f"served tower: {served_compile}", flush=True)  # eager here would make the ratios below meaningless
    asyncio.run(prefill_round(url, images[: max(args.clients)], max(args.clients), "warm"))
    bare: list[float] = []
    runs: dict[str, dict[str, list[float]]] = {
        f"{n} clients": {"cold": [], "hits": [], "lat": []} for n in args.clients
    }
    for r in range(args.rounds):
        c.pause(proc)
        bare.append(bare_rate(tower, prepared, args.max_batch_tokens))
        c.resume(proc)
        for n in args.clients:
            run = runs[f"{n} clients"]
            cold, latencies = asyncio.run(prefill_round(url, images, n, f"round{r}-{n}"))
            hits, _ = asyncio.run(prefill_round(url, images, n, f"round{r}-{n}"))  # the same images again
            run["cold"].append(cold)
            run["hits"].append(hits)
            run["lat"] += latencies
            print(f"round {r}: bare {bare[-1]:.2f} img/s; {n} clients cold {cold:.2f}, hits {hits:.2f}", flush=True)
    passes = {}
    for label, run in runs.items():
        lat = sorted(run["lat"])
        passes[label] = {
            "cold_img_s": statistics.median(run["cold"]),
            "hits_img_s": statistics.median(run["hits"]),
            "ratio": statistics.median(cold / b for cold, b in zip(run["cold"], bare)),
            "hits_over_cold": statistics.median(h / cold for h, cold in zip(run["hits"], run["cold"])),
            "p50_s": lat[len(lat) // 2],
            "p95_s": lat[int(0.95 * (len(lat) - 1))],
        }
    return {"bare_img_s": bare, "passes": passes, "served_compile": served_compile}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, nargs="+", default=[16, 64])
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
    log = path.with_name(f"{path.name}-serve.log")  # the server's own output, printed if it never answers
    try:
        with c.server(
            c.visenc_cmd(str(path), port, *flags), f"http://127.0.0.1:{port}/readyz", c.service_env(), log
        ) as proc:
            found = measure(proc, port, tower, prepared, images, args)
    except RuntimeError:
        print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:]), file=sys.stderr)
        raise
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}, {args.images} distinct screenshots 720p-1440p, {args.rounds} rounds, prefill-like clients")
    print(f"  bare compiled forward: {statistics.median(found['bare_img_s']):.2f} img/s")
    for label, f in found["passes"].items():
        print(
            f"  {label}: cold {f['cold_img_s']:.2f} img/s (p50 {f['p50_s']:.3f} s, p95 {f['p95_s']:.3f} s), "
            f"service / bare forward {f['ratio']:.3f}; hits {f['hits_img_s']:.2f} img/s, "
            f"{f['hits_over_cold']:.1f}x cold"
        )
    if args.json:
        first = found["passes"][f"{args.clients[0]} clients"]
        print(json.dumps({**found, "ratio": first["ratio"], "device": name}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
