"""The REST wire format of the Open Inference Protocol, both directions: a JSON inference
request, optionally followed by binary tensors (Triton's binary tensor data extension),
into an `InferRequest`; outputs into a JSON (+ binary) response body.

Binary framing: the header ``Inference-Header-Content-Length: N`` says the first N bytes
of the body are the JSON; each input whose ``parameters.binary_data_size`` is set takes
that many of the remaining bytes, in the order the inputs appear, and every byte must be
taken. ``Inference-Header-Content-Length: 0`` is a raw request: the whole body is the one
input of a one-input model. Outputs are binary when the request says so
(``parameters.binary_data_output`` for all, ``outputs[i].parameters.binary_data`` for one)
and always for BF16, which has no JSON form. JSON may carry NaN and Infinity (Python's and
rapidjson's extension, which tritonclient parses) both ways; binary data needs no such rule.

`InferRequest` is protocol-neutral: the gRPC service builds the same object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import numpy as np

from jaxnitro._src.serve import tensors
from jaxnitro._src.serve.errors import InvalidRequest

try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - only slower without it
    _orjson = None  # type: ignore[assignment]

HEADER_LENGTH = "inference-header-content-length"
_DIGITS = re.compile(r"[0-9]{1,19}")
#: JSON at least this large is parsed without its ``data`` arrays first: they stay text
#: (`tensors.JsonArray`) until their declared shapes are checked against the limits.
DEFER_JSON_BYTES = 1 << 20
_DATA_KEY = re.compile(rb'"data"\s*:\s*\[')
#: What ends the text an array of numbers may span: a string or an object.
_NOT_NUMBERS = re.compile(rb'["{}]')


@dataclasses.dataclass(frozen=True)
class TensorIn:
    """One input as sent: either ``data`` (JSON list, or gRPC typed values) or ``raw`` bytes."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any = None
    raw: bytes | memoryview | None = None
    #: False when ``data`` cannot hold true/false (the request's JSON has none).
    may_hold_bools: bool = True


@dataclasses.dataclass(frozen=True)
class OutputWanted:
    name: str
    #: True/False: as binary/JSON; None: the request's default.
    binary: bool | None = None


@dataclasses.dataclass(frozen=True)
class InferRequest:
    inputs: tuple[TensorIn, ...]
    #: None: every output of the model.
    outputs: tuple[OutputWanted, ...] | None = None
    id: str | None = None
    binary_output: bool = False
    #: The body of a raw binary request (the one input's bytes); ``inputs`` is then empty.
    raw_body: bytes | None = None


# -- requests ----------------------------------------------------------------------------------
def parse_request(body: bytes, header_length: str | None) -> InferRequest:
    """An `InferRequest` from a REST body and its Inference-Header-Content-Length header."""
    header: bytes | memoryview
    binary: bytes | memoryview
    if header_length is None:
        header, binary = body, b""
    else:
        size = _header_length(header_length, len(body))
        if size == 0:
            if not body:
                raise InvalidRequest(
                    "a raw binary request (Inference-Header-Content-Length: "
                    "0) needs the input's bytes as the body; it is empty."
                )
            return InferRequest(inputs=(), raw_body=body, binary_output=True)
        header, binary = body[:size], memoryview(body)[size:]
    deferred = len(header) >= DEFER_JSON_BYTES
    try:
        doc = _deferred_json_object(bytes(header)) if deferred else _json_object(header)
    except InvalidRequest:
        if header_length is None and not deferred and (extra := _after_json(body)):
            raise InvalidRequest(
                f"the body has {extra} bytes after its JSON: binary tensor data needs the "
                f"header Inference-Header-Content-Length: <length of the JSON>."
            ) from None
        raise
    request_params = _parameters(doc.get("parameters"), "the request")
    bools = b"true" in header or b"false" in header
    inputs = _inputs(doc.get("inputs"), binary, framed=header_length is not None, bools=bools)
    return InferRequest(
        inputs=inputs,
        outputs=_outputs(doc.get("outputs")),
        id=_request_id(doc.get("id")),
        binary_output=request_params.get("binary_data_output") is True,
    )


def _header_length(value: str, body_size: int) -> int:
    value = value.strip()
    if not _DIGITS.fullmatch(value) or int(value) > body_size:
        raise InvalidRequest(
            f"Inference-Header-Content-Length must be an integer in [0, {body_size}] (the "
            f"body's length), got {value[:40]!r}."
        )
    return int(value)


def _json_object(data: bytes | memoryview) -> dict:
    doc = _fast_loads(data)
    if doc is None:
        doc = _loads(data)
    if not isinstance(doc, dict):
        raise InvalidRequest(
            f"the request JSON must be an object {{'inputs': [...]}}, got {type(doc).__name__}."
        )
    return doc


def _fast_loads(data: bytes | memoryview) -> Any:
    """The document, parsed by orjson when it is installed (the `serve` extra has it): it
    reads numbers about ten times faster than the json module, which makes JSON tensors
    cheap. None when orjson is missing or refuses the document (NaN, Infinity, a byte-order
    mark, UTF-16, a lone surrogate, deep nesting): the json module then decides, so what is
    accepted, and every error message, stays the json module's. One difference: orjson
    reads an integer beyond 64 bits as a float."""
    if _orjson is None:
        return None
    try:
        return _orjson.loads(data)
    except _orjson.JSONDecodeError:
        return None


def _loads(data: bytes | memoryview) -> Any:
    try:
        return json.loads(bytes(data))
    except RecursionError:
        raise InvalidRequest("the request JSON is nested too deeply.") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidRequest(f"failed to parse the request JSON: {e}.") from None


def _deferred_json_object(text: bytes) -> dict:
    """The request object of a large JSON body, its inputs' ``data`` arrays left as text.

    Each ``"data": [...]`` whose array holds no string or object is cut out and stands as a
    marker while the rest (names, datatypes, shapes: a few hundred bytes) is parsed; the
    markers in ``inputs`` then become `tensors.JsonArray` views of the body."""
    pieces: list[bytes] = []
    arrays: dict[str, tensors.JsonArray] = {}
    nonce = os.urandom(8).hex()
    pos = 0
    for match in _DATA_KEY.finditer(text):
        start = match.end() - 1
        if start < pos:
            continue
        stop = _NOT_NUMBERS.search(text, start)
        end = text.rfind(b"]", start, stop.start() if stop else len(text)) + 1
        if end <= start or text.count(b"[", start, end) != text.count(b"]", start, end):
            raise InvalidRequest(
                "a 'data' array of the request holds something other than numbers or "
                "true/false (a string or an object), or the JSON is malformed."
            )
        key = f"{nonce}:{len(arrays)}"
        pieces += [text[pos:start], f'"{key}"'.encode()]
        arrays[key] = tensors.JsonArray(text, start, end, _loads_any)
        pos = end
    pieces.append(text[pos:])
    rest = b"".join(pieces)
    if len(rest) >= DEFER_JSON_BYTES:  # e.g. a "d\u0061ta" key: its values would be parsed
        raise InvalidRequest(
            f"the request JSON outside its inputs' 'data' arrays is {len(rest)} bytes, over "
            f'{DEFER_JSON_BYTES}; give each input\'s values as "data": [...], or send them '
            f"as binary data."
        )
    try:
        doc = _json_object(rest)
    except InvalidRequest as e:
        message = str(e).split(": line ")[0].rstrip(".")
        raise InvalidRequest(f"{message} (in the JSON around its 'data' arrays).") from None
    inputs = doc.get("inputs")
    for entry in inputs if isinstance(inputs, list) else ():
        data = entry.get("data") if isinstance(entry, dict) else None
        if isinstance(data, str) and data in arrays:
            entry["data"] = arrays[data]
    return doc


def _loads_any(data: memoryview) -> Any:
    doc = _fast_loads(data)
    return _loads(data) if doc is None else doc


def _after_json(body: bytes) -> int:
    """How many bytes follow a JSON object at the start of ``body`` (0: none, or no object)."""
    text = body.decode("utf-8", "replace")
    try:
        doc, end = json.JSONDecoder().raw_decode(text)
    except (ValueError, RecursionError):
        return 0
    return len(body) - len(text[:end].encode()) if isinstance(doc, dict) else 0


def _parameters(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"'parameters' of {where} must be an object, got {value!r:.80}.")
    return value


def _inputs(
    value: Any, binary: bytes | memoryview, *, framed: bool, bools: bool
) -> tuple[TensorIn, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest(
            "the request needs 'inputs': a non-empty list of {'name', 'datatype', 'shape', "
            "'data'} objects."
        )
    out: list[TensorIn] = []
    offset = 0
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise InvalidRequest(f"inputs[{i}] must be an object, got {entry!r:.80}.")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"inputs[{i}] needs a 'name' string.")
        datatype = entry.get("datatype")
        if not isinstance(datatype, str) or not tensors.known(datatype):
            raise InvalidRequest(
                f"input {name!r}: 'datatype' {datatype!r:.40} is not a protocol datatype; use "
                f"one of {[*tensors.DTYPES, tensors.VARIABLE]}."
            )
        shape = parse_shape(name, entry.get("shape"))
        params = _parameters(entry.get("parameters"), f"input {name!r}")
        size = params.get("binary_data_size")
        if size is None:
            if "data" not in entry:
                raise InvalidRequest(
                    f"input {name!r} has neither 'data' nor parameters.binary_data_size."
                )
            out.append(TensorIn(name, datatype, shape, data=entry["data"], may_hold_bools=bools))
            continue
        _check_binary(name, datatype, shape, entry, size, framed, len(binary) - offset)
        out.append(TensorIn(name, datatype, shape, raw=binary[offset : offset + size]))
        offset += size
    if offset != len(binary):
        raise InvalidRequest(
            f"unexpected additional input data: {len(binary) - offset} bytes after the last "
            f"binary input (the binary_data_size values add up to {offset})."
        )
    return tuple(out)


def _check_binary(
    name: str,
    datatype: str,
    shape: tuple[int, ...],
    entry: dict,
    size: Any,
    framed: bool,
    left: int,
) -> None:
    """A binary input's framing: its size is an int that matches its shape and fits the body."""
    if "data" in entry:
        raise InvalidRequest(
            f"input {name!r} has both 'data' and parameters.binary_data_size; send one."
        )
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidRequest(
            f"input {name!r}: binary_data_size must be an integer >= 0, got {size!r:.40}."
        )
    if not framed:
        raise InvalidRequest(
            f"input {name!r} is binary (binary_data_size {size}), but the request has no "
            f"binary part: send the header Inference-Header-Content-Length: <length of "
            f"the JSON> and the bytes after the JSON."
        )
    expected = tensors.byte_size(datatype, shape)
    if expected is not None and size != expected:
        raise InvalidRequest(
            f"input {name!r}: binary_data_size is {size}, but shape {list(shape)} "
            f"{datatype} is {expected} bytes."
        )
    if size > left:
        raise InvalidRequest(
            f"unexpected size for input {name!r}: expecting {size} additional bytes, "
            f"{left} left in the body."
        )


def parse_shape(name: str, value: Any) -> tuple[int, ...]:
    """A shape as a tuple of ints >= 0 (JSON and gRPC alike)."""
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    )
    if not ok or len(value) > 32:
        raise InvalidRequest(
            f"input {name!r}: 'shape' must be a list of at most 32 integers >= 0, got "
            f"{value!r:.80}."
        )
    return tuple(value)


def _outputs(value: Any) -> tuple[OutputWanted, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequest(f"'outputs' must be a list of {{'name'}} objects, got {value!r:.80}.")
    out = []
    for i, entry in enumerate(value):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest(f"outputs[{i}] must be an object with a 'name' string.")
        params = _parameters(entry.get("parameters"), f"output {name!r}")
        binary = params.get("binary_data")
        out.append(OutputWanted(name, binary if isinstance(binary, bool) else None))
    return tuple(out)


def _request_id(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise InvalidRequest(f"'id' must be a string, got {value!r:.40}.")


# -- responses ---------------------------------------------------------------------------------
def encode_response(
    *,
    model: str,
    version: str,
    request: InferRequest,
    outputs: dict[str, np.ndarray],
    binary: dict[str, bool],
) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of a REST inference response; ``binary`` says which outputs go binary."""
    entries = []
    blobs: list[memoryview] = []
    for name, arr in outputs.items():
        entry: dict[str, Any] = {
            "name": name,
            "datatype": tensors.datatype_of(arr.dtype),
            "shape": list(arr.shape),
        }
        if binary[name]:
            # a view of the array's bytes (little-endian, contiguous): the join below is
            # the only copy of the output into the body
            little = np.ascontiguousarray(arr, arr.dtype.newbyteorder("<"))
            blob = little.reshape(-1).view(np.uint8).data
            entry["parameters"] = {"binary_data_size": blob.nbytes}
            blobs.append(blob)
        else:
            entry["data"] = arr.reshape(-1).tolist()
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version}
    if request.id is not None:
        doc["id"] = request.id
    doc["outputs"] = entries
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not blobs:
        return header, {"content-type": "application/json"}
    return b"".join([header, *blobs]), {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }


def binary_choice(request: InferRequest, names: list[str], dtypes: dict[str, np.dtype]) -> dict:
    """Which outputs go binary: as asked per output, else the request's default; BF16 always."""
    asked = {o.name: o.binary for o in request.outputs or ()}
    out = {}
    for name in names:
        choice = asked.get(name)
        out[name] = (request.binary_output if choice is None else choice) or dtypes[
            name
        ].name == "bfloat16"
    return out
