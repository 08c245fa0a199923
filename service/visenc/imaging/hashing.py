"""The image hash: SHA-256 of the raw image bytes, as 64 lowercase hex digits.

The client library computes it the same way (``visenc_client.image_hash``).
"""

from __future__ import annotations

import hashlib
import re

HASH_HEX_LEN = 64
_HASH_RE = re.compile(r"[0-9a-f]{64}")


def image_hash(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def is_valid_hash(value: str) -> bool:
    return _HASH_RE.fullmatch(value) is not None
