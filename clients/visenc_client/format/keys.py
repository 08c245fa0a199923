"""Index keys ``visenc:{namespace}:{fingerprint}:{image_hash}``, image and video hashes, namespaces.
No part contains ``:``, so a key splits back."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

#: a tenant / key namespace: 1-64 characters of [A-Za-z0-9_.-]
NAMESPACE_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
NAMESPACE_RULE = "1-64 characters of [A-Za-z0-9_.-]"
_NAMESPACE_RE = re.compile(NAMESPACE_PATTERN)
#: the key of a vLLM request's ``ec_transfer_params`` that lists the images visenc lacks
ABSENT_KEY = "visenc_absent"
HASH_PATTERN = r"^[0-9a-f]{64}$"
_HASH_RE = re.compile(HASH_PATTERN)


def image_hash(data: bytes | bytearray | memoryview) -> str:
    """The image key: SHA-256 of the raw image bytes, 64 lowercase hex digits."""
    return hashlib.sha256(data).hexdigest()


def video_hash(frame_hashes: Sequence[str]) -> str:
    """A video's key, from its frames' ``image_hash`` values in order."""
    h = hashlib.sha256(b"visenc-video\0")
    for frame in frame_hashes:
        h.update(bytes.fromhex(frame))
    return h.hexdigest()


def is_valid_hash(value: str) -> bool:
    return _HASH_RE.fullmatch(value) is not None


def is_valid_namespace(value: str) -> bool:
    return _NAMESPACE_RE.fullmatch(value) is not None


def entry_key(namespace: str, fingerprint: str, image_hash: str) -> str:
    return f"visenc:{namespace}:{fingerprint}:{image_hash}"


def split_key(key: str) -> tuple[str, str, str]:
    prefix, namespace, fingerprint, image_hash = key.split(":")
    if prefix != "visenc":
        raise ValueError(f"not an entry key: {key!r}")
    return namespace, fingerprint, image_hash
