"""The gRPC side of the Open Inference Protocol: ``inference.GRPCInferenceService`` with
the six core RPCs and Triton's ``ModelConfig``, ``ModelStatistics`` and ``Repository*``
extensions, on grpc.aio in the same event loop (and through the same batchers) as the REST
app. Outputs always go back as ``raw_output_contents``, the only form
tritonclient.grpc reads; inputs may be raw or typed ``contents``. A `ServeError` becomes its
status code (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
import numpy as np

from jaxnitro._src.serve.codec import InferRequest, OutputWanted, TensorIn, parse_shape
from jaxnitro._src.serve.errors import InvalidRequest, NotFound, ServeError
from jaxnitro._src.serve.modelconfig import repository_parameters
from jaxnitro._src.serve.proto import grpc_service_pb2 as pb
from jaxnitro._src.serve.proto import grpc_service_pb2_grpc as pb_grpc
from jaxnitro._src.serve.registry import ServedModel
from jaxnitro._src.serve.runtime import Runtime, server_metadata
from jaxnitro._src.serve.tensors import datatype_of

log = logging.getLogger("jaxnitro.serve")

#: The typed-contents field of each datatype (FP16 and BF16 travel only raw).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_STATUS = {
    "OK": 200,
    "INVALID_ARGUMENT": 400,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 413,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 408,
    "INTERNAL": 500,
}


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.runtime.ready)

    async def ModelReady(self, request, context):
        # a model or version not loaded is not ready (as over HTTP, where tritonclient reads
        # any status but 200 as False), not an error: a client polls this while it loads
        try:
            model = self.runtime.registry.get(request.name, request.version or None)
        except NotFound:
            self.runtime.metrics.request(
                protocol="grpc", endpoint="ready", model="", code=404, seconds=None
            )
            return pb.ModelReadyResponse(ready=False)
        self.runtime.metrics.request(
            protocol="grpc", endpoint="ready", model=model.name, code=200, seconds=None
        )
        return pb.ModelReadyResponse(ready=model.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**server_metadata())

    async def ModelMetadata(self, request, context):
        model = await self._model(request.name, request.version, context, "metadata")
        meta = model.metadata()
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta["inputs"]],
            outputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta["outputs"]],
        )

    async def ModelInfer(self, request, context):
        runtime = self.runtime
        started = time.perf_counter()
        found, rows, code, model = "", 0, "OK", None
        input_s = output_s = 0.0
        runtime.metrics.inflight += 1
        share = runtime.inflight_bytes.share()
        try:
            share.take(request.ByteSize())
            # held until answered: a version being swapped out waits for this request
            model = runtime.registry.acquire(request.model_name, request.model_version or None)
            found = model.name
            decoding = time.perf_counter()
            parsed = _parse(request)
            prepared = model.prepare(parsed)
            input_s = time.perf_counter() - decoding
            rows = prepared.rows
            outputs = await runtime.run(model, prepared)
            encoding = time.perf_counter()
            response = _response(model.name, model.version, request.id, outputs)
            output_s = time.perf_counter() - encoding
            return response
        except asyncio.CancelledError:  # the server stops, and its drain timeout has passed
            runtime.grpc_cut += 1
            code = "CANCELLED"
            raise
        except ServeError as e:
            code = e.grpc_code
            await context.abort(getattr(grpc.StatusCode, code), str(e))
        except Exception as e:
            if isinstance(e, grpc.aio.AbortError):
                raise
            code = "INTERNAL"
            log.exception("internal error answering ModelInfer %r", request.model_name[:100])
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")
        finally:
            runtime.metrics.inflight -= 1
            share.release()
            seconds = time.perf_counter() - started
            runtime.metrics.request(
                protocol="grpc",
                endpoint="infer",
                model=found,
                code=_STATUS.get(code, 500),
                seconds=seconds,
            )
            if model is not None:
                runtime.registry.release(model)
                model.stats.request(
                    ok=code == "OK", seconds=seconds, rows=rows, input_s=input_s, output_s=output_s
                )
            if runtime.log_requests:
                log.info(
                    'grpc "ModelInfer %s" %s %.1fms rows=%d',
                    request.model_name[:100],
                    code,
                    seconds * 1e3,
                    rows,
                )

    async def ModelConfig(self, request, context):
        model = await self._model(request.name, request.version, context, "config")
        return pb.ModelConfigResponse(config=_message(pb.ModelConfig(), model.config()))

    async def ModelStatistics(self, request, context):
        stats = await self._answer(
            context, "stats", lambda: self.runtime.statistics(request.name, request.version)
        )
        return pb.ModelStatisticsResponse(
            model_stats=[_message(pb.ModelStatistics(), s) for s in stats]
        )

    async def RepositoryIndex(self, request, context):
        index = await self._answer(
            context, "repository_index", lambda: self.runtime.index(ready_only=request.ready)
        )
        entry = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(models=[entry(**e) for e in index])

    async def RepositoryModelLoad(self, request, context):
        def load():
            options = repository_parameters("load", _parameters(request.parameters))
            return self.runtime.load(request.model_name, **options)

        await self._answer(context, "load", load)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        def unload():
            options = repository_parameters("unload", _parameters(request.parameters))
            return self.runtime.unload(request.model_name, **options)

        await self._answer(context, "unload", unload)
        return pb.RepositoryModelUnloadResponse()

    async def _answer(self, context, endpoint: str, call) -> Any:
        """``call()`` (awaited if it is a coroutine), or its `ServeError` as a status."""
        try:
            result = call()
            if asyncio.iscoroutine(result):
                result = await result
        except ServeError as e:
            self.runtime.metrics.request(
                protocol="grpc", endpoint=endpoint, model="", code=e.status, seconds=None
            )
            await context.abort(getattr(grpc.StatusCode, e.grpc_code), str(e))
            raise  # abort raises; this line is never reached
        self.runtime.metrics.request(
            protocol="grpc", endpoint=endpoint, model="", code=200, seconds=None
        )
        return result

    async def _model(self, name: str, version: str, context, endpoint: str) -> ServedModel:
        try:
            model = self.runtime.registry.get(name, version or None)
        except ServeError as e:
            self.runtime.metrics.request(
                protocol="grpc", endpoint=endpoint, model="", code=e.status, seconds=None
            )
            await context.abort(getattr(grpc.StatusCode, e.grpc_code), str(e))
            raise  # abort raises; this line is never reached
        self.runtime.metrics.request(
            protocol="grpc", endpoint=endpoint, model=model.name, code=200, seconds=None
        )
        return model


def _parse(request: Any) -> InferRequest:
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequest(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            f"give one per input, in order."
        )
    inputs = []
    for i, t in enumerate(request.inputs):
        shape = parse_shape(t.name, list(t.shape))
        if raw:
            if t.HasField("contents"):
                raise InvalidRequest(
                    f"input {t.name!r} has typed contents, but the request uses "
                    f"raw_input_contents; use one form for all inputs."
                )
            inputs.append(TensorIn(t.name, t.datatype, shape, raw=raw[i]))
            continue
        field = _CONTENTS.get(t.datatype)
        if field is None:
            raise InvalidRequest(
                f"input {t.name!r}: {t.datatype or '(no datatype)'} has no typed contents "
                f"field; send it in raw_input_contents."
            )
        values = list(getattr(t.contents, field))
        # typed contents are of one kind: only bool_contents holds booleans
        bools = field == "bool_contents"
        inputs.append(TensorIn(t.name, t.datatype, shape, data=values, may_hold_bools=bools))
    outputs = tuple(OutputWanted(o.name) for o in request.outputs) or None
    return InferRequest(inputs=tuple(inputs), outputs=outputs, id=request.id or None)


def _parameters(parameters: Any) -> dict[str, Any]:
    """A repository request's ``map<string, ModelRepositoryParameter>`` as plain values."""
    out = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        out[key] = None if choice is None else getattr(parameter, choice)
    return out


def _message(message: Any, doc: dict) -> Any:
    """``message`` filled from the JSON form Triton's REST API writes of it."""
    from google.protobuf import json_format

    return json_format.ParseDict(doc, message)


def _response(name: str, version: str, request_id: str, outputs: dict[str, np.ndarray]):
    response = pb.ModelInferResponse(model_name=name, model_version=version, id=request_id)
    for key, arr in outputs.items():
        response.outputs.add(name=key, datatype=datatype_of(arr.dtype), shape=list(arr.shape))
        response.raw_output_contents.append(
            np.ascontiguousarray(arr, arr.dtype.newbyteorder("<")).tobytes()
        )
    return response


async def start_grpc(runtime: Runtime, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A started grpc.aio server for ``runtime`` on host:port (0: any free port)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", runtime.max_body_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),
        ]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(runtime), server)
    try:
        bound = server.add_insecure_port(f"{_host(host)}:{port}")
    except RuntimeError as e:  # grpcio raises, older ones returned 0
        raise OSError(f"cannot listen for gRPC on {host}:{port}: {e}") from None
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    return server, bound


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
