"""SGLang's encode-prefill-decode (EPD) encoder protocol, spoken without importing SGLang.

An SGLang language server started with ``--language-only --encoder-urls http://visenc:8000``
sends each request's images to its encoder URLs and waits for the embeddings to be pushed
to it. What this module speaks (read from ``sglang==0.5.23``,
``srt/disaggregation/encoder/{http_server,server,receiver}.py``, pinned by
``tests/with_sglang/test_sglang_epd.py`` against that code):

- ``POST /encode`` ``{req_id, num_parts, part_idx, mm_items, modality, prefill_host,
  embedding_port, ...}``: one *part* of a request (the items one encoder got). Answered
  200 ``null`` once the part's embedding is delivered; an error is ``{status: "error",
  message, req_id}`` with a 4xx/5xx status (SGLang then fails that request).
- ``POST /scheduler_receive_url`` ``{req_id, receive_count, receive_url: "host:port"}``:
  once per scheduler rank (tensor parallel), before or after ``/encode``. The part goes to
  every registered URL once ``receive_count`` of them registered (``zmq_to_scheduler``).
  An ``/encode`` that names an ``embedding_port`` goes to ``prefill_host:embedding_port``
  instead (``zmq_to_tokenizer``).
- Delivery: a ZMQ PUSH of two frames: a pickled ``EmbeddingData`` (``req_id``,
  ``num_parts``, ``part_idx``, ``grid_dim``: one ``grid_thw`` row per image, ``modality``,
  ``dtype``, ``shape``) and the raw bytes of one contiguous ``[tokens, D]`` tensor, the
  part's images' rows in item order. An error is frame 0 alone with ``error_msg`` set.

SGLang reads frame 0 with an unpickler that admits a fixed list of globals
(``safe_pickle_loads``): ``EmbeddingData``, ``Modality``, torch dtypes. The frame is written
here opcode by opcode (``embedding_data_frame``), naming exactly those globals, so that
visenc needs neither SGLang (a CUDA-only install) nor a general pickler.
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
