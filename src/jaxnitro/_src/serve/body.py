"""Reading a request body within limits: at most ``limit`` bytes as sent (a larger
Content-Length is refused before reading), at most ``limit`` bytes after gzip/deflate
decompression (inflated in one bounded step, so a zip bomb costs ``limit`` bytes, not its
expansion), and within a deadline, so a client that trickles its body cannot hold a
connection forever. tritonclient sends no Content-Type, so the body is never
interpreted by its content type.

Across requests, `InflightBytes` bounds the bytes of the bodies being answered at once
(``--max-inflight-bytes``): a request that would go over it gets 503 before its body is
read, so many large requests at once cannot take the server's memory."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Mapping

from jaxnitro._src.serve.errors import InvalidRequest, PayloadTooLarge, RequestTimeout, Unavailable

#: The default limit on a request body (before and after decompression) and on a decoded
#: tensor: 64 MiB, as Triton's --http-max-input-size.
MAX_BODY_BYTES = 64 << 20
#: Seconds for a whole body to arrive.
READ_TIMEOUT_S = 30.0


class InflightBytes:
    """The request bytes being answered, against ``limit``: each request takes its share
    through a `Share` and gives it back when answered."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def share(self) -> Share:
        return Share(self)


class Share:
    """One request's bytes of an `InflightBytes` budget (give them back with `release`)."""

    def __init__(self, budget: InflightBytes):
        self.budget = budget
        self.held = 0

    def take(self, size: int) -> None:
        """Hold ``size`` more bytes, or raise `Unavailable` (503) if that goes over."""
        budget = self.budget
        if budget.used + size > budget.limit:
            raise Unavailable(
                f"the server is answering {budget.used} bytes of requests already; "
                f"{size} more would go over its limit of {budget.limit} "
                f"(jaxnitro serve --max-inflight-bytes). Retry shortly."
            )
        budget.used += size
        self.held += size

    def release(self) -> None:
        self.budget.used -= self.held
        self.held = 0


async def read_body(
    headers: Mapping[str, str],
    chunks: AsyncIterator[bytes],
    *,
    limit: int,
    timeout: float = READ_TIMEOUT_S,
    share: Share | None = None,
) -> bytes:
    """The decoded body: read from ``chunks``, decompressed per Content-Encoding.

    ``share`` takes the body's bytes as they are known: the declared Content-Length before
    reading (else each chunk as it comes), then the decompressed size."""
    declared = headers.get("content-length")
    per_chunk = share
    if declared is not None:
        if not declared.strip().isdigit():
            raise InvalidRequest(f"Content-Length {declared[:40]!r} is not a byte count.")
        if int(declared) > limit:
            raise PayloadTooLarge(_too_large(int(declared), limit, "the request body"))
        if share is not None:
            share.take(int(declared))
            per_chunk = None  # the whole body is held already
    try:
        async with asyncio.timeout(timeout):
            body = await _collect(chunks, limit, per_chunk)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout:g} s.") from None
    decoded = decompress(body, headers.get("content-encoding"), limit=limit)
    if share is not None and decoded is not body:
        share.take(len(decoded))
    return decoded


async def _collect(chunks: AsyncIterator[bytes], limit: int, share: Share | None) -> bytes:
    parts = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(_too_large(size, limit, "the request body"))
        if chunk:
            if share is not None:
                share.take(len(chunk))
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
