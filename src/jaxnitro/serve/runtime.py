"""What both protocols share: the registry, a batcher per model, the metrics, and the
life cycle, start (batchers on the running loop) → warm up (every bucket size once, in
each model's worker thread; only then ready) → close (refuse new requests, answer the
queued ones, stop the worker threads)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
from collections.abc import Callable

import numpy as np

from jaxnitro.serve.batcher import Batcher
from jaxnitro.serve.body import InflightBytes
from jaxnitro.serve.errors import Unavailable
from jaxnitro.serve.metrics import Gauge, Metrics
from jaxnitro.serve.registry import Prepared, Registry, ServedModel

#: Bodies at least this large are decoded in a thread, so a big JSON request does not
#: stall the event loop.
OFFLOAD_BYTES = 1 << 20
#: The default --max-inflight-bytes, in bodies of the largest size (--max-body-bytes).
INFLIGHT_BODIES = 4
#: The protocol extensions this server implements (server metadata).
EXTENSIONS = ("binary_tensor_data",)


def server_metadata() -> dict:
    """The protocol's server metadata: name, version, extensions."""
    try:
        version = importlib.metadata.version("jaxnitro")
    except importlib.metadata.PackageNotFoundError:
        version = "0"
    return {"name": "jaxnitro", "version": version, "extensions": list(EXTENSIONS)}


@dataclasses.dataclass
class Runtime:
    registry: Registry
    max_batch_size: int | None
    max_batch_delay_ms: float
    max_body_bytes: int
    max_queue_size: int
    log_requests: bool = False
    #: The bytes of requests answered at once (None: 4 x max_body_bytes).
    max_inflight_bytes: int | None = None
    metrics: Metrics = dataclasses.field(init=False)
    inflight_bytes: InflightBytes = dataclasses.field(init=False)
    #: gRPC inference calls cancelled unanswered (by the drain timeout).
    grpc_cut: int = dataclasses.field(init=False, default=0)
    batchers: dict[str, Batcher] = dataclasses.field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        # batch-size histogram buckets at the padded sizes: one bucket per compiled program
        buckets = sorted({b for m in self.registry.models.values() for b in m.bucket_sizes()})
        self.metrics = Metrics(batch_buckets=buckets)
        if self.max_inflight_bytes is None:
            self.max_inflight_bytes = INFLIGHT_BODIES * self.max_body_bytes
        self.inflight_bytes = InflightBytes(self.max_inflight_bytes)

    def start(self) -> None:
        """Start a batcher per model on the running event loop."""
        for name, model in self.registry.models.items():
            batcher = Batcher(
                model,
                max_batch_size=self.max_batch_size,
                max_delay_s=self.max_batch_delay_ms / 1e3,
                max_queue_size=self.max_queue_size,
                on_batch=functools.partial(self.metrics.batch, name),
            )
            batcher.start()
            self.batchers[name] = batcher

    async def warm_up(self, done: Callable[[str, int], None] | None = None) -> None:
        """Compile every bucket of every model (concurrently, one worker thread each);
        `done(model, size)` follows each bucket, on that model's worker thread."""
        loop = asyncio.get_running_loop()

        async def one(model: ServedModel) -> None:
            each = None if done is None else functools.partial(done, model.name)
            await loop.run_in_executor(model.executor, model.warm_up, each)
            model.ready = True

        await asyncio.gather(*(one(m) for m in self.registry.models.values()))

    async def run(self, model: ServedModel, prepared: Prepared) -> dict[str, np.ndarray]:
        """The requested outputs for a prepared request, through the model's batcher."""
        if not model.ready:
            raise Unavailable(f"model {model.name!r} is warming up; retry shortly.")
        batcher = self.batchers.get(model.name)
        if batcher is None:
            raise Unavailable(f"model {model.name!r} is not started.")
        outputs = await batcher.submit(prepared.inputs, prepared.rows)
        return {k: outputs[k] for k in prepared.outputs}

    async def close(self) -> None:
        await asyncio.gather(*(b.close() for b in self.batchers.values()))
        for model in self.registry.models.values():
            model.ready = False
        await asyncio.get_running_loop().run_in_executor(None, self.registry.close)

    def render_metrics(self) -> str:
        return self.metrics.render(self._gauges())

    def _gauges(self) -> list[Gauge]:
        models = self.registry.models
        batchers = self.batchers
        return [
            (
                "jaxnitro_queue_depth",
                "Requests waiting for a model call.",
                [({"model": k}, b.depth) for k, b in batchers.items()],
            ),
            (
                "jaxnitro_queue_rows",
                "Rows waiting for a model call.",
                [({"model": k}, b.queued_rows) for k, b in batchers.items()],
            ),
            (
                "jaxnitro_model_ready",
                "1 once the model is loaded and warmed up.",
                [({"model": k}, float(m.ready)) for k, m in models.items()],
            ),
            (
                "jaxnitro_compiled_batch_sizes",
                "Padded batch sizes compiled so far.",
                [({"model": k}, len(m.compiled_batch_sizes)) for k, m in models.items()],
            ),
        ]
