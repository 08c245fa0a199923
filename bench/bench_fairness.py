"""Tenants sharing one simulated device (``models/sim.py``): a flood does not hold an interactive tenant back.

python bench/bench_fairness.py [--image-ms 25] [--seconds 20] [--json]

Three passes, each on a fresh server, timed from the device's own timeline:
  alone:  tenant B sends interactive images at 20% of the device's capacity;
  flood:  tenant A floods batch work at 10x capacity (8 images a request), B as before;
  equal:  tenants C and D both flood.
B's time to rows (encode that waits, rows inline) is compared with its bound: B alone's p95 plus three of the
longest forwards of the flood pass (the one running when B's image arrives, the one launched behind it, its own).
Tenants are told apart on the timeline by their images' token counts (256 and 240).
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
import aiohttp
import msgpack
from harness.waits import metric

from visenc.models.sim import Span, stats

SPEC = "sim:launch_ms=1,token_us={token_us:g},patch=16,max_side=256,hidden=64"
#: the two image sizes, in tokens: 16 x 16 and 15 x 16 patches
SIDES = {256: (256, 256), 240: (256, 240)}
SERVE = ["--max-batch-tokens", "2048", "--prefetch-tokens", "4096", "--tenant-max-images", "64", "--max-wait-ms", "2"]


class Tenant:
    """Open-loop sender: ``rate`` images a second, ``per`` a request, for ``seconds``; latencies and statuses."""

    def __init__(self, name: str, tokens: int, priority: str, rate: float, per: int, seed: int) -> None:
        self.name, self.tokens, self.priority, self.rate, self.per, self.seed = name, tokens, priority, rate, per, seed
        self.latencies: list[tuple[float, float]] = []  # (sent at, seconds to rows)
        self.statuses: dict[int, int] = {}
        self.bodies: list[list[bytes]] = []

    def prepare(self, seconds: float) -> None:
        """Every request's images, made before the clock starts."""
        w, h = SIDES[self.tokens]
        n = int(self.rate * seconds / self.per) + 1
        self.bodies = [[c.jpeg(self.seed + i * self.per + k, w, h) for k in range(self.per)] for i in range(n)]

    async def run(self, session: aiohttp.ClientSession, url: str) -> None:
        bodies, self.bodies = self.bodies, []
        headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
        headers |= {"X-Visenc-Namespace": self.name, "X-Visenc-Priority": self.priority}
        tasks, t0 = [], time.monotonic()
        for i, images in enumerate(bodies):
            await asyncio.sleep(max(0.0, t0 + i * self.per / self.rate - time.monotonic()))
            body = msgpack.packb({"items": [{"data": d} for d in images], "include_rows": True})
            tasks.append(asyncio.create_task(self._send(session, url, body, headers)))
        await asyncio.gather(*tasks)

    async def _send(self, session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> None:
        sent = time.monotonic()
        async with session.post(f"{url}/v1/encode", data=body, headers=headers) as r:
            await r.read()
            self.statuses[r.status] = self.statuses.get(r.status, 0) + 1
        if r.status == 200:
            self.latencies.append((sent, time.monotonic() - sent))

    def p95(self, after: float) -> float:
        kept = sorted(s for at, s in self.latencies if at >= after)
        return kept[int(0.95 * (len(kept) - 1))] if kept else float("nan")


def one_pass(args: argparse.Namespace, tenants: list[Tenant], tag: str) -> tuple[list[Span], float, dict[str, float]]:
    """Serve, send every tenant's load at once; the spans after the warm-up, its start, the refusals counted."""
    with tempfile.TemporaryDirectory(prefix="visenc-fair-") as tmp:
        timeline, port = Path(tmp) / "timeline.jsonl", c.free_port()
        spec = SPEC.format(token_us=args.token_us) + f",timeline={timeline}"
        cmd = [c.PYTHON, str(Path(__file__).with_name("_sim_serve.py")), "--", "--model", spec, *SERVE]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        url = f"http://127.0.0.1:{port}"
        for t in tenants:
            t.prepare(args.seconds)
        with c.server(cmd, f"{url}/readyz", c.service_env(), Path(tmp) / "serve.log"):

            async def drive() -> tuple[float, str]:
                connector = aiohttp.TCPConnector(limit=0)
                async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(300)) as s:
                    warm_from = time.monotonic() + args.warm_up_s
                    await asyncio.gather(*(t.run(s, url) for t in tenants))
                    async with s.get(f"{url}/metrics") as r:
                        return warm_from, await r.text()

            warm_from, metrics = asyncio.run(drive())
        spans = [Span(**json.loads(line)) for line in timeline.read_text().splitlines() if line]
    end = warm_from + args.seconds - args.warm_up_s  # the senders' last second: every tenant still sends
    refused = {t.name: metric(metrics, "visenc_refusals_total", tenant=t.name) for t in tenants}
    print(f"{tag}: " + "; ".join(f"{t.name} {dict(sorted(t.statuses.items()))}" for t in tenants), flush=True)
    return [s for s in spans if warm_from <= s.start and s.end <= end], warm_from, refused


def token_shares(spans: list[Span]) -> tuple[float, float]:
    """Device time of the 256-token and the 240-token images (a span's time is linear in its tokens)."""
    small = sum((256 * s.images - s.tokens) / 16 for s in spans)
    big = sum(s.images for s in spans) - small
    a, b = 256 * big, 240 * small
    return a / (a + b), b / (a + b)


def one_round(args: argparse.Namespace, capacity: float, r: int) -> dict[str, float]:
    """B alone, then A's flood beside B, side by side: B's p95 against its bound, the device's busy share."""
    b_rate, seed = 0.2 * capacity, 10**7 * r
    alone = Tenant("b", 240, "interactive", b_rate, 1, seed)
    _, alone_from, _ = one_pass(args, [alone], f"round {r}, alone")
    flood = Tenant("a", 256, "batch", 10 * capacity, 8, seed + 10**6)
    b = Tenant("b", 240, "interactive", b_rate, 1, seed + 10**5)
    spans, warm_from, refused = one_pass(args, [flood, b], f"round {r}, flood")
    longest = max(s.end - s.start for s in spans)
    return {
        "b_alone_p95_s": alone.p95(alone_from),
        "b_flood_p95_s": b.p95(warm_from),
        "longest_forward_s": longest,
        "b_p95_over_bound": b.p95(warm_from) / (alone.p95(alone_from) + 3 * longest),
        "device_busy": stats(spans)["busy_share"],
        "a_refused": refused["a"],
        "a_answered": flood.statuses.get(200, 0),
        "b_refused": refused["b"] + sum(n for code, n in b.statuses.items() if code != 200),
    }


def equal_shares(args: argparse.Namespace, capacity: float) -> tuple[float, float]:
    """Two tenants flooding at equal weight: each one's share of the device's time."""
    c1, c2 = (
        Tenant("c", 256, "batch", 5 * capacity, 8, 2 * 10**8),
        Tenant("d", 240, "batch", 5 * capacity, 8, 3 * 10**8),
    )
    spans, _, _ = one_pass(args, [c1, c2], "equal")
    return token_shares(spans)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image-ms", type=float, default=25.0, help="device time of one 256-token image")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each pass")
    p.add_argument("--warm-up-s", type=float, default=4.0, help="start of each pass left out")
    p.add_argument("--rounds", type=int, default=1, help="alone and flood passes, alternating")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.token_us = (args.image_ms - 1) * 1000 / 256
    capacity = 8 / (0.001 + 2048 * args.token_us / 1e6)  # images a second, in full batches of 8
    runs = [one_round(args, capacity, r) for r in range(args.rounds)]
    med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
    share_c, share_d = equal_shares(args, capacity)
    out = {**med, "equal_share_c": share_c, "equal_share_d": share_d, "rounds": args.rounds}
    print(f"\nsimulated device {SPEC.format(token_us=args.token_us)}; capacity {capacity:.1f} images/s")
    print(f"  B alone p95 {out['b_alone_p95_s'] * 1000:.0f} ms; beside A's flood {out['b_flood_p95_s'] * 1000:.0f} ms")
    bound = out["b_alone_p95_s"] + 3 * out["longest_forward_s"]
    print(f"  bound (alone p95 + 3 x longest forward {out['longest_forward_s'] * 1000:.0f} ms) {bound * 1000:.0f} ms:")
    ratios = c.spread([run["b_p95_over_bound"] for run in runs], "")
    print(
        f"  B's p95 / bound {ratios} (<= 1); device busy {c.spread([run['device_busy'] for run in runs], '')} (>= 0.95)"
    )
    print(
        f"  A: {out['a_answered']} requests answered, {out['a_refused']:.0f} refused 429; B refused {out['b_refused']}"
    )
    print(f"  two tenants flooding at equal weight: device shares {share_c:.3f} / {share_d:.3f} (0.5 +- 0.05)")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
