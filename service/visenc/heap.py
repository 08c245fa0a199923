"""The C heap under a CPU forward (glibc's malloc).

A CPU forward allocates and frees the same few MiB-sized activations at every
layer. With glibc's defaults a freed block over the (dynamic) mmap threshold
goes back to the kernel at once, and free memory past the (dynamic) trim
threshold at the heap's top is trimmed, so each forward faults its pages in
again: tiny CLIP's forward at batch 8 runs 1.22x faster without that (29-31 ->
24-25 ms an image, ``bench/bench_heap.py``), a ViT-B/16's 1.03x. glibc's
thresholds move with the allocation history, so in the service the slow case
struck some starts and not others; this setting rules it out.

``hold_freed(keep)`` keeps up to ``keep`` bytes of freed heap for reuse (and
serves blocks up to 32 MiB from the heap). It raises no peak: the heap never
grows past the most the forwards held at once; it only stops shrinking between
them. ``give_back()`` returns the free memory to the kernel; the device worker
calls it when the device has been idle a while. Both do nothing on another C
library.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: glibc's ceiling for the mmap threshold on 64-bit hosts (``HEAP_MAX_SIZE / 2``)
MMAP_THRESHOLD_MAX = 32 << 20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: its C library
        libc.gnu_get_libc_version  # noqa: B018  (glibc only)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def _thresholds(keep: int) -> dict[int, int]:
    """The mallopt settings that keep up to ``keep`` bytes. Setting the trim threshold freezes
    the dynamic mmap threshold at 128 KiB, so both are set."""
    return {M_MMAP_THRESHOLD: MMAP_THRESHOLD_MAX, M_TRIM_THRESHOLD: min(keep, 2**31 - 1)}


def environment(keep: int) -> dict[str, str]:
    """glibc's environment variables that make another process start as ``hold_freed(keep)`` sets this one."""
    names = {M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_", M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_"}
    return {names[param]: str(value) for param, value in _thresholds(keep).items()}


def hold_freed(keep: int) -> bool:
    """Keep up to ``keep`` bytes of freed heap for the next allocations (``0``: glibc's
    defaults, untouched). Returns whether the setting took effect."""
    libc = _glibc()
    if libc is None or keep <= 0:
        return False
    done = all(libc.mallopt(param, value) == 1 for param, value in _thresholds(keep).items())
    if not done:
        log.warning("could not set the C heap's thresholds; glibc's defaults stay")
    return done


def give_back() -> bool:
    """Return the free heap memory of every arena to the kernel. Whether any was returned."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1
