"""Entries read from a tier, checked (header, key, tower) before use: a mismatch is a miss, never served."""

from __future__ import annotations

import logging

from visenc.index.tiered import Index
from visenc.metrics import Metrics
from visenc.models.base import VisionTower
from visenc_client.format import CorruptEntry, Entry, unpack_entry

log = logging.getLogger(__name__)


def wire_dtype(dtype: object) -> str:
    """A torch dtype as the wire names it (``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


class EntryCheck:
    """Checks entries against the tower; a corrupt one is discarded from L1. Event loop only; stateless."""

    def __init__(self, index: Index, tower: VisionTower, metrics: Metrics) -> None:
        self.index = index
        self.fingerprint = tower.fingerprint
        self.hidden_size = tower.hidden_size
        self.dtype = wire_dtype(tower.dtype)
        self.metrics = metrics

    def checked(self, key: str, image_hash: str, entry: Entry | None, *, video: bool = False) -> Entry | None:
        """``entry`` if it matches its stored header and this key, else ``None``; a manifest only for ``video``."""
        if entry is None:
            return None
        try:
            stored = unpack_entry(entry.blob, fingerprint=self.fingerprint, hash=image_hash)
            if (stored.rows, stored.hidden, stored.dtype, stored.grid_thw) != (
                entry.rows,
                entry.hidden,
                entry.dtype,
                entry.grid_thw,
            ):
                raise CorruptEntry("entry fields differ from its stored header")
            if stored.kind != entry.kind:
                raise CorruptEntry("entry kind differs from its stored header")
            if stored.kind == "video":
                return entry if video else None
            if stored.hidden != self.hidden_size or stored.dtype != self.dtype:
                raise CorruptEntry(
                    f"entry is [{stored.rows}, {stored.hidden}] {stored.dtype}, the tower "
                    f"makes rows of {self.hidden_size} {self.dtype}"
                )
        except CorruptEntry as e:
            log.warning("corrupt index entry for image %s treated as a miss: %s", image_hash, e)
            self.metrics.corrupt_entries.inc()
            self.index.discard(key)
            return None
        return entry

    def peek(self, key: str, image_hash: str, *, video: bool = False) -> Entry | None:
        """L1's entry for ``key``, checked (no round trip)."""
        return self.checked(key, image_hash, self.index.peek(key), video=video)
