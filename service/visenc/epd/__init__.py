"""SGLang's encoder protocol (EPD), spoken without importing SGLang: ``POST /encode`` and
``/scheduler_receive_url``, rows pushed over ZMQ as ``[pickled EmbeddingData, raw rows]``.

Read from ``sglang==0.5.23`` and pinned against it by ``tests/with_sglang/test_sglang_epd.py``; frame 0 is
written opcode by opcode with exactly the globals SGLang's safe unpickler admits (``docs/internals.md``).
"""

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
