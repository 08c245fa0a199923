"""Shared bench plumbing: images, servers in subprocesses, concurrent single-image clients.

Every figure a bench prints is a ratio of rates measured in the same run, so
the noise of a shared machine cancels as far as it can.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
if str(ROOT) not in sys.path:  # harness: the waits and the free port the tests use too
    sys.path.insert(0, str(ROOT))

from harness.waits import free_port, wait_ready  # benches call c.free_port, c.wait_ready


def spread(values: list[float], unit: str = "x") -> str:
    """A ratio over rounds as reported everywhere: median, with min and max and the number of rounds."""
    import statistics

    return f"{statistics.median(values):.2f}{unit} (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def jpeg(seed: int, width: int = 640, height: int = 480) -> bytes:
    """A photo-like JPEG (gradients plus blocky noise), different for every seed; cheap to make."""
    rng = np.random.default_rng(seed)
    row = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    col = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    mix = rng.uniform(0.2, 1.0, (1, 1, 3)).astype(np.float32)
    noise = rng.integers(0, 40, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    noise = np.repeat(np.repeat(noise, 8, axis=0), 8, axis=1)[:height, :width]
    arr = ((row * mix + col * (1 - mix)) * 0.8).astype(np.uint8) + noise
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="JPEG", quality=85)
    return buf.getvalue()


@contextlib.contextmanager
def server(
    cmd: list[str], health_url: str, env: dict[str, str] | None = None, log: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a server subprocess until the block ends (terminate, then kill)."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(
        cmd, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_ready(health_url, proc, timeout_s=180.0, path="")
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)  # a paused server cannot handle SIGTERM
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        if log:
            out.close()  # type: ignore[union-attr]


def pause(proc: subprocess.Popen[bytes]) -> None:
    """Freeze a server started by ``server`` (and its children) so it takes no CPU."""
    os.killpg(proc.pid, signal.SIGSTOP)


def resume(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGCONT)


def visenc_cmd(model: str, port: int, *extra: str) -> list[str]:
    return [PYTHON, "-m", "visenc", "serve", "--model", model, "--port", str(port), "--log-level", "warning", *extra]


def service_env(tree: Path = ROOT) -> dict[str, str]:
    """The project (this one, or another source ``tree``) on the server's path, ahead of (never instead of)
    the caller's own entries."""
    paths = [str(tree / "service"), str(tree / "clients"), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


Send = Callable[[aiohttp.ClientSession, bytes], Awaitable[None]]


async def in_flight(items: list[bytes], concurrency: int, send: Callable[[bytes], Awaitable[None]]) -> None:
    """``concurrency`` senders, each taking the next item until all are sent (first item first)."""
    queue = list(reversed(items))

    async def one() -> None:
        while queue:
            await send(queue.pop())

    await asyncio.gather(*(one() for _ in range(concurrency)))


async def clients_rate(images: list[bytes], send: Send, concurrency: int = 8) -> float:
    """images/s for ``concurrency`` clients, each sending one image per request until all are sent
    (aiohttp: a fifth of httpx's CPU a request, ``bench/bench_client.py``)."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300.0)) as client:
        t0 = time.perf_counter()
        await in_flight(images, concurrency, lambda data: send(client, data))
        return len(images) / (time.perf_counter() - t0)


def serve_checkpoint(
    stack: contextlib.ExitStack, checkpoint: Path, *flags: str, env: dict[str, str] | None = None
) -> str:
    """``visenc serve`` of ``checkpoint`` in bf16 on a free loopback port until ``stack`` closes: its URL."""
    port = free_port()
    cmd = visenc_cmd(str(checkpoint), port, "--dtype", "bfloat16", *flags)
    stack.enter_context(server(cmd, f"http://127.0.0.1:{port}/readyz", service_env() if env is None else env))
    return f"http://127.0.0.1:{port}"


def encode_request(data: bytes, namespace: str, inline: bool = True) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a one-image ``/v1/encode`` that waits (msgpack both ways)."""
    import msgpack

    body = msgpack.packb({"items": [{"data": data}], "wait": True, "include_rows": inline})
    return body, {
        "Content-Type": "application/msgpack",
        "Accept": "application/msgpack",
        "X-Visenc-Namespace": namespace,
    }


def visenc_sender(base: str, namespace: str, inline: bool = True) -> Send:
    """Cold encode with the bytes (msgpack), wait, and get the rows; ``inline``: in the encode answer."""
    import msgpack

    async def send(client: aiohttp.ClientSession, data: bytes) -> None:
        body, headers = encode_request(data, namespace, inline)
        async with client.post(f"{base}/v1/encode", data=body, headers=headers, raise_for_status=True) as r:
            item = msgpack.unpackb(await r.read())["items"][0]
        if item["status"] != "ready" or (inline and not item.get("rows")):
            raise RuntimeError(f"visenc answered {item}")
        if not inline:
            url = f"{base}/v1/embeddings/{item['hash']}"
            async with client.get(url, headers={"X-Visenc-Namespace": namespace}, raise_for_status=True) as r:
                await r.read()

    return send


def serve_rates(
    model: str,
    configs: list[tuple[dict[str, str], list[str]]],
    images: list[bytes],
    rounds: int,
    concurrency: int = 8,
    inline: bool = True,
) -> list[list[float]]:
    """Cold images/s of ``visenc serve`` under each (environment, flags) configuration, per round; the
    servers not measured are paused (an idle server still polls). ``inline``: as ``visenc_sender``'s."""
    with contextlib.ExitStack() as stack:
        servers = []
        for env, flags in configs:
            port = free_port()
            cmd = visenc_cmd(model, port, *flags)
            proc = stack.enter_context(server(cmd, f"http://127.0.0.1:{port}/readyz", {**service_env(), **env}))
            servers.append((proc, f"http://127.0.0.1:{port}"))
            asyncio.run(clients_rate(images[:concurrency], visenc_sender(servers[-1][1], "warm", inline), concurrency))
            pause(proc)
        rates: list[list[float]] = [[] for _ in configs]
        for r in range(rounds):
            order = range(len(servers)) if r % 2 == 0 else reversed(range(len(servers)))
            for i in order:
                proc, url = servers[i]
                resume(proc)
                send = visenc_sender(url, f"r{r}", inline)
                rates[i].append(asyncio.run(clients_rate(images, send, concurrency)))
                pause(proc)
    return rates


def raw_sender(url: str) -> Send:
    async def send(client: aiohttp.ClientSession, data: bytes) -> None:
        headers = {"Content-Type": "application/octet-stream"}
        async with client.post(url, data=data, headers=headers, raise_for_status=True) as r:
            await r.read()

    return send


def infinity_sender(base: str, model: str) -> Send:
    async def send(client: aiohttp.ClientSession, data: bytes) -> None:
        uri = "data:image/jpeg;base64," + base64.b64encode(data).decode()
        doc = {"model": model, "modality": "image", "input": [uri]}
        async with client.post(f"{base}/embeddings", json=doc, raise_for_status=True) as r:
            await r.read()

    return send


def bare_rate(
    tower: Any,
    images: list[bytes],
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    *,
    preprocess: bool = True,
    threads: tuple[int, ...] | None = None,
) -> tuple[tuple[int, int], float, dict[tuple[int, int], float]]:
    """Decode + preprocess (if asked) + forward in one thread at each (torch threads, batch size): the
    best (threads, batch), its images/s, and every rate."""
    import torch

    from visenc.imaging.decode import decode

    def prep(b: bytes) -> Any:
        return tower.preprocess(decode(b, max_pixels=1 << 30))

    prepared = None if preprocess else [prep(b) for b in images]
    before = torch.get_num_threads()
    rates: dict[tuple[int, int], float] = {}
    try:
        for nt in threads or sorted({1, os.cpu_count() or 1}):
            torch.set_num_threads(nt)
            for bs in batch_sizes:
                t0 = time.perf_counter()
                for i in range(0, len(images), bs):
                    chunk = [prep(b) for b in images[i : i + bs]] if prepared is None else prepared[i : i + bs]
                    tower.forward(chunk)
                rates[(nt, bs)] = len(images) / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    best = max(rates, key=lambda k: rates[k])
    return best, rates[best], rates


def write_qwen25_checkpoint(path: Path, vision: dict[str, Any], seed: int = 0, max_pixels: int = 12845056) -> Path:
    """A Qwen2.5-VL vision-only checkpoint folder with ``vision`` as its config and seeded weights
    (kept when it exists)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    if (path / "model.safetensors").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    text = {"hidden_size": vision["out_hidden_size"], "num_hidden_layers": 1}  # never built: only its width
    config = Qwen2_5_VLConfig(vision_config=vision, text_config=text)
    config.save_pretrained(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VisionTransformerPretrainedModel(config.vision_config)
    state = {f"model.visual.{k}": v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": 56 * 56,
        "max_pixels": max_pixels,
        "patch_size": vision["patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
    }
    (path / "preprocessor_config.json").write_text(__import__("json").dumps(processor))
    return path
