"""Every GPU check in one call, each command under its own time limit, then the four targets."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: the CUDA test cases (they skip without a device)
TESTS = ["tests/unit/test_device_reads.py", "tests/unit/test_varlen.py", "tests/unit/test_compiled.py"]
#: target: (what, threshold)
TARGETS = {
    "speedup": ("compiled / transformers' own path, 1080p", 4.0),
    "mfu": ("MFU, compiled, 1080p x4", 0.45),
    "batched": ("batched / per-image, compiled", 1.0),
    "service": ("service / bare forward, cold", 0.95),
    "hits": ("hits / cold, 16 clients", 10.0),
}
#: run only when named (``--only``)
OPTIONAL = {"bench_staging"}


def commands(smoke: bool) -> list[tuple[str, int, list[str]]]:
    """(name, time limit in seconds, argv) of each check; together within one 600 s device call."""
    py = sys.executable
    if smoke:
        tiny = ["--device", "cpu", "--tower", "tiny"]
        return [
            ("bench_gpu", 600, [py, "bench/bench_gpu.py", *tiny, "--rounds", "1", "--profile", "--json"]),
            (
                "bench_gpu_service",
                600,
                [py, "bench/bench_gpu_service.py", *tiny, *"--images 8 --rounds 1 --clients 4 8 --json".split()],
            ),
            ("bench_staging", 600, [py, "bench/bench_staging.py", *"--images 8 --rounds 1".split()]),
            ("tests", 600, [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, "-k", "cuda"]),
        ]
    return [
        ("bench_gpu", 170, [py, "bench/bench_gpu.py", "--rounds", "3", "--profile", "--json"]),
        ("bench_gpu_service", 220, [py, "bench/bench_gpu_service.py", *"--images 128 --rounds 2 --json".split()]),
        (
            "bench_staging",
            160,
            [py, "bench/bench_staging.py", *"--device cuda --tower 7b --images 48 --rounds 1".split()],
        ),
        ("tests", 80, [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, "-k", "cuda"]),
    ]


def run(name: str, limit_s: int, argv: list[str], out: Path, env: dict[str, str]) -> tuple[int | None, str]:
    """Run one check with its output in ``out/name.log``; (exit status or ``None`` past its limit, output)."""
    print(f"== {name}: {' '.join(argv[1:])} (limit {limit_s} s)", flush=True)
    log = out / f"{name}.log"
    started = time.monotonic()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            status: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            # KeyboardInterrupt, not SIGTERM: the bench's own clean-up runs and stops the server it started
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            status = None
    text = log.read_text(errors="replace")
    print("\n".join(text.splitlines()[-60:]))
    verdict = "past its time limit" if status is None else f"exit {status}"
    print(f"== {name}: {verdict} after {time.monotonic() - started:.0f} s\n", flush=True)
    return status, text


def last_json(text: str, key: str) -> dict[str, Any] | None:
    """The last line of ``text`` that is a JSON object holding ``key``."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if key in doc:
                return doc  # type: ignore[no-any-return]
    return None


def figures(gpu: dict[str, Any] | None, service: dict[str, Any] | None) -> dict[str, list[tuple[str, float]]]:
    """Each target's measured figures, labelled (empty where the bench printed nothing)."""
    scenarios = (gpu or {}).get("scenarios", {})
    out: dict[str, list[tuple[str, float]]] = {k: [] for k in TARGETS}
    for label, s in scenarios.items():
        if label.startswith("1080p"):
            out["speedup"].append((label, s["ratios"]["compiled / transformers"]))
        mfu = s["paths"]["visenc compiled"]["mfu"]
        if label == "1080p x4" and mfu is not None:
            out["mfu"].append((label, mfu))
        if not label.endswith("x1"):
            out["batched"].append((label, s["ratios"]["batched / per-image (compiled)"]))
    for label, found in (service or {}).get("passes", {}).items():
        out["service"].append((f"{label}, cold", found["ratio"]))
        if label == "16 clients":
            out["hits"].append((label, found["hits_over_cold"]))
    return out


def report(found: dict[str, list[tuple[str, float]]], device: str, smoke: bool) -> bool:
    """Print the targets; whether all were measured and met."""
    print(f"targets on {device}" + (" (smoke run on a CPU: not judged)" if smoke else ""))
    met = True
    for key, (what, threshold) in TARGETS.items():
        values = found[key]
        shown = ", ".join(f"{label} {value:.3g}" for label, value in values) or "not measured"
        ok = bool(values) and all(value >= threshold for _, value in values)
        met &= ok
        verdict = "" if smoke else ("  MET" if ok else "  NOT MET")
        print(f"  {what:<42} >= {threshold:<5g} {shown}{verdict}")
    return met


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="on a CPU: the same commands on tiny towers")
    p.add_argument("--out", type=Path, default=None, help="folder for the logs and compile caches (default: a new one)")
    p.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="run only these checks (bench_gpu, bench_gpu_service, bench_staging, tests)",
    )
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="visenc-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor"),
        "TRITON_CACHE_DIR": str(out / "triton"),
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "service"), str(ROOT / "clients"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    }
    texts: dict[str, str] = {}
    for name, limit_s, argv in commands(args.smoke):
        if (name not in OPTIONAL and args.only is None) or (args.only is not None and name in args.only):
            _, texts[name] = run(name, limit_s, argv, out, env)
    gpu = last_json(texts.get("bench_gpu", ""), "scenarios")
    service = last_json(texts.get("bench_gpu_service", ""), "ratio")
    device = (gpu or service or {}).get("device", "no device reported")
    met = report(figures(gpu, service), device, args.smoke)
    if service is not None:
        print(f"  the served tower: {service.get('served_compile')}")
    print(f"logs: {out}")
    return 0 if args.smoke or met else 1


if __name__ == "__main__":
    raise SystemExit(main())
