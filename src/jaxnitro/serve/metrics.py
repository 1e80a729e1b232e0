"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand: a
few counters and histograms need no client library, and the server then has no global
registry for tests or a second server in the same process to collide in.

Exposed (``GET /metrics``):

- ``jaxnitro_requests_total{protocol, endpoint, model, code}``: every API request, by HTTP
  status (gRPC codes counted as the status they map to); ``model`` is empty unless the
  request named a model this server has, so unknown names cannot grow the label set.
- ``jaxnitro_request_errors_total{protocol, code}``: the requests answered with an error.
- ``jaxnitro_request_duration_seconds{protocol, model}``: inference latency, histogram.
- ``jaxnitro_batch_rows{model}``: rows per bundle call, histogram (its ``_count`` is the
  number of calls); ``jaxnitro_batch_duration_seconds{model}``: time per call.
- ``jaxnitro_queue_depth{model}`` / ``jaxnitro_queue_rows{model}``: requests / rows waiting.
- ``jaxnitro_inflight_requests``, ``jaxnitro_model_ready{model}``,
  ``jaxnitro_compiled_batch_sizes{model}`` (programs compiled: fixed after warm-up).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

Labels = tuple[tuple[str, str], ...]
#: (name, help, [(labels, value)]) of a gauge read at scrape time.
Gauge = tuple[str, str, list[tuple[dict[str, str], float]]]


class _Histogram:
    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class Metrics:
    """The server's counters and histograms; safe to update from any thread."""

    def __init__(self, *, batch_buckets: Sequence[float] = (1, 2, 4, 8, 16, 32, 64, 128, 256)):
        self._lock = threading.Lock()
        self._requests: dict[Labels, int] = {}
        self._errors: dict[Labels, int] = {}
        self._latency: dict[Labels, _Histogram] = {}
        self._batch_rows: dict[Labels, _Histogram] = {}
        self._batch_seconds: dict[Labels, _Histogram] = {}
        self._batch_buckets = tuple(sorted(batch_buckets))
        self.inflight = 0

    def request(
        self, *, protocol: str, endpoint: str, model: str, code: int, seconds: float | None
    ) -> None:
        with self._lock:
            key = (
                ("protocol", protocol),
                ("endpoint", endpoint),
                ("model", model),
                ("code", str(code)),
            )
            self._requests[key] = self._requests.get(key, 0) + 1
            if code >= 400:
                err = (("protocol", protocol), ("code", str(code)))
                self._errors[err] = self._errors.get(err, 0) + 1
            if seconds is not None and endpoint == "infer":
                lat = (("protocol", protocol), ("model", model))
                self._latency.setdefault(lat, _Histogram(LATENCY_BUCKETS)).observe(seconds)

    def batch(self, model: str, rows: int, seconds: float) -> None:
        with self._lock:
            key = (("model", model),)
            self._batch_rows.setdefault(key, _Histogram(self._batch_buckets)).observe(rows)
            self._batch_seconds.setdefault(key, _Histogram(LATENCY_BUCKETS)).observe(seconds)

    def render(self, gauges: Iterable[Gauge] = ()) -> str:
        """The exposition text, with ``gauges`` (read by the caller now) appended."""
        out: list[str] = []
        with self._lock:
            _counter(out, "jaxnitro_requests_total", "API requests by status code.", self._requests)
            _counter(
                out,
                "jaxnitro_request_errors_total",
                "Requests answered with an error.",
                self._errors,
            )
            _histogram(
                out,
                "jaxnitro_request_duration_seconds",
                "Inference request latency.",
                self._latency,
            )
            _histogram(
                out,
                "jaxnitro_batch_rows",
                "Rows per model call (before padding).",
                self._batch_rows,
            )
            _histogram(
                out,
                "jaxnitro_batch_duration_seconds",
                "Seconds per model call.",
                self._batch_seconds,
            )
            inflight = self.inflight
        _gauge(out, "jaxnitro_inflight_requests", "Requests being answered.", [({}, inflight)])
        for name, text, samples in gauges:
            _gauge(out, name, text, samples)
        return "\n".join(out) + "\n"


def _label_text(labels: Iterable[tuple[str, str]]) -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in labels]
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _counter(out: list[str], name: str, text: str, values: dict[Labels, int]) -> None:
    out += [f"# HELP {name} {text}", f"# TYPE {name} counter"]
    out += [f"{name}{_label_text(k)} {v}" for k, v in sorted(values.items())]


def _histogram(out: list[str], name: str, text: str, values: dict[Labels, _Histogram]) -> None:
    out += [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
    for labels, h in sorted(values.items()):
        running = 0
        for bound, count in zip((*h.bounds, math.inf), h.counts, strict=True):
            running += count
            le = _label_text((*labels, ("le", _number(bound))))
            out.append(f"{name}_bucket{le} {running}")
        out.append(f"{name}_sum{_label_text(labels)} {_number(h.sum)}")
        out.append(f"{name}_count{_label_text(labels)} {running}")


def _gauge(
    out: list[str], name: str, text: str, samples: list[tuple[dict[str, str], float]]
) -> None:
    out += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
    out += [f"{name}{_label_text(sorted(lab.items()))} {_number(v)}" for lab, v in samples]


def parse(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of an exposition text (for tests and benchmarks)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
