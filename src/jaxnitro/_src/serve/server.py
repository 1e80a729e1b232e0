"""`serve` (blocking: REST on uvicorn, gRPC on grpc.aio, one event loop) and `build_app`
(the Starlette app alone, for in-process use).

The order of `serve`: load every bundle (a bad one fails here, before anything listens)
→ bind the ports → print the models and URLs → warm up (live but not ready until every
bucket size of every model has run once) → serve → on SIGTERM or Ctrl-C: not ready at once
(a load balancer stops sending), serving on until no request is in flight, then stop
accepting and answer what is left, all within the drain timeout; then cut what is left
(requests still running, responses a client does not read), leave behind the loads still
running (a hung warm-up cannot hold the exit), stop the worker threads, and return how many
were cut (`jaxnitro serve` exits 0 when none, `EXIT_CUT` otherwise). A second signal
aborts what is still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

try:
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn
except ImportError as e:  # pragma: no cover - the `serve` extra is missing
    raise ImportError(
        f"jaxnitro serve needs starlette, uvicorn and prometheus_client ({e}); pip install "
        f"'jaxnitro[serve]'."
    ) from e

from jaxnitro._src.core.errors import ConfigError, check_int
from jaxnitro._src.serve.assembly import (
    REPOSITORY_POLL_SECS,
    Sources,
    build_runtime,
    check_seconds,
)
from jaxnitro._src.serve.batcher import MAX_QUEUE_SIZE
from jaxnitro._src.serve.body import MAX_BODY_BYTES, READ_TIMEOUT_S
from jaxnitro._src.serve.connections import (
    HEADER_TIMEOUT_S,
    LINGER_MAX,
    MAX_CONNECTIONS,
    ConnectionLimits,
    protocol_class,
)
from jaxnitro._src.serve.repository import (
    MODEL_LOAD_TIMEOUT_S,
    describe,
    printable,
    quoted,
)
from jaxnitro._src.serve.rest import create_app, create_metrics_app
from jaxnitro._src.serve.runtime import Runtime

#: Seconds the requests in progress get to finish after SIGTERM (REST and gRPC).
DRAIN_TIMEOUT_S = 30.0
#: The exit status of `jaxnitro serve` when the drain timeout cut requests.
EXIT_CUT = 3
#: File descriptors kept for the server's own files, gRPC, and refused connections that
#: linger, when fitting max_connections under the open-files limit.
_RESERVED_FDS = 64 + LINGER_MAX

log = logging.getLogger("jaxnitro.serve")


def build_app(
    dirs: Sources = (),
    *,
    max_batch_size: int | None = None,
    max_batch_delay_ms: float = 0.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_queue_size: int = MAX_QUEUE_SIZE,
    max_inflight_bytes: int | None = None,
    body_timeout: float = READ_TIMEOUT_S,
    log_requests: bool = False,
    **repository: Any,
):
    """The Starlette app serving the bundles in ``dirs`` (REST only; no ports, no signals).

    The bundles load now; the batchers start and every bucket size is compiled when the
    app starts up (its lifespan), so use it as a context manager.

    Args:
        dirs: bundle directories (or loaded `jn.Bundle` objects), each served under its
            manifest name.
        max_batch_size: merge concurrent requests into calls of up to this many rows (None:
            each request runs alone).
        max_batch_delay_ms: how long a request may wait for others to join its call.
        max_body_bytes: the largest request body, before and after decompression, and the
            largest decoded input tensor.
        max_queue_size: requests waiting per model before new ones get 503.
        max_inflight_bytes: the request bytes answered at once (bodies, and what they
            decompress to) before new requests get 503; None: 4 x max_body_bytes.
        body_timeout: seconds a request body gets to arrive (every endpoint), else 408.
        log_requests: log one line per request (logger ``jaxnitro.serve``).
        repository: ``model_repository``, ``model_control_mode``, ``repository_poll_secs``,
            ``load_model``, ``version_policy`` and ``model_load_timeout``, as in `serve`
            (in place of ``dirs``).

    Example:
        >>> from starlette.testclient import TestClient
        >>> with TestClient(build_app(["bundles/mnist"])) as client:
        ...     client.get("/v2/models/mnistmlp").json()["inputs"]
        [{'name': 'img', 'datatype': 'UINT8', 'shape': [-1, 28, 28]}]
    """
    runtime = build_runtime(
        dirs,
        max_batch_size=max_batch_size,
        max_batch_delay_ms=max_batch_delay_ms,
        max_body_bytes=max_body_bytes,
        max_queue_size=max_queue_size,
        max_inflight_bytes=max_inflight_bytes,
        body_timeout=body_timeout,
        log_requests=log_requests,
        **repository,
    )
    app = create_app(runtime, lifespan=functools.partial(_lifespan, runtime))
    app.state.runtime = runtime
    return app


@contextlib.asynccontextmanager
async def _lifespan(runtime: Runtime, app: Any) -> AsyncIterator[None]:
    """The app's life: batchers started and every model warmed up, then closed."""
    runtime.start()
    await _load(runtime)
    try:
        yield
    finally:
        await runtime.close()


def serve(
    dirs: Sources = (),
    *,
    model_repository: str | os.PathLike | None = None,
    model_control_mode: str = "none",
    repository_poll_secs: float = REPOSITORY_POLL_SECS,
    load_model: Sequence[str] = (),
    version_policy: str | dict | None = None,
    model_load_timeout: float = MODEL_LOAD_TIMEOUT_S,
    host: str = "127.0.0.1",
    port: int = 8000,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    max_batch_size: int | None = None,
    max_batch_delay_ms: float = 0.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_queue_size: int = MAX_QUEUE_SIZE,
    max_inflight_bytes: int | None = None,
    body_timeout: float = READ_TIMEOUT_S,
    header_timeout: float = HEADER_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
    drain_timeout: float = DRAIN_TIMEOUT_S,
    log_requests: bool = False,
) -> int:
    """Serve bundles over the Open Inference Protocol (KServe V2) until SIGTERM or Ctrl-C.

    Standard clients work unchanged: tritonclient.http (JSON and binary tensors, gzip),
    tritonclient.grpc, KServe V2 JSON. Each bundle is served under its manifest name at
    ``/v2/models/<name>``; ``/v2/health/ready`` answers 200 once every model has compiled
    every batch size it can be padded to. Port 0 picks a free port (printed at start-up).

    Args:
        dirs: bundle directories (or loaded `jn.Bundle` objects); or instead:
        model_repository: a directory laid out as ``<model>/<version>/`` (a bundle in each
            version directory, versions positive integers), served under those names.
        model_control_mode: ``none`` (load every model at start), ``poll`` (rescan every
            ``repository_poll_secs``: load added versions, unload removed ones) or
            ``explicit`` (load ``load_model`` and what the load API asks for).
        repository_poll_secs: seconds between rescans in ``poll`` mode.
        load_model: the models ``explicit`` mode loads at start.
        version_policy: the versions served of a model without a ``policy.json``:
            ``latest:N`` (default ``latest:1``), ``all``, ``specific:1,3``, or Triton's
            JSON form.
        model_load_timeout: seconds one version of a repository's model gets to load and
            warm up; past it, it is UNAVAILABLE with that reason and left behind (a thread
            cannot be stopped), and the other models load and unload meanwhile.
        host: the address to listen on (both protocols).
        port: the REST port.
        grpc_port: the gRPC port; None: no gRPC.
        metrics_port: also serve ``/metrics`` on this port; None: only on the REST port.
        max_batch_size, max_batch_delay_ms, max_body_bytes, max_queue_size,
            max_inflight_bytes, body_timeout, log_requests: as in `build_app`.
        header_timeout: seconds a REST connection gets to send a request line and headers
            (from its start, or from a request's first byte), else 408 and closed.
        max_connections: REST connections open at once; one more is answered 503 and
            closed. Lowered (with a line saying so) when the open-files limit is lower.
        drain_timeout: seconds the requests in progress get after SIGTERM; then the rest
            (a client that does not read its response, too) are cut.

    Returns:
        The number of requests the drain timeout cut (0: a clean stop). A load or warm-up
        left behind (hung) keeps its thread until the process ends; `jaxnitro serve` exits
        without waiting for it.

    Example:
        >>> jn.serve.serve(["bundles/mnist"], port=8000, grpc_port=8001, max_batch_size=32)
    """
    _check_ports(port=port, grpc_port=grpc_port, metrics_port=metrics_port)
    for name, seconds in (("header_timeout", header_timeout), ("drain_timeout", drain_timeout)):
        check_seconds(name, seconds)
    check_int("max_connections", max_connections, fix="pass e.g. 1000")
    runtime = build_runtime(
        dirs,
        max_batch_size=max_batch_size,
        max_batch_delay_ms=max_batch_delay_ms,
        max_body_bytes=max_body_bytes,
        max_queue_size=max_queue_size,
        max_inflight_bytes=max_inflight_bytes,
        body_timeout=body_timeout,
        log_requests=log_requests,
        model_repository=model_repository,
        model_control_mode=model_control_mode,
        repository_poll_secs=repository_poll_secs,
        load_model=load_model,
        version_policy=version_policy,
        model_load_timeout=model_load_timeout,
    )
    _configure_logging()
    limits = ConnectionLimits(
        header_timeout=float(header_timeout), max_connections=_fit_connections(max_connections)
    )
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(
            _serve(runtime, host, port, grpc_port, metrics_port, limits, float(drain_timeout))
        )


def _check_ports(**ports: int | None) -> None:
    """Raise `ConfigError` for a port out of range, or one port given to two protocols."""
    for name, value in ports.items():
        if value is not None and not (
            isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535
        ):
            raise ConfigError(f"{name} must be an int in [0, 65535], got {value!r}.")
    taken = [(k, v) for k, v in ports.items() if v]
    for i, (name, value) in enumerate(taken):
        for other, same in taken[:i]:
            if value == same:
                raise ConfigError(
                    f"{other} and {name} are both {value}; give each protocol its own port."
                )


def _loop_factory():
    """uvloop's event loop when it is installed (uvicorn's default too), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _load(runtime: Runtime) -> None:
    """Warm up the bundles given, or load what the repository serves at start."""
    if runtime.repository is None:
        await _warm_up(runtime)
        return
    try:
        await runtime.repository.start()
    finally:
        runtime.starting = False


def _fit_connections(wanted: int) -> int:
    """``wanted``, or fewer when the open-files limit cannot hold that many connections
    (after raising its soft limit as far as the hard one allows): past the limit accept()
    fails, and no client, good or bad, gets in."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:  # pragma: no cover - no procfs
        used = 0
    needed = wanted + used + _RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return wanted
    fitted = max(1, soft - used - _RESERVED_FDS)
    _say(
        f"max connections: {fitted}, not {wanted}: the open-files limit is {soft} (ulimit -n) "
        f"and {used} are in use; raise it to serve {wanted}."
    )
    return fitted


def _configure_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _say(text: str) -> None:
    print(text, flush=True)


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # ours handle SIGTERM/SIGINT, and exit 0 afterwards
        yield


async def _serve(
    runtime: Runtime,
    host: str,
    port: int,
    grpc_port: int | None,
    metrics_port: int | None,
    limits: ConnectionLimits,
    drain_timeout: float,
) -> int:
    stop = asyncio.Event()
    _handle_signals(asyncio.get_running_loop(), stop)
    sock = _bind(host, port)
    runtime.start()
    config = uvicorn.Config(
        create_app(runtime),
        http=protocol_class(limits),
        lifespan="off",
        log_level="warning",
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=None,
    )
    http = _Uvicorn(config)
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    grpc_server = None
    metrics_server: uvicorn.Server | None = None
    warm: asyncio.Task | None = None
    try:
        await _started(http, http_task)
        if http_task.done():
            raise ConfigError(f"the REST server on {host}:{port} did not start.")
        grpc_server, grpc_bound = await _start_grpc(runtime, host, grpc_port)
        metrics_server, metrics_bound = await _start_metrics(runtime, host, metrics_port, limits)
        _banner(runtime, host, sock.getsockname()[1], grpc_bound, metrics_bound)
        started = time.perf_counter()
        warm = asyncio.create_task(_load(runtime))
        waiting = {warm, http_task, asyncio.create_task(stop.wait())}
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if warm in done:
            warm.result()
            _report_ready(runtime, time.perf_counter() - started)
            await asyncio.wait({http_task, *waiting - {warm}}, return_when="FIRST_COMPLETED")
    finally:
        if warm is not None and not warm.done():  # SIGTERM while loading: stop waiting
            warm.cancel()
            await asyncio.gather(warm, return_exceptions=True)
        cut = await _shut_down(runtime, http, http_task, grpc_server, drain_timeout)
        if metrics_server is not None:
            metrics_server.should_exit = True
    return cut


async def _started(server: uvicorn.Server, task: asyncio.Task) -> None:
    """Wait until ``server`` listens, or its ``task`` ended (then raise what ended it)."""
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()


async def _start_grpc(runtime: Runtime, host: str, port: int | None) -> tuple[Any, int | None]:
    """The gRPC server on ``port`` and the port it bound; ``(None, None)`` for no gRPC."""
    if port is None:
        return None, None
    try:
        from jaxnitro._src.serve.grpc_service import start_grpc
    except ImportError as e:
        raise ConfigError(
            f"gRPC needs grpcio and protobuf ({e}); pip install 'jaxnitro[serve]', or "
            f"leave out grpc_port."
        ) from e
    try:
        return await start_grpc(runtime, host, port)
    except OSError as e:
        raise ConfigError(
            f"{e}: is another server using port {port}? Choose another one with "
            f"--grpc-port (0 picks a free one), or turn gRPC off with --no-grpc."
        ) from None


async def _start_metrics(
    runtime: Runtime, host: str, port: int | None, limits: ConnectionLimits
) -> tuple[uvicorn.Server | None, int | None]:
    """The ``/metrics`` server on ``port`` and the port it bound; ``(None, None)`` for none."""
    if port is None:
        return None, None
    sock = _bind(host, port, flag="--metrics-port")
    server = _Uvicorn(  # with the REST port's guards: it is as reachable
        uvicorn.Config(
            create_metrics_app(runtime),
            http=protocol_class(limits),
            lifespan="off",
            log_level="warning",
        )
    )
    await _started(server, asyncio.create_task(server.serve(sockets=[sock])))
    return server, sock.getsockname()[1]


def _report_ready(runtime: Runtime, seconds: float) -> None:
    """The line saying the server is ready, and each repository model's state."""
    loaded = "every model warmed up" if runtime.ready else "done loading (not ready)"
    _say(f"ready: {loaded} in {seconds:.1f}s")
    for entry in runtime.index() if runtime.repository is not None else ():
        version = f" version {entry['version']}" if entry["version"] else ""
        state = "serving" if entry["state"] == "READY" else "not serving"
        reason = f": {printable(entry['reason'])}" if entry.get("reason") else ""
        _say(f"  {state} {quoted(entry['name'])}{version}{reason}")


async def _warm_up(runtime: Runtime) -> None:
    """`runtime.warm_up()` with progress per model and batch size: a transient bar on a
    terminal, a line per step (about ten at most) in a log."""
    from jaxnitro._src.observe.display import Display

    total = sum(len(m.bucket_sizes()) for m in runtime.registry.all())
    lock = threading.Lock()  # the models warm up on their own worker threads
    with Display(None).bar("warming up", total, lines=True) as advance:

        def done(model: str, size: int) -> None:
            with lock:
                advance(1, f"{quoted(model)}, batch {size}")

        await runtime.warm_up(done)


async def _shut_down(runtime, http, http_task, grpc_server, drain_timeout: float) -> int:
    """Stop accepting, give what is in progress ``drain_timeout`` seconds, cut the rest;
    the number cut."""
    # [Step 1] not ready (a load balancer stops sending), serving on until nothing is in
    # flight; [Step 2] stop accepting, and give what is left the rest of the drain timeout
    runtime.stopping = True
    deadline = time.monotonic() + drain_timeout
    _say(
        f"stopping: not ready; finishing {runtime.metrics.inflight} request(s) in flight "
        f"(drain timeout {drain_timeout:g} s)"
    )
    while runtime.metrics.inflight and time.monotonic() < deadline and not http_task.done():
        await asyncio.sleep(0.05)
    left = max(deadline - time.monotonic(), 0.0)
    http.should_exit = True
    grpc_stop = None
    if grpc_server is not None:  # grpc.aio cancels the calls still running after the grace
        grpc_stop = asyncio.ensure_future(grpc_server.stop(left))
    tasks = [http_task] if grpc_stop is None else [http_task, grpc_stop]
    done, _ = await asyncio.wait(tasks, timeout=left)
    cut = 0 if http_task in done else _cut_connections(http)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    cut += runtime.grpc_cut
    await runtime.close()
    abandoned = sorted(runtime.repository.abandoned) if runtime.repository is not None else []
    if abandoned:
        hung = ", ".join(f"{quoted(name)} version {version}" for name, version in abandoned)
        _say(f"left behind: the load of {hung}, past --model-load-timeout")
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            raise result
    if cut:
        _say(
            f"stopped: cut {cut} request(s) still unanswered after the drain timeout of "
            f"{drain_timeout:g} s (running, or a client not reading its response; jaxnitro "
            f"serve --drain-timeout)"
        )
    else:
        _say("stopped")
    return cut


def _cut_connections(http: uvicorn.Server) -> int:
    """Close every REST connection left (a request still running, or a response its client
    does not read); the number that had a request."""
    connections = list(http.server_state.connections)
    cut = sum(1 for c in connections if getattr(c, "cycle", None) is not None)
    for task in list(http.server_state.tasks):
        task.cancel()
    for connection in connections:
        transport = getattr(connection, "transport", None)
        if transport is not None:
            transport.abort()
    http.force_exit = True  # uvicorn stops waiting for the connections to close
    return cut


def _handle_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> list[int]:
    """SIGTERM/SIGINT set ``stop``; a second one also aborts what is running."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        return received

    def on_signal(sig: int) -> None:
        received.append(sig)
        if len(received) > 1:
            _say("second signal: aborting requests in flight")
            os._exit(1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return received


def _bind(host: str, port: int, flag: str = "--port") -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # without it every response waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port} ({e.strerror or e}); choose another {flag} "
            f"(0 picks a free one)."
        ) from None
    sock.set_inheritable(True)
    return sock


def _banner(
    runtime: Runtime, host: str, rest_port: int, grpc_port: int | None, metrics_port: int | None
) -> None:
    shown = f"[{host}]" if ":" in host else host
    repository = runtime.repository
    if repository is None:
        models = runtime.registry.models
        _say(f"jaxnitro serve: {len(models)} model(s)")
        for model in models.values():
            meta = model.metadata()
            ins = ", ".join(f"{t['name']} {t['datatype']}{t['shape']}" for t in meta["inputs"])
            outs = ", ".join(f"{t['name']} {t['datatype']}{t['shape']}" for t in meta["outputs"])
            _say(f"  {quoted(model.name)} (version {model.version}): {ins} -> {outs}")
    else:
        poll = f", rescanned every {repository.poll_secs:g}s" if repository.mode == "poll" else ""
        _say(
            f"jaxnitro serve: model repository {quoted(str(repository.root))} (control mode "
            f"{repository.mode}{poll})"
        )
        for line in describe(repository.root):
            _say(line)
        wanted = [quoted(name) for name in sorted(repository.wanted)]
        _say(f"loading: {', '.join(wanted) if wanted else '(nothing: use the load API)'}")
    if runtime.max_batch_size:
        batching = (
            f"dynamic batching: up to {runtime.max_batch_size} rows, "
            f"{runtime.max_batch_delay_ms:g} ms delay"
        )
    else:
        batching = "dynamic batching: off (each request runs alone)"
    _say(batching)
    base = f"http://{shown}:{rest_port}"
    _say(f"REST:    {base}/v2  (POST {base}/v2/models/<name>/infer)")
    _say(f"         GET .../<name>/config, .../stats; POST {base}/v2/repository/index")
    if grpc_port is not None:
        _say(f"gRPC:    {shown}:{grpc_port}")
    _say(f"metrics: {base}/metrics")
    if metrics_port is not None:
        _say(f"metrics: http://{shown}:{metrics_port}/metrics")
    sizes = {len(m.bucket_sizes()) for m in runtime.registry.all()}
    if sizes:
        _say(f"warming up: {max(sizes)} batch sizes per model (not ready until done)")
