"""Reading a request body within limits: at most ``limit`` bytes as sent (a larger
Content-Length is refused before reading), at most ``limit`` bytes after gzip/deflate
decompression (inflated in one bounded step, so a zip bomb costs ``limit`` bytes, not its
expansion), and within a deadline, so a client that trickles its body cannot hold a
connection forever. tritonclient sends no Content-Type, so the body is never
interpreted by its content type."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Mapping

from .errors import InvalidRequest, PayloadTooLarge, RequestTimeout

#: The default limit on a request body (before and after decompression) and on a decoded
#: tensor: 64 MiB, as Triton's --http-max-input-size.
MAX_BODY_BYTES = 64 << 20
#: Seconds for a whole body to arrive.
READ_TIMEOUT_S = 30.0


async def read_body(
    headers: Mapping[str, str],
    chunks: AsyncIterator[bytes],
    *,
    limit: int,
    timeout: float = READ_TIMEOUT_S,
) -> bytes:
    """The decoded body: read from ``chunks``, decompressed per Content-Encoding."""
    declared = headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise InvalidRequest(f"Content-Length {declared[:40]!r} is not a byte count.")
        if int(declared) > limit:
            raise PayloadTooLarge(_too_large(int(declared), limit, "the request body"))
    try:
        async with asyncio.timeout(timeout):
            body = await _collect(chunks, limit)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout:g} s.") from None
    return decompress(body, headers.get("content-encoding"), limit=limit)


async def _collect(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    parts = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(_too_large(size, limit, "the request body"))
        if chunk:
            parts.append(chunk)
    return b"".join(parts)


def decompress(body: bytes, encoding: str | None, *, limit: int) -> bytes:
    """``body`` decoded per a Content-Encoding of identity, gzip or deflate (zlib or raw)."""
    name = (encoding or "identity").strip().lower()
    if name in ("", "identity"):
        return body
    if name in ("gzip", "x-gzip"):
        return _inflate(body, 16 + zlib.MAX_WBITS, limit, name)
    if name == "deflate":  # RFC 9110 says zlib-wrapped; some clients send raw deflate
        try:
            return _inflate(body, zlib.MAX_WBITS, limit, name)
        except InvalidRequest:
            return _inflate(body, -zlib.MAX_WBITS, limit, name)
    raise InvalidRequest(
        f"Content-Encoding {encoding[:40]!r} is not supported; send gzip, deflate or none."
        if encoding
        else "unsupported Content-Encoding."
    )


def _inflate(data: bytes, wbits: int, limit: int, name: str) -> bytes:
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as e:
        raise InvalidRequest(f"the {name} request body does not decompress: {e}.") from None
    if len(out) > limit:
        raise PayloadTooLarge(_too_large(None, limit, f"the decompressed ({name}) body"))
    if not inflater.eof or inflater.unused_data:
        raise InvalidRequest(
            f"the {name} request body is truncated or has trailing bytes after the stream."
        )
    return out


def _too_large(size: int | None, limit: int, what: str) -> str:
    got = "" if size is None else f" ({size} bytes)"
    return (
        f"{what}{got} exceeds the limit of {limit} bytes; send smaller batches, or start the "
        f"server with a larger max_body_bytes (jaxnitro serve --max-body-bytes)."
    )
