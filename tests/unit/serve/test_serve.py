"""`jaxnitro serve`: the Open Inference Protocol (KServe V2) over REST and gRPC.

Quick tests run the codec, the batcher and the Starlette app in-process on a fake bundle.
The slow ones export real bundles (Tiny, and a BF16-input variant), start
``python -m jaxnitro._src.serve`` in a subprocess on free ports and talk to it with the standard
clients (tritonclient.http binary and JSON, tritonclient.grpc, plain urllib JSON), then
throw the bad inputs of serving.md §5 at it, load it from 16 threads, and stop it with
SIGTERM while requests are in flight.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import Tiny, nitro

import jaxnitro as jn
from jaxnitro._src.serve import body, build_app, codec, registry
from jaxnitro._src.serve.codec import InferRequest
from jaxnitro._src.serve.errors import InvalidRequest, PayloadTooLarge, Unavailable
from jaxnitro._src.serve.metrics import parse as parse_metrics
from jaxnitro._src.serve.registry import Registry, ServedModel
from jaxnitro._src.serve.runtime import Runtime


# -- a fake bundle for the in-process tests -----------------------------------------------------
class FakeBundle:
    """Two inputs, two outputs, and a record of every call's batch size."""

    name = "fake"
    inputs = {"a": jn.TensorSpec("float32", (3,)), "b": jn.TensorSpec("int32", ())}
    outputs = {"total": jn.TensorSpec("float32", ()), "twice": jn.TensorSpec("float32", (3,))}

    def __init__(self, delay: float = 0.0):
        self.calls: list[int] = []
        self.delay = delay

    def __call__(self, *, a, b):
        assert a.dtype == np.float32 and b.dtype == np.int32
        self.calls.append(len(a))
        time.sleep(self.delay)
        return {"total": a.sum(-1) + b, "twice": a * 2}


def _binary_body(tensors: list[tuple[str, np.ndarray, str]], **params) -> tuple[bytes, int]:
    """A request framed like tritonclient.http's default (binary inputs and outputs)."""
    doc = {
        "inputs": [
            {
                "name": name,
                "shape": list(arr.shape),
                "datatype": dt,
                "parameters": {"binary_data_size": arr.nbytes},
            }
            for name, arr, dt in tensors
        ],
        "parameters": {"binary_data_output": True, **params},
    }
    header = json.dumps(doc).encode()
    return header + b"".join(arr.tobytes() for _, arr, _ in tensors), len(header)


def _split_binary_response(data: bytes, header_length: int) -> dict[str, np.ndarray]:
    doc = json.loads(data[:header_length])
    out, offset = {}, header_length
    for o in doc["outputs"]:
        dtype = {"FP32": np.float32, "INT32": np.int32, "BF16": ml_dtypes.bfloat16}[o["datatype"]]
        if "data" in o:
            out[o["name"]] = np.asarray(o["data"], dtype).reshape(o["shape"])
            continue
        size = o["parameters"]["binary_data_size"]
        raw = data[offset : offset + size]
        out[o["name"]] = np.frombuffer(raw, dtype).reshape(o["shape"])
        offset += size
    assert offset == len(data)
    return out


# -- quick ---------------------------------------------------------------------------------------
def test_codec_binary_framing_and_body_limits():
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    data, n = _binary_body([("x", x, "FP32")])
    req = codec.parse_request(data, str(n))
    (t,) = req.inputs
    assert (t.name, t.datatype, t.shape, bytes(t.raw)) == ("x", "FP32", (2, 2), x.tobytes())
    assert req.binary_output and req.outputs is None
    # raw binary request: the whole body is the one input
    assert codec.parse_request(x.tobytes(), "0").raw_body == x.tobytes()

    def refused(body_bytes, header, match):
        with pytest.raises(InvalidRequest, match=match):
            codec.parse_request(body_bytes, header)

    refused(data + b"\0", str(n), "unexpected additional input data: 1 bytes")
    refused(data[:-1], str(n), "expecting 16 additional bytes, 15 left")
    refused(data, str(len(data) + 1), rf"must be an integer in \[0, {len(data)}\]")
    refused(data, "12abc", "Inference-Header-Content-Length must be an integer")
    refused(data, "99999999999999999999", "Inference-Header-Content-Length must be")
    refused(data[:n], None, "no binary part")
    refused(data, None, "16 bytes after its JSON: .*Inference-Header-Content-Length")
    refused(b"{not json", None, "failed to parse the request JSON")
    refused(b"[" * 100_000, None, "nested too deeply|failed to parse")
    # zip bomb: the decompressed size is capped, not the compressed one
    bomb = gzip.compress(b"0" * 1_000_000)
    with pytest.raises(PayloadTooLarge, match="decompressed"):
        body.decompress(bomb, "gzip", limit=100_000)
    assert body.decompress(zlib.compress(b"abc"), "deflate", limit=10) == b"abc"
    with pytest.raises(InvalidRequest, match="truncated"):
        body.decompress(bomb[:-20], "gzip", limit=10_000_000)


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_app_in_process_json_binary_and_errors():
    from starlette.testclient import TestClient

    fake = FakeBundle()
    app = build_app([fake], max_batch_size=4)
    with TestClient(app) as client:
        assert sorted(fake.calls) == [1, 2, 4]  # warm-up: every bucket size once
        assert client.get("/v2/health/ready").status_code == 200
        meta = client.get("/v2/models/fake").json()
        assert meta["platform"] == "jax" and meta["inputs"][0] == {
            "name": "a",
            "datatype": "FP32",
            "shape": [-1, 3],
        }
        a = np.arange(15, dtype=np.float32).reshape(5, 3)
        b = np.arange(5, dtype=np.int32)
        doc = {
            "id": "r1",
            "inputs": [
                {"name": "a", "shape": [5, 3], "datatype": "FP32", "data": a.tolist()},
                {"name": "b", "shape": [5], "datatype": "INT32", "data": b.tolist()},
            ],
        }
        r = client.post("/v2/models/fake/versions/1/infer", content=json.dumps(doc))
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["id"] == "r1" and got["model_name"] == "fake"
        np.testing.assert_allclose(got["outputs"][0]["data"], a.sum(-1) + b)
        assert fake.calls[-2:] == [4, 1]  # 5 rows > max_batch_size 4: split
        data, n = _binary_body([("a", a, "FP32"), ("b", b, "INT32")])
        r = client.post(
            "/v2/models/fake/infer",
            content=data,
            headers={"Inference-Header-Content-Length": str(n)},
        )
        out = _split_binary_response(r.content, int(r.headers["inference-header-content-length"]))
        np.testing.assert_allclose(out["twice"], a * 2)
        bad = [
            ("/v2/models/nope/infer", doc, 404, "unknown model 'nope'"),
            ("/v2/models/fake/versions/7/infer", doc, 404, "no version '7'"),
            ("/v2/models/fake/infer", {"inputs": doc["inputs"][:1]}, 400, r"missing .*\['b'\]"),
            ("/v2/models/fake/infer", {**doc, "outputs": [{"name": "tota"}]}, 400, "'total'"),
        ]
        for path, payload, status, match in bad:
            r = client.post(path, content=json.dumps(payload))
            assert r.status_code == status and re.search(match, r.json()["error"]), r.text
        r = client.get("/v2/models/fake/infer")
        assert r.status_code == 405 and "error" in r.json()
        assert client.get("/v2/health/live").status_code == 200
        counts = parse_metrics(client.get("/metrics").text)
        unknown = 'jaxnitro_requests_total{code="404",endpoint="infer",model="",protocol="http"}'
        assert counts[unknown] == 2  # unknown model, unknown version: no label for the name
    # without its lifespan (not started, not warmed up) the app is live but not ready
    client = TestClient(build_app([FakeBundle()]))
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 503
    r = client.post("/v2/models/fake/infer", content=json.dumps(doc))
    assert r.status_code == 503 and "warming up" in r.json()["error"]


def test_batcher_merges_splits_isolates_and_bounds_its_queue():
    fake = FakeBundle(delay=0.01)
    model = ServedModel(fake, bucket_cap=8, max_tensor_bytes=1 << 20)
    runtime = Runtime(
        Registry([model]),
        max_batch_size=8,
        max_batch_delay_ms=5,
        max_body_bytes=1 << 20,
        max_queue_size=64,
    )
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(1, 6, 30)] + [19]  # 19 > 8: split across calls

    async def main():
        runtime.start()
        model.ready = True
        batcher = runtime.registry.get("fake").batcher

        async def one(rows):
            a = rng.normal(size=(rows, 3)).astype(np.float32)
            b = rng.integers(0, 9, rows).astype(np.int32)
            out = await batcher.submit({"a": a, "b": b}, rows)
            np.testing.assert_allclose(out["total"], a.sum(-1) + b, rtol=1e-6)
            np.testing.assert_allclose(out["twice"], a * 2)

        await asyncio.gather(*(one(s) for s in sizes))
        small = Runtime(
            Registry([ServedModel(FakeBundle(0.2), bucket_cap=8, max_tensor_bytes=1 << 20)]),
            max_batch_size=None,
            max_batch_delay_ms=0,
            max_body_bytes=1 << 20,
            max_queue_size=1,
        )
        small.start()
        q = small.registry.get("fake").batcher
        args = ({"a": np.zeros((1, 3), np.float32), "b": np.zeros(1, np.int32)}, 1)
        first = asyncio.ensure_future(q.submit(*args))  # runs
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(q.submit(*args))  # waits in the queue (size 1)
        await asyncio.sleep(0)
        with pytest.raises(Unavailable, match="queued"):
            await q.submit(*args)
        await asyncio.gather(first, second)
        await small.close()
        await runtime.close()

    asyncio.run(main())
    assert sum(fake.calls) == sum(sizes) and max(fake.calls) <= 8
    assert len(fake.calls) < len(sizes)  # requests were merged


def test_json_is_read_fast_and_exactly_as_the_json_module_reads_it(monkeypatch):
    x = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    doc = {"id": "r1", "inputs": [{"name": "a", "datatype": "FP32", "shape": [2, 3]}]}
    doc["inputs"][0]["data"] = x.ravel().tolist()
    data = json.dumps(doc).encode()
    fast = codec.parse_request(data, None)
    monkeypatch.setattr(codec, "_orjson", None)  # what a server without orjson does
    assert codec.parse_request(data, None) == fast and fast.id == "r1"
    monkeypatch.undo()
    np.testing.assert_array_equal(np.asarray(fast.inputs[0].data, np.float32), x.ravel())
    # what orjson refuses, the json module decides: NaN and Infinity are read...
    nan = b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [2], "data": [NaN, Infinity]}]}'
    assert codec._fast_loads(nan) is None
    values = codec.parse_request(nan, None).inputs[0].data
    assert math.isnan(values[0]) and values[1] == math.inf
    # ...and a malformed body gets the json module's message
    with pytest.raises(InvalidRequest, match="failed to parse the request JSON: Expecting"):
        codec.parse_request(b'{"inputs": [1,]}', None)


def test_binary_outputs_are_written_whole_from_any_layout():
    strided = np.arange(24, dtype=np.float32).reshape(3, 8)[:, ::3]  # not contiguous
    rows = np.arange(6, dtype=np.int32)[::-1]  # negative strides
    request = InferRequest(inputs=(), binary_output=True)
    content, headers = codec.encode_response(
        model="m",
        version="1",
        request=request,
        outputs={"y": strided, "z": rows},
        binary={"y": True, "z": True},
    )
    out = _split_binary_response(content, int(headers["inference-header-content-length"]))
    np.testing.assert_array_equal(out["y"], strided)
    np.testing.assert_array_equal(out["z"], rows)


class SizedDelayBundle(FakeBundle):
    """Calls of one row are quick; of more rows, slow. Records each call's thread."""

    def __init__(self):
        super().__init__()
        self.threads: list[str] = []

    def __call__(self, *, a, b):
        self.threads.append(threading.current_thread().name)
        self.delay = 0.0 if len(a) == 1 else 0.25
        return super().__call__(a=a, b=b)


@pytest.mark.parametrize("max_batch_size", [None, 4])
def test_quick_calls_run_on_the_event_loop_slow_ones_in_the_worker_in_order(
    max_batch_size, monkeypatch
):
    # far from both call times, so a loaded machine cannot blur quick and slow
    monkeypatch.setattr(registry, "INLINE_MAX_S", 0.1)
    fake = SizedDelayBundle()
    model = ServedModel(fake, bucket_cap=4, max_tensor_bytes=1 << 20)
    runtime = Runtime(
        Registry([model]),
        max_batch_size=max_batch_size,
        max_batch_delay_ms=0,
        max_body_bytes=1 << 20,
        max_queue_size=8,
    )

    def inputs(rows):
        return {"a": np.ones((rows, 3), np.float32), "b": np.arange(rows, dtype=np.int32)}, rows

    async def main():
        runtime.start()
        await runtime.warm_up()  # times every bucket: 1 is quick, 2 and 4 are not
        assert model.quick(1) and not model.quick(2) and not model.quick(5)
        batcher = runtime.registry.get("fake").batcher
        del fake.calls[:], fake.threads[:]
        await batcher.submit(*inputs(1))  # quick: here, on the loop
        slow = asyncio.ensure_future(batcher.submit(*inputs(3)))  # slow: in the worker
        await asyncio.sleep(0.05)
        quick = asyncio.ensure_future(batcher.submit(*inputs(1)))  # queued behind it
        out = await quick
        assert slow.done()  # it did not overtake the slow call
        np.testing.assert_array_equal(out["total"], [3.0])
        np.testing.assert_array_equal((await slow)["total"], [3.0, 4.0, 5.0])
        await runtime.close()

    asyncio.run(main())
    loop_thread = threading.current_thread().name
    assert fake.calls == [1, 3, 1]
    assert fake.threads[0] == loop_thread
    assert fake.threads[1].startswith("jaxnitro-serve-fake")


# -- the real thing, in a subprocess ------------------------------------------------------------
@jn.experiment
class TinyBF16(Tiny):
    """Tiny behind a BF16 wire input (cast to float32 inside the exported program)."""

    def export_inputs(self):
        return {"x": jn.TensorSpec("bfloat16", (8,))}

    def export_preprocess(self, *, x):
        return {"x": x.astype(jnp.float32)}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    n = nitro(Tiny(max_epochs=1), run_dir=root / "run")
    jn.train(n)
    jn.export_model(n, root / "tiny", platforms=("cpu",))
    n16 = nitro(TinyBF16(max_epochs=1), run_dir=root / "run16")
    jn.export_model(n16, root / "tiny16", name="tiny-bf16", platforms=("cpu",))
    return {"n": n, "n16": n16, "tiny": root / "tiny", "tiny16": root / "tiny16"}


class Server:
    """``python -m jaxnitro._src.serve`` in a subprocess, on ports it picks itself."""

    def __init__(self, dirs, *args: str):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        cmd = [sys.executable, "-m", "jaxnitro._src.serve", *map(str, dirs), "--port", "0"]
        self.proc = subprocess.Popen(
            [*cmd, "--grpc-port", "0", "--metrics-port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.rest = self._wait_for(r"REST:\s+http://([\d.]+:\d+)/v2")
        self.grpc = self._wait_for(r"gRPC:\s+([\d.]+:\d+)")
        deadline = time.monotonic() + 120
        while self.status("GET", "/v2/health/ready") != 200:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.output
            time.sleep(0.1)

    def _read(self):
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def _wait_for(self, pattern: str) -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            match = re.search(pattern, self.output)
            if match:
                return match.group(1)
            assert self.proc.poll() is None, self.output
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in {self.output}")

    def request(self, method, path, body=None, headers=None) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection(self.rest, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def status(self, method, path, body=None, headers=None) -> int:
        try:
            return self.request(method, path, body, headers)[0]
        except OSError:
            return -1

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.request("GET", "/metrics")[2].decode())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._reader.join(5)


@pytest.fixture(scope="module")
def server(bundles):
    s = Server(
        [bundles["tiny"], bundles["tiny16"]],
        "--max-batch-size",
        "16",
        "--max-batch-delay-ms",
        "2",
        "--max-body-bytes",
        "2000000",
        "--log-requests",
    )
    yield s
    s.stop()


def _x(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, 8)).astype(np.float32)


@pytest.mark.slow
def test_start_up_banner_access_log_and_no_nagle_delay(server):
    # "ready:" is printed just after the models answer ready: wait for the line itself
    server._wait_for(r"(ready:)")
    out = server.output
    assert "tiny (version 1): x FP32[-1, 8] -> output FP32[-1, 4]" in out
    assert "tiny-bf16 (version 1): x BF16[-1, 8]" in out
    assert f"REST:    http://{server.rest}/v2" in out and f"gRPC:    {server.grpc}" in out
    assert "dynamic batching: up to 16 rows, 2 ms delay" in out and "ready:" in out
    # the warm-up's progress, per model and batch size, ends at its true count before ready
    warming = re.findall(r"warming up: (\d+)/(\d+) · (tiny(?:-bf16)?), batch (\d+)", out)
    assert warming and warming[-1][0] == warming[-1][1], out
    assert {model for _, _, model, _ in warming} <= {"tiny", "tiny-bf16"}
    assert out.index("warming up: " + warming[-1][0]) < out.index("ready:")
    conn = http.client.HTTPConnection(server.rest, timeout=10)
    times = []
    for _ in range(20):  # keep-alive: a response split in two writes would wait ~40 ms
        started = time.perf_counter()
        conn.request("POST", INFER, body=_json_infer())
        conn.getresponse().read()
        times.append(time.perf_counter() - started)
    conn.close()
    # Nagle's delay would hold every response ~40 ms; a loaded machine delays only some, so
    # the fastest quarter must be quick (the median was, on an idle machine)
    assert sorted(times)[len(times) // 4] < 0.02, times
    deadline = time.monotonic() + 5
    while 'POST /v2/models/tiny/infer" 200' not in server.output:
        assert time.monotonic() < deadline, server.output[-2000:]
        time.sleep(0.05)
    assert re.search(
        r'127\.0\.0\.1 "POST /v2/models/tiny/infer" 200 [\d.]+ms rows=2', server.output
    )


@pytest.mark.slow
def test_standard_clients_get_jn_predict(server, bundles):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    n = bundles["n"]
    x = _x(5)
    expected = jn.predict(n, {"x": x})
    client = httpclient.InferenceServerClient(server.rest)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
    meta = client.get_model_metadata("tiny")
    assert meta == {
        "name": "tiny",
        "versions": ["1"],
        "platform": "jax",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 4]}],
    }
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    for binary in (True, False):  # tritonclient's default, and JSON both ways
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        out = httpclient.InferRequestedOutput("output", binary_data=binary)
        result = client.infer("tiny", [inp], outputs=[out], request_id="abc")
        np.testing.assert_allclose(result.as_numpy("output"), expected, atol=1e-5, rtol=1e-5)
        assert result.get_response()["id"] == "abc"
    for algorithm in ("gzip", "deflate"):
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer(
            "tiny",
            [inp],
            request_compression_algorithm=algorithm,
            response_compression_algorithm=algorithm,
        )
        np.testing.assert_allclose(result.as_numpy("output"), expected, atol=1e-5, rtol=1e-5)
    # BF16 through the binary path, to a model whose input is BF16
    x16 = x.astype(ml_dtypes.bfloat16)
    expected16 = jn.predict(bundles["n16"], {"x": x16.astype(np.float32)})
    inp = httpclient.InferInput("x", list(x.shape), "BF16")
    inp.set_data_from_numpy(x16)
    result = client.infer("tiny-bf16", [inp])
    np.testing.assert_allclose(result.as_numpy("output"), expected16, atol=1e-5, rtol=1e-5)
    # ... and to the FP32 model: a clear 400, never a silent cast
    with pytest.raises(Exception, match=r"\[400\].*datatype BF16, but model 'tiny' expects FP32"):
        client.infer("tiny", [inp])
    client.close()

    g = grpcclient.InferenceServerClient(server.grpc)
    try:
        assert g.is_server_live() and g.is_server_ready() and g.is_model_ready("tiny")
        gmeta = g.get_model_metadata("tiny", as_json=True)
        assert gmeta["platform"] == "jax" and gmeta["inputs"][0]["shape"] == ["-1", "8"]
        inp = grpcclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = g.infer("tiny", [inp], request_id="g1")
        np.testing.assert_allclose(result.as_numpy("output"), expected, atol=1e-5, rtol=1e-5)
        inp = grpcclient.InferInput("x", list(x.shape), "BF16")
        inp.set_data_from_numpy(x16)
        result = g.infer("tiny-bf16", [inp])
        np.testing.assert_allclose(result.as_numpy("output"), expected16, atol=1e-5, rtol=1e-5)
        for model, inputs, code in [
            ("nope", [inp], "NOT_FOUND"),
            ("tiny", [inp], "INVALID_ARGUMENT"),  # BF16 to FP32
        ]:
            with pytest.raises(Exception, match=code):
                g.infer(model, inputs)
    finally:
        g.close()

    doc = {"inputs": [{"name": "x", "shape": [5, 8], "datatype": "FP32", "data": x.tolist()}]}
    req = urllib.request.Request(
        f"http://{server.rest}/v2/models/tiny/infer", data=json.dumps(doc).encode()
    )
    with urllib.request.urlopen(req) as r:  # no Content-Type, like tritonclient
        got = json.load(r)["outputs"][0]
    assert got["shape"] == [5, 4] and got["datatype"] == "FP32"
    np.testing.assert_allclose(np.reshape(got["data"], (5, 4)), expected, atol=1e-5, rtol=1e-5)


def _json_infer(x=None, **override) -> bytes:
    x = _x(2) if x is None else x
    entry = {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.tolist()}
    entry.update(override)
    return json.dumps({"inputs": [entry]}).encode()


def _raw(x: np.ndarray, extra: bytes = b"", size: int | None = None, dt="FP32") -> tuple:
    doc = {
        "inputs": [
            {
                "name": "x",
                "shape": list(x.shape),
                "datatype": dt,
                "parameters": {"binary_data_size": x.nbytes if size is None else size},
            }
        ]
    }
    header = json.dumps(doc).encode()
    return header + x.tobytes() + extra, {"Inference-Header-Content-Length": str(len(header))}


INFER = "/v2/models/tiny/infer"
_X2 = _x(2)
_BOMB = gzip.compress(_json_infer(np.zeros((80_000, 8), np.float32)))  # 10 kB -> 3.4 MB
_EXPANDS = b'{"inputs":[{"name":"x","shape":[75000,8],"datatype":"FP32","data":[' + (
    b"0," * 599_999 + b"0]}]}"
)  # 1.2 MB of body, 2.4 MB as FP32: over the 2 MB limit

# (id, method, path, body, headers, status): serving.md §5, against a 2 MB body limit
BAD_INPUTS = [
    ("1-malformed-json", "POST", INFER, b'{"inputs": [', {}, 400),
    ("2-no-content-type", "POST", INFER, _json_infer(), {}, 200),
    ("3-inputs-missing", "POST", INFER, b'{"outputs": []}', {}, 400),
    ("3-inputs-not-a-list", "POST", INFER, b'{"inputs": {"x": 1}}', {}, 400),
    ("3-input-name-not-str", "POST", INFER, _json_infer(name=3), {}, 400),
    ("3-body-not-an-object", "POST", INFER, b"[1, 2]", {}, 400),
    ("4-missing-input", "POST", INFER, b'{"inputs": []}', {}, 400),
    ("5-unknown-input", "POST", INFER, _json_infer(name="y"), {}, 400),
    (
        "5-duplicate-input",
        "POST",
        INFER,
        json.dumps({"inputs": [json.loads(_json_infer())["inputs"][0]] * 2}).encode(),
        {},
        400,
    ),
    (
        "5-duplicate-output",
        "POST",
        INFER,
        json.dumps({**json.loads(_json_infer()), "outputs": [{"name": "output"}] * 2}).encode(),
        {},
        400,
    ),
    ("6-wrong-datatype", "POST", INFER, _json_infer(datatype="INT32"), {}, 400),
    ("6-unknown-datatype", "POST", INFER, _json_infer(datatype="FP8"), {}, 400),
    ("7-wrong-rank", "POST", INFER, _json_infer(shape=[2, 8, 1]), {}, 400),
    ("7-wrong-dim", "POST", INFER, _json_infer(shape=[2, 7]), {}, 400),
    ("8-count-mismatch", "POST", INFER, _json_infer(shape=[3, 8]), {}, 400),
    ("8-ragged", "POST", INFER, _json_infer(data=[[1.0] * 8, [1.0] * 7]), {}, 400),
    ("9-strings", "POST", INFER, _json_infer(data=["a"] * 16), {}, 400),
    ("9-bools-as-floats", "POST", INFER, _json_infer(data=[True] * 16), {}, 400),
    ("9-nulls", "POST", INFER, _json_infer(data=[None] * 16), {}, 400),
    ("10-negative-dim", "POST", INFER, _json_infer(shape=[-2, 8]), {}, 400),
    ("10-float-dim", "POST", INFER, _json_infer(shape=[2.5, 8]), {}, 400),
    ("11-huge-dims", "POST", INFER, _json_infer(shape=[2**60, 8]), {}, 400),
    ("11-overflowing-dims", "POST", INFER, _json_infer(shape=[16, 2**60 + 2]), {}, 400),
    ("12-binary-size-too-big", "POST", INFER, *_raw(_X2, size=_X2.nbytes + 4), 400),
    ("12-binary-size-too-small", "POST", INFER, *_raw(_X2, size=_X2.nbytes - 4), 400),
    ("12-binary-size-negative", "POST", INFER, *_raw(_X2, size=-1), 400),
    ("12-trailing-bytes", "POST", INFER, *_raw(_X2, extra=b"\0" * 4), 400),
    ("12-binary-without-header", "POST", INFER, _raw(_X2)[0], {}, 400),
    (
        "13-header-length-not-a-number",
        "POST",
        INFER,
        _raw(_X2)[0],
        {"Inference-Header-Content-Length": "ten"},
        400,
    ),
    (
        "13-header-length-over-content-length",
        "POST",
        INFER,
        _raw(_X2)[0],
        {"Inference-Header-Content-Length": "100000"},
        400,
    ),
    (
        "13-header-length-over-int32",
        "POST",
        INFER,
        _raw(_X2)[0],
        {"Inference-Header-Content-Length": str(2**31 + 5)},
        400,
    ),
    ("14-raw-request", "POST", INFER, _X2.tobytes(), {"Inference-Header-Content-Length": "0"}, 200),
    (
        "14-raw-request-partial-row",
        "POST",
        INFER,
        _X2.tobytes()[:-4],
        {"Inference-Header-Content-Length": "0"},
        400,
    ),
    ("15-body-over-limit", "POST", INFER, b" " * 2_100_000, {}, 413),
    ("15-gzip-bomb", "POST", INFER, _BOMB, {"Content-Encoding": "gzip"}, 413),
    ("15-json-expands-over-limit", "POST", INFER, _EXPANDS, {}, 413),
    ("15-unknown-encoding", "POST", INFER, _json_infer(), {"Content-Encoding": "br"}, 400),
    ("15-corrupt-gzip", "POST", INFER, b"\x1f\x8b\x08junk", {"Content-Encoding": "gzip"}, 400),
    ("16-deep-nesting", "POST", INFER, b'{"inputs": ' + b"[" * 250_000, {}, 400),
    ("18-unknown-model", "POST", "/v2/models/nope/infer", _json_infer(), {}, 404),
    ("18-unknown-version", "POST", "/v2/models/tiny/versions/2/infer", _json_infer(), {}, 404),
    ("18-version-1", "POST", "/v2/models/tiny/versions/1/infer", _json_infer(), {}, 200),
    ("18-unknown-model-metadata", "GET", "/v2/models/nope", None, {}, 404),
    ("20-wrong-method", "GET", INFER, None, {}, 405),
    ("20-wrong-method-health", "POST", "/v2/health/live", b"", {}, 405),
    ("21-batch-over-max-batch-size", "POST", INFER, _json_infer(_x(40)), {}, 200),
    ("22-batch-zero", "POST", INFER, _json_infer(np.zeros((0, 8), np.float32)), {}, 400),
    ("24-nan-and-infinity", "POST", INFER, _json_infer(data=[float("nan")] * 16), {}, 200),
    (
        "25-bf16-as-json",
        "POST",
        "/v2/models/tiny-bf16/infer",
        _json_infer(datatype="BF16"),
        {},
        400,
    ),
    (
        "26-unknown-output",
        "POST",
        INFER,
        json.dumps({**json.loads(_json_infer()), "outputs": [{"name": "logits"}]}).encode(),
        {},
        400,
    ),
    ("27-fuzzed-path", "GET", "/v2/models/%00%ff/../../x", None, {}, 404),
    ("27-fuzzed-route", "POST", "/v2/modelz/tiny/infer", b"x", {}, 404),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,path,payload,headers,status",
    [c[1:] for c in BAD_INPUTS],
    ids=[c[0] for c in BAD_INPUTS],
)
def test_bad_inputs_get_their_status_and_the_server_stays_live(
    server, method, path, payload, headers, status
):
    got, resp_headers, data = server.request(method, path, payload, headers)
    assert got == status, data[:300]
    if status != 200:
        assert resp_headers["content-type"].startswith("application/json")
        error = json.loads(data)["error"]
        assert isinstance(error, str) and error
    assert server.status("GET", "/v2/health/live") == 200


@pytest.mark.slow
def test_2000_concurrent_requests_are_batched_and_all_correct(server, bundles):
    pool = _x(20_000, seed=3)
    expected = np.concatenate(
        [jn.predict(bundles["n"], {"x": pool[i : i + 2000]}) for i in range(0, len(pool), 2000)]
    )
    before = server.metrics()
    rng = np.random.default_rng(4)
    jobs = []
    offset = 0
    for i in range(2000):
        rows = 37 if i % 100 == 0 else int(rng.integers(1, 9))  # some over max_batch_size 16
        jobs.append((i, offset, rows))
        offset += rows
    assert offset <= len(pool)
    local = threading.local()

    def one(job):
        i, start, rows = job
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(server.rest, timeout=60)
        x = pool[start : start + rows]
        if i % 2:
            data, headers = _raw(x)
        else:
            data, headers = _json_infer(x), {}
        conn.request("POST", INFER, body=data, headers=headers)
        r = conn.getresponse()
        raw = r.read()
        assert r.status == 200, raw[:300]
        if "inference-header-content-length" in {k.lower() for k, _ in r.getheaders()}:
            out = _split_binary_response(raw, int(r.getheader("Inference-Header-Content-Length")))
            got = out["output"]
        else:
            got = np.reshape(json.loads(raw)["outputs"][0]["data"], (rows, 4))
        np.testing.assert_allclose(got, expected[start : start + rows], atol=1e-5, rtol=1e-5)
        return rows

    with ThreadPoolExecutor(16) as ex:
        assert sum(ex.map(one, jobs)) == offset
    after = server.metrics()
    ok = 'jaxnitro_requests_total{code="200",endpoint="infer",model="tiny",protocol="http"}'
    assert after[ok] - before.get(ok, 0) == 2000
    calls = 'jaxnitro_batch_rows_count{model="tiny"}'
    rows = 'jaxnitro_batch_rows_sum{model="tiny"}'
    assert after[rows] - before[rows] == offset
    assert after[calls] - before[calls] < 2000  # merged
    assert after['jaxnitro_batch_rows_bucket{le="16.0",model="tiny"}'] == after[calls]  # cap
    assert after['jaxnitro_compiled_batch_sizes{model="tiny"}'] == 5  # 1..16: no new compile
    assert server.status("GET", "/v2/health/live") == 200


@pytest.mark.slow
def test_sigterm_finishes_requests_in_flight_and_exits_0(bundles):
    import tritonclient.grpc as grpcclient

    s = Server([bundles["tiny"]], "--max-batch-size", "64", "--max-batch-delay-ms", "400")
    x = _x(3, seed=9)
    expected = jn.predict(bundles["n"], {"x": x})

    def rest_call(_):
        status, _, data = s.request("POST", INFER, _json_infer(x))
        assert status == 200, data
        return np.reshape(json.loads(data)["outputs"][0]["data"], (3, 4))

    def grpc_call(_):
        g = grpcclient.InferenceServerClient(s.grpc)
        try:
            inp = grpcclient.InferInput("x", [3, 8], "FP32")
            inp.set_data_from_numpy(x)
            return g.infer("tiny", [inp]).as_numpy("output")
        finally:
            g.close()

    try:
        with ThreadPoolExecutor(8) as ex:
            futures = [ex.submit(rest_call, i) for i in range(6)]
            futures += [ex.submit(grpc_call, i) for i in range(2)]
            deadline = time.monotonic() + 30
            while s.metrics().get('jaxnitro_queue_depth{model="tiny"}', 0) < 8:
                assert time.monotonic() < deadline, s.output
                time.sleep(0.01)
            s.proc.send_signal(signal.SIGTERM)
            for f in futures:
                np.testing.assert_allclose(f.result(), expected, atol=1e-5, rtol=1e-5)
        assert s.proc.wait(60) == 0, s.output
        s._reader.join(5)
        assert "stopped" in s.output
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{s.rest}/v2/health/live", timeout=5)
    finally:
        s.stop()


@pytest.mark.slow
def test_bundle_dir_errors_exit_1_with_a_message(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxnitro._src.serve", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 1 and "manifest.json is missing" in proc.stderr, proc.stderr
