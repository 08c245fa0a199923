"""Index keys: ``visenc:{namespace}:{fingerprint}:{image_hash}``.

The fingerprint covers the model, its weights, dtype and preprocessing, so two
models or two resolutions never share an entry; the namespace isolates tenants.
"""

from __future__ import annotations


def entry_key(namespace: str, fingerprint: str, image_hash: str) -> str:
    return f"visenc:{namespace}:{fingerprint}:{image_hash}"
