"""The cost of ``visenc proxy``'s hop, alone: the same chat request (``--images`` screenshots as data
URLs, an agent's turn) sent straight to an upstream and through the proxy, alternating, against an
upstream that answers at once (a stand-in for vLLM, so only the hop is timed) and a real visenc
(tiny tower) the proxy hands the images to after each answer, as deployed.

    .venv/bin/python bench/bench_proxy.py [--images 8] [--rounds 40] [--size 1280x720]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common as c

ANSWER = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}}],
    }
).encode()


def upstream(port: int) -> None:
    """An OpenAI-shaped server that reads the body and answers one token at once."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def body(datas: list[bytes]) -> bytes:
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(d).decode()}}
        for d in datas
    ]
    content = [*parts, {"type": "text", "text": "What next?"}]
    return json.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": content}]}).encode()


def proxy_cmd(port: int, visenc: str, upstream: str) -> list[str]:
    flags = ["--port", str(port), "--log-level", "warning", "--visenc", visenc, "--upstream", upstream]
    return [sys.executable, "-m", "visenc", "proxy", *flags]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--size", default="1280x720")
    p.add_argument("--upstream-server", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.upstream_server:
        upstream(args.upstream_server)
        return 0
    size = tuple(int(x) for x in args.size.split("x"))
    ports = {k: c.free_port() for k in ("visenc", "upstream", "proxy")}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    datas = [c.jpeg(700 + i, *size) for i in range(args.images)]
    payload = body(datas)
    headers = {"content-type": "application/json"}
    with (
        c.server(c.visenc_cmd("tiny-qwen2-vl", ports["visenc"]), urls["visenc"] + "/readyz", c.service_env()),
        c.server([sys.executable, __file__, "--upstream-server", str(ports["upstream"])], urls["upstream"] + "/health"),
        c.server(
            proxy_cmd(ports["proxy"], urls["visenc"], urls["upstream"]),
            urls["proxy"] + "/health",
            c.service_env(),
        ) as proxy,
        httpx.Client(timeout=60) as client,
    ):
        cpu = psutil.Process(proxy.pid)

        def timed(url: str) -> float:
            t0 = time.perf_counter()
            r = client.post(url + "/v1/chat/completions", content=payload, headers=headers)
            elapsed = time.perf_counter() - t0
            r.raise_for_status()
            return elapsed

        for _ in range(3):  # warm-up: visenc holds the images after the first
            timed(urls["proxy"])
            time.sleep(0.5)
        hops = []
        cpu_before = sum(cpu.cpu_times()[:2])
        for _ in range(args.rounds):
            time.sleep(0.05)  # the background hand-over of the previous round is through
            direct = timed(urls["upstream"])
            through = timed(urls["proxy"])
            hops.append((through - direct) * 1e3)
        time.sleep(0.3)
        cpu_ms = (sum(cpu.cpu_times()[:2]) - cpu_before) * 1e3 / args.rounds
    mb = len(payload) / 1e6
    print(f"{args.images} screenshots {args.size} ({mb:.1f} MB body), {args.rounds} alternating rounds:")
    print(f"  proxy hop      {statistics.median(hops):6.2f} ms (min {min(hops):.2f}, max {max(hops):.2f})")
    print(f"  proxy CPU/req  {cpu_ms:6.2f} ms (the hand-over to visenc after the answer included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
