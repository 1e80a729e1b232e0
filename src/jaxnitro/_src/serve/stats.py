"""Per model version inference statistics, in the shape of Triton's statistics extension
(``GET /v2/models/{m}/versions/{v}/stats``, gRPC ``ModelStatistics``).

A `ModelStats` is updated where the Prometheus metrics are (the request handlers when a
request is answered, the batcher after each model call) and read by three exporters: the
REST JSON, the gRPC message, and the ``nv_inference_*`` metric families.

- ``inference_count``: rows inferred (Triton counts each row of a batched request);
- ``execution_count``: model calls (one call runs the rows of several merged requests);
- ``success``/``fail``: answered requests, from arrival to response, by outcome;
- ``queue``: time from submission to the start of the request's model call;
- ``compute_input``/``compute_output``: decoding the request / encoding the response;
- ``compute_infer``: the model call, counted once per request in it;
- ``batch_stats``: per call size, the number of calls and their time.
"""

from __future__ import annotations

import threading
import time

#: The duration fields of ``inference_stats``, in Triton's order.
DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


class ModelStats:
    """The counters of one model version; safe to update from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        #: name -> [count, ns]
        self.durations: dict[str, list[int]] = {k: [0, 0] for k in DURATIONS}
        #: batch size -> [calls, ns]
        self.batches: dict[int, list[int]] = {}

    def request(self, *, ok: bool, seconds: float, rows: int, input_s: float, output_s: float):
        """A request answered (``ok``) or failed, after ``seconds`` in the server."""
        with self._lock:
            self._add("success" if ok else "fail", seconds)
            if ok:
                self.inference_count += rows
                self.last_inference_ms = int(time.time() * 1e3)
                self._add("compute_input", input_s)
                self._add("compute_output", output_s)

    def call(self, rows: int, seconds: float, waits: list[float]) -> None:
        """A model call on ``rows`` rows that took ``seconds``; ``waits``: the queue time of
        each request whose first rows it ran."""
        ns = int(seconds * 1e9)
        with self._lock:
            self.execution_count += 1
            entry = self.batches.setdefault(rows, [0, 0])
            entry[0] += 1
            entry[1] += ns
            infer = self.durations["compute_infer"]
            infer[0] += len(waits)
            infer[1] += ns * len(waits)
            for wait in waits:
                self._add("queue", wait)

    def _add(self, name: str, seconds: float) -> None:
        entry = self.durations[name]
        entry[0] += 1
        entry[1] += int(max(0.0, seconds) * 1e9)

    def snapshot(self, name: str, version: str) -> dict:
        """The statistics as Triton's REST JSON writes one entry of ``model_stats``."""
        with self._lock:
            return {
                "name": name,
                "version": version,
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {
                    k: {"count": c, "ns": ns} for k, (c, ns) in self.durations.items()
                },
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": {"count": calls, "ns": 0},
                        "compute_infer": {"count": calls, "ns": ns},
                        "compute_output": {"count": calls, "ns": 0},
                    }
                    for size, (calls, ns) in sorted(self.batches.items())
                ],
            }
