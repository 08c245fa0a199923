"""One memory budget per process, measured from outside: a real ``visenc serve`` whose pass of
real-size rows covers 3x its L1, half of the images answered ready and never read, stays within its
budget plus the model plus 256 MB."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import httpx
import pytest
from harness.paths import ROOT
from harness.processes import serve_subprocess
from harness.waits import metric

sys.path[:0] = [str(ROOT / "bench")]
import _common as c  # noqa: E402
import bench_gpu  # noqa: E402

from visenc_client.format import image_hash  # noqa: E402

MiB = 1 << 20
BUDGET = 256 * MiB


def status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) * 1024
    return out


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to read peak RSS")
def test_a_pass_over_3x_l1_with_half_never_read_stays_within_the_budget(tmp_path):
    model = c.write_qwen25_checkpoint(tmp_path / "wide", bench_gpu.TINY_VISION)  # rows 3584 bf16
    log = tmp_path / "serve.log"
    # leases that outlast the pass: the unread images' pins stay until the budget cuts them
    args = (
        "--model",
        str(model),
        "--dtype",
        "bfloat16",
        "--process-memory-bytes",
        str(BUDGET),
        "--ready-lease-s",
        "3600",
    )
    with serve_subprocess(*args, "--shm-dir", str(tmp_path), log=log) as (url, proc):
        with httpx.Client(base_url=url, timeout=120) as http:
            split = log.read_text()
            assert "memory budget 0.25 GiB" in split, split  # start-up logs the split
            l1 = int(http.get("/readyz").json()["index"]["max_bytes"])
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # the peak from here on
            at_ready = status(proc.pid)["VmRSS"]  # the model, the runtime and their buffers
            peak = [at_ready]
            stop = threading.Event()

            def sample() -> None:
                while not stop.wait(0.05):
                    peak.append(status(proc.pid)["VmRSS"])

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            stored = i = 0
            try:
                while stored < 3 * l1:
                    data = c.jpeg(500 + i, 1280, 720)
                    (item,) = http.post("/v1/encode", content=_body(data)).json()["items"]
                    assert item["status"] == "ready", item
                    stored += item["num_tokens"] * item["hidden_size"] * 2
                    if i % 2 == 0:  # half are read; the others' ready answers are never read
                        assert len(http.get(f"/v1/embeddings/{item['hash']}").content) == item["num_tokens"] * 7168
                    i += 1
            finally:
                stop.set()
                sampler.join()
            index = http.get("/readyz").json()["index"]
            cut = metric(http.get("/metrics").text, "visenc_cache_pins_cut_total")
            hwm = max(max(peak), status(proc.pid)["VmHWM"])
    assert index["bytes"] <= index["max_bytes"] + index["overflow_bytes"], index
    assert cut > 0, "the unread images' pins past the budget were not cut"
    assert hwm <= at_ready + BUDGET + 256 * MiB, (hwm - at_ready) / MiB
    print(f"peak RSS over the RSS at ready: {(hwm - at_ready) / MiB:.0f} MiB; budget {BUDGET / MiB:.0f} MiB")


def _body(data: bytes) -> bytes:
    import json
    from base64 import b64encode

    return json.dumps({"items": [{"hash": image_hash(data), "data": b64encode(data).decode()}], "wait": True}).encode()
