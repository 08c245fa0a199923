"""SGLang's encoder protocol (EPD), spoken without importing SGLang."""

from visenc.epd.serve import EPD, EncodePart, EPDError, EPDSettings, ReceiveUrl
from visenc.epd.wire import EMBEDDING_DATA, MODALITY, embedding_data_frame

__all__ = [
    "EMBEDDING_DATA",
    "EPD",
    "MODALITY",
    "EPDError",
    "EPDSettings",
    "EncodePart",
    "ReceiveUrl",
    "embedding_data_frame",
]
