"""What an SGLang client adds to a request whose images visenc encodes (SGLang's ``--encoder-urls``).

SGLang's ``GenerateReqInput`` takes, per image:

- ``mm_content_hashes``: ``"sha256:<64 hex>"`` of the image bytes, visenc's hash. SGLang forwards
  it to its encoder with the image; visenc then serves an image it (or any replica sharing its
  index) already encoded from the hash alone: no download, no decode, no forward.
- ``mm_hashes``: the key SGLang's prefix cache gives the image where its tokenizer builds the
  multimodal inputs (``MultimodalDataItem.set_hash(int(h, 16))``, which keeps the low 64 bits):
  visenc's hash, so every replica keys the image alike. Where the scheduler builds them from the
  encoder's rows (SGLang's ``zmq_to_scheduler`` default), SGLang keys the image by a hash of
  those rows, which visenc makes bit-identical for the same bytes.

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
