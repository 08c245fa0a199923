"""py-spy records of a served visenc, and what they say: each thread's busy share and its hottest lines,
with the text of each line (compiled graphs' generated code included, read from the inductor cache)."""

from __future__ import annotations

import collections
import contextlib
import linecache
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: where a thread is idle: waiting for work, a lock, a selector or a device event
IDLE = re.compile(
    r"(wait|select|_worker \(concurrent|run_forever|Runner\.run|synchronize|_recv_msg|Timer\.check|sleep)"
)
FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")


@contextlib.contextmanager
def recorded(pid: int, folder: Path | None, name: str) -> Iterator[None]:
    """While the block runs, py-spy samples ``pid`` (every thread, idle ones too) into ``folder/name.txt``
    (collapsed stacks), then prints its summary; nothing without a folder or without py-spy."""
    spy = find_py_spy()
    if folder is None or spy is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.txt"
    argv = [spy, "record", "--pid", str(pid), "--rate", "250", "--threads", "--idle", "--format", "raw"]
    spying = subprocess.Popen([*argv, "--output", str(out), "--nonblocking"], stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        spying.send_signal(signal.SIGINT)  # py-spy writes what it sampled on SIGINT
        try:
            spying.wait(timeout=30)
        except subprocess.TimeoutExpired:
            spying.kill()
        if out.exists() and out.stat().st_size:
            print(f"py-spy {name}:\n{summary(out)}", flush=True)


def find_py_spy() -> str | None:
    """``PY_SPY``, else py-spy on the path, beside this Python, or in the ``bin`` of a ``sys.path`` entry (where
    ``pip install --target`` puts it)."""
    beside = [Path(sys.executable).with_name("py-spy"), *(Path(p) / "bin" / "py-spy" for p in sys.path if p)]
    found = os.environ.get("PY_SPY") or shutil.which("py-spy") or next((p for p in beside if p.is_file()), None)
    return str(found) if found else None


def samples(path: Path) -> dict[str, list[tuple[list[str], int]]]:
    """Each thread's stacks (outermost frame first) and their sample counts; a pool's threads (``name_3``)
    as one (``name_*``)."""
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        head, *frames = stack.split(";")
        thread = re.sub(r"_\d+$", "_*", head.split(": ", 1)[-1] if head.startswith("thread") else head)
        threads[thread].append((frames, int(n)))
    return threads


def summary(path: Path, hot: int = 6, roots: list[Path] | None = None) -> str:
    """Per thread: its busy share (samples not idle) and its ``hot`` hottest leaf lines, with their text."""
    roots = roots if roots is not None else cache_roots()
    out = []
    for thread, stacks in sorted(samples(path).items(), key=lambda kv: -busy(kv[1])):
        total = sum(n for _, n in stacks)
        work = busy(stacks)
        if work < 0.02 * total:
            continue
        out.append(f"  {thread}: busy {work / total:.0%} of {total} samples (each thread's share, summed)")
        leaves: collections.Counter[str] = collections.Counter()
        for frames, n in stacks:
            if frames and not IDLE.search(frames[-1]):
                leaves[frames[-1]] += n
        for frame, n in leaves.most_common(hot):
            out.append(f"    {n / total:5.1%} {frame}{source(frame, roots)}")
    return "\n".join(out)


def busy(stacks: list[tuple[list[str], int]]) -> int:
    return sum(n for frames, n in stacks if frames and not IDLE.search(frames[-1]))


def source(frame: str, roots: list[Path]) -> str:
    """`` | <the line's text>`` where the file is found (as named, or by its name under ``roots``)."""
    m = FRAME.match(frame)
    if m is None:
        return ""
    found = Path(m["file"])
    if not found.is_file():
        found = next((p for root in roots for p in root.rglob(found.name)), found)
    text = linecache.getline(str(found), int(m["line"])).strip()
    return f" | {text[:140]}" if text else ""


def cache_roots() -> list[Path]:
    """Where inductor writes its generated code (``TORCHINDUCTOR_CACHE_DIR``, else its default)."""
    user = os.environ.get("USER") or str(os.getuid())
    default = Path(tempfile.gettempdir()) / f"torchinductor_{user}"
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return [p for p in ([Path(given)] if given else []) + [default] if p.is_dir()]


def main(argv: Any = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("record", type=Path, help="a collapsed-stack file py-spy wrote (--format raw)")
    p.add_argument("--hot", type=int, default=8)
    args = p.parse_args(argv)
    print(summary(args.record, args.hot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
