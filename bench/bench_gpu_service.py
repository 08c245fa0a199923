"""``visenc serve`` on a GPU with a Qwen2.5-VL-7B-sized checkpoint under prefill-like clients, against the
bare compiled forward of the same images on the same device: cold and hits, 16 and 64 clients.

    python bench/bench_gpu_service.py [--images 96] [--rounds 3] [--clients 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "service"), str(Path(__file__).resolve().parent)]

import _common as c
import _spy
import bench_gpu

#: screenshot sizes the images cycle through
SCREENS = [(1280, 720), (1920, 1080), (2560, 1440), (1366, 768), (1440, 900), (1600, 900)]


#: what a pass's ``/metrics`` deltas say of the device's share of its time (histograms: (sum, count))
HISTOGRAMS = [
    "visenc_forward_launch_seconds",
    "visenc_forward_seconds",
    "visenc_preprocess_seconds",
    "visenc_queue_wait_seconds",
    "visenc_output_seconds",
    "visenc_batch_size_images",
]


def scrape(url: str) -> dict[str, float]:
    """The service's histogram sums and counts (``name_sum``, ``name_count``), its copy-out waits, its busy share."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if any(s.name in (f"{h}_sum", f"{h}_count") for h in HISTOGRAMS) or s.name == "visenc_device_busy_ratio":
                found[s.name] = s.value
            elif s.name == "visenc_device_wait_seconds_sum" and s.labels.get("reason") == "copy-out":
                found["copy_out_wait_s"] = s.value
    return found


def diagnosis(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """One pass's per-forward and per-image means, from the deltas of two scrapes ``seconds`` apart."""

    def mean(h: str) -> float:
        n = after.get(f"{h}_count", 0) - before.get(f"{h}_count", 0)
        return (after.get(f"{h}_sum", 0) - before.get(f"{h}_sum", 0)) / n if n else float("nan")

    forwards = after.get("visenc_forward_seconds_count", 0) - before.get("visenc_forward_seconds_count", 0)
    device_s = after.get("visenc_forward_seconds_sum", 0) - before.get("visenc_forward_seconds_sum", 0)
    return {
        "forwards": forwards,
        "images_per_forward": mean("visenc_batch_size_images"),
        "launch_ms": 1e3 * mean("visenc_forward_launch_seconds"),
        "forward_device_ms": 1e3 * mean("visenc_forward_seconds"),
        "device_share": device_s / seconds,
        "preprocess_ms": 1e3 * mean("visenc_preprocess_seconds"),
        "queue_wait_ms": 1e3 * mean("visenc_queue_wait_seconds"),
        "output_ms": 1e3 * mean("visenc_output_seconds"),
        "copy_out_wait_s": after.get("copy_out_wait_s", 0) - before.get("copy_out_wait_s", 0),
        "busy_ratio": after.get("visenc_device_busy_ratio", float("nan")),
    }


def bare_rate(tower: Any, prepared: list[Any], max_batch_tokens: int, launches: list[float] | None = None) -> float:
    """images/s of the forward alone, in batches of up to ``max_batch_tokens`` patches, in order; each
    batch's launch (host) seconds appended to ``launches``."""
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
        launched = time.perf_counter()
        tower.forward(batch)
        if launches is not None:
            launches.append(time.perf_counter() - launched)
    sync()
    return len(prepared) / (time.perf_counter() - t0)


async def prefill_round(
    url: str, images: list[bytes], clients: int, namespace: str, fetch: bool = True
) -> tuple[float, list[float]]:
    """(images/s, each image's seconds) of ``clients`` prefill-like workers: encode with wait, then fetch
    the rows over HTTP (unless ``fetch`` is false), one image at a time each."""
    from visenc_client import AsyncClient

    todo = list(reversed(images))
    latencies: list[float] = []

    async def worker() -> None:
        async with AsyncClient(url, namespace=namespace, timeout=300) as vc:
            while todo:
                data, t0 = todo.pop(), time.perf_counter()
                (handle,) = await vc.encode([data], wait=True)
                if fetch:
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
    diagnoses: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        c.pause(proc)
        launches: list[float] = []
        bare.append(bare_rate(tower, prepared, args.max_batch_tokens, launches))
        c.resume(proc)
        print(f"round {r}: bare launch {1e3 * statistics.mean(launches):.2f} ms a forward", flush=True)
        for n in args.clients:
            run = runs[f"{n} clients"]
            before, t0 = scrape(url), time.perf_counter()
            with _spy.recorded(proc.pid, args.profile_dir, f"round{r}-{n}") if r == 0 else contextlib.nullcontext():
                cold, latencies = asyncio.run(prefill_round(url, images, n, f"round{r}-{n}"))
            diagnoses[f"round {r}, {n} clients, cold"] = d = diagnosis(before, scrape(url), time.perf_counter() - t0)
            print(f"round {r}: {n} clients cold: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items()), flush=True)
            with (
                _spy.recorded(proc.pid, args.profile_dir, f"round{r}-{n}-hits") if r == 0 else contextlib.nullcontext()
            ):
                hits, _ = asyncio.run(prefill_round(url, images, n, f"round{r}-{n}"))  # the same images again
            run["cold"].append(cold)
            run["hits"].append(hits)
            run["lat"] += latencies
            print(f"round {r}: bare {bare[-1]:.2f} img/s; {n} clients cold {cold:.2f}, hits {hits:.2f}", flush=True)
            if args.encode_only:  # the rows' transfer left out: what the service's forward path alone keeps up
                only, _ = asyncio.run(prefill_round(url, images, n, f"round{r}-{n}-only", fetch=False))
                run.setdefault("encode_only", []).append(only)
                print(f"round {r}: {n} clients cold, encode only (no rows fetched) {only:.2f} img/s", flush=True)
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
        if "encode_only" in run:
            passes[label]["encode_only_img_s"] = statistics.median(run["encode_only"])
    return {"bare_img_s": bare, "passes": passes, "served_compile": served_compile, "diagnoses": diagnoses}


def report(found: dict[str, Any], args: Any, name: str) -> None:
    print(f"{name}, {args.images} distinct screenshots 720p-1440p, {args.rounds} rounds, prefill-like clients")
    print(f"  bare compiled forward: {statistics.median(found['bare_img_s']):.2f} img/s")
    for label, f in found["passes"].items():
        print(
            f"  {label}: cold {f['cold_img_s']:.2f} img/s (p50 {f['p50_s']:.3f} s, p95 {f['p95_s']:.3f} s), "
            f"service / bare forward {f['ratio']:.3f}; hits {f['hits_img_s']:.2f} img/s, "
            f"{f['hits_over_cold']:.1f}x cold"
            + (
                f"; encode only (no rows fetched) {f['encode_only_img_s']:.2f} img/s"
                if "encode_only_img_s" in f
                else ""
            )
        )
    if args.json:
        first = found["passes"][f"{args.clients[0]} clients"]
        print(json.dumps({**found, "ratio": first["ratio"], "device": name}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/visenc-bench-qwen2.5-vl-7b-vision"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--tower", choices=["7b", "tiny"], default="7b")
    p.add_argument("--json", action="store_true")
    p.add_argument("--encode-only", action="store_true", help="also a cold pass that fetches no rows")
    p.add_argument("--profile-dir", type=Path, default=None, help="py-spy the server's first cold pass into here")
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
    report(found, args, torch.cuda.get_device_name() if args.device == "cuda" else "CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
