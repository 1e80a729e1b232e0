"""`jaxnitro serve`: exported bundles over the Open Inference Protocol (KServe V2), so
standard clients (tritonclient.http/grpc, KServe, plain JSON) work unchanged.

It may import `core`, `export` and `observe.display` (the warm-up's progress).

The modules, in the order a request meets them:

- `connections`: the REST port's guards (connection cap, header deadline and size, and a
  connection answered before its body arrived closed);
- `body`: the request body within size and time limits, gzip/deflate decoded, and the
  bytes in flight across requests;
- `codec`: REST JSON + binary tensor framing <-> `InferRequest` / response bytes;
  `tensors`: datatype names and element decoding;
- `registry`: the models by name and version, metadata and configuration, the version a
  request gets and the lease it holds, and the checks that run before queueing;
- `batcher`: the per-version queue that merges concurrent requests into one bundle call;
- `runtime`: registry + batchers + metrics, their life cycle, and version swaps;
- `repository`: a model repository (``DIR/<model>/<version>/``), control modes, load
  timeouts; `modelconfig`: version policies, ``config.pbtxt`` and the load API's parameters;
- `rest` (Starlette) and `grpc_service` (grpc.aio): the two protocols;
- `stats`: Triton's statistics per version; `metrics`: prometheus_client, a registry per
  server; `server`: `serve` and `build_app`; `command`: the CLI.

Example:
    >>> jn.export_model(n, "bundles/tiny")
    >>> from jaxnitro._src.serve import serve
    >>> serve(["bundles/tiny"], port=8000, grpc_port=8001, max_batch_size=32)
    >>> serve(model_repository="models", model_control_mode="poll", grpc_port=8001)
"""

from typing import TYPE_CHECKING, Any

from jaxnitro._src.serve.errors import (
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ServeError,
    Unavailable,
)

if TYPE_CHECKING:
    from jaxnitro._src.serve.server import build_app, serve


def __getattr__(name: str) -> Any:
    # Imported on first use: `jaxnitro serve --help` (and the jaxnitro CLI, which registers
    # the command) must work without starlette, uvicorn and grpcio installed.
    if name in ("serve", "build_app"):
        from jaxnitro._src.serve import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "InvalidRequest",
    "NotFound",
    "PayloadTooLarge",
    "ServeError",
    "Unavailable",
    "build_app",
    "serve",
]
