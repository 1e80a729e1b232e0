"""Tensor values on the wire: the protocol's datatype names and the two ways elements
arrive, as little-endian bytes (the binary extension, gRPC raw contents) or as a JSON list
(flat or nested, row-major). Decoding checks the element count against the declared shape
before it allocates anything, and never coerces across kinds (no bool or string as a
number, not even mixed in with numbers, no float as an int, no int out of the dtype's range).

A large JSON body's ``data`` lists arrive as `JsonArray`s, still JSON text: their size is
checked against the declared shape and the limit before any value becomes a Python object
(about 32 bytes each, for 2-4 bytes of text), so a refused body costs little beyond its bytes."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from jaxnitro._src.serve.errors import InvalidRequest, PayloadTooLarge

#: Open Inference Protocol datatype -> numpy dtype (BF16 from Triton's extension table).
#: BYTES is a protocol datatype no bundle takes; it is known so that the message says so.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
VARIABLE = "BYTES"
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

#: Which numpy kinds of a parsed JSON list may become a dtype of this kind.
_JSON_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf", "V": "iuf"}


@dataclasses.dataclass(frozen=True)
class JsonArray:
    """A JSON array of numbers (or true/false) not parsed yet: ``text[start:end]``.

    Its values are counted by their commas (an array of n values, flat or nested without
    empty lists, has n - 1), which costs no allocation; ``loads`` parses it when it fits."""

    text: bytes
    start: int
    end: int
    loads: Callable[[memoryview], Any]

    def count(self) -> int:
        commas = self.text.count(b",", self.start, self.end)
        if commas:
            return commas + 1
        return 1 if _VALUE_TEXT.search(self.text, self.start, self.end) else 0

    def may_hold_bools(self) -> bool:
        return any(self.text.find(t, self.start, self.end) >= 0 for t in (b"true", b"false"))

    def parse(self) -> Any:
        return self.loads(memoryview(self.text)[self.start : self.end])


_VALUE_TEXT = re.compile(rb"[^\[\]\s]")


def datatype_of(dtype: np.dtype) -> str | None:
    """The protocol's name of a dtype ("FP32"), or None when the protocol has none."""
    return _NAMES.get(np.dtype(dtype))


def known(datatype: str) -> bool:
    return datatype in DTYPES or datatype == VARIABLE


def element_count(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def byte_size(datatype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes of a tensor in the binary format; None for BYTES (variable-size elements)."""
    dtype = DTYPES.get(datatype)
    return None if dtype is None else element_count(shape) * dtype.itemsize


def from_bytes(name: str, data: bytes | memoryview, dtype: np.dtype, shape: tuple) -> np.ndarray:
    """The tensor a binary blob holds (no copy: the array views the request body)."""
    expected = element_count(shape) * dtype.itemsize
    if len(data) != expected:
        raise InvalidRequest(
            f"input {name!r}: {len(data)} bytes of binary data, but {shape} "
            f"{datatype_of(dtype)} needs {expected}."
        )
    if dtype.kind == "b":  # any nonzero byte is True; numpy would keep the raw byte
        return (np.frombuffer(data, np.uint8) != 0).reshape(shape)
    return np.frombuffer(data, dtype.newbyteorder("<")).reshape(shape).astype(dtype, copy=False)


def from_list(
    name: str,
    data: Any,
    dtype: np.dtype,
    shape: tuple,
    *,
    limit: int,
    may_hold_bools: bool = True,
) -> np.ndarray:
    """The tensor a JSON ``data`` list (or `JsonArray`) holds: flat, or nested exactly as
    ``shape``.

    ``limit`` bounds the decoded tensor's bytes: JSON digits can expand (``0,`` is 2 bytes
    of body and 8 as FP64), so a body under the body limit can still decode over it.
    ``may_hold_bools=False`` (the request's JSON has no true/false anywhere) skips looking
    for booleans among numbers."""
    datatype = datatype_of(dtype)
    if dtype.name == "bfloat16":
        raise InvalidRequest(
            f"input {name!r}: BF16 has no JSON form; send it as binary data (tritonclient: "
            f"set_data_from_numpy(x, binary_data=True) with an ml_dtypes.bfloat16 array)."
        )
    if isinstance(data, JsonArray):
        _check_size(name, datatype, dtype, shape, limit)
        held = data.count()
        if held != element_count(shape):
            raise InvalidRequest(
                f"input {name!r}: 'data' holds {held} values, but the declared shape "
                f"{list(shape)} has {element_count(shape)}; give it flat or nested as the shape."
            )
        may_hold_bools = data.may_hold_bools()
        data = data.parse()
    values = _shaped_values(name, data, datatype, shape)
    count = element_count(shape)
    if count and values.dtype.kind not in _JSON_KINDS[dtype.kind]:
        raise InvalidRequest(
            f"input {name!r}: {datatype} data must be "
            f"{_WANTED[dtype.kind]}, got {_describe(values)}."
        )
    if count and dtype.kind != "b" and may_hold_bools and _holds_bools(data):
        raise InvalidRequest(
            f"input {name!r}: {datatype} data must be {_WANTED[dtype.kind]}, got true/false "
            f"mixed with numbers; send 1 and 0 (or the values meant)."
        )
    _check_size(name, datatype, dtype, shape, limit)
    if count and dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = values.min(), values.max()
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise InvalidRequest(
                f"input {name!r}: value {bad} is out of range for {datatype} "
                f"[{info.min}, {info.max}]."
            )
    return values.astype(dtype).reshape(shape)


def _shaped_values(name: str, data: Any, datatype: str | None, shape: tuple) -> np.ndarray:
    """``data`` as an array, when it is a list of ``shape``'s count of values, flat or nested
    as ``shape``; else `InvalidRequest` saying which."""
    if not isinstance(data, list):
        raise InvalidRequest(
            f"input {name!r}: 'data' must be a JSON list of {datatype} values, got "
            f"{type(data).__name__}."
        )
    count = element_count(shape)
    try:
        values = np.asarray(data)
    except (ValueError, TypeError):
        raise InvalidRequest(
            f"input {name!r}: 'data' is ragged; give it flat ({count} values) or nested as the "
            f"shape {list(shape)}."
        ) from None
    if values.size != count or (values.ndim != 1 and values.shape != shape):
        raise InvalidRequest(
            f"input {name!r}: 'data' holds {values.size} values in shape {list(values.shape)}, "
            f"but the declared shape {list(shape)} has {count}; give it flat or nested as "
            f"the shape."
        )
    return values


def _check_size(name: str, datatype: str | None, dtype: np.dtype, shape: tuple, limit: int):
    count = element_count(shape)
    if count * dtype.itemsize > limit:
        raise PayloadTooLarge(
            f"input {name!r}: {count} {datatype} values take {count * dtype.itemsize} bytes, "
            f"over the limit of {limit}; send smaller batches (binary data is smaller too)."
        )


def _holds_bools(data: list) -> bool:
    """Whether a (nested) list holds a bool: numpy would read True as 1 among numbers."""
    kinds = set(map(type, data))
    if bool in kinds:
        return True
    return list in kinds and any(_holds_bools(v) for v in data if type(v) is list)


_WANTED = {
    "b": "true/false",
    "i": "integers",
    "u": "integers",
    "f": "numbers",
    "V": "numbers",
}


def _describe(values: np.ndarray) -> str:
    kind = values.dtype.kind
    return {
        "b": "true/false values",
        "f": "non-integer numbers",
        "U": "strings",
        "S": "strings",
        "O": "values that are not all numbers (null, objects, mixed or too-large values)",
    }.get(kind, f"{values.dtype} values")
