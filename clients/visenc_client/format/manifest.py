"""A video's manifest: its tubes' hashes, stored under the video's own key like an image's rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from visenc_client.format.entry import CorruptEntry, Entry, pack_entry

_DIGEST_BYTES = 32


def pack_manifest(tubes: Sequence[str], *, grid_thw: tuple[int, int, int], fingerprint: str, video: str) -> Entry:
    """A value of kind ``video`` whose rows are its tubes' raw 32-byte digests, in order."""
    digests = np.frombuffer(b"".join(bytes.fromhex(t) for t in tubes), dtype="<f4").reshape(len(tubes), -1)
    return pack_entry(digests, dtype="float32", grid_thw=grid_thw, fingerprint=fingerprint, hash=video, kind="video")


def manifest_tubes(entry: Entry) -> list[str]:
    """The tube hashes of a manifest read from the index (``CorruptEntry`` if it is not one)."""
    if entry.kind != "video" or entry.dtype != "float32" or entry.hidden * 4 != _DIGEST_BYTES:
        raise CorruptEntry("not a video manifest")
    if entry.rows != entry.grid_thw[0]:
        raise CorruptEntry("a video manifest whose tube count is not its grid's")
    raw = bytes(entry.rows_view())
    return [raw[i : i + _DIGEST_BYTES].hex() for i in range(0, len(raw), _DIGEST_BYTES)]
