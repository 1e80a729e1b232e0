"""`jaxnitro serve` against a hostile or broken model repository and at shutdown (issue 41,
items 4-8, 12, 13; issue 44, item 6): repository bodies read within limits and a deadline,
slow-loris connections on any endpoint, a warm-up that never returns, SIGTERM while loading,
readiness while a named model has no ready version, config.pbtxt and load overrides, and
model names that would forge a line of output.

The quick tests run the settings and a hung warm-up in-process; the slow ones start
``jaxnitro serve`` in a subprocess on free ports and use raw sockets.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import Tiny, nitro
from helpers.procs import until
from test_serve import FakeBundle, Server

import jaxnitro as jn
from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.serve import command, repository
from jaxnitro._src.serve.errors import InvalidRequest
from jaxnitro._src.serve.modelconfig import model_settings, repository_parameters
from jaxnitro._src.serve.registry import Registry, ServedModel
from jaxnitro._src.serve.repository import Repository
from jaxnitro._src.serve.runtime import Runtime

X = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)


# -- quick ---------------------------------------------------------------------------------------
def test_load_parameters_and_model_configs_apply_the_subset_or_refuse():
    assert command.MODEL_LOAD_TIMEOUT_S == repository.MODEL_LOAD_TIMEOUT_S
    assert repository_parameters("load", {"config": '{"max_batch_size": 8}'}) == {
        "config": {"max_batch_size": 8}
    }
    assert repository_parameters("unload", {"unload_dependents": True}) == {}
    with pytest.raises(InvalidRequest, match="does not load model files"):
        repository_parameters("load", {"file:1/model.onnx": b"xx"})
    with pytest.raises(InvalidRequest, match="'priority' is not supported"):
        repository_parameters("load", {"priority": 1})
    got = model_settings(
        {
            "name": "m",
            "max_batch_size": 4,
            "dynamic_batching": {"max_queue_delay_microseconds": "1500"},
            "version_policy": {"specific": {"versions": ["1", "3"]}},
        },
        name="m",
        where="cfg",
    )
    assert got == {
        "max_batch_size": 4,
        "batching": True,
        "max_batch_delay_ms": 1.5,
        "preferred": [],
        "version_policy": {"specific": {"versions": [1, 3]}},
    }
    for doc, match in [
        ({"instance_group": [{"count": 2}]}, "'instance_group' not supported"),
        ({"name": "other"}, "not the model's name"),
        ({"backend": "onnxruntime"}, "jaxnitro bundles only"),
        ({"max_batch_size": 0}, "must be an int >= 1"),
        ({"dynamic_batching": {"priority_levels": 2}}, "'priority_levels' not supported"),
    ]:
        with pytest.raises(ConfigError, match=match):
            model_settings(doc, name="m", where="cfg")


class _Hangs(FakeBundle):
    """A bundle whose every call (so its warm-up) blocks until ``release`` is set."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def __call__(self, **inputs):
        self.release.wait()
        return super().__call__(**inputs)


def test_a_hung_warm_up_times_out_holds_no_other_model_and_no_shutdown(tmp_path):
    for name in ("hang", "good"):
        (tmp_path / name / "1").mkdir(parents=True)
    hangs = _Hangs()
    runtime = Runtime(
        Registry(), max_batch_size=None, max_batch_delay_ms=0, max_body_bytes=1 << 20,
        max_queue_size=8,
    )  # fmt: skip

    def make_model(name, version, path, settings):
        bundle = hangs if name == "hang" else FakeBundle()
        return ServedModel(
            bundle, name=name, version=version, bucket_cap=2, max_tensor_bytes=1 << 20
        )

    repo = Repository(
        tmp_path, runtime=runtime, make_model=make_model, mode="explicit", load_timeout=2.0
    )
    runtime.repository = repo

    async def main():
        runtime.start()
        hung = asyncio.ensure_future(repo.load("hang"))
        await asyncio.sleep(0.2)
        await repo.load("good")  # not held by the hung model's load
        assert not hung.done() and runtime.registry.get("good").ready
        await repo.unload("good")
        with pytest.raises(InvalidRequest, match="within 2 s .*--model-load-timeout"):
            await hung
        (entry,) = [e for e in repo.index() if e["name"] == "hang"]
        assert entry["state"] == "UNAVAILABLE" and "--model-load-timeout" in entry["reason"]
        assert "hang" not in runtime.registry.table and not runtime.ready
        await asyncio.wait_for(runtime.close(), 10)  # the hung worker is not waited for

    try:
        asyncio.run(main())
    finally:
        hangs.release.set()


# -- the real thing, in a subprocess ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Tiny bundle (input x FP32[-1, 8], output FP32[-1, 4]) and its outputs on X."""
    root = tmp_path_factory.mktemp("serve-hardening")
    n = nitro(Tiny(max_epochs=1), run_dir=root / "run")
    with warnings.catch_warnings():  # untrained weights serve as well as trained ones
        warnings.filterwarnings("ignore", "export_model: Tiny has taken no optimizer step")
        path = jn.export_model(n, root / "tiny", platforms=("cpu",))
    return Path(path), np.asarray(jn.load_bundle(path, max_batch_size=4)(x=X))


def _broken_copy(src: Path, dest: Path) -> None:
    """A version copied without the staging rename and cut short: truncated weights."""
    shutil.copytree(src, dest)
    biggest = max((p for p in dest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 2)


class Proc(Server):
    """`Server`, without waiting to be ready (and optionally with a command of its own)."""

    def __init__(self, *args: str, prefix: list[str] | None = None):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        cmd = prefix or [sys.executable, "-m", "jaxnitro._src.serve"]
        self.proc = subprocess.Popen(
            [*cmd, "--port", "0", "--grpc-port", "0", "--metrics-port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.rest = self._wait_for(r"REST:\s+http://([\d.]+:\d+)/v2")
        self.grpc = "" if "--no-grpc" in args else self._wait_for(r"gRPC:\s+([\d.]+:\d+)")
        self._wait_for(r"(?m)^(ready: .* in \d+\.\ds)$")

    def json(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
        status, _, data = self.request(method, path, body)
        return status, json.loads(data)


def _connect(address: str, timeout: float = 30.0) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (the socket's timeout fails the test)."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass  # closed with bytes of ours unread: what came before the reset is kept
    return out


@pytest.mark.slow
def test_repository_bodies_are_limited_and_deadlined_on_every_endpoint(tiny):
    s = Server([tiny[0]], "--max-connections", "6", "--body-timeout", "1")
    try:
        # [item 4] a declared 768 MiB: 413 at once, not after it arrived
        big = _connect(s.rest)
        big.sendall(
            b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 805306368\r\n"
            b"\r\n" + b"{" * 1024
        )
        answer = _read_until_closed(big)
        assert answer.startswith(b"HTTP/1.1 413 "), answer
        assert b"a repository request body is over 1048576 bytes" in answer
        # a chunked body: reading stops at the limit
        chunked = _connect(s.rest)
        chunked.sendall(
            b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(24):  # 1.5 MiB, and never the last chunk
            chunked.sendall(b"10000\r\n" + b" " * 65536 + b"\r\n")
        answer = _read_until_closed(chunked)
        assert answer.startswith(b"HTTP/1.1 413 "), answer
        # [item 5] every slot taken by bodies trickled one byte at a time, on repository
        # endpoints and on one that reads no body: each is cut at the body deadline
        slow = []
        for path in ["POST /v2/repository/index"] * 3 + [
            "POST /v2/repository/models/tiny/load",
            "POST /v2/repository/models/tiny/unload",
            "GET /v2/health/live",
        ]:
            sock = _connect(s.rest)
            sock.sendall(f"{path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{{".encode())
            slow.append(sock)
        # the metrics port has the same guards
        metrics = re.findall(r"metrics: http://([\d.]+:\d+)/metrics", s.output)[-1]
        slow.append(_connect(metrics))
        slow[-1].sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
        stop = threading.Event()

        def trickle():
            alive = list(slow)
            while alive and not stop.wait(0.2):
                for sock in list(alive):
                    try:
                        sock.send(b" ")
                    except OSError:
                        alive.remove(sock)

        trickler = threading.Thread(target=trickle, daemon=True)
        trickler.start()
        try:
            answers = [_read_until_closed(sock) for sock in slow]
            # trickling goes on: good requests are answered all the same
            status = until(lambda: s.status("POST", "/v2/repository/index", b"{}") == 200, 30)
            assert status
        finally:
            stop.set()
            trickler.join(5)
        for answer in answers[:5]:
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert b"did not arrive within 1 s" in answer
        for answer in answers[5:]:  # answered, then closed
            assert answer.startswith(b"HTTP/1.1 200 "), answer
        for sock in [big, chunked, *slow]:
            sock.close()
    finally:
        s.stop()


@pytest.mark.slow
def test_readiness_needs_every_named_model_and_the_intact_older_version_serves(tiny, tmp_path):
    bundle, expected = tiny
    repo = tmp_path / "models"
    shutil.copytree(bundle, repo / "tiny" / "1")
    _broken_copy(bundle, repo / "tiny" / "2")  # the newest version: broken
    _broken_copy(bundle, repo / "broken" / "1")  # its only version: broken
    forged = "x\nready: every model warmed up (forged)"
    shutil.copytree(bundle, repo / forged / "1")
    s = Proc(
        "--model-repository", str(repo), "--model-control-mode", "poll",
        "--repository-poll-secs", "0.5", "--max-batch-size", "4", "--no-grpc",
    )  # fmt: skip
    try:
        # [item 8] the older version serves while the newest is broken
        body = json.dumps(
            {
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": [2, 8], "data": X.ravel().tolist()}
                ]
            }
        )
        status, doc = s.json("POST", "/v2/models/tiny/infer", body.encode())
        assert status == 200, (doc, s.output)
        assert doc["model_version"] == "1"
        np.testing.assert_allclose(doc["outputs"][0]["data"], expected.ravel(), rtol=1e-5)
        index = {(e["name"], e["version"]): e for e in s.json("POST", "/v2/repository/index")[1]}
        assert index[("tiny", "1")]["state"] == "READY"
        assert index[("tiny", "2")]["state"] == "UNAVAILABLE" and index[("tiny", "2")]["reason"]
        assert index[("broken", "1")]["state"] == "UNAVAILABLE"
        # not ready while "broken" has no ready version; ready once it leaves the repository
        assert s.json("GET", "/v2/health/ready") == (503, {"ready": False})
        status, doc = s.json("POST", "/v2/models/broken/infer", body.encode())
        assert status == 404 and "has no version loaded: version 1 UNAVAILABLE" in doc["error"]
        gone = repo / ".gone-broken"
        os.rename(repo / "broken", gone)
        until(lambda: s.status("GET", "/v2/health/ready") == 200, 60)
        # [item 13] a directory name with a newline cannot forge a line of output
        lines = s.output.splitlines()
        assert not [line for line in lines if line.startswith("ready: every model warmed up (f")]
        assert repr(forged) in s.output
    finally:
        s.stop()


#: `jaxnitro serve` in which the model named "hang" warms up forever (its first call never
#: returns), as a compile or a model call that never ends would.
HANGING = """
import threading, sys
from jaxnitro._src.serve import registry
from jaxnitro._src.serve.command import serve_command
warm_up = registry.ServedModel.warm_up
def hangs(self, done=None):
    if self.name == "hang":
        threading.Event().wait()
    return warm_up(self, done)
registry.ServedModel.warm_up = hangs
serve_command(prog_name="jaxnitro serve")
"""


@pytest.mark.slow
def test_a_hung_warm_up_times_out_and_sigterm_still_stops_the_server(tiny, tmp_path):
    bundle, _ = tiny
    repo = tmp_path / "models"
    for name in ("hang", "good"):
        shutil.copytree(bundle, repo / name / "1")
    s = Proc(
        "--model-repository", str(repo), "--model-control-mode", "explicit",
        "--model-load-timeout", "8", "--drain-timeout", "2", "--max-batch-size", "2",
        "--no-grpc", prefix=[sys.executable, "-c", HANGING],
    )  # fmt: skip
    try:
        with ThreadPoolExecutor(2) as pool:
            hung = pool.submit(s.json, "POST", "/v2/repository/models/hang/load")
            until(lambda: ("hang", "1") in {(e["name"], e["version"]) for e in _index(s)}, 30)
            # [item 6] the other model loads and unloads while "hang" warms up forever
            assert s.json("POST", "/v2/repository/models/good/load") == (200, {})
            assert s.json("POST", "/v2/repository/models/good/unload") == (200, {})
            assert not hung.done(), hung.result()
            status, doc = hung.result(timeout=60)
        assert status == 400 and "within 8 s (jaxnitro serve --model-load-timeout)" in doc["error"]
        (entry,) = [e for e in _index(s) if e["name"] == "hang"]
        assert entry["state"] == "UNAVAILABLE" and "--model-load-timeout" in entry["reason"]
        # [item 7] SIGTERM while a load hangs: stopped within the drain timeout
        again = threading.Thread(target=s.status, args=("POST", "/v2/repository/models/hang/load"))
        again.start()
        until(lambda: _state(s, "hang") == "LOADING", 30)
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(60)
        assert s.proc.returncode in (0, 3), s.output
        assert "left behind: the load of hang version 1, past --model-load-timeout" in s.output
        again.join(30)
    finally:
        s.stop()


def _index(s: Server) -> list[dict]:
    return json.loads(s.request("POST", "/v2/repository/index")[2])


def _state(s: Server, name: str) -> str:
    return next((e["state"] for e in _index(s) if e["name"] == name), "")


@pytest.mark.slow
def test_config_pbtxt_and_load_configs_are_applied_or_refused(tiny, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    bundle, _ = tiny
    repo = tmp_path / "models"
    for version in (1, 2):
        shutil.copytree(bundle, repo / "cfg" / str(version))
    (repo / "cfg" / "config.pbtxt").write_text(
        'name: "cfg"\nmax_batch_size: 2\n'
        "dynamic_batching { max_queue_delay_microseconds: 3000 }\n"
        "version_policy { all {} }\n"
    )
    shutil.copytree(bundle, repo / "odd" / "1")
    (repo / "odd" / "config.pbtxt").write_text("instance_group [ { count: 2 } ]\n")
    s = Proc(
        "--model-repository", str(repo), "--model-control-mode", "explicit",
        "--load-model", "cfg", "--max-batch-size", "4",
    )  # fmt: skip
    try:
        # config.pbtxt applied: both versions (version_policy), batch size 2, 3 ms
        assert {e["version"] for e in _index(s) if e["state"] == "READY"} == {"1", "2"}
        status, config = s.json("GET", "/v2/models/cfg/versions/1/config")
        assert config["max_batch_size"] == 2 and config["version_policy"] == {"all": {}}
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 3000
        # a field this server does not apply: the model is refused with its name
        status, doc = s.json("POST", "/v2/repository/models/odd/load")
        assert status == 400 and "instance_group" in doc["error"], doc
        # a load request's config overrides config.pbtxt; one it cannot apply gets 400
        override = {"parameters": {"config": json.dumps({"max_batch_size": 1})}}
        load = "/v2/repository/models/cfg/load"
        assert s.json("POST", load, json.dumps(override).encode()) == (200, {})
        status, config = s.json("GET", "/v2/models/cfg/config")
        assert config["max_batch_size"] == 1 and "dynamic_batching" not in config
        assert config["version_policy"] == {"latest": {"num_versions": 1}}
        for params, match in [
            ({"config": json.dumps({"instance_group": []})}, "'instance_group' not supported"),
            ({"file:1/model.onnx": "AAAA"}, "does not load model files"),
            ({"priority": 2}, "'priority' is not supported"),
        ]:
            status, doc = s.json("POST", load, json.dumps({"parameters": params}).encode())
            assert status == 400 and match in doc["error"], doc
        g = grpcclient.InferenceServerClient(s.grpc)
        g.load_model("cfg", config=json.dumps({"max_batch_size": 2}))
        assert g.get_model_config("cfg", as_json=True)["config"]["max_batch_size"] == 2
        with pytest.raises(InferenceServerException, match="does not load model files"):
            g.load_model("cfg", config="{}", files={"file:1/x": b"x"})
        # a load without config: config.pbtxt again, as it is now
        (repo / "cfg" / "config.pbtxt").write_text("max_batch_size: 4\nversion_policy { all {} }")
        g.load_model("cfg")
        for version in ("1", "2"):
            config = g.get_model_config("cfg", version, as_json=True)["config"]
            assert config["max_batch_size"] == 4 and "dynamic_batching" not in config
    finally:
        s.stop()


@pytest.mark.slow
def test_sigterm_turns_readiness_off_first_then_drains(tiny):
    s = Server([tiny[0]], "--drain-timeout", "30")
    try:
        body = json.dumps(
            {
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": [2, 8], "data": X.ravel().tolist()}
                ]
            }
        ).encode()
        conn = http.client.HTTPConnection(s.rest, timeout=60)
        conn.putrequest("POST", "/v2/models/tiny/infer")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        conn.send(body[:10])  # in flight: its body is on its way
        until(lambda: "jaxnitro_inflight_requests 1.0" in _metrics(s), 30)
        s.proc.send_signal(signal.SIGTERM)
        s._wait_for(r"(stopping: not ready)")
        # a load balancer's probe, on a new connection: not ready; still live
        assert s.request("GET", "/v2/health/ready")[0] == 503
        assert s.request("GET", "/v2/health/live")[0] == 200
        conn.send(body[10:])
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["outputs"][0]["shape"] == [2, 4]
        assert s.proc.wait(60) == 0, s.output
    finally:
        s.stop()


def _metrics(s: Server) -> str:
    try:
        return s.request("GET", "/metrics")[2].decode()
    except OSError:
        return ""
