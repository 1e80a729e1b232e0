"""Prometheus metrics through ``prometheus_client``, in a `CollectorRegistry` of the server's
own (never the library's global one), so two servers in one process, or in tests, never
share or collide on a metric.

Exposed (``GET /metrics`` on the REST port, and on ``--metrics-port``):

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
- Triton's names, per ``model`` and ``version``, read at scrape time from each version's
  `ModelStats`: ``nv_inference_request_success``, ``nv_inference_request_failure``,
  ``nv_inference_count``, ``nv_inference_exec_count``, ``nv_inference_request_duration_us``,
  ``nv_inference_queue_duration_us``, ``nv_inference_compute_infer_duration_us``: counters
  in meaning, written under Triton's exact names (no ``_total`` suffix, so typed
  ``untyped``), which its dashboards query.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

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

#: (name, help, [(labels, value)]) of a gauge read at scrape time.
Gauge = tuple[str, str, list[tuple[dict[str, str], float]]]
#: (model, version, stats snapshot) of every loaded version, read at scrape time.
Snapshots = Callable[[], Iterable[dict]]

#: Triton's counter name -> (help, how to read it from a stats snapshot).
_TRITON: dict[str, tuple[str, Callable[[dict], float]]] = {
    "nv_inference_request_success": (
        "Number of successful inference requests, all batch sizes",
        lambda s: s["inference_stats"]["success"]["count"],
    ),
    "nv_inference_request_failure": (
        "Number of failed inference requests, all batch sizes",
        lambda s: s["inference_stats"]["fail"]["count"],
    ),
    "nv_inference_count": (
        "Number of inferences performed (rows of batched requests)",
        lambda s: s["inference_count"],
    ),
    "nv_inference_exec_count": (
        "Number of model executions performed (merged requests run once)",
        lambda s: s["execution_count"],
    ),
    "nv_inference_request_duration_us": (
        "Cumulative inference request duration in microseconds",
        lambda s: (
            (s["inference_stats"]["success"]["ns"] + s["inference_stats"]["fail"]["ns"]) / 1e3
        ),
    ),
    "nv_inference_queue_duration_us": (
        "Cumulative inference queuing duration in microseconds",
        lambda s: s["inference_stats"]["queue"]["ns"] / 1e3,
    ),
    "nv_inference_compute_infer_duration_us": (
        "Cumulative compute inference duration in microseconds",
        lambda s: s["inference_stats"]["compute_infer"]["ns"] / 1e3,
    ),
}


class Metrics:
    """The server's counters and histograms (thread-safe, as prometheus_client's are).

    Args:
        batch_buckets: the histogram buckets of rows per call (the padded sizes).
        gauges: called at scrape time for the gauges of the moment.
        snapshots: called at scrape time for each loaded version's statistics.
    """

    def __init__(
        self,
        *,
        batch_buckets: Sequence[float] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
        gauges: Callable[[], Iterable[Gauge]] = list,
        snapshots: Snapshots = list,
    ):
        self.registry = CollectorRegistry(auto_describe=False)
        self.inflight = 0
        r = self.registry
        self._requests = Counter(
            "jaxnitro_requests",
            "API requests by status code.",
            ["protocol", "endpoint", "model", "code"],
            registry=r,
        )
        self._errors = Counter(
            "jaxnitro_request_errors",
            "Requests answered with an error.",
            ["protocol", "code"],
            registry=r,
        )
        self._latency = Histogram(
            "jaxnitro_request_duration_seconds",
            "Inference request latency.",
            ["protocol", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._batch_rows = Histogram(
            "jaxnitro_batch_rows",
            "Rows per model call (before padding).",
            ["model"],
            buckets=sorted(batch_buckets),
            registry=r,
        )
        self._batch_seconds = Histogram(
            "jaxnitro_batch_duration_seconds",
            "Seconds per model call.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._children: dict[tuple, tuple] = {}
        self._batch_children: dict[str, tuple] = {}
        r.register(_ScrapeTime(self, gauges, snapshots))

    def request(
        self, *, protocol: str, endpoint: str, model: str, code: int, seconds: float | None
    ) -> None:
        # the labelled children, looked up once per label set: `labels()` costs more than
        # the increment (a dict read here; the label sets are few and bounded)
        key = (protocol, endpoint, model, code)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self._requests.labels(protocol, endpoint, model, str(code)),
                self._errors.labels(protocol, str(code)) if code >= 400 else None,
                self._latency.labels(protocol, model) if endpoint == "infer" else None,
            )
        requests, errors, latency = children
        requests.inc()
        if errors is not None:
            errors.inc()
        if seconds is not None and latency is not None:
            latency.observe(seconds)

    def batch(self, model: str, rows: int, seconds: float) -> None:
        children = self._batch_children.get(model)
        if children is None:
            children = self._batch_children[model] = (
                self._batch_rows.labels(model),
                self._batch_seconds.labels(model),
            )
        children[0].observe(rows)
        children[1].observe(seconds)

    def render(self) -> bytes:
        """The exposition text (format 0.0.4)."""
        return generate_latest(self.registry)


class _ScrapeTime(Collector):
    """What is read when scraped: the gauges and Triton's per-version counters."""

    def __init__(self, metrics: Metrics, gauges: Callable, snapshots: Snapshots):
        self.metrics, self.gauges, self.snapshots = metrics, gauges, snapshots

    def collect(self) -> Iterable[Metric]:
        inflight = GaugeMetricFamily("jaxnitro_inflight_requests", "Requests being answered.")
        inflight.add_metric([], self.metrics.inflight)
        yield inflight
        for name, text, samples in self.gauges():
            keys = sorted({k for labels, _ in samples for k in labels})
            family = GaugeMetricFamily(name, text, labels=keys)
            for labels, value in samples:
                family.add_metric([labels.get(k, "") for k in keys], value)
            yield family
        snapshots = list(self.snapshots())
        for name, (text, read) in _TRITON.items():
            # "counter" would add "_total" to the name; Triton's dashboards query it bare
            triton = Metric(name, text, "unknown")
            for s in snapshots:
                triton.add_sample(name, {"model": s["name"], "version": s["version"]}, read(s))
            yield triton


def parse(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of an exposition text, read by prometheus_client's parser
    (for tests and benchmarks); labels in the order the text gives them."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
