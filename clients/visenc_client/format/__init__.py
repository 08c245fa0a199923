"""What the service and its clients agree on, defined once: the stored value of an embedding
(``entry``), the wire's dtypes (``dtypes``), index keys, hashes and namespaces (``keys``), video
manifests (``manifest``), the handle and its statuses and reasons (``handle``), media types and the
rows frame (``frame``). Pure Python + numpy + msgpack (no torch, no I/O): the service, every client,
the engine connectors and the load tests import these same definitions, by these names.
"""

from visenc_client.format.dtypes import (
    NUMPY_DTYPES,
    TORCH_NAMES,
    bfloat16_as_float32,
    tensor_words,
    words_tensor,
)
from visenc_client.format.entry import (
    DATA_OFFSET,
    KINDS,
    MAGIC,
    VERSION,
    CorruptEntry,
    Entry,
    pack_entry,
    parse_header,
    unpack_entry,
)
from visenc_client.format.frame import (
    FRAME_PREFIX_BYTES,
    JSON,
    MSGPACK,
    MSGPACK_TYPES,
    ROWS_MEDIA_TYPE,
    CorruptFrame,
    frame_head,
    frame_header_length,
    frame_items,
    split_frame,
)
from visenc_client.format.handle import (
    HANDLE_FIELDS,
    LEASE_HEADER,
    REASONS,
    STATUSES,
    Handle,
    Reason,
    Status,
)
from visenc_client.format.keys import (
    ABSENT_KEY,
    HASH_PATTERN,
    NAMESPACE_PATTERN,
    NAMESPACE_RULE,
    entry_key,
    image_hash,
    is_valid_hash,
    is_valid_namespace,
    split_key,
    video_hash,
)
from visenc_client.format.manifest import (
    manifest_tubes,
    pack_manifest,
)

__all__ = [
    "ABSENT_KEY",
    "DATA_OFFSET",
    "FRAME_PREFIX_BYTES",
    "HANDLE_FIELDS",
    "HASH_PATTERN",
    "JSON",
    "KINDS",
    "LEASE_HEADER",
    "MAGIC",
    "MSGPACK",
    "MSGPACK_TYPES",
    "NAMESPACE_PATTERN",
    "NAMESPACE_RULE",
    "NUMPY_DTYPES",
    "REASONS",
    "ROWS_MEDIA_TYPE",
    "STATUSES",
    "TORCH_NAMES",
    "VERSION",
    "CorruptEntry",
    "CorruptFrame",
    "Entry",
    "Handle",
    "Reason",
    "Status",
    "bfloat16_as_float32",
    "entry_key",
    "frame_head",
    "frame_header_length",
    "frame_items",
    "image_hash",
    "is_valid_hash",
    "is_valid_namespace",
    "manifest_tubes",
    "pack_entry",
    "pack_manifest",
    "parse_header",
    "split_frame",
    "split_key",
    "tensor_words",
    "unpack_entry",
    "video_hash",
    "words_tensor",
]
