"""Index keys: ``visenc:{namespace}:{fingerprint}:{image_hash}``.

The fingerprint covers the model, its weights, dtype and preprocessing, so two
models or two resolutions never share an entry; the namespace isolates tenants.
None of the three parts contains ``:`` (namespace ``[A-Za-z0-9_.-]``,
fingerprint and hash hex digits), so a key splits back unambiguously.

Redis Cluster: an entry key has no hash tag, so entries spread over every
slot. The claim key of an entry wraps the whole entry key in a hash tag,
``{visenc:ns:fp:hash}:claim``, so it lives in the *same slot* as its entry and
one Lua script can read the entry and take the claim atomically.
"""

from __future__ import annotations


def entry_key(namespace: str, fingerprint: str, image_hash: str) -> str:
    return f"visenc:{namespace}:{fingerprint}:{image_hash}"


def split_key(key: str) -> tuple[str, str, str]:
    """``(namespace, fingerprint, image_hash)`` of an entry key."""
    prefix, namespace, fingerprint, image_hash = key.split(":")
    if prefix != "visenc":
        raise ValueError(f"not an entry key: {key!r}")
    return namespace, fingerprint, image_hash


def claim_key(key: str) -> str:
    """The claim key of an entry key: same Redis Cluster slot (hash tag = the entry key)."""
    return f"{{{key}}}:claim"
