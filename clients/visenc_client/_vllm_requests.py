"""What ``VisencConnector`` reads of a vLLM request's multimodal items."""

from __future__ import annotations

from typing import Any

from visenc_client.format import ABSENT_KEY


def item_grid(data: Any) -> tuple[int, ...] | None:
    """The grid vLLM's processor gave an item (``image_grid_thw`` and the like), if it has one."""
    if data is None:
        return None
    for key in ("image_grid_thw", "video_grid_thw"):
        if key in data:
            return tuple(int(x) for x in data[key].data.reshape(-1).tolist())
    return None


def told_absent(request: Any) -> frozenset[str]:
    """The identifiers the request says visenc lacks (``ec_transfer_params["visenc_absent"]``)."""
    params = getattr(request, "ec_transfer_params", None)
    listed = params.get(ABSENT_KEY) if isinstance(params, dict) else None
    return frozenset(i for i in listed if isinstance(i, str)) if isinstance(listed, list) else frozenset()


def encodable(data: Any) -> bool:
    """Whether vLLM holds pixels or embeddings to encode the item itself, not only its grid."""
    if data is None:
        return True  # vLLM filled no data here: it came with the request, as pixels
    return any(k.startswith("pixel_values") or k.endswith("_embeds") for k in data)
