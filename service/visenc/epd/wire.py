"""Frame 0 of an SGLang embedding push, written opcode by opcode."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from visenc_client.format import TORCH_NAMES

#: where SGLang 0.5.23 defines what frame 0 names (its unpickler admits these globals)
EMBEDDING_DATA = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY = ("sglang.srt.multimodal.modality", "Modality")
#: ``Modality`` members' values (``enum.auto()``: IMAGE = 1, VIDEO = 2, AUDIO = 3)
MODALITY_VALUES = {"IMAGE": 1, "VIDEO": 2, "AUDIO": 3}


@dataclass(frozen=True, slots=True)
class _Global:
    module: str
    name: str


@dataclass(frozen=True, slots=True)
class _Enum:
    cls: _Global
    value: int


def _pickle(value: Any, out: bytearray) -> None:
    """Protocol-2 opcodes for the few types frame 0 holds."""
    if value is None:
        out += b"N"
    elif value is True or value is False:
        out += b"\x88" if value else b"\x89"
    elif isinstance(value, int):
        if -(1 << 31) <= value < (1 << 31):
            out += b"J" + struct.pack("<i", value)
        else:
            raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            out += b"\x8a" + bytes([len(raw)]) + raw
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"X" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, list):
        out += b"]"
        if value:
            out += b"("
            for item in value:
                _pickle(item, out)
            out += b"e"
    elif isinstance(value, dict):
        out += b"}"
        if value:
            out += b"("
            for k, v in value.items():
                _pickle(k, out)
                _pickle(v, out)
            out += b"u"
    elif isinstance(value, _Global):
        out += b"c" + value.module.encode() + b"\n" + value.name.encode() + b"\n"
    elif isinstance(value, _Enum):
        _pickle(value.cls, out)
        _pickle(value.value, out)
        out += b"\x85R"  # TUPLE1, REDUCE
    else:
        raise TypeError(f"frame 0 holds no {type(value).__name__}")


def embedding_data_frame(
    req_id: str,
    num_parts: int,
    part_idx: int,
    *,
    modality: str = "IMAGE",
    grid: list[list[int]] | None = None,
    dtype: str | None = None,
    shape: list[int] | None = None,
    error_msg: str | None = None,
    error_code: int | None = None,
) -> bytes:
    """Frame 0 as SGLang's ``pickle.dumps(EmbeddingData(...).copy_without_embedding())`` writes it, or an error."""
    state = {
        "req_id": req_id,
        "num_parts": num_parts,
        "part_idx": part_idx,
        "grid_dim": grid,
        "modality": _Enum(_Global(*MODALITY), MODALITY_VALUES[modality]),
        "embedding": None,
        "send_time": None,
        "dtype": None if dtype is None else _Global(*TORCH_NAMES[dtype].split(".")),
        "shape": shape,
        "_mr_ptr": None,
        "error_msg": error_msg,
        "error_code": error_code,
    }
    out = bytearray(b"\x80\x02")  # PROTO 2
    _pickle(_Global(*EMBEDDING_DATA), out)
    out += b")\x81"  # EMPTY_TUPLE, NEWOBJ: the class's __new__, no __init__
    _pickle(state, out)
    out += b"b."  # BUILD (the instance's __dict__), STOP
    return bytes(out)
