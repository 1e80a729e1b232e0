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
from typing import Any

import numpy as np

from jaxnitro._src.serve.batcher import Batcher
from jaxnitro._src.serve.body import READ_TIMEOUT_S, InflightBytes
from jaxnitro._src.serve.errors import InvalidRequest, Unavailable
from jaxnitro._src.serve.metrics import Gauge, Metrics
from jaxnitro._src.serve.registry import DEFAULT_BUCKET_CAP, Prepared, Registry, ServedModel

#: Bodies at least this large are decoded in a thread, so a big JSON request does not
#: stall the event loop.
OFFLOAD_BYTES = 1 << 20
#: The default --max-inflight-bytes, in bodies of the largest size (--max-body-bytes).
INFLIGHT_BODIES = 4
#: The protocol extensions this server implements (server metadata).
EXTENSIONS = (
    "binary_tensor_data",
    "model_configuration",
    "statistics",
    "model_repository",
)


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
    #: Seconds a request body gets to arrive, on every endpoint that reads one.
    body_timeout: float = READ_TIMEOUT_S
    metrics: Metrics = dataclasses.field(init=False)
    inflight_bytes: InflightBytes = dataclasses.field(init=False)
    #: gRPC inference calls cancelled unanswered (by the drain timeout).
    grpc_cut: int = dataclasses.field(init=False, default=0)
    #: The model repository, when serving one (`jaxnitro._src.serve.repository`).
    repository: Any = dataclasses.field(init=False, default=None)
    #: True until the models to serve at start-up are loaded (not ready meanwhile).
    starting: bool = dataclasses.field(init=False, default=False)
    #: True from SIGTERM on: not ready, so a load balancer stops sending, while the
    #: requests in flight finish.
    stopping: bool = dataclasses.field(init=False, default=False)
    _started: bool = dataclasses.field(init=False, default=False)

    def __post_init__(self) -> None:
        # batch-size histogram buckets at the padded sizes: one bucket per compiled program
        cap = self.max_batch_size or DEFAULT_BUCKET_CAP
        buckets = sorted({b for m in self.registry.all() for b in m.bucket_sizes()}) or [
            *_powers(cap)
        ]
        self.metrics = Metrics(
            batch_buckets=buckets, gauges=self._gauges, snapshots=self._snapshots
        )
        if self.max_inflight_bytes is None:
            self.max_inflight_bytes = INFLIGHT_BODIES * self.max_body_bytes
        self.inflight_bytes = InflightBytes(self.max_inflight_bytes)

    @property
    def ready(self) -> bool:
        """Ready (``/v2/health/ready``): started, not stopping, every loaded model warmed
        up, and every model a repository names with a version ready."""
        if self.starting or self.stopping or not self.registry.ready:
            return False
        return self.repository is None or self.repository.ready

    def start(self) -> None:
        """Start a batcher per model version on the running event loop."""
        self._started = True
        for model in self.registry.all():
            self._start_batcher(model)

    def _start_batcher(self, model: ServedModel) -> None:
        stats, name = model.stats, model.name

        def on_batch(rows: int, seconds: float, waits: list[float]) -> None:
            self.metrics.batch(name, rows, seconds)
            stats.call(rows, seconds, waits)

        cap, delay = self.max_batch_size, self.max_batch_delay_ms
        if model.configured:  # a repository's config.pbtxt (or load config) set its own
            cap = model.bucket_cap if model.batching else None
            delay = model.max_batch_delay_ms
        model.batcher = Batcher(
            model,
            max_batch_size=cap,
            max_delay_s=delay / 1e3,
            max_queue_size=self.max_queue_size,
            on_batch=on_batch,
        )
        model.batcher.start()

    async def warm_up(self, done: Callable[[str, int], None] | None = None) -> None:
        """Compile every bucket of every model (concurrently, one worker thread each);
        `done(model, size)` follows each bucket, on that model's worker thread."""
        await asyncio.gather(*(self._warm(m, done) for m in self.registry.all()))

    @staticmethod
    async def _warm(model: ServedModel, done: Callable[[str, int], None] | None = None) -> None:
        each = None if done is None else functools.partial(done, model.name)
        await asyncio.get_running_loop().run_in_executor(model.executor, model.warm_up, each)
        model.ready = True

    async def add_version(self, model: ServedModel) -> None:
        """Put a loaded version in service: in the table but not ready (requests without a
        version keep going to the versions already ready), its batcher started, every
        bucket compiled and run once, and only then ready."""
        self.registry.add(model)
        if self._started:
            self._start_batcher(model)
        await self._warm(model)

    async def retire(self, model: ServedModel) -> None:
        """Take a version out of service without failing a request: out of the table first
        (no new request reaches it), then wait for the requests holding it (in flight and
        queued) to be answered, then stop its batcher and worker thread."""
        self.registry.remove(model)
        if model.leases:
            model.drained = asyncio.Event()
            await model.drained.wait()
        if model.batcher is not None:
            await model.batcher.close()
        model.ready = False
        await asyncio.to_thread(model.executor.shutdown, wait=True)

    async def abandon(self, model: ServedModel) -> None:
        """Take out of service a version whose load or warm-up hung: out of the table, its
        batcher stopped (no request reached it: it never was ready), its worker thread
        left to itself (a thread cannot be stopped)."""
        self.registry.remove(model)
        model.ready = False
        if model.batcher is not None:
            await model.batcher.close()
        model.executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, model: ServedModel, prepared: Prepared) -> dict[str, np.ndarray]:
        """The requested outputs for a prepared request, through the model's batcher."""
        if not model.ready:
            raise Unavailable(f"model {model.name!r} is warming up; retry shortly.")
        batcher = model.batcher
        if batcher is None:
            raise Unavailable(f"model {model.name!r} is not started.")
        outputs = await batcher.submit(prepared.inputs, prepared.rows)
        return {k: outputs[k] for k in prepared.outputs}

    async def close(self) -> None:
        if self.repository is not None:
            await self.repository.stop()
        # a version still warming up (perhaps hung) is left behind, not waited for
        for model in [m for m in self.registry.all() if not m.ready]:
            await self.abandon(model)
        models = self.registry.all()
        await asyncio.gather(*(m.batcher.close() for m in models if m.batcher is not None))
        for model in models:
            model.ready = False
        await asyncio.get_running_loop().run_in_executor(None, self.registry.close)

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def _snapshots(self) -> list[dict]:
        return [m.stats.snapshot(m.name, m.version) for m in self.registry.all()]

    def statistics(self, name: str = "", version: str = "") -> list[dict]:
        """Triton's ``model_stats``: of every version, of a model's, or of one version."""
        if not name:
            models = self.registry.all()
        elif version:
            models = [self.registry.get(name, version)]
        else:
            self.registry.get(name)  # 404 for an unknown name
            models = list(self.registry.table[name].values())
        return [m.stats.snapshot(m.name, m.version) for m in models]

    def index(self, *, ready_only: bool = False) -> list[dict]:
        """Triton's repository index (without a repository: the bundles served)."""
        if self.repository is not None:
            return self.repository.index(ready_only=ready_only)
        out = [
            {"name": m.name, "version": m.version, "state": "READY" if m.ready else "LOADING"}
            for m in self.registry.all()
        ]
        return [e for e in out if e["state"] == "READY"] if ready_only else out

    async def load(self, name: str, **options: Any) -> None:
        await self._repository("load").load(name, **options)

    async def unload(self, name: str, **options: Any) -> None:
        await self._repository("unload").unload(name, **options)

    def _repository(self, action: str) -> Any:
        if self.repository is None:
            raise InvalidRequest(
                f"cannot {action} a model: this server serves the bundles it was started "
                f"with, not a model repository; start it with --model-repository DIR "
                f"--model-control-mode explicit to {action} models by request."
            )
        return self.repository

    def _gauges(self) -> list[Gauge]:
        table = self.registry.table
        by_model = {name: list(v.values()) for name, v in table.items()}
        newest = self.registry.models

        def total(models: list[ServedModel], read) -> float:
            return sum(read(m.batcher) for m in models if m.batcher is not None)

        return [
            (
                "jaxnitro_queue_depth",
                "Requests waiting for a model call.",
                [({"model": k}, total(ms, lambda b: b.depth)) for k, ms in by_model.items()],
            ),
            (
                "jaxnitro_queue_rows",
                "Rows waiting for a model call.",
                [({"model": k}, total(ms, lambda b: b.queued_rows)) for k, ms in by_model.items()],
            ),
            (
                "jaxnitro_model_ready",
                "1 once the model is loaded and warmed up.",
                [({"model": k}, float(m.ready)) for k, m in newest.items()],
            ),
            (
                "jaxnitro_compiled_batch_sizes",
                "Padded batch sizes compiled so far.",
                [({"model": k}, len(m.compiled_batch_sizes)) for k, m in newest.items()],
            ),
        ]


def _powers(cap: int) -> list[int]:
    sizes, b = [], 1
    while b < cap:
        sizes.append(b)
        b *= 2
    return [*sizes, cap]
