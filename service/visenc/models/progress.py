"""How far a fetch is: ``Progress``, and byte counts for people (``size_text``)."""

from __future__ import annotations

import logging
import sys
import threading
import time

log = logging.getLogger("visenc")

#: how often progress lines are logged when stderr is not a terminal
PROGRESS_EVERY_S = 5.0


class Progress:
    """Bytes fetched: a tqdm bar on a terminal, a log line every ``PROGRESS_EVERY_S`` otherwise."""

    def __init__(self, total: int, label: str) -> None:
        from huggingface_hub.utils import are_progress_bars_disabled, tqdm

        self.total, self.label, self.done = total, label, 0
        self.lock = threading.Lock()
        self.bar = None
        if sys.stderr.isatty() and not are_progress_bars_disabled():
            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label)
        else:
            log.info("%s: fetching %s", label, size_text(total))
        self.logged = time.monotonic()

    def update(self, n: int) -> None:
        with self.lock:
            self.done += n
            if self.bar is not None:
                self.bar.update(n)
            elif time.monotonic() - self.logged >= PROGRESS_EVERY_S:
                self.logged = time.monotonic()
                log.info(
                    "%s: %s of %s (%.0f%%)",
                    self.label,
                    size_text(self.done),
                    size_text(self.total),
                    100 * self.done / max(1, self.total),
                )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def size_text(n: float) -> str:
    """``n`` bytes for a person: ``512 B``, ``1.3 GiB``."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"
