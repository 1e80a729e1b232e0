"""What a request can get wrong, as one exception per answer: the HTTP status and the gRPC
code both protocols send for it (the gRPC code by its `grpc.StatusCode` name, so the REST
server needs no grpcio). Handlers raise these; the REST app turns one into
``{"error": "<message>"}`` with its status, the gRPC service into its status code."""

from __future__ import annotations

from jaxnitro._src.core.errors import JaxnitroError


class ServeError(JaxnitroError):
    """A request the server refuses or cannot answer; ``str(e)`` is the message clients see."""

    status: int = 500
    grpc_code: str = "INTERNAL"
    #: Extra response headers (e.g. Retry-After).
    headers: dict[str, str] = {}


class InvalidRequest(ServeError):
    """Malformed JSON or binary framing, a wrong name, datatype, shape or element count."""

    status = 400
    grpc_code = "INVALID_ARGUMENT"


class NotFound(ServeError):
    """An unknown model, or a version this server does not have."""

    status = 404
    grpc_code = "NOT_FOUND"


class PayloadTooLarge(ServeError):
    """A body (before or after decompression) or a decoded tensor over the size limit."""

    status = 413
    grpc_code = "RESOURCE_EXHAUSTED"


class Unavailable(ServeError):
    """The model is still warming up, its queue is full, or the server is stopping."""

    status = 503
    grpc_code = "UNAVAILABLE"
    headers = {"Retry-After": "1"}


class RequestTimeout(ServeError):
    """The request body did not arrive in time."""

    status = 408
    grpc_code = "DEADLINE_EXCEEDED"
