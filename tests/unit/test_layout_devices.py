"""What a GPU runs is what CI runs: streams, events, pinned buffers, CUDA calls and CUDA branches sit in
``visenc/devices/cuda.py`` alone (chosen in ``devices/__init__.py``); every other line of the service runs
on the simulated device too."""

from __future__ import annotations

import re

from harness.paths import ROOT

SERVICE = ROOT / "service" / "visenc"
CUDA_CODE = re.compile(
    r"torch\.cuda|\.type\s*[!=]=\s*['\"]cuda|['\"]cuda['\"]\s*[!=]=|Stream\(|pin_memory|non_blocking"
    r"|record_stream|mem_get_info|wait_event|empty_cache|set_sync_debug_mode"
)
#: the device interface itself: its CUDA implementation, and the one place that picks it
DEVICES = {"devices/cuda.py", "devices/__init__.py"}
#: start-up, before any tower: which device to open (``bootstrap``), and whether NVML sees that GPU (``preflight``)
START_UP = {"bootstrap.py", "preflight.py"}


def cuda_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if CUDA_CODE.search(line)]


def test_cuda_code_sits_in_the_cuda_implementation_alone() -> None:
    found = {}
    for path in sorted(SERVICE.rglob("*.py")):
        name = path.relative_to(SERVICE).as_posix()
        if name in DEVICES | START_UP:
            continue
        lines = cuda_lines(path.read_text())
        if name == "devices/host.py":  # the host device queues its copies too: ``non_blocking`` alone is allowed
            lines = [x for x in lines if cuda_lines(x.replace("non_blocking", ""))]
        if lines:
            found[name] = lines
    assert found == {}, f"CUDA code outside visenc/devices/cuda.py: {found}"


def test_start_up_only_chooses_the_device() -> None:
    """Start-up asks whether CUDA is there and which device was named; it neither launches nor copies."""
    for name in START_UP:
        lines = cuda_lines((SERVICE / name).read_text())
        assert all(re.search(r"is_available|startswith\(\"cuda|version\.cuda|nvml", x, re.I) for x in lines), lines


def test_the_check_finds_what_it_forbids() -> None:
    """The pattern is live: each kind of CUDA code the service once had outside the interface is caught."""
    before = [
        'self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None',
        "host = torch.empty(o.shape, dtype=o.dtype, pin_memory=True)",
        "self._stream.wait_event(event)",
        "free, total = torch.cuda.mem_get_info(device)",
        "return pixels.pin_memory().to(self.device, self.dtype, non_blocking=True)",
        'if self.device.type != "cuda":',
    ]
    assert [line for line in before if not cuda_lines(line)] == []
    assert cuda_lines((SERVICE / "devices" / "cuda.py").read_text())
