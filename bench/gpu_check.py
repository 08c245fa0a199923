"""Every GPU check in one call: steps smallest first, each under its own time limit and within one
budget; each figure printed as soon as it is measured (``FIGURE`` lines), a step stopped at its limit
loses only its own figures; then the targets, and the steps skipped."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: the CUDA test cases (they skip without a device)
TESTS = ["tests/unit/test_device_reads.py", "tests/unit/test_varlen.py", "tests/unit/test_compiled.py"]
#: target: (what, threshold)
TARGETS = {
    "speedup": ("compiled / transformers' own path, 1080p", 4.0),
    "mfu": ("MFU, compiled, 1080p", 0.45),
    "batched": ("batched / per-image, compiled", 1.0),
    "service": ("service / bare forward, cold", 0.95),
    "hits": ("hits / cold, 16 clients", 10.0),
}
#: run only when named (``--only``)
OPTIONAL = {"bench_staging"}
#: a step is started only with at least this long left of the budget (else it is said skipped)
MIN_STEP_S = 45


def commands(smoke: bool, spy_dir: Path) -> list[tuple[str, int, list[str]]]:
    """(name, time limit in seconds, argv) of each step, smallest first; each step's figures are its own. The
    16-client service step records the server with py-spy into ``spy_dir`` where py-spy is found."""
    py = sys.executable
    spied = ["--encode-only", "--profile-dir", str(spy_dir)]
    gpu = [py, "bench/bench_gpu.py", "--json"]
    service = [py, "bench/bench_gpu_service.py", "--json"]
    if smoke:
        tiny = ["--device", "cpu", "--tower", "tiny"]
        return [
            ("tests", 600, [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, "-k", "cuda"]),
            ("bench_gpu 1080p x1", 600, [*gpu, *tiny, "--rounds", "1", "--scenarios", "1080p x1"]),
            ("bench_gpu_service 16", 600, [*service, *tiny, *"--images 8 --rounds 1 --clients 4".split(), *spied]),
            ("bench_staging", 600, [py, "bench/bench_staging.py", *"--images 8 --rounds 1".split()]),
        ]
    return [
        ("tests", 80, [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, "-k", "cuda"]),
        ("bench_gpu 1080p x1", 120, [*gpu, "--rounds", "3", "--profile", "--scenarios", "1080p x1"]),
        ("bench_gpu 1080p x4", 90, [*gpu, "--rounds", "3", "--scenarios", "1080p x4"]),
        ("bench_gpu_service 16", 150, [*service, *"--images 96 --rounds 2 --clients 16".split(), *spied]),
        ("bench_gpu_service 64", 130, [*service, *"--images 128 --rounds 2 --clients 64".split()]),
        ("bench_gpu mixed", 90, [*gpu, "--rounds", "2", "--scenarios", "720p x8", "mixed x6"]),
        (
            "bench_staging",
            160,
            [py, "bench/bench_staging.py", *"--device cuda --tower 7b --images 48 --rounds 1".split()],
        ),
    ]


#: a service round's line (``bench_gpu_service.py``): its figure is printed the moment the round ends
ROUND = re.compile(r"round (\d+): bare ([\d.]+) img/s; (\d+) clients cold ([\d.]+), hits ([\d.]+)")


def live_figure(line: str) -> str | None:
    m = ROUND.search(line)
    if m is None:
        return None
    r, bare, n, cold, hits = m.groups()
    ratio, hits_ratio = float(cold) / float(bare), float(hits) / float(cold)
    return f"service / bare forward, {n} clients, round {r}: {ratio:.3f} (hits / cold {hits_ratio:.1f})"


def run(name: str, limit_s: float, argv: list[str], out: Path, env: dict[str, str]) -> tuple[int | None, str]:
    """Run one step, its output in ``out/<name>.log`` and here as it comes; (exit status, or ``None`` past
    its limit, output). A step stopped at its limit keeps every figure it printed."""
    print(f"== {name}: {' '.join(argv[1:])} (limit {limit_s:.0f} s)", flush=True)
    started, lines = time.monotonic(), []
    log = out / f"{name.replace(' ', '_')}.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(limit_s, stop, (proc,))
        timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            lines.append(line)
            figure = live_figure(line)
            print(f"FIGURE {figure}" if figure else line.rstrip("\n"), flush=True)
        proc.wait()
        timer.cancel()
    status = None if getattr(proc, "stopped", False) else proc.returncode
    verdict = "past its time limit: stopped" if status is None else f"exit {status}"
    print(f"== {name}: {verdict} after {time.monotonic() - started:.0f} s\n", flush=True)
    return status, "".join(lines)


def stop(proc: subprocess.Popen[str]) -> None:
    """Past its limit: KeyboardInterrupt first (the bench's clean-up stops the server it started), then kill."""
    proc.stopped = True  # type: ignore[attr-defined]
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


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
    """Each target's figures one step measured, labelled (empty where it printed none)."""
    scenarios = (gpu or {}).get("scenarios", {})
    out: dict[str, list[tuple[str, float]]] = {k: [] for k in TARGETS}
    for label, s in scenarios.items():
        if label.startswith("1080p"):
            out["speedup"].append((label, s["ratios"]["compiled / transformers"]))
        mfu = s["paths"]["visenc compiled"]["mfu"]
        if label.startswith("1080p") and mfu is not None:
            out["mfu"].append((label, mfu))
        if not label.endswith("x1"):
            out["batched"].append((label, s["ratios"]["batched / per-image (compiled)"]))
    for label, found in (service or {}).get("passes", {}).items():
        out["service"].append((f"{label}, cold", found["ratio"]))
        if label == "16 clients":
            out["hits"].append((label, found["hits_over_cold"]))
    return out


def step_figures(text: str) -> dict[str, list[tuple[str, float]]]:
    return figures(last_json(text, "scenarios"), last_json(text, "ratio"))


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


def run_steps(args: argparse.Namespace, out: Path, env: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """Each chosen step within what is left of ``--budget-s``; (figures by target, steps skipped and why)."""
    found: dict[str, list[tuple[str, float]]] = {k: [] for k in TARGETS}
    skipped, device, deadline = [], "no device reported", time.monotonic() + args.budget_s
    for name, limit_s, argv in commands(args.smoke, out / "spy"):
        base = name.split(" ")[0]
        chosen = base in args.only if args.only is not None else base not in OPTIONAL
        if not chosen:
            skipped.append(f"{name} (not chosen: --only)")
            continue
        left = deadline - time.monotonic()
        if left < min(limit_s, MIN_STEP_S):
            skipped.append(f"{name} (the budget had {max(0, left):.0f} s left)")
            continue
        status, text = run(name, min(limit_s, left), argv, out, env)
        for key, values in step_figures(text).items():
            for label, value in values:
                print(f"FIGURE {TARGETS[key][0]}: {label} {value:.3g}", flush=True)
            found[key] += values
        device = (last_json(text, "device") or {}).get("device", device)
        if status is None:
            skipped.append(f"{name} (stopped at its limit: only the rounds printed above count)")
    found["device"] = device  # type: ignore[assignment]
    return found, skipped


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="on a CPU: the same commands on tiny towers")
    p.add_argument("--out", type=Path, default=None, help="folder for the logs and compile caches (default: a new one)")
    p.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="run only these steps (bench_gpu, bench_gpu_service, bench_staging, tests)",
    )
    p.add_argument("--budget-s", type=float, default=570, help="all steps together (one 600 s device call)")
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
    found, skipped = run_steps(args, out, env)
    device = str(found.pop("device"))
    met = report(found, device, args.smoke)
    print("steps skipped: " + ("; ".join(skipped) if skipped else "none"))
    print(f"logs: {out}")
    return 0 if args.smoke or met else 1


if __name__ == "__main__":
    raise SystemExit(main())
