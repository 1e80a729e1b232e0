"""The REST side of the Open Inference Protocol (KServe V2) as a Starlette app.

Routes: ``GET /v2`` (server metadata), ``GET /v2/health/live``, ``GET /v2/health/ready``,
``GET /v2/models/{name}[/versions/{v}]`` (model metadata), ``GET .../ready``,
``POST .../infer``, Triton's extensions ``GET .../config``, ``GET /v2/models[/{name}
[/versions/{v}]]/stats``, ``POST /v2/repository/index``, ``POST
/v2/repository/models/{name}/load|unload``, and ``GET /metrics``. Every error, the
router's 404 and 405 included, is ``{"error": "<message>"}``; the infer route reads the
raw body (tritonclient sends no Content-Type), so no request is ever answered 422.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time
import zlib
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxnitro._src.serve import body, codec
from jaxnitro._src.serve.errors import InvalidRequest, PayloadTooLarge, ServeError
from jaxnitro._src.serve.metrics import CONTENT_TYPE
from jaxnitro._src.serve.modelconfig import repository_parameters
from jaxnitro._src.serve.registry import Prepared, ServedModel
from jaxnitro._src.serve.repository import quoted
from jaxnitro._src.serve.runtime import OFFLOAD_BYTES, Runtime, server_metadata

log = logging.getLogger("jaxnitro.serve")
#: The largest body of a repository request (index, load, unload): a small JSON object.
SMALL_BODY_BYTES = 1 << 20


def _json(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(doc, separators=(",", ":")),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def error_response(e: ServeError) -> Response:
    return _json({"error": str(e)}, e.status, e.headers or None)


def create_app(runtime: Runtime, *, lifespan=None) -> Starlette:
    """The app serving ``runtime``'s models (its batchers must run in the app's loop)."""
    api = _Api(runtime)
    # the router tries routes in order: inference first, it is nearly every request
    prefixes = ("/v2/models/{name}", "/v2/models/{name}/versions/{version}")
    routes = [Route(prefix + "/infer", api.infer, methods=["POST"]) for prefix in prefixes]
    routes += [
        Route("/v2/models/stats", api.statistics, methods=["GET"]),
        Route("/v2/repository/index", api.repository_index, methods=["POST"]),
        Route("/v2/repository/models/{name}/load", api.load, methods=["POST"]),
        Route("/v2/repository/models/{name}/unload", api.unload, methods=["POST"]),
        Route("/v2", api.server_metadata, methods=["GET"]),
        Route("/v2/health/live", api.live, methods=["GET"]),
        Route("/v2/health/ready", api.ready, methods=["GET"]),
    ]
    for prefix in prefixes:
        routes += [
            Route(prefix, api.model_metadata, methods=["GET"]),
            Route(prefix + "/ready", api.model_ready, methods=["GET"]),
            Route(prefix + "/config", api.model_config, methods=["GET"]),
            Route(prefix + "/stats", api.statistics, methods=["GET"]),
        ]
    routes.append(Route("/metrics", api.metrics, methods=["GET"]))
    return Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
        middleware=[Middleware(_AccessLog)] if runtime.log_requests else [],
        lifespan=lifespan,
    )


def create_metrics_app(runtime: Runtime) -> Starlette:
    """``GET /metrics`` alone (the ``--metrics-port`` server)."""

    async def metrics(request: Request) -> Response:
        return Response(runtime.render_metrics(), media_type=CONTENT_TYPE)

    return Starlette(
        routes=[Route("/metrics", metrics, methods=["GET"])],
        exception_handlers={HTTPException: _http_error},
    )


class _AccessLog:
    """One log line per HTTP request: client, method, path, status, time, rows inferred."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-", 0)
            rows = scope.get("state", {}).get("rows")
            log.info(
                '%s "%s %s" %d %.1fms%s',
                client[0],
                quoted(scope["method"][:20]),
                quoted(scope["path"][:200]),
                status,
                (time.perf_counter() - started) * 1e3,
                f" rows={rows}" if rows else "",
            )


class _Api:
    """The route handlers."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.registry = runtime.registry

    async def server_metadata(self, request: Request) -> Response:
        return _json(server_metadata())

    async def live(self, request: Request) -> Response:
        return _json({"live": True})

    async def ready(self, request: Request) -> Response:
        ok = self.runtime.ready
        return _json({"ready": ok}, 200 if ok else 503)

    async def model_metadata(self, request: Request) -> Response:
        return self._about_model(request, "metadata", lambda m: _json(m.metadata()))

    async def model_ready(self, request: Request) -> Response:
        def answer(m):
            return _json({"name": m.name, "ready": m.ready}, 200 if m.ready else 503)

        return self._about_model(request, "ready", answer)

    async def model_config(self, request: Request) -> Response:
        return self._about_model(request, "config", lambda m: _json(m.config()))

    async def statistics(self, request: Request) -> Response:
        name = request.path_params.get("name", "")
        try:
            doc = {"model_stats": self.runtime.statistics(name, _version(request) or "")}
            response = _json(doc)
        except ServeError as e:
            response = error_response(e)
        found = name if response.status_code == 200 else ""
        self._count("stats", found, response.status_code)
        return response

    async def repository_index(self, request: Request) -> Response:
        try:
            doc = await _small_json(request, self.runtime.body_timeout)
            response = _json(self.runtime.index(ready_only=bool(doc.get("ready"))))
        except ServeError as e:
            response = error_response(e)
        self._count("repository_index", "", response.status_code)
        return response

    async def load(self, request: Request) -> Response:
        return await self._repository(request, "load", self.runtime.load)

    async def unload(self, request: Request) -> Response:
        return await self._repository(request, "unload", self.runtime.unload)

    async def _repository(self, request: Request, endpoint: str, action) -> Response:
        try:
            doc = await _small_json(request, self.runtime.body_timeout)
            await action(request.path_params["name"], **_load_options(endpoint, doc))
            response = _json({})
        except ServeError as e:
            response = error_response(e)
        self._count(endpoint, "", response.status_code)
        return response

    def _count(self, endpoint: str, model: str, code: int) -> None:
        self.runtime.metrics.request(
            protocol="http", endpoint=endpoint, model=model, code=code, seconds=None
        )

    def _about_model(self, request: Request, endpoint: str, answer) -> Response:
        found = ""
        try:
            model = self.registry.get(request.path_params["name"], _version(request))
            response, found = answer(model), model.name
        except ServeError as e:
            response = error_response(e)
        self.runtime.metrics.request(
            protocol="http",
            endpoint=endpoint,
            model=found,
            code=response.status_code,
            seconds=None,
        )
        return response

    async def infer(self, request: Request) -> Response:
        runtime = self.runtime
        started = time.perf_counter()
        found, rows, model = "", 0, None
        input_s = output_s = 0.0
        runtime.metrics.inflight += 1
        share = runtime.inflight_bytes.share()
        try:
            # held until answered: a version being swapped out waits for this request
            model = self.registry.acquire(request.path_params["name"], _version(request))
            found = model.name
            data = await body.read_body(
                request.headers,
                request.stream(),
                limit=runtime.max_body_bytes,
                timeout=runtime.body_timeout,
                share=share,
            )
            decoding = time.perf_counter()
            parsed, prepared = await _decoded(model, data, request.headers.get(codec.HEADER_LENGTH))
            input_s = time.perf_counter() - decoding
            rows = prepared.rows
            outputs = await runtime.run(model, prepared)
            encoding = time.perf_counter()
            response = _encoded(model, parsed, outputs, request.headers.get("accept-encoding"))
            output_s = time.perf_counter() - encoding
        except ServeError as e:
            response = error_response(e)
        finally:
            runtime.metrics.inflight -= 1
            share.release()
            if model is not None:
                self.registry.release(model)
        seconds = time.perf_counter() - started
        code = response.status_code
        runtime.metrics.request(
            protocol="http", endpoint="infer", model=found, code=code, seconds=seconds
        )
        if model is not None:
            model.stats.request(
                ok=code == 200, seconds=seconds, rows=rows, input_s=input_s, output_s=output_s
            )
        request.state.rows = rows  # for the access log
        return response

    async def metrics(self, request: Request) -> Response:
        return Response(self.runtime.render_metrics(), media_type=CONTENT_TYPE)


async def _decoded(
    model: ServedModel, data: bytes, header_length: str | None
) -> tuple[codec.InferRequest, Prepared]:
    """The parsed request and the model's prepared inputs; a large body is decoded in a
    thread, so it does not stall the event loop."""

    def decode() -> tuple[codec.InferRequest, Prepared]:
        parsed = codec.parse_request(data, header_length)
        return parsed, model.prepare(parsed)

    if len(data) < OFFLOAD_BYTES:
        return decode()
    return await asyncio.to_thread(decode)


def _encoded(
    model: ServedModel, parsed: codec.InferRequest, outputs: dict, accept_encoding: str | None
) -> Response:
    """The response to ``parsed``: its outputs, binary where asked, compressed where accepted."""
    content, headers = codec.encode_response(
        model=model.name,
        version=model.version,
        request=parsed,
        outputs=outputs,
        binary=codec.binary_choice(parsed, list(outputs), model_dtypes(model)),
    )
    return _compressed(content, headers, accept_encoding)


def _version(request: Request) -> str | None:
    return request.path_params.get("version")


async def _small_json(request: Request, timeout: float) -> dict:
    """The JSON object of a repository request's body (empty: ``{}``), read as /infer reads
    its body: a declared Content-Length over `SMALL_BODY_BYTES` is refused before reading,
    a body without one stops being read at the limit, and all of it must arrive within
    ``timeout`` seconds (else 408)."""
    try:
        data = await body.read_body(
            request.headers, request.stream(), limit=SMALL_BODY_BYTES, timeout=timeout
        )
    except PayloadTooLarge:
        raise PayloadTooLarge(
            f"a repository request body is over {SMALL_BODY_BYTES} bytes; send a small JSON object."
        ) from None
    if not data.strip():
        return {}
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise InvalidRequest(f"the request body is not JSON ({e}); send a JSON object.") from None
    if not isinstance(doc, dict):
        raise InvalidRequest(f"the request body is JSON {type(doc).__name__}; send an object.")
    return doc


def _load_options(endpoint: str, doc: dict) -> dict:
    """The keyword arguments of a load or unload call, from its body (Triton's
    ``{"parameters": {...}}``): what is not supported is refused, never ignored."""
    unknown = sorted(set(doc) - {"parameters"})
    if unknown:
        raise InvalidRequest(
            f"a repository {endpoint} body has key(s) {unknown}; send "
            f'{{"parameters": {{...}}}} (or nothing).'
        )
    params = doc.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidRequest(f'"parameters" is JSON {type(params).__name__}; send an object.')
    return repository_parameters(endpoint, params)


async def _http_error(request: Request, exc: Exception) -> Response:
    """The router's 404/405 (and any HTTPException) as ``{"error": ...}``."""
    assert isinstance(exc, HTTPException)
    messages = {404: f"no route {request.url.path[:200]!r}", 405: "method not allowed"}
    text = messages.get(exc.status_code, str(exc.detail))
    return _json({"error": text}, exc.status_code, dict(exc.headers or {}))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal error answering %s", request.url.path[:200])
    return _json({"error": f"internal server error: {type(exc).__name__}: {exc}"}, 500)


def model_dtypes(model) -> dict:
    return {k: spec.dtype for k, spec in model.outputs.items()}


def _compressed(content: bytes, headers: dict[str, str], accept: str | None) -> Response:
    """The response, gzip/deflate-compressed if the client accepts it (tritonclient's
    response_compression_algorithm) and it is worth it."""
    codings = {c.split(";")[0].strip().lower() for c in (accept or "").split(",")}
    if len(content) >= 1024 and "gzip" in codings:
        content, headers = gzip.compress(content, 1), {**headers, "content-encoding": "gzip"}
    elif len(content) >= 1024 and "deflate" in codings:
        content, headers = zlib.compress(content, 1), {**headers, "content-encoding": "deflate"}
    media = headers.pop("content-type")
    return Response(content, media_type=media, headers=headers)
