"""The C heap under a CPU forward (glibc): ``hold_freed`` keeps freed activations, ``trim`` returns them."""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

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
    # setting the trim threshold freezes the dynamic mmap threshold at 128 KiB, so both are set
    return {M_MMAP_THRESHOLD: MMAP_THRESHOLD_MAX, M_TRIM_THRESHOLD: min(keep, 2**31 - 1)}


def environment(keep: int) -> dict[str, str]:
    """glibc's environment variables that start another process as ``hold_freed(keep)`` sets this one."""
    names = {M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_", M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_"}
    return {names[param]: str(value) for param, value in _thresholds(keep).items()}


def hold_freed(keep: int) -> bool:
    """Keep up to ``keep`` bytes of freed heap for the next allocations; whether it took effect."""
    libc = _glibc()
    if libc is None or keep <= 0:
        return False
    done = all(libc.mallopt(param, value) == 1 for param, value in _thresholds(keep).items())
    if not done:
        log.warning("could not set the C heap's thresholds; glibc's defaults stay")
    return done


def trim() -> bool:
    """Return the free heap memory of every arena to the kernel; whether any was returned."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1
