"""What an SGLang client adds to a request whose images visenc encodes (SGLang's ``--encoder-urls``;
docs/integration-sglang.md)::

    body = {"text": prompt, "image_data": image_urls, **request_fields(images)}  # images: their bytes
"""

from __future__ import annotations

from collections.abc import Sequence

from visenc_client.format import image_hash


def request_fields(images: Sequence[bytes]) -> dict[str, list[str]]:
    """``mm_content_hashes`` and ``mm_hashes`` for a request's images (their bytes, in order)."""
    hashes = [image_hash(d) for d in images]
    return {
        "mm_content_hashes": ["sha256:" + h for h in hashes],
        "mm_hashes": hashes,
    }
